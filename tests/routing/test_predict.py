"""The router's predictions of a turn on a pool: from the pool's step model and its load now, at least
its recent pace, scaled by how late its recent turns ended; the profile's rates without a model."""

from __future__ import annotations

import dataclasses

import pytest

from weaved.calibration.cost import Linear, StepCost
from weaved.config.profile import RoutingThresholds
from weaved.routing.predict import forecast, predict_ttft_s, predict_ttlt_s
from weaved.routing.types import PoolState

TH = RoutingThresholds(cpu_prefill_tokens_per_s=1000.0, cpu_decode_tokens_per_s=2000.0)
COST = StepCost(prefill=Linear(0.01, 0.001, 1e-7), decode=Linear(0.02, 0.002, 1e-6))


def pool(batch=0, queue=0, queued=0, context=0, step_s=0.0, lateness=1.0, cost=COST, chunk=256) -> PoolState:
    return PoolState("cpu", "cpu", "cpu", "standard", False, batch, queue, 100_000, 16,
                     queued_prefill_tokens=queued, prefill_chunk=chunk, context_tokens=context, step_cost=cost,
                     step_s=step_s, lateness=lateness)


def test_an_idle_pool_is_its_step_model():
    p = pool()
    assert predict_ttft_s(p, 512, TH) == pytest.approx(COST.prefill_s(512, 256))
    f = forecast(p, 512, 100, TH)
    assert f.step_s == pytest.approx(COST.decode.s(1, 512 + 50))  # alone, at its mean context over the answer
    assert predict_ttlt_s(p, 512, 100, TH) == pytest.approx(f.ttft_s + 100 * f.step_s)


def test_the_running_batch_and_the_queue_slow_a_turn():
    idle, busy = pool(), pool(batch=8, queue=2, queued=1000, context=10 * 4000)
    assert predict_ttft_s(busy, 512, TH) > predict_ttft_s(idle, 512, TH) + COST.prefill_s(1000, 256, 4000) - 1e-9
    f = forecast(busy, 512, 100, TH)
    # the batch with this turn: ten others at 4,000 positions each and this one
    assert f.step_s == pytest.approx(COST.decode.s(11, 10 * 4000 + 562))


def test_a_pool_busy_with_other_prompts_decodes_at_its_recent_pace():
    slow = pool(batch=2, context=2000, step_s=0.5)
    f = forecast(slow, 10, 100, TH)
    assert f.step_s == 0.5 and f.ttft_s == pytest.approx(0.5)  # one chunk, one step at the pace
    assert predict_ttlt_s(slow, 10, 100, TH) == pytest.approx(0.5 + 100 * 0.5)


def test_lateness_scales_the_time_to_last_token():
    p = pool(batch=3, context=3000)
    assert predict_ttlt_s(dataclasses.replace(p, lateness=2.5), 300, 50, TH) == pytest.approx(
        2.5 * predict_ttlt_s(p, 300, 50, TH))


def test_without_a_step_model_the_profile_rates_are_used():
    p = pool(batch=8, queued=300, cost=None)
    assert predict_ttft_s(p, 700, TH) == pytest.approx(1.0 + 4 * 8 / 2000)
    assert predict_ttlt_s(p, 700, 100, TH) == pytest.approx(1.0 + 4 * 8 / 2000 + 100 * 16 / 2000)


def test_a_pool_state_refuses_a_bad_pace_or_lateness():
    with pytest.raises(ValueError, match="step_s"):
        pool(step_s=-1.0)
    with pytest.raises(ValueError, match="lateness"):
        pool(lateness=0.0)
    with pytest.raises(ValueError, match="step_cost"):
        pool(cost={"prefill": [0, 0, 0]})
