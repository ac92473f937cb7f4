"""A session as the daemon holds it: SLA, placement, KV, committed tokens, transcript, running turn."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from weaved.engine.sequence import Sequence, SLARank
from weaved.kv.cache import KVCache
from weaved.routing.types import SLA, TOP_PRIORITY, Placement


@dataclass(eq=False)
class Session:
    id: str
    sla: SLA
    max_context: int
    system: str | None
    placement: Placement
    kv: KVCache
    committed: list[int]  # token ids whose KV rows are written: len == kv.length
    messages: list[dict]  # the transcript: {"role", "content"} (+ "finish_reason" on answers, transcript_entry)
    created: float = field(default_factory=time.time)
    tail: list[int] = field(default_factory=list)  # sampled but not yet fed (the turn's last token)
    turn: Sequence | None = None
    ephemeral: bool = False  # an OpenAI call without a session: deleted after its turn
    last_active: float = field(default_factory=time.time)
    where: str | None = None  # the pool running the session's turns now (None: its placement's decode pool)
    kv_at: str | None = None  # the pool whose backend holds a copy of its KV (None: only the file)
    move_reason: str | None = None  # why it was sent to ``where`` while idle (its KV follows at the next turn)
    publishing: threading.Event | None = None  # set once its context's prefix is stored (being copied until then)
    # the running (or last) chat turn's answer plan (weaved.agent.plan.AnswerPlan) and the seed of its
    # calls' ids: its answer is recorded parsed, with the ids the API answered with
    answer_plan: object | None = None
    call_seed: str | None = None
    forked_from: str | None = None  # the session it was forked from (kept after the parent is deleted)
    detached: bool = False  # its running turn is a detached one, journaled until it ends (run again if cut)
    # its KV file was lost and made anew at load: its context is all ``tail`` (fed again at its next turn),
    # and the journal's tokens are forgotten when that turn starts feeding them
    rebuild: bool = False
    turn_from: int | None = None  # the transcript's length before its last chat turn's input
    # its last answer, which a full disk kept out of the journal (its tokens are committed): the transcript
    # gains it once the journal does, before anything else is recorded (``TurnEvents._record_unrecorded``)
    unrecorded: UnrecordedAnswer | None = None

    @property
    def pool(self) -> str:
        return self.where or self.placement.decode_pool

    @property
    def rank(self) -> SLARank:
        return rank_of(self.placement)

    @property
    def context_tokens(self) -> int:
        return len(self.committed) + len(self.tail)

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn.status.done

    @property
    def settled(self) -> bool:
        """No turn, or its end recorded (``busy`` turns false a moment before: between a turn's last token
        and its record, ``last_active`` is still its start, so a session is not idle until then)."""
        return self.turn is None or self.turn.ended.is_set()


def rank_of(placement: Placement) -> SLARank:
    """The rank the engine runs a turn at under ``placement``: its priority, highest first."""
    return SLARank(TOP_PRIORITY - placement.priority)


def transcript_entry(role: str, content: str, finish_reason: str | None = None, answer: dict | None = None) -> dict:
    """One message of a session's transcript.  An answer says why it ended (``stop``, ``length``,
    ``cancelled``, or ``interrupted`` when the daemon stopped in the middle of it: a crash or kill).
    ``content`` is the text as generated, which the chat template renders again at the next turn (so
    the context's tokens stay the KV's); ``answer`` (a chat turn's) is that text parsed as the API
    returned it - ``content``, ``tool_calls``, ``reasoning_content``; empty when it is the text."""
    entry = {"role": role, "content": content}
    if finish_reason is not None:
        entry["finish_reason"] = finish_reason
    if answer is not None:
        entry["answer"] = answer
    return entry


@dataclass(frozen=True)
class UnrecordedAnswer:
    """An answer whose tokens are committed but which the journal could not record yet (a full disk)."""

    text: str
    tokens: list[int]  # its generated ids, as the journal records an answer's
    reason: str  # its finish reason
    answer: dict | None = None  # its parsed form (a chat turn's), as ``transcript_entry`` takes it

    def entry(self) -> dict:
        """The answer as a transcript entry."""
        return transcript_entry("assistant", self.text, self.reason, self.answer)


def pending_answer(s: Session) -> list[dict]:
    """``s``'s answer that a full disk kept out of the journal, as a transcript entry (none: [])."""
    return [] if s.unrecorded is None else [s.unrecorded.entry()]


def transcript_view(entry: dict) -> dict:
    """A transcript message as the API shows it: an answer's parsed form (OpenAI's assistant message,
    calls with their ids) in place of its raw text, and its finish reason as the API gave it
    (``tool_calls`` for calls that ended the answer)."""
    view = {k: v for k, v in entry.items() if k != "answer"}
    answer = entry.get("answer")
    if answer:
        view = {"role": entry["role"], **answer, **{k: v for k, v in view.items() if k not in ("role", "content")}}
        if answer.get("tool_calls") and view.get("finish_reason") == "stop":
            view["finish_reason"] = "tool_calls"  # as the API returned it (an answer that ended by itself)
    return view
