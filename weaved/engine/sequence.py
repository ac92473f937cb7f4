"""One turn of a session as the batch engine sees it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, StrEnum

import numpy as np

from weaved.engine.constraint import TokenConstraint
from weaved.engine.sampling import Sampler, SamplingParams
from weaved.engine.stops import StopChecker
from weaved.kv.cache import KVCache


class SeqStatus(StrEnum):
    WAITING = "waiting"  # prompt tokens still to prefill
    RUNNING = "running"  # decoding: one token per step
    PAUSED = "paused"  # preempted this step; its KV stays where it is, resuming costs nothing
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (SeqStatus.FINISHED, SeqStatus.CANCELLED, SeqStatus.FAILED)


# A throughput-tolerant prefill with a TTLT budget but no TTFT target is due after this share of the
# budget: the rest is left for its decode.
PREFILL_SHARE = 0.25
PACE = 0.9  # a paced decode aims to end within this share of its budget


class SLARank(int, Enum):
    """Scheduling rank by SLA class: lower runs first."""

    INTERACTIVE = 0
    BACKGROUND = 1
    BATCH = 2


@dataclass(eq=False)
class Sequence:
    """A turn being generated: its pending prompt tokens, sampler, deadlines and output sink.

    ``pending`` holds tokens whose KV is not yet written (the new prompt, then each sampled token
    until the next step feeds it).  ``emit`` is called from the engine thread with each event; the
    API wraps it so that events reach asyncio safely.
    """

    session_id: str
    kv: KVCache
    pending: list[int]  # tokens to feed; the prompt first, then the last sampled token
    params: SamplingParams
    rank: SLARank
    ttft_s: float | None = None  # target time to first token
    ttlt_s: float | None = None  # budget for the whole turn
    # the answer length pacing and admission plan for (the router's typical answer) when max_tokens only
    # bounds it by the context: a request without a limit is not planned as ~30,000 tokens (a token due
    # every few ms, a whole batch slot) - None: max_tokens
    expected_tokens: int | None = None
    emit: Callable[[dict], None] | None = None
    decoder: object | None = None  # tokenizer.StreamDecoder: token ids -> text as it streams
    stops: StopChecker | None = None  # stop strings and stop/end-of-generation token ids
    prompt_logprobs: bool = False  # return the prompt tokens' log-probabilities (completions echo)
    constraint: TokenConstraint | None = None  # what it may sample (a grammar), applied to its own row
    history: list[int] = field(default_factory=list)  # context tokens, for the repetition penalty
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    sampler: Sampler = field(init=False)
    text: list[str] = field(default_factory=list)  # emitted output text pieces
    piece_chars: int = 0  # characters the generated tokens decoded to (before the stop checks)
    prefilled: int = 0  # prompt tokens fed this turn
    prev_row: np.ndarray | None = None  # last logits row of the previous prefill chunk (prompt logprobs)
    # called (engine thread) once the prefill is done and the first token sampled: the daemon moves the
    # sequence to its decode pool (set when prefill and decode run in different pools)
    handoff: Callable[[Sequence], None] | None = None
    # called (engine thread) when the engine admits the sequence, before its first step there: the
    # daemon brings the session's KV to this engine's backend (a GPU pool's one host-to-device copy)
    on_admit: Callable[[], None] | None = None
    # called (engine thread) once, after on_admit: writes the KV of the first n pending prompt tokens
    # elsewhere (a pipeline prefill across peers) and returns n, which the engine then counts as fed;
    # n < len(pending), so the engine still feeds the last token and samples the first from its logits
    prefill_outside: Callable[[Sequence], int] | None = None
    cancel_requested: bool = False  # a cancel is on its way to the engine (it lands at the next step)
    # the router's forecast for this turn where it runs (seconds to the first token, then per answer
    # token), which the pool compares with what the turn took once it ends (``BatchEngine.lateness``)
    forecast: tuple[float, float] | None = None
    # set by the daemon once the turn is over for good: its end recorded and its last event emitted
    ended: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def prefilling(self) -> bool:
        return self.first_token_at is None

    @property
    def remaining_tokens(self) -> int:
        """Tokens the turn still plans to generate: up to ``max_tokens``, or ``expected_tokens`` where
        given - twice what it has generated once the answer outgrows that."""
        n, cap = len(self.generated), self.params.max_tokens
        planned = cap if self.expected_tokens is None else min(
            cap, self.expected_tokens if n < self.expected_tokens else 2 * n)
        return max(1, planned - n)

    def deadline(self, now: float) -> float:
        """When this sequence's next unit of work is due (monotonic seconds; inf if no target).

        A waiting prefill is due at its TTFT deadline (without one, after ``PREFILL_SHARE`` of its TTLT
        budget).  A decode spreads the time left until ``PACE`` of the turn's TTLT budget evenly over the
        tokens it still has to generate (a token lands at the first step after it is due: the last
        tenth of the budget absorbs that).  Aiming at a share of what is left instead - recomputed at
        every token - moved the aim closer to the end with each one: paced batch turns of 64 tokens
        ended at 299.5 s of a 300 s budget.
        """
        if self.prefilling:
            if self.ttft_s is not None:
                return self.arrival + self.ttft_s
            return self.arrival + PREFILL_SHARE * self.ttlt_s if self.ttlt_s is not None else float("inf")
        if self.ttlt_s is None:
            return float("inf")
        aim = self.arrival + PACE * self.ttlt_s
        last = self.last_token_at if self.last_token_at is not None else now
        return last + max(0.0, aim - last) / self.remaining_tokens

    @property
    def plain_sample(self) -> bool:
        """Whether its next token depends on its row of logits alone (``sampling.sample_rows`` may
        draw it with the step's other rows): no grammar, nothing banned, a plain sampler chain."""
        banned = self.stops is not None and self.stops.stop_ids and len(self.generated) < self.params.min_tokens
        return self.constraint is None and not banned and self.sampler.plain

    def sample(self, logits_row: np.ndarray) -> int:
        """The next token from this sequence's row of logits [vocab]: its constraint's mask and, before
        ``min_tokens``, no stop or end-of-generation token.  ValueError when nothing may be sampled."""
        c = self.constraint
        allowed = c.allowed() if c is not None else None
        banned = ()
        if self.stops is not None and len(self.generated) < self.params.min_tokens:
            banned = tuple(self.stops.stop_ids)
        tok = self.sampler.sample(logits_row, self.history, allowed=allowed, banned=banned)
        if c is not None:
            c.accept(tok)
        return tok
