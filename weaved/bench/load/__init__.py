"""``weave bench --scenario load``: many concurrent clients against a real ``weave serve`` for a while.

The mix (``clients.py``): half the clients interactive, a quarter background, a quarter batch; half
through the ``openai`` SDK and half through plain ``httpx``; two in three requests streamed; every
fourth client works in sessions it creates, uses for a few turns and deletes; one streamed request in
ten is cancelled after its first few chunks.  Measured: every request's outcome by HTTP status, time to
first token and latency by class, whether each met its class's SLA, the aggregate rate of generated
tokens against the engine's own batched rate (measured in the same run, before the daemon starts), and
the daemon's resident memory and open descriptors sampled over the run (``report.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Each class's SLA in the load, sent with every request.  Served within it means: a streamed interactive
# answer's first token within ttft_ms (a whole interactive answer, which shows no first token, within
# WHOLE_INTERACTIVE_S); a background or batch answer within ttlt_s.
SLAS = {
    "interactive": {"class": "interactive", "ttft_ms": 2000},
    "background": {"class": "background", "ttlt_s": 60},
    "batch": {"class": "batch", "ttlt_s": 300},
}
WHOLE_INTERACTIVE_S = 10.0


@dataclass(frozen=True)
class LoadOptions:
    model: Path
    threads: int
    clients: int = 64
    duration_s: float = 600.0
    warmup_s: float = 60.0  # outcomes and samples before this are left out of the figures
    max_tokens: int = 64
    sample_s: float = 5.0  # how often the daemon's memory and descriptors are read
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clients < 1 or self.threads < 1 or self.max_tokens < 1:
            raise ValueError("clients, threads and max_tokens must be >= 1")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"the warm-up ({self.warmup_s} s) must be shorter than the run ({self.duration_s} s)")
        if self.sample_s <= 0:
            raise ValueError("sample_s must be > 0")

    @classmethod
    def quick(cls, model: Path, threads: int, clients: int | None = None, duration_s: float | None = None
              ) -> LoadOptions:
        """A minute with 16 clients: the same mix, for a first look."""
        duration = duration_s or 60.0
        return cls(model=model, threads=threads, clients=clients or 16, duration_s=duration,
                   warmup_s=min(15.0, duration / 4), sample_s=2.0)
