"""Turning planned items into daemon calls: sessions, compaction, prompts and sampling.

Every turn is a list of prompt token ids (``start_turn(prompt=[...])``) so its length is exact, and
samples greedily with ``ignore_eos`` so it generates exactly ``max_tokens``.  Sessions:
- an agent's first turn creates its session (class background, ``ttlt_s`` from the workload,
  ``max_context`` from the workload) with the start context as the prompt;
- a turn that would overflow the session compacts first: a new session whose prompt is a
  ``start_context``-token summary followed by the turn's own new tokens, then the old session is
  deleted.  A compaction during a check-in creates the new session interactive (the person is there);
- a batch job is a session of its own, deleted when the job ends (by the replay).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from weaved.bench.agents.records import TurnKind, TurnRecord
from weaved.bench.agents.tokens import TokenPool
from weaved.bench.agents.workload import AgentWorkload, BatchJob, CheckIn, Exchange, HeartbeatTurn, compaction_needed
from weaved.engine.sampling import SamplingParams
from weaved.routing.types import SLA, SLAClass

Submit = Callable[[TurnRecord, Callable[[Callable[[dict], None]], None]], bool]


@dataclass
class AgentState:
    """One agent as the replay drives it: its session, context, heartbeat and check-in."""


    index: int
    session: str | None = None
    context: int = 0  # the session's context tokens (committed + the unfed last token)
    next_heartbeat: int = 0
    heartbeat_due: float | None = None
    busy: TurnRecord | None = None
    checkin: CheckIn | None = None
    exchange: int = 0  # next exchange of the active check-in
    asked_at: float | None = None  # the person has asked the next question (not yet submitted)
    promoted: bool = False
    queued: deque[CheckIn] = field(default_factory=deque)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class AgentTurns:
    def __init__(self, daemon, w: AgentWorkload, tokens: TokenPool, submit: Submit, note: Callable[[str], None]):
        self.d, self.w, self.tokens, self._submit, self._note = daemon, w, tokens, submit, note
        self.background = SLA(SLAClass.BACKGROUND, None, w.background_ttlt_s)
        self.interactive = SLA(SLAClass.INTERACTIVE, w.interactive_ttft_ms, None)
        self.batch_sla = SLA(SLAClass.BATCH, None, w.batch_ttlt_s)

    def shared(self) -> list[int]:
        """The leading tokens every agent's session starts with (the same ids for all)."""
        return self.tokens.take(min(self.w.shared_prompt, self.w.start_context), "shared-system-prompt")

    def context_of(self, sid: str | None) -> int:
        """The session's context as the daemon holds it (after a failed turn, whose usage is unknown)."""
        try:
            return int(self.d.get_session(sid)["context_tokens"]) if sid else 0
        except Exception:  # noqa: BLE001 - gone: the agent starts afresh at its next turn
            return 0

    def heartbeat(self, a: AgentState, hb: HeartbeatTurn) -> TurnRecord | None:
        w = self.w
        tool = self.tokens.take(hb.append, "heartbeat", a.index, hb.index)
        fresh = a.session is None
        compact = not fresh and compaction_needed(a.context, hb.append, hb.generate, w.checkin_reserve, w.max_context)
        prompt = tool
        if compact:
            prompt = self.tokens.take(w.start_context, "summary", a.index, hb.index) + tool
        if fresh or compact:  # a session starts with the system prompt and tools every agent shares
            prompt = self.shared() + prompt[len(self.shared()):]
        rec = TurnRecord(TurnKind.HEARTBEAT, a.index, hb.index, a.session or "", len(prompt), hb.generate, 0.0,
                         compacted=compact)
        return self._run(a, rec, prompt, self.background if (fresh or compact) else None, self.background)

    def exchange(self, a: AgentState, c: CheckIn, i: int, ex: Exchange, waited: float) -> TurnRecord | None:
        w = self.w
        question = self.tokens.take(ex.question, "question", c.index, i)
        compact = compaction_needed(a.context, ex.question, ex.answer, 0, w.max_context)
        prompt = question
        if compact:  # rare: consecutive check-ins used the room a heartbeat keeps for one
            prompt = self.tokens.take(w.start_context, "summary-checkin", c.index, i) + question
            prompt = self.shared() + prompt[len(self.shared()):]
            a.promoted = True  # the new session is created interactive and is demoted when the person leaves
        rec = TurnRecord(TurnKind.EXCHANGE, a.index, c.index, a.session or "", len(prompt), ex.answer, 0.0,
                         compacted=compact, waited_s=waited)
        return self._run(a, rec, prompt, self.interactive if compact else None, None)

    def _run(self, a: AgentState, rec: TurnRecord, prompt: list[int], new_session: SLA | None,
             turn_sla: SLA | None) -> TurnRecord | None:
        """Start ``rec`` on the agent's session, first replacing the session when ``new_session``."""
        w = self.w

        def start(emit) -> None:
            if new_session is not None:
                old = a.session
                info = self.d.create_session(new_session, max_context=w.max_context, prompt_tokens=len(prompt))
                a.session, a.context = info["id"], 0
                if old is not None:
                    self._delete(old)
            rec.session_id = a.session
            # heartbeats restate the agent's SLA: a demotion resets the session to a bare background SLA
            self.d.start_turn(session_id=a.session, prompt=prompt, params=greedy(rec.max_tokens), sla=turn_sla,
                              emit=emit)

        return rec if self._submit(rec, start) else None

    def batch(self, job: BatchJob) -> TurnRecord | None:
        doc = self.tokens.take(job.document, "batch", job.slot, job.index)
        rec = TurnRecord(TurnKind.BATCH, None, job.index, "", len(doc), job.summary, 0.0, slot=job.slot)

        def start(emit) -> None:
            info = self.d.create_session(self.batch_sla, max_context=job.document + job.summary,
                                         prompt_tokens=job.document)
            rec.session_id = info["id"]
            try:
                self.d.start_turn(session_id=rec.session_id, prompt=doc, params=greedy(job.summary), emit=emit)
            except Exception:
                self._delete(rec.session_id)
                raise

        return rec if self._submit(rec, start) else None

    def _delete(self, sid: str) -> None:
        try:
            self.d.delete_session(sid)
        except Exception as exc:  # noqa: BLE001 - a leftover session costs disk, not correctness
            self._note(f"deleting {sid}: {type(exc).__name__}: {exc}")
