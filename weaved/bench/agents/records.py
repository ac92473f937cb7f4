"""What the replay records of each turn: one ``TurnRecord`` per turn it asked for.

Times are seconds from the run's start (``time.monotonic`` based).  A record is written by the replay's
thread when the turn is submitted and by the engine thread that runs it (token and end times); the
replay reads it only once the turn has ended or the run has been closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class TurnKind(StrEnum):
    HEARTBEAT = "heartbeat"  # a background agent's turn
    EXCHANGE = "exchange"  # a person's question during a check-in
    BATCH = "batch"  # a batch job's document and summary

    @property
    def sla_class(self) -> str:
        return {TurnKind.HEARTBEAT: "background", TurnKind.EXCHANGE: "interactive",
                TurnKind.BATCH: "batch"}[self]


class TurnStatus(StrEnum):
    RUNNING = "running"  # submitted, not ended when the run was closed
    DONE = "done"  # generated every token it asked for
    FAILED = "failed"  # the daemon ended it with an error, or ended it early
    REJECTED = "rejected"  # start_turn refused it (the daemon's message is in ``error``)


SLA_CLASSES = ("background", "interactive", "batch")


@dataclass
class TurnRecord:
    kind: TurnKind
    agent: int | None  # None for batch jobs
    index: int  # heartbeat index, check-in index or batch job index
    session_id: str
    new_tokens: int  # tokens this turn appends (its prompt)
    max_tokens: int  # tokens it generates (ignore_eos: exactly this many when it completes)
    submitted: float
    slot: int | None = None  # batch jobs: the slot that runs them
    compacted: bool = False  # the agent started a new session for this turn
    waited_s: float = 0.0  # exchanges: from the person asking to the question's submission
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    status: TurnStatus = TurnStatus.RUNNING
    finish_reason: str | None = None
    error: str | None = None
    context_after: int | None = None  # the session's context when the turn ended (from usage)

    @property
    def sla_class(self) -> str:
        return self.kind.sla_class

    @property
    def generated(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def ttlt_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.submitted

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token gaps (seconds) between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "class": self.sla_class, "agent": self.agent, "index": self.index,
                "session": self.session_id, "new_tokens": self.new_tokens, "max_tokens": self.max_tokens,
                "submitted": round(self.submitted, 4), "compacted": self.compacted,
                "waited_s": round(self.waited_s, 4), "ttft_s": _r(self.ttft_s), "ttlt_s": _r(self.ttlt_s),
                "generated": self.generated, "status": self.status.value, "finish_reason": self.finish_reason,
                "error": self.error}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
