"""Three real daemons on loopback (``weave serve`` on a tiny model, each with its own socket, data
directory and federation port): Q-Ring decode and pipeline prefill driven by the router.

Node A homes ring sessions and names B and C as peers; every node's KV cap holds 1,024 positions.
A session that may reach 1,536 positions cannot live on one node: A serves it on a ring of A, B and
C (each holds a third), a node without live peers refuses it.  Its greedy continuations match a
single-node session of A's own CPU pool except at near-ties.  Killing C mid-decode: A rebuilds the
session on A and B from its transcript (through a pipeline prefill of the two) and the turn
completes; no daemon hangs.  Restarted, A rebuilds the session from its journal's transcript on the
ring that is left, a new ring session's long first prompt scatters through a pipeline, and a standard
session's long first prompt is prefilled by a pipeline of A and B and gathered into A's file - giving
exactly the tokens and log-probabilities a single node gives.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = [pytest.mark.federation, pytest.mark.slow]

NODE_TOKENS = 1024  # each node's KV cap, in positions of the tiny model
RING_CONTEXT = 1536  # more than one node holds, less than two do
BOUND_S = 90.0  # a bound on waiting for health checks, never a timing assertion
NEAR_TIE = 0.3
# a chosen token's log-probability, ring vs one node, free running: the ring sums attention in another
# order, and a last-bit difference can flip a Q8_0 rounding that later positions inherit (the KL bars
# themselves are held in test_multiprocess, on the same RingMember steps)
LOGPROB_TOL = 0.1


def profile(tmp: Path, name: str, kv_bytes: int, peers: str = "") -> Path:
    from importlib.resources import files

    text = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
    text = text.replace('name = "auto"            # the hostname', f'name = "{name}"')
    text = text.replace('kv_cap_bytes = "auto"', f"kv_cap_bytes = {NODE_TOKENS * kv_bytes}")
    text = text.replace('kernels = "auto"', "kernels = 1")  # three daemons share two cores
    text = text.replace("pipeline_min_prompt_tokens = 8192", "pipeline_min_prompt_tokens = 64")
    text += ('\n[federation]\nport = 0\ntoken = "tok"\nhealth_interval_s = 0.5\nhealth_timeout_s = 0.5\n'
             'ring_timeout_s = 30\nring_idle_timeout_s = 60\n')
    path = tmp / f"{name}.toml"
    path.write_text(text + peers)
    return path


def federation_url(proc) -> str:
    m = re.search(r"federation on (http://\S+)", proc.output)
    assert m, proc.output
    return m.group(1)


class Events:
    """Collects a daemon's /v1/events in a thread until closed."""

    def __init__(self, sock: Path):
        self.got: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._t.start()

    def _run(self, sock: Path) -> None:
        with uds_client(sock, timeout=None) as c, c.stream("GET", "/v1/events") as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.got.append(json.loads(line[6:]))
                if self._stop.is_set():
                    return

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.got if e["type"] == kind]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_llama):
    from weaved.model.loader import open_model

    kv_bytes = open_model(tiny_llama)[1].kv_bytes_per_token
    tmp = tmp_path_factory.mktemp("ring")
    for n in "abc":
        (tmp / n).mkdir()
    model = ["--model", str(tiny_llama)]
    with weave_serve(tmp / "b", *model, "--profile", str(profile(tmp, "node-b", kv_bytes))) as b, \
            weave_serve(tmp / "c", *model, "--profile", str(profile(tmp, "node-c", kv_bytes))) as c:
        peers = "".join(f'\n[[peers]]\nname = "{n}"\nurl = "{federation_url(p)}"\ntoken = "tok"\n'
                        for n, p in (("b", b), ("c", c)))
        a_args = (tmp / "a", *model, "--profile", str(profile(tmp, "node-a", kv_bytes, peers)))
        with weave_serve(*a_args) as a:
            with uds_client(a.socket) as http:
                end = time.monotonic() + BOUND_S
                while sum(p["state"] == "alive" for p in http.get("/v1/status").json()["peers"]) < 2:
                    assert time.monotonic() < end, a.output
                    time.sleep(0.2)
            yield {"a": a, "b": b, "c": c, "a_args": a_args}
            rc_a = a.terminate()
        assert rc_a == 0, a.output  # the home stopped its ring: the members leave cleanly
    assert b.proc.returncode == 0, b.output


