"""How long a turn would take on a pool now: the router's predictions (pure functions of a ``PoolState``).

A pool whose state carries its step-time model (``PoolState.step_cost``: the calibrated one of its
backend, ``weaved.calibration``) is predicted step by step from what it holds now:

- time to first token: the prompts queued ahead and this one, fed in the pool's chunks (each chunk
  after the context before it), while every step also decodes the running batch;
- time to last token: then ``answer`` decode steps of the batch with this turn in it, every sequence
  at its present context (a decode step reads the weights once whatever its batch, so the step time
  is what a turn's answer costs, not its share of the pool's rate).

Neither can see the prompts other turns will bring while this one runs, so each step is taken to last
at least the pool's recent mean step time (``PoolState.step_s``): a pool busy with other turns'
prefill chunks decodes this turn's answer at that pace, not at a decode step's.  What the forecast
still misses (the turns that arrive later and share the steps, the scheduler's order) the pool
measures: each turn that ends compares its time with its forecast for the tokens it generated, and
the time to last token is scaled by the recent ratio (``PoolState.lateness``).

A pool without one (a profile that gives the CPU rates by hand) falls back to the profile's CPU rates:
the prompt tokens at the prefill rate, and a full batch's decode steps at the aggregate decode rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weaved.config.profile import RoutingThresholds
from weaved.routing.types import PoolState


def _live(pool: PoolState) -> int:
    return pool.batch_depth + pool.queue_depth


def predict_ttft_s(pool: PoolState, prompt_tokens: int, th: RoutingThresholds, context: int = 0) -> float:
    """Seconds until the first token of a turn of ``prompt_tokens`` after ``context`` positions on ``pool``:
    the queued prompts and this one at the pool's prefill speed, plus the decode work of the running
    batch in each step the prefill spans."""
    tokens = pool.queued_prefill_tokens + prompt_tokens
    steps = math.ceil(tokens / pool.prefill_chunk) if pool.prefill_chunk else 1
    cost = pool.step_cost
    if cost is None:
        return tokens / th.cpu_prefill_tokens_per_s + steps * pool.batch_depth / th.cpu_decode_tokens_per_s
    mean = pool.context_tokens / _live(pool) if _live(pool) else 0.0
    queued = cost.prefill_s(pool.queued_prefill_tokens, pool.prefill_chunk or max(1, tokens), int(mean))
    own = cost.prefill_s(prompt_tokens, pool.prefill_chunk or max(1, tokens), context)
    decode = cost.decode.variable_s(pool.batch_depth, mean * pool.batch_depth)
    return max(queued + own + steps * decode, steps * pool.step_s)


@dataclass(frozen=True)
class Forecast:
    """A turn's predicted time on a pool: to its first token, then each answer token's step."""

    ttft_s: float
    step_s: float

    def ttlt_s(self, answer_tokens: int) -> float:
        return self.ttft_s + answer_tokens * self.step_s


def forecast(pool: PoolState, prompt_tokens: int, answer_tokens: int, th: RoutingThresholds,
             context: int = 0) -> Forecast:
    """The turn's forecast on ``pool`` from its state alone (``PoolState.lateness`` not applied)."""
    ttft = predict_ttft_s(pool, prompt_tokens, th, context)
    cost = pool.step_cost
    if cost is None:
        return Forecast(ttft, pool.max_batch / th.cpu_decode_tokens_per_s)
    batch = min(pool.max_batch, _live(pool) + 1)
    others = pool.context_tokens * min(1.0, (batch - 1) / _live(pool)) if _live(pool) else 0.0
    mine = context + prompt_tokens + answer_tokens / 2
    return Forecast(ttft, max(cost.decode.s(batch, others + mine), pool.step_s))


def predict_ttlt_s(pool: PoolState, prompt_tokens: int, answer_tokens: int, th: RoutingThresholds,
                   context: int = 0) -> float:
    """Seconds a turn (``prompt_tokens`` after ``context`` positions, then ``answer_tokens``) takes on
    ``pool``: its forecast, scaled by how late the pool's recent turns ended against theirs."""
    return forecast(pool, prompt_tokens, answer_tokens, th, context).ttlt_s(answer_tokens) * pool.lateness
