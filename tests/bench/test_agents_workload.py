"""The agents workload: parameters, the seeded plan, compaction and check-ins (no model, no clock)."""

from __future__ import annotations

import dataclasses

import pytest

from weaved.bench.agents.tokens import TokenPool
from weaved.bench.agents.workload import AgentWorkload, Plan, compaction_needed

REF = AgentWorkload()


def _items(plan: Plan, agents: int = 4, turns: int = 6):
    hbs = [plan.heartbeat(a, k) for a in range(agents) for k in range(turns)]
    jobs = [plan.batch_job(s, j) for s in range(2) for j in range(3)]
    return hbs, jobs, plan.checkins


def test_reference_values_are_the_spec():
    w = REF
    assert (w.agents, w.start_context, w.max_context) == (16, 2000, 8192)
    assert (w.tool_output, w.agent_gen, w.heartbeat_s, w.heartbeat_jitter) == ((256, 1024), (64, 256), 20.0, 0.5)
    assert (w.checkins_per_min, w.exchanges, w.question, w.answer) == (4.0, (1, 3), (20, 60), (32, 128))
    assert (w.exchange_gap_s, w.interactive_ttft_ms, w.interactive_itl_p99_ms) == ((5.0, 15.0), 500.0, 100.0)
    assert (w.batch_concurrency, w.batch_document, w.batch_summary, w.batch_ttlt_s) == (2, 4000, 256, 300.0)
    assert (w.background_ttlt_s, w.sla_share) == (60.0, 0.95)
    quick = AgentWorkload.quick()
    assert quick.duration_s < w.duration_s and quick.agents < w.agents and quick.tool_output == w.tool_output


def test_same_seed_same_plan_other_seed_other_plan():
    assert _items(Plan(REF)) == _items(Plan(AgentWorkload()))
    assert _items(Plan(REF)) != _items(Plan(dataclasses.replace(REF, seed=1)))
    # an item does not depend on how many others were drawn before it
    assert Plan(REF).heartbeat(3, 5) == Plan(REF).heartbeat(3, 5)
    # the check-ins planned in a longer run start with those of a shorter one
    short, long = Plan(dataclasses.replace(REF, duration_s=120)), Plan(dataclasses.replace(REF, duration_s=600))
    assert long.checkins[: len(short.checkins)] == short.checkins


def test_heartbeats_within_the_parameters():
    w = REF
    plan = Plan(w)
    for a in range(w.agents):
        first = plan.heartbeat(a, 0)
        assert first.append == w.start_context and 0 <= first.gap_s <= w.heartbeat_s
        assert w.agent_gen[0] <= first.generate <= w.agent_gen[1]
        for k in range(1, 40):
            hb = plan.heartbeat(a, k)
            assert w.tool_output[0] <= hb.append <= w.tool_output[1]
            assert w.agent_gen[0] <= hb.generate <= w.agent_gen[1]
            assert w.heartbeat_s * 0.5 <= hb.gap_s <= w.heartbeat_s * 1.5
    gaps = [plan.heartbeat(a, k).gap_s for a in range(16) for k in range(1, 40)]
    assert 18 < sum(gaps) / len(gaps) < 22  # centred on the heartbeat
    starts = sorted(plan.heartbeat(a, 0).gap_s for a in range(16))
    assert starts[-1] - starts[0] > w.heartbeat_s / 2  # staggered, not all at once


def test_checkins_within_the_parameters():
    w = dataclasses.replace(REF, duration_s=3600.0)
    plan = Plan(w)
    cs = plan.checkins
    assert 180 <= len(cs) <= 300  # 4 a minute for an hour (Poisson: 240 +/- 3 sigma)
    assert [c.index for c in cs] == list(range(len(cs)))
    assert all(0 <= a.at_s < b.at_s < w.duration_s for a, b in zip(cs, cs[1:], strict=False))
    assert len({c.agent for c in cs}) == w.agents and all(0 <= c.agent < w.agents for c in cs)
    for c in cs:
        assert w.exchanges[0] <= len(c.exchanges) <= w.exchanges[1]
        assert c.exchanges[0].gap_s == 0.0
        assert all(w.exchange_gap_s[0] <= e.gap_s <= w.exchange_gap_s[1] for e in c.exchanges[1:])
        assert all(w.question[0] <= e.question <= w.question[1] for e in c.exchanges)
        assert all(w.answer[0] <= e.answer <= w.answer[1] for e in c.exchanges)
    assert {len(c.exchanges) for c in cs} == {1, 2, 3}
    assert Plan(dataclasses.replace(w, checkins_per_min=0)).checkins == ()


def test_batch_jobs_are_the_reference_document():
    job = Plan(REF).batch_job(1, 7)
    assert (job.slot, job.index, job.document, job.summary) == (1, 7, 4000, 256)


def test_compaction_keeps_every_turn_within_the_context():
    """Replaying one agent's heartbeats by the rule: the context grows to near max_context, never
    beyond it (with room for a check-in), and each compaction restarts from the summary."""
    w = REF
    plan = Plan(w)
    hb = plan.heartbeat(0, 0)
    ctx, compactions, peak = hb.append + hb.generate, 0, 0
    for k in range(1, 200):
        hb = plan.heartbeat(0, k)
        if compaction_needed(ctx, hb.append, hb.generate, w.checkin_reserve, w.max_context):
            compactions += 1
            ctx = w.start_context + hb.append + hb.generate
        else:
            ctx += hb.append + hb.generate
        assert ctx + w.checkin_reserve <= w.max_context
        peak = max(peak, ctx)
    assert compactions >= 10 and peak > w.max_context - w.tool_output[1] - w.agent_gen[1] - w.checkin_reserve


def test_compaction_rule_boundary():
    assert not compaction_needed(8000, 100, 92, 0, 8192)
    assert compaction_needed(8000, 100, 93, 0, 8192)
    assert compaction_needed(7000, 100, 92, 1001, 8192)


def test_checkin_reserve_is_one_whole_checkin():
    assert REF.checkin_reserve == 3 * (60 + 128)


@pytest.mark.parametrize("bad", [
    {"agents": 0}, {"duration_s": 0}, {"tool_output": (10, 5)}, {"heartbeat_jitter": 1.0}, {"sla_share": 0},
    {"max_context": 3000}, {"batch_document": 8000}, {"exchanges": (0, 2)},
])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        AgentWorkload(**bad)


def test_token_pool_windows_are_exact_and_seeded():
    pool = TokenPool(list(range(100, 150)), seed=3)
    a = pool.take(120, "heartbeat", 0, 1)
    assert len(a) == 120 and set(a) <= set(range(100, 150))
    assert a == pool.take(120, "heartbeat", 0, 1)
    assert a != pool.take(120, "heartbeat", 0, 2)
    assert TokenPool(list(range(100, 150)), seed=4).take(120, "heartbeat", 0, 1) != a
