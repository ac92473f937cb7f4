"""End to end: a detached turn (a task nobody waits on) that a stop or a crash cuts runs again after the
restart, from where its session stood before it, and ends whole."""

from __future__ import annotations

import time

import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow

TASK = [{"role": "user", "content": "Write the numbers from 1 to 1000, separated by commas."}]
ANSWER = 400  # tokens: seconds of decoding, long enough to be cut by the stop
WAIT_S = 120.0


def _wait(client, sid: str, done) -> dict:
    """The session once ``done(it)`` holds (polled; bounded)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        info = client.get(f"/v1/sessions/{sid}").json()
        if done(info):
            return info
        time.sleep(0.05)
    raise AssertionError(f"session {sid} did not get there: {info}")


@pytest.mark.parametrize("stop", ["sigterm", "kill -9"])
def test_a_detached_turn_cut_by_a_stop_runs_again_after_the_restart(tmp_path, smollm2_q4_0, stop):
    body = {"messages": TASK, "max_tokens": ANSWER, "temperature": 0, "detach": True,
            "sla": {"class": "background", "ttlt_s": 600}}
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:
        with uds_client(proc.socket) as c:
            sid = c.post("/v1/sessions", json={"sla": {"class": "background"}}).json()["id"]
            assert c.post(f"/v1/sessions/{sid}/turns", json=body).status_code == 202
            prompt = _wait(c, sid, lambda s: s["context_tokens"] > 0)["context_tokens"]
            _wait(c, sid, lambda s: s["context_tokens"] >= prompt + 4)  # a few tokens of its answer
        if stop == "sigterm":
            assert proc.terminate() == 0
        else:  # a crash: the turn's record and its committed tokens are all the journal has
            proc.proc.kill()
            proc.proc.wait()
    cut = proc.output
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:  # the same data directory
        assert "detached turn(s) cut by the last stop or crash run again" in proc.output
        with uds_client(proc.socket) as c:
            info = _wait(c, sid, lambda s: s["status"] == "idle" and len(s["messages"]) == 2)
            user, answer = info["messages"]
            assert user["content"] == TASK[0]["content"]
            assert answer["role"] == "assistant" and answer["finish_reason"] in ("length", "stop"), (cut, info)
            # what the task answers uncut, asked again of a fresh session
            fresh = c.post("/v1/sessions", json={"sla": {"class": "background"}}).json()["id"]
            whole = c.post(f"/v1/sessions/{fresh}/turns", json={**body, "detach": False}).json()
            assert answer["content"] == whole["choices"][0]["message"]["content"]
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:  # ended: not run a second time
        assert "run again" not in proc.output
        with uds_client(proc.socket) as c:
            assert c.get(f"/v1/sessions/{sid}").json()["messages"] == info["messages"]