def complete(http, sid: str, prompt: list[int], n: int) -> dict:
    r = http.post("/v1/completions", json={"session": sid, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def session(http, max_context: int) -> dict:
    r = http.post("/v1/sessions", json={"sla": {"class": "background"}, "max_context": max_context})
    assert r.status_code == 200, r.text
    return r.json()


def agree(ring: dict, single: dict) -> int:
    """Greedy tokens equal up to the first near-tie of the single node; returns the positions compared."""
    a, b = ring["logprobs"], single["logprobs"]
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
        top = sorted(b["top_logprobs"][i].values(), reverse=True)
        if ta != tb:
            assert top[0] - top[1] < NEAR_TIE, f"diverged at {i} with margin {top[0] - top[1]:.3f}"
            return i
        assert abs(a["token_logprobs"][i] - b["token_logprobs"][i]) < LOGPROB_TOL, i
    return len(a["tokens"])


def test_a_single_node_refuses_a_context_over_its_cap(nodes):
    with uds_client(nodes["b"].socket) as http:  # b federates but names no peers
        r = http.post("/v1/sessions", json={"max_context": RING_CONTEXT})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert f"this node holds at most {NODE_TOKENS}" in msg and "no peer serving this model is alive" in msg


def test_joining_a_group_needs_the_token_and_the_same_model(nodes):
    import httpx

    url = federation_url(nodes["b"]) + "/federation/v1/groups"
    body = {"group": "g", "rank": 1, "world": 2, "host": "127.0.0.1", "port": 1, "home": "x",
            "fingerprint": "another-model", "timeout_s": 1, "idle_timeout_s": 1}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer tok"}, timeout=30)
    assert r.status_code == 409 and "serves another model" in r.json()["error"]["message"]


def test_the_ring_serves_a_context_over_the_node_cap_and_matches_one_node(nodes):
    rng = np.random.default_rng(7)
    with uds_client(nodes["a"].socket, timeout=300) as http:
        ring = session(http, RING_CONTEXT)
        assert ring["placement"]["decode_strategy"] == "qring" and ring["backend"] == "qring"
        assert any(f"exceeds what this node holds ({NODE_TOKENS} tokens)" in r for r in ring["placement"]["reasons"])
        compared = 0
        for n_prompt in (40, 200):
            prompt = rng.integers(100, 5000, n_prompt).tolist()
            single = session(http, 512)
            assert single["placement"]["decode_strategy"] == "standard"
            s_out = complete(http, single["id"], prompt, 16)
            http.delete(f"/v1/sessions/{single['id']}")  # every node's cap is small: free what is done with
            if n_prompt == 40:
                r_out = complete(http, ring["id"], prompt, 16)
            else:  # the second prompt in a fresh ring session
                other = session(http, RING_CONTEXT)
                r_out = complete(http, other["id"], prompt, 16)
                assert http.delete(f"/v1/sessions/{other['id']}").status_code == 200
            compared += agree(r_out, s_out)
        assert compared >= 16
        # the first ring session grows past what one node holds
        long = rng.integers(100, 5000, 1000).tolist()
        out = complete(http, ring["id"], long, 8)
        assert len(out["logprobs"]["tokens"]) == 8
        got = http.get(f"/v1/sessions/{ring['id']}").json()
        assert got["context_tokens"] > NODE_TOKENS
        st = http.get("/v1/status").json()
        rp = next(p for p in st["pools"] if p["name"] == "ring")
        assert rp["ring"]["members"] == ["b", "c"] and rp["ring"]["sessions"] == 1  # the other was deleted
    for n in "bc":  # each member serves the ring's group and holds its shards under its own cap
        with uds_client(nodes[n].socket) as http:
            st = http.get("/v1/status").json()
        assert [g["state"] for g in st["groups"]] == ["serving"] and st["groups"][0]["home"] == "node-a"
        per_node = st["kv"]["cap_bytes"] // NODE_TOKENS  # the model's KV bytes per position
        assert st["kv"]["reserved_bytes"] == RING_CONTEXT // 3 * per_node  # its third, reserved when opened


def test_killing_a_peer_mid_decode_completes_the_turn_on_the_survivors(nodes):
    a = nodes["a"]
    rng = np.random.default_rng(11)
    prompt = rng.integers(100, 5000, 120).tolist()
    events = Events(a.socket)
    with uds_client(a.socket, timeout=300) as http:
        sid = session(http, 512)["id"]
        single = complete(http, sid, prompt, 160)
        http.delete(f"/v1/sessions/{sid}")
        for s in http.get("/v1/sessions").json()["data"]:  # the earlier tests' ring sessions
            http.delete(f"/v1/sessions/{s['id']}")
        ring = session(http, RING_CONTEXT)
        text, n = [], 0
        with http.stream("POST", "/v1/completions", json={
                "session": ring["id"], "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 2}) as r:
            chunks = []
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])["choices"][0]
                chunks.append(chunk)
                n += 1
                if n == 20:
                    nodes["c"].proc.kill()  # SIGKILL: no goodbye on the data plane
            text = chunks
        assert text[-1]["finish_reason"] == "length"
        tokens = [t for c in text if c.get("logprobs") for t in c["logprobs"]["tokens"]]
        assert len(tokens) == 160
        end = time.monotonic() + BOUND_S
        while not events.of("ring_rebuild"):
            assert time.monotonic() < end, events.got
            time.sleep(0.1)
        lost, rebuilt, formed = events.of("ring_lost"), events.of("ring_rebuild"), events.of("ring_formed")
        assert lost and formed[-1]["members"] == ["b"], (lost, formed)
        assert any(e["session"] == ring["id"] and e["tokens"] > len(prompt) for e in rebuilt), rebuilt
        assert any(e["via"] == "pipeline" for e in rebuilt), rebuilt  # two nodes, two layers: a pipeline
        # the continuation is the single node's except at near-ties
        lps = [c["logprobs"] for c in text if c.get("logprobs")]
        joined = {"tokens": tokens, "token_logprobs": [x for lp in lps for x in lp["token_logprobs"]],
                  "top_logprobs": [x for lp in lps for x in lp["top_logprobs"]]}
        assert agree({"logprobs": joined}, single) >= 20
        # the survivors go on: another turn on the same session, A and B healthy
        assert len(complete(http, ring["id"], prompt[:10], 4)["logprobs"]["tokens"]) == 4
        st = http.get("/v1/status").json()
        assert next(p for p in st["peers"] if p["name"] == "c")["state"] == "dead"
    with uds_client(nodes["b"].socket) as http:
        assert http.get("/health").status_code == 200
    events._stop.set()


def test_a_restarted_home_rebuilds_its_ring_sessions_from_their_transcripts(nodes):
    """After the kill above: A restarts; its ring session comes back from the journal, is rebuilt on
    A and B at its next turn, and a new session's long first prompt takes a two-stage pipeline."""
    with uds_client(nodes["a"].socket) as http:
        (ring,) = http.get("/v1/sessions").json()["data"]
    assert nodes["a"].terminate() == 0, nodes["a"].output
    with weave_serve(*nodes["a_args"]) as a2:
        events = Events(a2.socket)
        with uds_client(a2.socket, timeout=300) as http:
            end = time.monotonic() + BOUND_S
            while not any(p["name"] == "b" and p["state"] == "alive" for p in http.get("/v1/status").json()["peers"]):
                assert time.monotonic() < end, a2.output
                time.sleep(0.2)
            got = http.get(f"/v1/sessions/{ring['id']}").json()
            # the whole context comes back; the last sampled token was never fed: the next turn's first
            assert got["backend"] == "qring" and got["context_tokens"] == ring["context_tokens"]
            r = http.post("/v1/completions", json={"session": ring["id"], "prompt": [300, 301, 302], "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == got["context_tokens"] - 1
            # two nodes hold one such session (768 of each node's 1,024 positions), not two: refused cleanly
            fresh = session(http, RING_CONTEXT)
            r = http.post("/v1/completions", json={"session": fresh["id"], "prompt": list(range(200, 300)),
                                                   "max_tokens": 4})
            assert r.status_code == 503 and "the ring of 2 node(s) has no room" in r.json()["error"]["message"], r.text
            assert http.delete(f"/v1/sessions/{ring['id']}").status_code == 200
            assert len(complete(http, fresh["id"], list(range(200, 300)), 4)["logprobs"]["tokens"]) == 4
            end = time.monotonic() + BOUND_S
            while not events.of("pipeline_prefill"):
                assert time.monotonic() < end, events.got
                time.sleep(0.1)
            # a standard session's long first prompt: pipeline prefill on A and B, gathered into A's file;
            # hidden states travel as float32 and the kernels are batch invariant, so the answer is B's own
            assert http.delete(f"/v1/sessions/{fresh['id']}").status_code == 200
            prompt = list(range(400, 500))
            local = session(http, 512)
            assert local["placement"]["decode_strategy"] == "standard"
            piped = complete(http, local["id"], prompt, 8)
            end = time.monotonic() + BOUND_S
            while not [e for e in events.of("pipeline_prefill") if e.get("gather")]:
                assert time.monotonic() < end, events.got
                time.sleep(0.1)
            (gathered,) = [e for e in events.of("pipeline_prefill") if e.get("gather")]
            assert gathered["tokens"] == len(prompt) - 1 and gathered["ranges"] == [[0, 1], [1, 2]]
        with uds_client(nodes["b"].socket, timeout=300) as hb:
            alone = complete(hb, session(hb, 512)["id"], prompt, 8)
        assert piped["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert piped["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
        rebuilt = events.of("ring_rebuild")
        # the rebuild prefills what the journal committed (the tail is the next turn's to feed)
        assert [(e["session"], e["tokens"], e["via"]) for e in rebuilt] == [(ring["id"], got["context_tokens"] - 1,
                                                                              "pipeline")]
        assert events.of("ring_formed")[0]["members"] == ["b"]
        assert events.of("pipeline_prefill")[0]["session"] == fresh["id"]  # a ring session's: scattered
        events._stop.set()
        assert a2.terminate() == 0, a2.output
