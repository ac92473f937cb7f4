"""A ring member that leaves and comes back (two ``weave serve`` daemons on loopback, tiny model).

Node A homes a session of 1,536 positions on nodes capped at 1,024: it needs A and B.  B stopped
cleanly (SIGTERM) leaves the ring at once and exits 0; A's next turn finds no room on a ring of one
and is refused with 503 and the reason, the session and its transcript kept.  B started again: A's
next turn forms a ring with it, rebuilds the session from its transcript and answers as before.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve
from tests.federation.test_ring_daemons import BOUND_S, RING_CONTEXT, complete, federation_url, profile, session

pytestmark = [pytest.mark.federation, pytest.mark.slow]


def wait_alive(http, name: str, alive: bool = True) -> None:
    end = time.monotonic() + BOUND_S
    while any(p["name"] == name and p["alive"] for p in http.get("/v1/status").json()["peers"]) != alive:
        assert time.monotonic() < end, f"peer {name} not {'alive' if alive else 'dead'}"
        time.sleep(0.2)


def test_a_member_that_leaves_and_returns(tmp_path: Path, tiny_llama):
    from weaved.model.loader import open_model

    kv_bytes = open_model(tiny_llama)[1].kv_bytes_per_token
    for n in "ab":
        (tmp_path / n).mkdir()
    model = ["--model", str(tiny_llama)]
    b_profile = profile(tmp_path, "node-b", kv_bytes)
    port_args = []
    with weave_serve(tmp_path / "b", *model, "--profile", str(b_profile)) as b:
        url = federation_url(b)
        port_args = ["--federation-port", url.rsplit(":", 1)[1]]  # B comes back at the same address
        peers = f'\n[[peers]]\nname = "b"\nurl = "{url}"\ntoken = "tok"\n'
        with weave_serve(tmp_path / "a", *model, "--profile", str(profile(tmp_path, "node-a", kv_bytes, peers))) as a, \
                uds_client(a.socket, timeout=300) as http:
            wait_alive(http, "b")
            sid = session(http, RING_CONTEXT)["id"]
            first = complete(http, sid, list(range(100, 180)), 6)
            assert b.terminate() == 0, b.output  # a member that stops leaves its groups cleanly
            r = http.post("/v1/completions", json={"session": sid, "prompt": [5, 6, 7], "max_tokens": 4})
            assert r.status_code == 503, r.text
            assert "the ring of 1 node(s) has no room for this session's KV" in r.json()["error"]["message"]
            assert http.get(f"/v1/sessions/{sid}").json()["context_tokens"] >= 80  # kept, transcript and all
            with weave_serve(tmp_path / "b", *model, "--profile", str(b_profile), *port_args):
                wait_alive(http, "b")
                again = complete(http, sid, [5, 6, 7], 4)
                assert len(again["logprobs"]["tokens"]) == 4
                ring = next(p for p in http.get("/v1/status").json()["pools"] if p["name"] == "ring")["ring"]
                assert ring["members"] == ["b"] and ring["rebuilt_sessions"] >= 1
    assert len(first["logprobs"]["tokens"]) == 6
