"""Admission: a pool accepts a new turn only while it can still meet the SLAs it has accepted.

What the turns a pool holds demand, in decode tokens per second:

- an interactive turn holds a batch slot while it runs: one token per step, ``capacity / max_batch``;
- a throughput-tolerant turn with a TTLT budget must produce what it has left (its remaining tokens,
  and its unfed prompt at the prefill's relative cost) by the end of its budget: that work over the
  time left, at most a slot (a turn cannot decode faster than one token per step);
- a turn without a budget takes what is left over: nothing is reserved for it.

``capacity`` is the pool's decode rate at a full batch (``Capacity``).  A new turn is refused - HTTP 503
with ``Retry-After`` - when the demand with it would pass the capacity, the paced demands counted with
``HEADROOM`` (their rates are estimates; a slot is a slot), or, for an interactive turn, when every
batch slot already holds one (it would wait for a slot with no bound on its time to first token) or when
the pool's step model predicts that a step of the interactive turns with it would take longer than the
inter-token target (every interactive turn decodes in every step, so their number sets the gap each of
them sees; a pool always takes one).  An empty pool's refusal is marked ``Refusal.alone``: waiting would
not help.  Refusing early is the point: work accepted and then timed out costs the client more than a
clear "not now".
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from weaved.calibration.cost import StepCost
from weaved.engine.sequence import Sequence, SLARank

HEADROOM = 0.9  # paced demand may reach this share of what the slots leave: the rates and the steps vary
MIN_SAMPLES = 8  # steps at three quarters of a batch or more before the measured rate replaces the profile's
RETRY_MIN_S, RETRY_MAX_S = 1.0, 300.0


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry_after_s: float  # when the demand is expected to have room again
    # the pool holds nothing: it would refuse the turn however long the client waited (another pool may
    # take it; where none can, the daemon runs it here anyway rather than refuse it forever)
    alone: bool = False


class Capacity:
    """A pool's decode capacity in tokens per second at a full batch: measured from its recent steps that
    decoded at least three quarters of a batch (prefill tokens counted at ``prefill_cost`` decode tokens
    each), or the profile's figure ``prior_tps`` until there are ``MIN_SAMPLES`` of them (None: unknown,
    admit all).  ``record`` is called by the engine thread, ``tokens_per_s`` from any thread."""

    def __init__(self, max_batch: int, prior_tps: float | None, prefill_cost: float):
        if max_batch < 1 or prefill_cost < 0 or (prior_tps is not None and prior_tps <= 0):
            raise ValueError("Capacity needs max_batch >= 1, prefill_cost >= 0 and a positive prior")
        self.max_batch, self.prior_tps, self.prefill_cost = max_batch, prior_tps, prefill_cost
        self._samples: deque[tuple[int, float, float]] = deque(maxlen=64)  # (batch, work, seconds)
        self._lock = threading.Lock()

    def record(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        if 4 * decode_tokens >= 3 * self.max_batch and seconds > 0:
            with self._lock:
                self._samples.append((decode_tokens, decode_tokens + self.prefill_cost * prefill_tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        with self._lock:
            samples = list(self._samples)
        if len(samples) < MIN_SAMPLES:
            return self.prior_tps
        batch, work, seconds = (sum(x) for x in zip(*samples, strict=True))
        # a decode step reads the weights once whatever its batch, so its time hardly grows with the
        # batch: the rate at a full batch is the measured one scaled by max_batch / the mean batch
        return work / seconds * self.max_batch * len(samples) / batch


def judge(live: list[Sequence], new: Sequence, capacity: Capacity, now: float,
          step: tuple[StepCost, float] | None = None) -> Refusal | None:
    """None to admit ``new`` beside the ``live`` turns of the pool, or why not and when to retry.
    ``step``: the pool's step-time model and the step time an interactive turn's gap allows (None: not
    known; then only the batch slots bound the interactive turns)."""
    cap = capacity.tokens_per_s
    slot = cap / capacity.max_batch if cap is not None else None
    live = [s for s in live if not s.status.done]
    interactive = [s for s in live if s.rank == SLARank.INTERACTIVE]
    tolerant = [s for s in live if s.rank != SLARank.INTERACTIVE]
    # the batch's slots and the step model bound the interactive turns whether or not the pool's rate is
    # known yet (a GPU pool measures it only once it has run full batches)
    if new.rank == SLARank.INTERACTIVE and len(interactive) >= capacity.max_batch:
        wait = min(s.remaining_tokens for s in interactive) / slot if slot else RETRY_MIN_S
        return Refusal(f"every one of the pool's {capacity.max_batch} batch slots holds an interactive turn",
                       _clamp(wait))
    if new.rank == SLARank.INTERACTIVE and step is not None and interactive:
        cost, target_s = step
        rows = [*interactive, new]
        step_s = cost.decode.s(len(rows), sum(s.kv.length + len(s.pending) for s in rows))
        if step_s > target_s:
            wait = min(s.remaining_tokens for s in interactive) * step_s
            return Refusal(f"a step of the pool's {len(interactive)} interactive turns and this one would take "
                           f"{step_s * 1e3:.0f} ms, past the {target_s * 1e3:.0f} ms an interactive token may take",
                           _clamp(wait))
    if cap is None:  # the paced demand needs the rate: unknown, every other turn is admitted
        return None
    slots = (len(interactive) + (new.rank == SLARank.INTERACTIVE)) * slot
    paced = sum(_rate(s, now, slot, capacity.prefill_cost) for s in tolerant)
    need = slot if new.rank == SLARank.INTERACTIVE else _rate(new, now, slot, capacity.prefill_cost)
    if slots + (paced + need - (slot if new.rank == SLARank.INTERACTIVE else 0.0)) / HEADROOM <= cap:
        return None
    demand = len(interactive) * slot + paced
    # when each accepted turn's demand goes: a paced one ends about its budget's end - or, already late,
    # once it has decoded what it has left at a slot's rate
    ends = [max(s.arrival + s.ttlt_s - now, s.remaining_tokens / slot) for s in tolerant if s.ttlt_s is not None]
    ends += [s.remaining_tokens / slot for s in interactive]
    return Refusal(f"the pool's accepted turns need {demand:.0f} of its {cap:.0f} tokens/s "
                   f"(this turn would need {need:.0f} more)", _clamp(min(ends, default=RETRY_MIN_S)),
                   alone=not live)


def _rate(s: Sequence, now: float, slot: float, prefill_cost: float) -> float:
    """Decode tokens per second ``s`` needs to end within its TTLT budget (0 without one)."""
    if s.ttlt_s is None:
        return 0.0
    left = s.arrival + s.ttlt_s - now
    work = s.remaining_tokens + prefill_cost * (len(s.pending) if s.prefilling else 0)
    return slot if left <= 0 else min(work / left, slot)


def _clamp(seconds: float) -> float:
    return max(RETRY_MIN_S, min(RETRY_MAX_S, seconds))
