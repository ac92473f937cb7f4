"""`weave status` names the sessions of the data directory the daemon did not recover, and how to go on."""

from __future__ import annotations

from weaved.cli.status import status_text


def test_sessions_not_recovered_are_named_with_the_way_out():
    st = {"sessions": [], "unrecovered": [{"id": f"s-{i}", "reason": "made for model x"} for i in range(5)]}
    line = next(ln for ln in status_text(st).splitlines() if "not recovered" in ln)
    assert line == ("          5 not recovered (why: `weave status --json`; `weave rm ID` deletes one): "
                    "s-0, s-1, s-2, ...")
    assert "not recovered" not in status_text({"sessions": [], "unrecovered": []})
