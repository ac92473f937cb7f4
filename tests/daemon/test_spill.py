"""A throughput-tolerant session's turns beside a GPU pool (the torch backend, on torch's CPU device
here): a turn the CPU pool cannot take - its admission refuses it, or the router predicts it would end
past its budget - spills to the GPU pool with one KV copy and the same tokens; the session returns to
the CPU once the CPU has room again, copying nothing.  Admission judges every turn where, and at the
rank, it then runs."""

from __future__ import annotations

import dataclasses

import pytest

from tests.daemon.test_coexec import (  # noqa: F401 (daemon_factory: a fixture)
    Turn,
    backends,
    daemon_factory,
    prompt_ids,
    record_migrations,
    start,
)
from weaved.calibration.cost import Linear, StepCost
from weaved.engine.admission import Capacity
from weaved.engine.sampling import SamplingParams
from weaved.routing.types import SLA, SLAClass

pytest.importorskip("torch")

TURN = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MINUTE = SLA(SLAClass.BACKGROUND, ttlt_s=60.0)
PROMPTS = [prompt_ids(24, 40), prompt_ids(9, 41)[1:], prompt_ids(9, 42)[1:]]


def _placements(d) -> list[dict]:
    seen: list[dict] = []
    publish = d.publish

    def record(kind: str, data: dict) -> None:
        if kind == "placement" and "placement" in data:
            seen.append(data["placement"])
        publish(kind, data)

    d.publish = record
    return seen


def _run(d, sid: str, prompt: list[int]) -> list[int]:
    t = start(d, sid, prompt, TURN)
    t.finish()
    return t.tokens


def test_a_turn_the_cpu_refuses_spills_to_the_gpu_and_the_session_returns(daemon_factory):  # noqa: F811
    d = daemon_factory()
    twin = d.create_session(MINUTE)["id"]  # the same turns, all on the CPU pool
    want = [_run(d, twin, p) for p in PROMPTS]
    assert d.get_session(twin)["pool"] == "cpu"
    # each turn carried the router's forecast, and the pool learned from what its turns took against it
    assert d.pools["cpu"].engine.lateness != 1.0

    moves, placed = record_migrations(d), _placements(d)
    sid = d.create_session(MINUTE)["id"]
    got = [_run(d, sid, PROMPTS[0])]
    assert d.get_session(sid)["pool"] == "cpu"
    cpu = d.pools["cpu"].engine
    kept = cpu.capacity
    cpu.capacity = Capacity(1, 1e-3, 1.0)  # the CPU pool has no decode rate to spare for a paced turn
    got.append(_run(d, sid, PROMPTS[1]))
    info = d.get_session(sid)
    assert info["pool"] == "gpu" and info["placement"]["decode_pool"] == "gpu"
    assert "cannot take the turn" in info["placement"]["reasons"][0]
    spill = [m for m in moves if m["reason"] == "spill"]
    assert len(spill) == 1 and spill[0]["bytes"] == spill[0]["kv_tokens"] * d.config.kv_bytes_per_token > 0

    cpu.capacity = kept  # room again: the router brings the session back, nothing copied
    got.append(_run(d, sid, PROMPTS[2]))
    info = d.get_session(sid)
    assert info["pool"] == "cpu" and "back on the CPU" in info["placement"]["reasons"][-1]
    back = [m for m in moves if m["reason"] == "return"]
    assert len(back) == 1 and back[0]["bytes"] == 0 and back[0]["to"] == "file"
    # created, spilled, returned (its first prompt kept its pools and priority: no placement event then)
    assert [p["decode_pool"] for p in placed] == ["cpu", "gpu", "cpu"]
    assert got == want  # bit-equal backends: the same greedy tokens wherever each turn ran
    gpu, _ = backends(d)
    assert gpu.device_kv_bytes() == 0  # the device copy was released on the way back


def test_a_turn_the_cpu_would_finish_late_spills_before_it_runs(daemon_factory):  # noqa: F811
    d = daemon_factory()
    placed = _placements(d)
    sid = d.create_session(MINUTE)["id"]
    _run(d, sid, PROMPTS[0])
    pool = d.pools["cpu"]
    kept = pool.step_cost
    # a step model of a CPU far too slow for a minute's budget (e.g. a large model on few cores)
    pool.step_cost = StepCost(Linear(1.0, 0.1, 0.0), Linear(10.0, 0.5, 0.0))
    _run(d, sid, PROMPTS[1])
    assert d.get_session(sid)["pool"] == "gpu"
    assert "over 80% of its 60 s budget" in " ".join(placed[-1]["reasons"])
    pool.step_cost = kept
    d.pools["cpu"].engine.lateness = 1.0
    _run(d, sid, PROMPTS[2])
    assert d.get_session(sid)["pool"] == "cpu"


def test_the_baselines_never_spill(daemon_factory):  # noqa: F811
    d = daemon_factory()
    d.profile = dataclasses.replace(d.profile, routing=dataclasses.replace(d.profile.routing, policy="isolation"))
    d.moves.routing = d.profile.routing
    sid = d.create_session(MINUTE)["id"]
    _run(d, sid, PROMPTS[0])
    pool = d.pools["cpu"]
    pool.step_cost = StepCost(Linear(1.0, 0.1, 0.0), Linear(10.0, 0.5, 0.0))
    _run(d, sid, PROMPTS[1])
    assert d.get_session(sid)["pool"] == "cpu"  # the isolation baseline keeps it where its class put it


