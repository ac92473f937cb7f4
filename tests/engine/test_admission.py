"""Admission: a pool takes a new turn only while it can meet the SLAs it has accepted (event-order tests:
the clock is a number passed in, and the capacity is given, never timed)."""

from __future__ import annotations

import numpy as np
import pytest

from weaved.calibration.cost import Linear, StepCost
from weaved.engine.admission import HEADROOM, MIN_SAMPLES, Capacity, judge
from weaved.engine.sampling import SamplingParams
from weaved.engine.sequence import SeqStatus, Sequence, SLARank
from weaved.kv.cache import KVCache


def turn(rank: SLARank, *, max_tokens: int = 100, prompt: int = 1, ttlt: float | None = None, arrival: float = 0.0,
         decoding: bool = True) -> Sequence:
    kv = KVCache(np.zeros((1, 2, 1, 8, 4), np.float16))
    s = Sequence("s", kv, list(range(prompt)), SamplingParams(max_tokens=max_tokens, temperature=0), rank,
                 ttlt_s=ttlt, arrival=arrival)
    if decoding:
        s.first_token_at = s.last_token_at = arrival
        s.status = SeqStatus.RUNNING
    return s


CAP = Capacity(max_batch=16, prior_tps=160.0, prefill_cost=0.5)  # a slot: 10 tokens/s


def test_throughput_turns_are_admitted_while_their_budgets_fit_and_refused_after():
    # each needs 100 tokens in 100 s: 1 token/s; paced demand may reach 160 x 0.9 = 144
    live = [turn(SLARank.BACKGROUND, ttlt=100.0) for _ in range(143)]
    assert judge(live, turn(SLARank.BACKGROUND, ttlt=100.0), CAP, now=0.0) is None
    live.append(turn(SLARank.BACKGROUND, ttlt=100.0))
    refusal = judge(live, turn(SLARank.BACKGROUND, ttlt=100.0), CAP, now=0.0)
    assert refusal is not None and "144 of its 160 tokens/s" in refusal.reason
    assert refusal.retry_after_s == 100.0  # when the earliest accepted budget ends
    # the same work with a longer budget fits
    assert judge(live, turn(SLARank.BATCH, ttlt=1000.0), CAP, now=0.0) is not None  # demand already at the top
    assert judge(live[:100], turn(SLARank.BATCH, ttlt=1000.0), CAP, now=0.0) is None


def test_interactive_turns_hold_a_slot_and_the_seventeenth_is_refused():
    live = [turn(SLARank.INTERACTIVE, max_tokens=50) for _ in range(16)]
    refusal = judge(live, turn(SLARank.INTERACTIVE), CAP, now=0.0)
    assert refusal is not None and "16 batch slots" in refusal.reason
    assert refusal.retry_after_s == pytest.approx(5.0)  # 50 tokens left at a slot's 10 tokens/s
    # fifteen interactive slots leave 10 tokens/s, less than a paced turn needing a slot / 0.9
    assert judge(live[:15], turn(SLARank.BACKGROUND, ttlt=10.0), CAP, now=0.0) is not None
    assert judge(live[:8], turn(SLARank.BACKGROUND, ttlt=10.0), CAP, now=0.0) is None


def test_best_effort_turns_reserve_nothing_and_prompts_count_at_their_cost():
    live = [turn(SLARank.BATCH) for _ in range(500)]  # no budget: they take what is left
    assert judge(live, turn(SLARank.BACKGROUND, ttlt=100.0), CAP, now=0.0) is None
    # a 2,000-token prompt at half a decode token each, plus 100 tokens, in 20 s: 55 tokens/s, capped to a slot
    big = turn(SLARank.BACKGROUND, prompt=2000, ttlt=20.0, decoding=False)
    live = [turn(SLARank.BACKGROUND, ttlt=100.0) for _ in range(135)]
    assert judge(live, big, CAP, now=0.0) is not None  # 135 + 10 > 144
    assert judge(live[:130], big, CAP, now=0.0) is None


def test_late_turns_count_a_full_slot_and_finished_ones_nothing():
    late = [turn(SLARank.BACKGROUND, ttlt=1.0) for _ in range(14)]  # budgets over: each wants a slot (140)
    assert judge(late, turn(SLARank.BACKGROUND, ttlt=100.0), CAP, now=50.0) is None  # 140 + 2 <= 144
    assert judge(late, turn(SLARank.BACKGROUND, ttlt=60.0), CAP, now=50.0) is not None  # 140 + 10 > 144
    assert judge(late, turn(SLARank.INTERACTIVE), CAP, now=50.0) is not None  # 10 + 140 / 0.9 > 160
    for s in late:
        s.status = SeqStatus.FINISHED
    assert judge(late, turn(SLARank.BACKGROUND, ttlt=60.0), CAP, now=50.0) is None


