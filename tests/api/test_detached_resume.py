"""Running cut detached turns again at start (``weaved.api.detached``), with the daemon double: each
request goes through the same checks as a new one, and one the daemon refuses is given up, logged."""

from __future__ import annotations

import asyncio

from tests.api.fake_daemon import FakeDaemon
from weaved.api.app import create_app
from weaved.api.detached import resume_detached
from weaved.routing.types import SLA, SLAClass

TASK = {"messages": [{"role": "user", "content": "label the tickets"}], "max_tokens": 5, "detach": True}


def test_cut_turns_start_again_and_refused_ones_are_given_up():
    fake = FakeDaemon(context_length=4096)
    good = fake.create_session(SLA(SLAClass.BACKGROUND))["id"]
    bad = fake.create_session(SLA(SLAClass.BACKGROUND))["id"]
    fake.cut_detached = [(good, TASK, 0), (bad, {**TASK, "temperature": 9}, 2), ("s-gone", TASK, 0)]
    state = create_app(fake).state.weave
    lines: list[str] = []

    async def run() -> int:
        started = await resume_detached(state, lines.append)
        await asyncio.sleep(0.2)  # the started turn's events drain in the background
        return started

    assert asyncio.run(run()) == 1
    starts = [kw for name, kw in fake.calls if name == "start_turn"]
    assert [kw["session_id"] for kw in starts] == [good]
    assert starts[0]["messages"] == TASK["messages"] and starts[0]["params"].max_tokens == 5
    forgotten = [kw["session_id"] for name, kw in fake.calls if name == "forget_detached_turn"]
    assert forgotten == [bad, "s-gone"]
    assert any(f"session {bad}: its detached turn" in line and "temperature" in line for line in lines)
    assert lines[-1] == "1 detached turn(s) cut by the last stop or crash run again"


def test_a_journaled_request_reads_back_as_the_same_request():
    """What a detached turn journals validates again into the request it was (aliased fields too:
    ``sla.class``, ``json_schema.schema``)."""
    from weaved.api.chat import chat_spec
    from weaved.api.models import ChatRequest

    fake = FakeDaemon(context_length=4096)
    sid = fake.create_session(SLA(SLAClass.BACKGROUND))["id"]
    body = {**TASK, "sla": {"class": "batch", "ttlt_s": 600},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "labels", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    req = ChatRequest.model_validate(body)
    spec = chat_spec(create_app(fake).state.weave, req, sid, None)
    assert ChatRequest.model_validate(spec.detached) == req
    assert spec.detached["sla"] == {"class": "batch", "ttlt_s": 600.0}


def test_sla_targets_given_as_headers_are_journaled_with_the_request(client, fake):
    """A detached turn run again after a restart has no headers: the SLA tags it was given as headers
    are journaled in its request, so the run again keeps its deadline."""
    sid = fake.create_session(SLA(SLAClass.BACKGROUND))["id"]
    r = client.post("/v1/chat/completions", json={**TASK, "session": sid},
                    headers={"X-Weave-TTLT-S": "900", "X-Weave-TTFT-Ms": "4000"})
    assert r.status_code == 202, r.text
    journaled = [kw["detached"] for name, kw in fake.calls if name == "start_turn"][0]
    assert journaled["sla"] == {"class": "background", "ttft_ms": 4000.0, "ttlt_s": 900.0}
    from weaved.api.models import ChatRequest
    assert ChatRequest.model_validate(journaled).sla.ttlt_s == 900.0
