"""`weave status` lines: the sessions of the data directory the daemon did not recover (and how to go on),
and the disk the KV files may still grow into."""

from __future__ import annotations

from weaved.cli.status import status_text


def test_sessions_not_recovered_are_named_with_the_way_out():
    st = {"sessions": [], "unrecovered": [{"id": f"s-{i}", "reason": "made for model x"} for i in range(5)]}
    line = next(ln for ln in status_text(st).splitlines() if "not recovered" in ln)
    assert line == ("          5 not recovered (why: `weave status --json`; `weave rm ID` deletes one): "
                    "s-0, s-1, s-2, ...")
    assert "not recovered" not in status_text({"sessions": [], "unrecovered": []})


def test_the_kv_line_says_the_free_disk():
    kv = {"sessions": 2, "file_bytes": 3 << 20, "ram_bytes": 1 << 20, "ram_measured": True,
          "reserved_bytes": 4 << 20, "cap_bytes": 1 << 30, "disk_free_bytes": 40 << 20}
    line = next(ln for ln in status_text({"kv": kv}).splitlines() if ln.startswith("kv"))
    assert line.startswith("kv        2 session file(s): 3.0 MiB on disk (40.0 MiB free), 1.0 MiB in RAM")
