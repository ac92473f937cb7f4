"""``weave bench --scenario ring``: is Q-Ring's communication hidden behind its attention on this CPU?

Three measurements, each in its own process (``procs``), and a projection:

1. Per head group (``measure``): the partial attention of one head group - a batch of query rows,
   each over its own session's KV shard - at several shard lengths, against the transfer time of
   the message that carries that head group around the ring (queries, the new K/V and the
   accumulator, ``sizes``) at 10 Gbps and at the loopback rate measured in the same run.  The ratio
   is the margin Q-Ring's design assumes to be 5-6x on server CPUs (docs/ring-cost-model.md): how
   much compute there is to hide the next head group's transfer behind.
2. Loopback decode (``decode``): real Q-Ring steps (``RingMember``, 2-3 processes, the model's
   dense layers on the home) against the alternative of broadcasting every head group's queries to
   all nodes and merging the partials once at home (``broadcast``).
3. The cost model (``cost_model``, docs/ring-cost-model.md): the measured rates projected to N
   nodes at 10 Gbps for a hundred agents at 32K context (Q-Ring's design scenario).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RingBenchOptions:
    model: Path
    threads: int = 2  # kernel threads of the per-head-group and dense measurements
    rows: int = 16  # query rows per head group message: the ring's batch depth (ring_batch_depth)
    # (context, nodes): one shard of context/nodes keys per row, e.g. 32K over 2 nodes = 16K keys
    shards: tuple[tuple[int, int], ...] = ((2048, 1), (8192, 1), (32768, 2), (32768, 4))
    heads_per_group: int = 1  # kv heads per head group (and their query heads)
    reps: int = 15  # timed repetitions of each compute measurement (median)
    link_gbps: float = 10.0
    pingpong_reps: int = 200
    bulk_bytes: int = 64 << 20  # the message that measures the loopback rate
    worlds: tuple[int, ...] = (2, 3)  # ring sizes of the loopback decode
    ring_sessions: int = 8
    ring_context: int = 2048
    ring_steps: int = 8  # timed decode steps of each protocol, taking turns (after one warm-up step each)
    agents: int = 100  # the projection's scenario: this many agents ...
    context: int = 32768  # ... at this context
    dense_batches: tuple[int, ...] = (16, 100)  # batch sizes the home's dense step is measured at
    timeout_s: float = 300.0  # every wait of the loopback groups (a dead process is seen at once anyway)
    deadline_s: float = 1800.0  # the whole multi-process part

    def __post_init__(self) -> None:
        for name in ("threads", "rows", "heads_per_group", "reps", "pingpong_reps", "bulk_bytes", "ring_sessions",
                     "ring_context", "ring_steps", "agents", "context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.shards or any(c < 1 or n < 1 for c, n in self.shards):
            raise ValueError("shards must be (context >= 1, nodes >= 1) pairs")
        if not self.worlds or any(w < 2 for w in self.worlds):
            raise ValueError("ring sizes must be >= 2")
        if self.link_gbps <= 0 or not self.dense_batches or min(self.dense_batches) < 1:
            raise ValueError("link_gbps must be > 0 and dense_batches >= 1")

    @classmethod
    def quick(cls, model: Path, threads: int = 2) -> RingBenchOptions:
        """Smaller and fewer: a minute or two instead of several."""
        return cls(model=Path(model), threads=threads, shards=((2048, 1), (32768, 4)), reps=5, pingpong_reps=50,
                   bulk_bytes=16 << 20, worlds=(2,), ring_sessions=4, ring_context=1024, ring_steps=3,
                   dense_batches=(16, 100))
