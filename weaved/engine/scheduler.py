"""Which sequences run in the next step, under a token budget, by SLA.

Order (docs/architecture.md, "Scheduling"): first any throughput-tolerant turn that is due - behind the
pace that ends it within its TTLT budget - earliest deadline first; then interactive; then background
and batch by earliest deadline (the TTFT deadline for a waiting prefill; the TTLT budget spread over the
remaining tokens for a decode).  A due turn needs a slot only now and then (its next token is due
after its budget / remaining tokens), so interactive turns lose little, and throughput-tolerant work
is never starved while the host has the capacity admission promised.  A sequence not picked this step
is paused; since its KV stays in its file, that costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from weaved.calibration.cost import StepCost
from weaved.engine.sequence import SeqStatus, Sequence, SLARank
from weaved.engine.step_budget import interactive_step_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 512  # tokens per step over all sequences
    max_batch: int = 64  # sequences per step
    prefill_chunk: int = 256  # the most prompt tokens one sequence feeds in a step
    order: str = "sla"  # "sla" (the order above) or "fifo": arrival order only (the benchmark's baseline)
    # tokens per step while an interactive turn is decoding: a step's time is that turn's inter-token
    # gap, so prefill chunks of other turns shrink to keep it short (None: token_budget always; with a
    # step model below, a cap on what the model allows)
    interactive_budget: int | None = None
    # the pool's step-time model and the step time an interactive turn's gap allows: while one is live,
    # the budget is also cut to what the model predicts within it (``step_budget``; None: not known)
    step_cost: StepCost | None = None
    step_target_s: float | None = None

    def __post_init__(self) -> None:
        for k in ("token_budget", "max_batch", "prefill_chunk"):
            if getattr(self, k) < 1:
                raise ValueError(f"scheduler {k} must be >= 1")
        if self.interactive_budget is not None and self.interactive_budget < 1:
            raise ValueError("scheduler interactive_budget must be >= 1")
        if self.step_target_s is not None and not self.step_target_s > 0:
            raise ValueError("scheduler step_target_s must be > 0")
        if self.order not in ("sla", "fifo"):
            raise ValueError(f"scheduler order must be 'sla' or 'fifo', got {self.order!r}")


@dataclass(frozen=True)
class Work:
    seq: Sequence
    n_tokens: int  # how many of seq.pending to feed this step


def priority_key(seq: Sequence, now: float) -> tuple:
    """Sort key: due throughput-tolerant turns, then by rank (interactive < background < batch); within
    each, deadline, then arrival."""
    due = seq.deadline(now)
    if seq.rank != SLARank.INTERACTIVE and due <= now:
        return (0, due, seq.arrival)
    return (1 + int(seq.rank), due, seq.arrival)


def schedule(active: list[Sequence], cfg: SchedulerConfig, now: float) -> list[Work]:
    """Pick the step's work; marks picked sequences RUNNING/WAITING and the rest PAUSED.

    Decodes cost one token.  Under the SLA order the interactive turns hold their part of the budget
    first - every decode's row, then each prompt's chunk in deadline order from what the rows leave (at
    least a token) - whatever is sorted before them; the other turns take what is left: a prefill at
    most ``prefill_chunk`` (one that gets nothing waits for a later step, except a due one, which feeds
    a token past the budget: it must go on), a decode a token (a due one always).  ``max_batch`` bounds
    the sequences of a step.
    """
    budget = cfg.token_budget
    key = (lambda s: s.arrival) if cfg.order == "fifo" else (lambda s: priority_key(s, now))
    ordered = sorted(active, key=key)
    live = [s for s in ordered if not s.status.done and s.pending]
    sla = cfg.order == "sla"
    interactive = [s for s in live if s.rank == SLARank.INTERACTIVE] if sla else []
    rows = sum(1 for s in interactive if not s.prefilling)  # the interactive rows every step runs
    sharing = _sharing(interactive, cfg)
    if interactive:
        if cfg.interactive_budget is not None and rows:  # (never below the rows themselves)
            budget = min(budget, max(cfg.interactive_budget, rows))
        if cfg.step_cost is not None and cfg.step_target_s is not None:
            budget = min(budget, _interactive_budget(live, interactive, sharing, cfg, now))
    free = budget - rows
    grants: dict[int, int] = {}  # the interactive prompts' chunks (a step holding one is its turn's TTFT)
    for s in sorted((s for s in interactive if s.prefilling), key=lambda s: id(s) in sharing):
        if id(s) in sharing:  # (after the others' chunks: what the target leaves, but always some)
            grants[id(s)] = max(min(SHARED_CHUNK_MIN, len(s.pending)), min(len(s.pending), cfg.prefill_chunk, free))
        else:
            grants[id(s)] = max(1, min(len(s.pending), cfg.prefill_chunk, free))
        free -= grants[id(s)]
    picked: list[Work] = []
    for seq in ordered:
        if seq.status.done or not seq.pending:
            continue
        ours = sla and seq.rank == SLARank.INTERACTIVE
        due = sla and not ours and priority_key(seq, now)[0] == 0
        if ours:
            n = grants[id(seq)] if seq.prefilling else 1
        elif seq.prefilling:
            n = min(len(seq.pending), cfg.prefill_chunk, free) if free > 0 else int(due)
        else:
            n = 1 if free > 0 or due else 0
        if n <= 0 or len(picked) >= cfg.max_batch:
            _pause(seq)
            continue
        if not ours:
            free -= n
        picked.append(Work(seq, n))
        seq.status = SeqStatus.WAITING if seq.prefilling else SeqStatus.RUNNING
    return picked


def _interactive_budget(live: list[Sequence], interactive: list[Sequence], sharing: set[int],
                        cfg: SchedulerConfig, now: float) -> int:
    """The step's tokens while an interactive turn is live, by the step model (``step_budget``) - never
    fewer than the rows that must run (interactive decodes, throughput-tolerant decodes already due)
    and the interactive turns' own prompt chunks, which always fit: a step that holds one is that
    turn's time to first token, so other turns' prompts get only what the target leaves (``sharing``:
    the long prompts that share it, from ``_sharing``).  ``live``: the turns with work, in order."""
    decodes = [s for s in live if not s.prefilling][:cfg.max_batch]
    must = sum(1 for s in decodes if s.rank == SLARank.INTERACTIVE or priority_key(s, now)[0] == 0)
    own = sum(min(len(s.pending), SHARED_CHUNK_MIN if id(s) in sharing else cfg.prefill_chunk)
              for s in interactive if s.prefilling)
    prompts = [s.kv.length for s in live if s.prefilling]
    fit = interactive_step_tokens(cfg.step_cost, cfg.step_target_s, [s.kv.length for s in decodes],
                                  max(prompts) if prompts else None)
    return max(fit, own + must)


SHARED_CHUNK_MIN = 16  # a long interactive prompt's least chunk in a step it shares (it always goes on)


def _sharing(interactive: list[Sequence], cfg: SchedulerConfig) -> set[int]:
    """The interactive prompts that share the step's target with the other interactive turns: those
    longer than a chunk - several steps' prefill whatever is done (an agent's long tool result), to their
    last chunk - while another interactive turn that is not one is live (a person's answer streaming, or a
    short prompt waiting for its first token).  Their chunks get what the step model leaves within the target (at least
    ``SHARED_CHUNK_MIN``) rather than a whole chunk, which at a long context takes seconds and would
    hold every other interactive turn's next token that long; a long prompt alone keeps whole chunks.
    Only with a step model (without one, the token budget sizes every chunk)."""
    if cfg.step_cost is None or cfg.step_target_s is None:
        return set()
    # (by the prompt's whole length, so its last chunk shares too; long prompts only among themselves: whole)
    long = {id(s) for s in interactive if s.prefilling and s.prefilled + len(s.pending) > cfg.prefill_chunk}
    return long if len(long) < len(interactive) else set()


def _pause(seq: Sequence) -> None:
    if seq.status == SeqStatus.RUNNING:
        seq.status = SeqStatus.PAUSED
        seq.preemptions += 1
