"""SLA accounting, percentiles and the capacity search, on synthetic records."""

from __future__ import annotations

import random

import numpy as np
import pytest

from weaved.bench.agents.capacity import relative, search_capacity
from weaved.bench.agents.metrics import Outcome, SLATargets, outcome, percentile, summarize
from weaved.bench.agents.records import TurnKind, TurnRecord, TurnStatus

T = SLATargets()  # background 60 s, batch 300 s, interactive 500 ms / 100 ms, share 0.95


def rec(kind: TurnKind, submitted: float = 0.0, *, ttft: float | None = None, gap: float = 0.02, n: int = 10,
        ended: float | None = None, status: TurnStatus | None = None) -> TurnRecord:
    r = TurnRecord(kind, 0 if kind is not TurnKind.BATCH else None, 0, "s-x", 10, n, submitted)
    if ttft is not None:
        r.first_token = submitted + ttft
        r.token_times = [r.first_token + i * gap for i in range(n)]
    r.ended = ended
    r.status = status or (TurnStatus.DONE if ended is not None else TurnStatus.RUNNING)
    return r


@pytest.mark.parametrize("kind, budget", [(TurnKind.HEARTBEAT, 60.0), (TurnKind.BATCH, 300.0)])
def test_throughput_classes_are_judged_by_time_to_last_token(kind, budget):
    assert outcome(rec(kind, 10, ttft=1, ended=10 + budget), T, 1000) is Outcome.MET
    assert outcome(rec(kind, 10, ttft=1, ended=10 + budget + 0.01), T, 1000) is Outcome.MISSED
    # still running at the end: unknown while inside the budget, missed once past it
    assert outcome(rec(kind, 10, ttft=1), T, 10 + budget - 1) is Outcome.UNFINISHED
    assert outcome(rec(kind, 10), T, 10 + budget + 1) is Outcome.MISSED
    assert outcome(rec(kind, 10, ttft=1, ended=12, status=TurnStatus.FAILED), T, 100) is Outcome.MISSED
    assert outcome(rec(kind, 10, status=TurnStatus.REJECTED), T, 11) is Outcome.MISSED
    # running, inside its budget, but at its pace so far it ends past it: missed already
    behind = rec(kind, 10, ttft=1, n=4, gap=budget / 8)
    behind.max_tokens = 40
    assert outcome(behind, T, 10 + 1 + 4 * budget / 8) is Outcome.MISSED
    on_pace = rec(kind, 10, ttft=1, n=4, gap=budget / 80)
    on_pace.max_tokens = 40
    assert outcome(on_pace, T, 10 + 1 + 4 * budget / 80) is Outcome.UNFINISHED


def test_interactive_needs_first_token_and_steady_stream():
    ex = TurnKind.EXCHANGE
    exact = SLATargets(interactive_itl_p99_s=0.125)  # binary-exact times: the bounds themselves are met
    assert outcome(rec(ex, 4, ttft=0.5, gap=0.125, ended=7), exact, 100) is Outcome.MET
    assert outcome(rec(ex, 4, ttft=0.5, gap=0.125, ended=7), T, 100) is Outcome.MISSED
    assert outcome(rec(ex, 5, ttft=0.51, gap=0.01, ended=7), T, 100) is Outcome.MISSED
    assert outcome(rec(ex, 5, ttft=0.2, gap=0.101, ended=7), T, 100) is Outcome.MISSED
    # one long stall among many short gaps: the p99 (interpolated) sees it
    r = rec(ex, 5, ttft=0.2, gap=0.01, n=50, ended=7)
    r.token_times[25:] = [t + 0.5 for t in r.token_times[25:]]
    assert outcome(r, T, 100) is Outcome.MISSED
    # running at the end
    assert outcome(rec(ex, 5), T, 5.4) is Outcome.UNFINISHED  # no token yet, but not late
    assert outcome(rec(ex, 5), T, 5.6) is Outcome.MISSED  # no token and already late
    assert outcome(rec(ex, 5, ttft=0.1), T, 6) is Outcome.UNFINISHED  # on time, still streaming
    assert outcome(rec(ex, 5, ttft=0.9), T, 6) is Outcome.MISSED  # late first token: known missed
    # a one-token answer has no gaps: its stream cannot be unsteady
    assert outcome(rec(ex, 5, ttft=0.1, n=1, ended=5.2), T, 6) is Outcome.MET