def test_a_check_in_is_judged_by_the_pool_the_router_moves_it_to(daemon_factory):  # noqa: F811
    """A background session checked in as interactive is sent to the GPU pool by its turn: admission
    judges that pool, not the full CPU pool it leaves (which would have refused it with a 503)."""
    d = daemon_factory()
    sid = d.create_session(MINUTE)["id"]
    _run(d, sid, PROMPTS[0])
    other = d.create_session(MINUTE)["id"]
    assert d.get_session(sid)["pool"] == d.get_session(other)["pool"] == "cpu"
    cpu = d.pools["cpu"].engine
    kept = cpu.capacity
    busy = start(d, other, PROMPTS[0], SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    try:
        busy.wait_tokens(1)
        assert d.get_session(other)["pool"] == "cpu"
        cpu.capacity = Capacity(1, 1e-3, 1.0)  # the CPU pool's rate is all taken by the other session's turn
        t = Turn()
        d.start_turn(session_id=sid, prompt=PROMPTS[1], params=TURN, emit=t.emit, sla=SLA(SLAClass.INTERACTIVE))
        t.finish()
    finally:
        cpu.capacity = kept
        d.cancel_turn(other)
        busy.finish()
    info = d.get_session(sid)
    assert info["pool"] == "gpu" and info["sla"]["class"] == "interactive"
    assert len(t.tokens) == TURN.max_tokens


def test_a_check_in_with_a_first_token_target_is_judged_for_the_prompt_it_brings(daemon_factory):  # noqa: F811
    """A batch session checked in as background with a first-token target: the router predicts that
    target for the turn's own prompt (not for an empty one, which any pool meets) and moves it to the
    GPU pool when the CPU pool would miss it."""
    d = daemon_factory()
    sid = d.create_session(SLA(SLAClass.BATCH, ttlt_s=600.0))["id"]
    _run(d, sid, PROMPTS[0])
    assert d.get_session(sid)["pool"] == "cpu"
    t = Turn()
    d.start_turn(session_id=sid, prompt=PROMPTS[1], params=TURN, emit=t.emit,
                 sla=SLA(SLAClass.BACKGROUND, ttft_ms=0.01, ttlt_s=600.0))
    t.finish()
    info = d.get_session(sid)
    assert info["pool"] == "gpu" and info["sla"]["class"] == "background"
    assert any("TTFT target" in r and "over" in r for r in info["placement"]["reasons"])


def test_a_check_in_the_cpu_refuses_spills_and_runs_where_admission_judged(daemon_factory):  # noqa: F811
    """A batch session checked in as background while its CPU pool has no rate to spare: admission
    finds the GPU pool can take the turn, and the turn runs there - the re-placement of the check-in
    applies the spill instead of placing the session back on the pool that refused it."""
    d = daemon_factory()
    sid = d.create_session(SLA(SLAClass.BATCH, ttlt_s=600.0))["id"]
    _run(d, sid, PROMPTS[0])
    assert d.get_session(sid)["pool"] == "cpu"
    cpu = d.pools["cpu"].engine
    kept = cpu.capacity
    cpu.capacity = Capacity(1, 1e-3, 1.0)  # no decode rate to spare for a paced turn
    t = Turn()
    try:
        d.start_turn(session_id=sid, prompt=PROMPTS[1], params=TURN, emit=t.emit, sla=MINUTE)
        t.finish()
    finally:
        cpu.capacity = kept
    info = d.get_session(sid)
    assert info["sla"]["class"] == "background"
    assert info["pool"] == "gpu" and "cannot take the turn" in info["placement"]["reasons"][0]
    assert len(t.tokens) == TURN.max_tokens


def _probe_ranks(d) -> list:
    """The ranks admission judges turns at, as the pools' engines are asked."""
    seen = []
    for pool in d.pools.values():
        refusal = pool.engine.refusal

        def judged(seq, refusal=refusal):
            seen.append(seq.rank)
            return refusal(seq)

        pool.engine.refusal = judged
    return seen


@pytest.mark.parametrize("policy", ["fifo", "isolation"])
def test_admission_judges_a_turn_at_the_rank_the_engine_runs_it(daemon_factory, policy):  # noqa: F811
    """The baselines keep a session's priority whatever its class (fifo: one for all; isolation: the
    class it was placed with): admission judges each turn at that rank, the engine's, not its class's."""
    d = daemon_factory()
    d.profile = dataclasses.replace(d.profile, routing=dataclasses.replace(d.profile.routing, policy=policy))
    d.moves.routing = d.profile.routing
    sid = d.create_session(SLA(SLAClass.BATCH, ttlt_s=600.0))["id"]
    _run(d, sid, PROMPTS[0])
    ranks = _probe_ranks(d)
    t = Turn()
    d.start_turn(session_id=sid, prompt=PROMPTS[1], params=TURN, emit=t.emit, sla=SLA(SLAClass.INTERACTIVE))
    ran_at = d.sessions[sid].turn.rank
    t.finish()
    assert d.get_session(sid)["sla"]["class"] == "interactive"
    assert ranks and ranks[-1] == ran_at == d.sessions[sid].rank
    assert ran_at.name == "BATCH"  # fifo's one priority, and isolation's kept one, both rank last


def test_a_turn_an_empty_pool_cannot_pace_runs_there_when_no_pool_takes_it(daemon):
    """A CPU-only host whose pool could not pace the turn even alone: refusing it would refuse it however
    often the client retried, so it runs (late rather than never)."""
    daemon.pools["cpu"].engine.capacity = Capacity(1, 1e-3, 1.0)
    sid = daemon.create_session(MINUTE)["id"]
    assert len(_run(daemon, sid, PROMPTS[0])) == TURN.max_tokens