def test_capacity_is_measured_from_full_steps_and_scaled_to_a_full_batch():
    cap = Capacity(max_batch=16, prior_tps=1000.0, prefill_cost=0.5)
    assert cap.tokens_per_s == 1000.0  # the profile's until measured
    for _ in range(MIN_SAMPLES * 3):
        cap.record(4, 0, 0.01)  # small batches say nothing about a full one
    assert cap.tokens_per_s == 1000.0
    for _ in range(MIN_SAMPLES):
        cap.record(12, 40, 0.1)  # 12 decodes + 40 prompt tokens (20 decode tokens of work) in 0.1 s
    assert cap.tokens_per_s == pytest.approx(32 / 0.1 * 16 / 12)
    assert Capacity(16, None, 0.5).tokens_per_s is None
    assert judge([turn(SLARank.INTERACTIVE) for _ in range(15)], turn(SLARank.INTERACTIVE),
                 Capacity(16, None, 0.5), now=0.0) is None  # unknown capacity: the batch's slots alone
    assert judge([turn(SLARank.BACKGROUND, ttlt=1.0) for _ in range(40)], turn(SLARank.BACKGROUND, ttlt=1.0),
                 Capacity(16, None, 0.5), now=0.0) is None  # and no paced demand is counted
    assert HEADROOM < 1.0


def test_interactive_turns_are_bounded_by_the_step_the_inter_token_target_allows():
    # a decode step: 10 ms + 5 ms a row + 1 us per position attended; the gap target 80 ms fits 14 short rows
    cost = StepCost(prefill=Linear(0.01, 0.001, 0.0), decode=Linear(0.01, 0.005, 1e-6))
    step = (cost, 0.081)
    live = [turn(SLARank.INTERACTIVE, max_tokens=50) for _ in range(14)]
    assert judge(live[:13], turn(SLARank.INTERACTIVE), CAP, now=0.0, step=step) is None
    refusal = judge(live, turn(SLARank.INTERACTIVE), CAP, now=0.0, step=step)
    assert refusal is not None and "14 interactive turns" in refusal.reason and "81 ms" in refusal.reason
    # the same count with a long prompt waiting: its positions make the step too long
    assert judge(live[:12], turn(SLARank.INTERACTIVE, prompt=8000, decoding=False), CAP, now=0.0, step=step) is not None
    # throughput-tolerant turns are not held to the gap; nor is a pool's first interactive turn, whatever the step
    assert judge(live, turn(SLARank.BACKGROUND, ttlt=1000.0), CAP, now=0.0, step=step) is None
    slow = (StepCost(prefill=Linear(1.0, 0.1, 0.0), decode=Linear(1.0, 0.1, 0.0)), 0.08)
    assert judge([], turn(SLARank.INTERACTIVE), CAP, now=0.0, step=slow) is None
    assert judge(live[:1], turn(SLARank.INTERACTIVE), CAP, now=0.0, step=slow) is not None


def test_a_pool_without_a_measured_rate_still_bounds_its_interactive_turns_by_its_slots():
    """A GPU pool has no rate until it has run full batches: the batch's slots still bound the
    interactive turns (the paced demand, which needs the rate, does not apply yet)."""
    unknown = Capacity(max_batch=2, prior_tps=None, prefill_cost=0.5)
    live = [turn(SLARank.INTERACTIVE) for _ in range(2)]
    refusal = judge(live, turn(SLARank.INTERACTIVE), unknown, now=0.0)
    assert refusal is not None and "batch slots" in refusal.reason
    assert judge(live, turn(SLARank.BACKGROUND, ttlt=1.0), unknown, now=0.0) is None
    assert judge(live[:1], turn(SLARank.INTERACTIVE), unknown, now=0.0) is None


def test_an_empty_pools_refusal_says_it_is_alone():
    """A pool with one slot, nothing running, and a turn needing more than the headroom allows: refused
    (another pool may take it), saying that waiting would not help - the daemon then runs it there rather
    than refuse it forever (tests/daemon/test_spill.py)."""
    one = Capacity(max_batch=1, prior_tps=20.0, prefill_cost=1.0)
    refusal = judge([], turn(SLARank.BACKGROUND, max_tokens=190, ttlt=10.0), one, now=0.0)
    assert refusal is not None and refusal.alone
    busy = judge([turn(SLARank.BACKGROUND, max_tokens=190, ttlt=10.0)],
                 turn(SLARank.BACKGROUND, max_tokens=190, ttlt=10.0), one, now=0.0)
    assert busy is not None and not busy.alone


def test_retry_after_counts_the_work_a_late_turn_still_holds():
    """A turn far past its budget still holds a slot until it has decoded what it has left: the refusal
    says to come back then, not in a second."""
    late = turn(SLARank.BATCH, max_tokens=5000, ttlt=10.0, arrival=-90.0)
    busy = [turn(SLARank.INTERACTIVE) for _ in range(15)] + [late]
    r = judge(busy, turn(SLARank.BACKGROUND, max_tokens=100, ttlt=20.0), CAP, now=0.0)
    assert r is not None and r.retry_after_s >= 10.0  # 100 tokens left per interactive turn at 10 tokens/s