def test_percentile_matches_numpy_linear():
    r = random.Random(1)
    for n in (1, 2, 7, 100):
        xs = [r.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_summary_counts_shares_and_latencies():
    hb, ex, b = TurnKind.HEARTBEAT, TurnKind.EXCHANGE, TurnKind.BATCH
    recs = [rec(hb, 0, ttft=1.0, ended=10) for _ in range(19)]
    recs += [rec(hb, 0, ttft=1.0, ended=70)]  # missed
    recs += [rec(hb, 95, ttft=1.0)]  # unfinished
    recs += [rec(ex, 0, ttft=0.2, gap=0.05, ended=1), rec(ex, 0, ttft=0.7, gap=0.05, ended=2)]
    recs += [rec(b, 0, ttft=5.0)]  # batch running, within its budget
    s = summarize(recs, T, 100.0)
    bg, it, ba = s["classes"]["background"], s["classes"]["interactive"], s["classes"]["batch"]
    assert (bg["turns"], bg["met"], bg["missed"], bg["unfinished"], bg["share_met"]) == (21, 19, 1, 1, 0.95)
    assert (it["met"], it["missed"], it["share_met"]) == (1, 1, 0.5)
    assert (ba["turns"], ba["unfinished"], ba["share_met"]) == (1, 1, None)
    assert bg["ttft_p50_ms"] == pytest.approx(1000.0) and it["itl_p99_ms"] == pytest.approx(50.0)
    assert s["tokens_generated"] == 24 * 10 and s["tokens_per_s"] == pytest.approx(2.4)
    assert s["meets_sla"] is False and s["limiting_class"] == "interactive"
    # a class with no judged turn does not fail the test; the others decide
    ok = summarize([r for r in recs if r.kind is not ex], T, 100.0)
    assert ok["meets_sla"] is True and ok["classes"]["interactive"]["share_met"] is None
    assert ok["limiting_class"] == "background"


def test_targets_follow_the_workload():
    from weaved.bench.agents.workload import AgentWorkload

    t = SLATargets.from_workload(AgentWorkload(interactive_ttft_ms=250, background_ttlt_s=30, sla_share=0.9))
    assert (t.interactive_ttft_s, t.background_ttlt_s, t.share, t.batch_ttlt_s) == (0.25, 30, 0.9, 300.0)


def _threshold(limit: int, calls: list[int]):
    def run(n: int):
        calls.append(n)
        return n <= limit, {"shares": {}}
    return run


def test_capacity_doubles_then_bisects():
    calls: list[int] = []
    res = search_capacity(_threshold(11, calls), start=4, max_agents=64, max_runs=10)
    assert calls == [4, 8, 16, 12, 10, 11]
    assert (res.capacity, res.failed_at, res.exact, res.label()) == (11, 12, True, "11")


def test_capacity_zero_when_one_agent_fails():
    calls: list[int] = []
    res = search_capacity(_threshold(0, calls), start=4, max_agents=64, max_runs=10)
    assert calls == [4, 2, 1] and (res.capacity, res.exact) == (0, True)


def test_capacity_capped_and_out_of_runs():
    res = search_capacity(_threshold(1000, []), start=4, max_agents=20, max_runs=10)
    assert [p.agents for p in res.probes] == [4, 8, 16, 20] and res.capped and res.label() == ">=20 (max)"
    res = search_capacity(_threshold(11, []), start=4, max_agents=64, max_runs=4)
    assert (res.capacity, res.failed_at, res.exact) == (8, 12, False) and res.label() == ">=8, <12 (runs ran out)"
    assert res.to_dict()["runs"][-1] == {"agents": 12, "passed": False, "shares": {}}
    with pytest.raises(ValueError):
        search_capacity(_threshold(1, []), start=0, max_agents=4, max_runs=2)


def test_capacity_relative_to_baseline():
    caps = {n: search_capacity(_threshold(k, []), start=1, max_agents=64, max_runs=20)
            for n, k in (("weave", 12), ("fifo", 8), ("isolation", 4))}
    assert relative(caps, "fifo") == {"weave": 1.5, "fifo": 1.0, "isolation": 0.5}
    caps["fifo"] = search_capacity(_threshold(0, []), start=1, max_agents=64, max_runs=20)
    assert set(relative(caps, "fifo").values()) == {None}
    assert set(relative(caps, "missing").values()) == {None}
