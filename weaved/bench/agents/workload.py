"""The reference agent workload (docs/benchmarks.md, "The agent workload"): its parameters and the
seeded plan of what every run asks.

Everything here is pure: no model, no clock.  ``AgentWorkload`` holds every parameter with the
reference values as defaults; ``plan(workload)`` derives what each agent, person and batch slot asks
from the seed alone, so two runs with the same workload ask exactly the same things in the same
order, whatever configuration serves them.

Timing model (why it is shaped this way):
- Heartbeats are closed-loop per agent: the gap (20 s +/- 50 %) runs from the end of the agent's
  previous turn to the start of its next, as an agent's heartbeat timer is re-armed after a run.
  An overloaded server therefore sees fewer turns rather than an unbounded queue; the SLA share and
  the tokens/s are what show the overload.
- Check-ins arrive open-loop at absolute times (a Poisson process at ``checkins_per_min``): people
  do not wait for the server before deciding to look at their agent.  Exchanges within a check-in
  are closed-loop (the gap runs from the end of the previous answer).
- Batch jobs are closed-loop: ``batch_concurrency`` slots, each starting its next job when the
  previous one ends.

Per-item randomness comes from ``random.Random`` seeded with a string naming the item (the seed, the
stream and the item's index): an item's content never depends on how many other items were drawn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

Range = tuple[int, int]  # inclusive token-count range


@dataclass(frozen=True)
class AgentWorkload:
    """What the agents scenario asks.  Defaults are the reference values (sized for a 2-core CPU
    serving SmolLM2-135M); ``quick`` and ``dataclasses.replace`` give variants."""

    agents: int = 16  # background agents
    duration_s: float = 180.0  # wall time of one run
    seed: int = 0
    # background agents
    start_context: int = 2000  # first turn's prompt, and the summary a compacted session starts from
    # of which the first tokens are the same for every agent (a system prompt and tool definitions): what
    # shared prefixes save (the weave-noprefix configuration is the run without them)
    shared_prompt: int = 1024
    max_context: int = 8192  # session context; the agent compacts before a turn would overflow it
    tool_output: Range = (256, 1024)  # tokens appended per heartbeat turn
    agent_gen: Range = (64, 256)  # tokens generated per heartbeat turn
    heartbeat_s: float = 20.0
    heartbeat_jitter: float = 0.5  # gap = heartbeat_s * uniform(1 - jitter, 1 + jitter)
    background_ttlt_s: float = 60.0
    # check-ins (a person looking at one agent)
    checkins_per_min: float = 4.0
    exchanges: Range = (1, 3)  # question/answer pairs per check-in
    question: Range = (20, 60)
    answer: Range = (32, 128)
    exchange_gap_s: tuple[float, float] = (5.0, 15.0)
    interactive_ttft_ms: float = 500.0
    interactive_itl_p99_ms: float = 100.0
    # batch jobs
    batch_concurrency: int = 2
    batch_document: int = 4000
    batch_summary: int = 256
    batch_ttlt_s: float = 300.0
    # the bar for "meets its SLA" in the capacity search: this share of turns of every class
    sla_share: float = 0.95

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                if len(v) != 2 or not 0 <= v[0] <= v[1]:
                    raise ValueError(f"{f.name} must be a (low, high) range with 0 <= low <= high, got {v}")
        positive = ("agents", "duration_s", "start_context", "max_context", "heartbeat_s", "background_ttlt_s",
                    "interactive_ttft_ms", "interactive_itl_p99_ms", "batch_document", "batch_summary",
                    "batch_ttlt_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("checkins_per_min", "batch_concurrency", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.heartbeat_jitter < 1:
            raise ValueError(f"heartbeat_jitter must be in [0, 1), got {self.heartbeat_jitter}")
        if not 0 < self.sla_share <= 1:
            raise ValueError(f"sla_share must be in (0, 1], got {self.sla_share}")
        for name in ("tool_output", "agent_gen", "question", "answer", "exchanges"):
            if getattr(self, name)[0] < 1:
                raise ValueError(f"{name} must start at 1 or more, got {getattr(self, name)}")
        # a compacted session must hold its first turn plus one whole check-in (see compaction_needed)
        fresh = self.start_context + self.tool_output[1] + self.agent_gen[1] + self.checkin_reserve
        if fresh > self.max_context:
            raise ValueError(f"max_context {self.max_context} cannot hold a fresh agent turn with a check-in "
                             f"({fresh} tokens); raise it or shrink the ranges")
        if self.batch_document + self.batch_summary > self.max_context:
            raise ValueError(f"a batch job ({self.batch_document} + {self.batch_summary} tokens) exceeds "
                             f"max_context {self.max_context}")

    @classmethod
    def quick(cls, **overrides) -> AgentWorkload:
        """A functional check in about a minute per configuration: the reference shapes, but 4 agents, so
        that turns finish inside the minute (16 agents' first 2,000-token prompts alone take the 2-core
        CPU pool about a minute to prefill)."""
        return cls(**{"agents": 4, "duration_s": 60.0, **overrides})

    @property
    def checkin_reserve(self) -> int:
        """Context a heartbeat turn leaves free so that one whole check-in fits without compacting."""
        return self.exchanges[1] * (self.question[1] + self.answer[1])

    @property
    def batch_context(self) -> int:
        return self.batch_document + self.batch_summary


# --- the plan: what each item asks ------------------------------------------------------------------

@dataclass(frozen=True)
class HeartbeatTurn:
    agent: int
    index: int  # 0: the agent's first turn (its start context); then one per heartbeat
    gap_s: float  # turn 0: offset from the run's start; later: wait after the previous turn ends
    append: int  # tokens of tool output (turn 0: the start context)
    generate: int


@dataclass(frozen=True)
class Exchange:
    gap_s: float  # wait after the previous answer (0 for the first question)
    question: int
    answer: int


@dataclass(frozen=True)
class CheckIn:
    index: int
    at_s: float  # when the person arrives, from the run's start
    agent: int
    exchanges: tuple[Exchange, ...]


@dataclass(frozen=True)
class BatchJob:
    slot: int
    index: int  # per slot
    document: int
    summary: int


def _rng(seed: int, *key: object) -> random.Random:
    return random.Random("/".join(str(k) for k in (seed, *key)))


def _between(r: random.Random, span: Range) -> int:
    return r.randint(span[0], span[1])


class Plan:
    """What a run of ``workload`` asks, item by item (deterministic in the seed)."""

    def __init__(self, workload: AgentWorkload):
        self.w = workload
        self.checkins = self._checkins()

    def heartbeat(self, agent: int, index: int) -> HeartbeatTurn:
        w = self.w
        r = _rng(w.seed, "heartbeat", agent, index)
        if index == 0:  # agents start staggered over one heartbeat, not all at once
            return HeartbeatTurn(agent, 0, r.uniform(0.0, w.heartbeat_s), w.start_context, _between(r, w.agent_gen))
        j = w.heartbeat_jitter
        gap = w.heartbeat_s * r.uniform(1.0 - j, 1.0 + j)
        return HeartbeatTurn(agent, index, gap, _between(r, w.tool_output), _between(r, w.agent_gen))

    def batch_job(self, slot: int, index: int) -> BatchJob:
        return BatchJob(slot, index, self.w.batch_document, self.w.batch_summary)

    def _checkins(self) -> tuple[CheckIn, ...]:
        w = self.w
        if w.checkins_per_min <= 0:
            return ()
        arrivals = _rng(w.seed, "checkin-arrivals")
        rate = w.checkins_per_min / 60.0
        out: list[CheckIn] = []
        t = arrivals.expovariate(rate)
        # bounded: a Poisson count over the run is far below this, the bound only guards the loop
        limit = max(16, math.ceil(rate * w.duration_s * 10))
        while t < w.duration_s and len(out) < limit:
            r = _rng(w.seed, "checkin", len(out), w.agents)
            agent = r.randrange(w.agents)
            n = _between(r, w.exchanges)
            ex = tuple(Exchange(0.0 if i == 0 else r.uniform(*w.exchange_gap_s), _between(r, w.question),
                                _between(r, w.answer)) for i in range(n))
            out.append(CheckIn(len(out), t, agent, ex))
            t += arrivals.expovariate(rate)
        return tuple(out)


def compaction_needed(context: int, append: int, generate: int, reserve: int, max_context: int) -> bool:
    """Whether an agent must compact before a turn: the session holds ``context`` tokens, the turn
    appends ``append`` and generates ``generate``, and ``reserve`` more must stay free (a heartbeat
    keeps room for a whole check-in, so a person's question never waits for a 2,000-token re-prefill)."""
    return context + append + generate + reserve > max_context
