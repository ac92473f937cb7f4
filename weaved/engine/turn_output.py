"""What a step makes of a sequence's rows: its token, stop checks and events, and the end of its turn.

The batch engine (``engine.py``) schedules, reserves and runs the forward; for each sequence it then
hands the row it sampled from to ``TurnOutput.sample``, which appends the token, runs the detokenizer
and the stop checks, emits the token event and ends the turn on a stop, the token limit or a full KV.
``finish`` and ``fail`` end a turn with its last event (once: a turn that has ended is left as it is),
and each finished turn that carried a forecast updates the pool's ``lateness``.  Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from weaved.engine.constraint import ConstraintError
from weaved.engine.sampling import logprobs_of
from weaved.engine.sequence import SeqStatus, Sequence
from weaved.errors import Overloaded, WeaveError

log = logging.getLogger("weave.engine")

PACE_WEIGHT = 0.2  # of the latest turn in the lateness (and, in the engine, of the latest step in its pace)
LATENESS_BOUNDS = (0.5, 4.0)  # one turn's ratio to its forecast is clipped to these: one outlier moves little


class TurnOutput:
    """The token side of one pool's engine.  ``counters`` is the engine's ``PoolCounters`` (tokens
    generated are counted here); ``clock`` its clock (token times, lateness)."""

    def __init__(self, name: str, counters, clock: Callable[[], float]):
        self.name = name
        self.counters = counters
        self.clock = clock
        # how late the pool's turns end against the router's forecasts: a moving mean of (time taken) /
        # (forecast for the tokens generated) over the turns that carried one (``routing.predict``)
        self.lateness = 1.0

    def prompt_logprobs(self, s: Sequence, fed: list[int], logits: np.ndarray) -> None:
        """Log-probability of each fed token given what came before it.  Row i of ``logits``
        predicts fed token i+1; the chunk's first token is predicted by the previous chunk's last
        row (none for the first token the turn feeds)."""
        rows = [s.prev_row, *logits[:-1]]
        items = []
        for tok, row in zip(fed, rows, strict=True):
            if row is None:
                items.append((tok, None, []))
            else:
                lp, top = logprobs_of(row, tok, s.params.logprobs or 0)
                items.append((tok, lp, top))
        s.prev_row = logits[-1].copy()
        self.emit(s, {"type": "prompt_logprobs", "items": items})

    def sample(self, s: Sequence, row: np.ndarray, drawn: int | None = None) -> int:
        """The token of ``s`` from its last row, its stop checks and its event; 1 if a token was generated.
        ``drawn``: the token the engine already drew for it with the step's other rows (its generator
        already advanced)."""
        now = self.clock()
        try:
            tok = drawn if drawn is not None else s.sample(row)
        except (ValueError, ConstraintError) as exc:  # nothing may be sampled: this turn ends, not the step
            self.fail(s, f"sampling failed: {exc}")
            return 0
        lp = logprobs_of(row, tok, s.params.logprobs) if s.params.logprobs is not None else None
        if s.first_token_at is None:
            s.first_token_at = now
            s.status = SeqStatus.RUNNING
        s.last_token_at = now
        s.generated.append(tok)
        self.counters.tokens_generated += 1
        piece = s.decoder.push(tok) if s.decoder is not None else ""
        step = s.stops.feed(piece, tok) if s.stops is not None else None
        text = step.text if step is not None else piece
        if text:
            s.text.append(text)
        # "at": where this token's decoded piece starts in the generated text - the API keeps a token's
        # log-probability only where the text it returns reaches that far (a stop string's tokens go)
        ev = {"type": "token", "token": tok, "text": text, "at": s.piece_chars}
        s.piece_chars += len(piece)
        if lp is not None:
            ev["logprob"], ev["top_logprobs"] = lp
        self.emit(s, ev)
        if step is not None and step.stopped:
            # the stop token (e.g. end of turn) is part of the transcript; feed it with the next turn
            s.pending = [tok]
            self.finish(s, SeqStatus.FINISHED, "stop")
        elif len(s.generated) >= s.params.max_tokens or s.kv.length + 1 >= s.kv.capacity:
            s.pending = [tok]
            self.finish(s, SeqStatus.FINISHED, "length")
        else:
            s.pending = [tok]
        return 1

    def finish(self, s: Sequence, status: SeqStatus, reason: str) -> None:
        if s.status.done:
            return
        if s.decoder is not None and status == SeqStatus.FINISHED and reason != "stop":
            tail = s.decoder.flush()
            if s.stops is not None:
                tail = s.stops.feed(tail).text + s.stops.flush() if tail else s.stops.flush()
            if tail:
                s.text.append(tail)
                self.emit(s, {"type": "token", "token": None, "text": tail})
        s.status = status
        s.finish_reason = reason
        if status == SeqStatus.FINISHED and s.forecast is not None:
            self._learn_lateness(s)
        targets = {k: v for k, v in (("ttft_target_s", s.ttft_s), ("ttlt_target_s", s.ttlt_s)) if v is not None}
        self.emit(s, {"type": "done", "finish_reason": reason, **targets})

    def _learn_lateness(self, s: Sequence) -> None:
        ttft, step = s.forecast
        expected = ttft + step * len(s.generated)
        if expected > 0:
            ratio = min(LATENESS_BOUNDS[1], max(LATENESS_BOUNDS[0], (self.clock() - s.arrival) / expected))
            self.lateness = (1 - PACE_WEIGHT) * self.lateness + PACE_WEIGHT * ratio

    def fail(self, s: Sequence, message: str, status: int | None = None, cause: Exception | None = None) -> None:
        """End the turn with an error; ``status`` the HTTP status its answer takes (None: 500).  A ``cause``
        that is one of the API's errors (a full KV cap) lends the event its type, code and retry advice."""
        if s.status.done:
            return
        s.status = SeqStatus.FAILED
        s.error = message
        s.finish_reason = "error"
        ev = {"type": "error", "message": message, **({"status": status} if status else {})}
        if isinstance(cause, WeaveError):
            ev |= {"error_type": cause.type, "code": cause.code}
            if isinstance(cause, Overloaded):
                ev |= {"retry_after_s": cause.retry_after_s, "retryable": cause.retryable}
        self.emit(s, ev)

    def emit(self, s: Sequence, ev: dict) -> None:
        if s.emit is not None:
            try:
                s.emit(ev)
            except Exception:  # a dead client must not stop the engine
                log.exception("engine %s: emit failed for %s", self.name, s.session_id)
