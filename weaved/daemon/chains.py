"""Stored Responses chains: a ``/v1/responses`` chain lives in one session, each stored response
recording where the session's transcript ended with its answer.

A continuation names a response; the session's context must then be exactly the chain through it.  A
turn of that session that no stored response holds - a turn cut by a crash or a shutdown before its
response was stored, a cancelled one (never stored), or a turn posted to the session directly - would
otherwise sit in the context unseen by the client, so a continuation first rewinds the session to its
response's end (``rewind``): the transcript, the committed tokens and the KV rows past it go.  A
continuation from a response its chain has gone past branches: the chain's session is forked through
that response's answer (``branch_response``), and the new chain lives in the fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

from weaved.agent.plan import AnswerPlan, AnswerSpec
from weaved.daemon.recovery import answer_end, transcript_of, unfed_prompt, unfed_tail
from weaved.daemon.session import Session, transcript_view
from weaved.daemon.turns import Context, chat_turn_tokens, check_names_rendered, no_chat_template
from weaved.errors import Conflict, InvalidRequest, NotFound, Overloaded
from weaved.kv.cache import KVCache
from weaved.routing.types import SLA


class ResponseChains:
    """The daemon's stored-response methods (a mixin of the daemon: it uses the daemon's lock, sessions,
    journal and KV store)."""

    def store_response(self, sid: str, rid: str, body: dict) -> None:
        with self._lock:
            s = self._get(sid)
            self._record_unrecorded(s)  # (its answer, if a full disk kept it out: the response ends past it)
            end = len(s.messages)
        self.journal.add_response(rid, sid, body, messages=end)

    def get_response(self, rid: str) -> tuple[str, dict]:
        """(session, response object) of a stored response; NotFound when unknown (or its session is gone)."""
        found = self.journal.get_response(rid)
        if found is not None and found[0] in self.unrecovered:
            raise Conflict(f"stored response {rid!r} is in session {found[0]}, which this daemon did not recover: "
                           f"{self.unrecovered[found[0]]}")
        if found is None or found[0] not in self.sessions:
            raise NotFound(f"no stored response {rid!r}")
        return found

    def latest_response(self, sid: str) -> str | None:
        return self.journal.latest_response(sid)

    def response_end(self, rid: str) -> int | None:
        """The transcript length of its session with response ``rid``'s answer (None: not recorded)."""
        return self.journal.response_end(rid)

    def branch_response(self, rid: str, sla: SLA | None = None) -> str:
        """A new chain continuing from stored response ``rid`` where its own chain has gone past it (a later
        response, deleted or not): a fork of its session through ``rid``'s answer, sharing that context's
        KV (nothing is computed again); the new session's id.  Its transcript is the parent's, entry for
        entry, so ``rid``'s place in it (``response_end``) holds there too."""
        sid, _ = self.get_response(rid)
        end = self.journal.response_end(rid)
        if end is None:
            raise InvalidRequest(f"response {rid!r} was stored by a Weave that did not record its place in its "
                                 f"chain, so nothing can continue it but its chain's latest",
                                 param="previous_response_id")
        rec = self.journal.get(sid)
        turn = sum(1 for m in rec.messages[:end] if m["role"] == "assistant")
        return self.fork_session(sid, turn, sla)["id"]

    def count_input(self, messages: list[dict], answer: AnswerSpec, system: str | None,
                    after: str | None = None) -> int:
        """The prompt tokens (its usage's ``input_tokens``) of a turn feeding ``messages`` under ``system``
        (the request's instructions): as a new chain's first turn, or continuing stored response
        ``after`` - its chain's context through its answer, as a continuation rewinds or branches to it.
        Nothing changes; what starting that turn would refuse of its messages is refused here too."""
        if not self.tokenizer.chat_template:
            raise no_chat_template(self.model_name)
        plan = AnswerPlan(answer, self.tokenizer, self.grammar)
        view = Context(system, [], [], [])
        if after is not None:
            sid, _ = self.get_response(after)
            end = self.journal.response_end(after)
            if end is None:
                raise InvalidRequest(f"response {after!r} was stored by a Weave that did not record its place in "
                                     f"its chain, so its context cannot be counted", param="previous_response_id")
            with self._lock:
                s = self._get(sid)
                if len(s.messages) > end:  # its chain went on (or a turn no response holds): the context at its end
                    view = Context(system, *_context_at(s, end, self.journal.get(sid).messages[end]["kv_at"]))
                else:
                    view = dataclasses.replace(Context.of(s), system=system)
        check_names_rendered(plan.render, view.messages + list(messages))
        new, keep = chat_turn_tokens(self.tokenizer, view, messages, render=plan.render)
        return keep + len(new)

    def response_input(self, rid: str) -> list[dict]:
        """The messages response ``rid`` answered (its input: what its request added to the chain), as
        the transcript shows them; InvalidRequest for a response stored without its place in it."""
        sid, obj = self.get_response(rid)
        end = self.journal.response_end(rid)
        prev = obj.get("previous_response_id")
        start = self.journal.response_end(prev) if prev else 0
        if end is None or start is None:
            raise InvalidRequest(f"response {rid!r} was stored by a Weave that did not record its input")
        with self._lock:
            return [transcript_view(m) for m in self._get(sid).messages[start:end - 1]]

    def delete_response(self, rid: str) -> None:
        """Delete a stored response; the last of a chain's takes the chain's session with it (unless a
        turn runs in it)."""
        sid, _ = self.get_response(rid)
        if self.journal.delete_response(rid) == 0:
            with self._lock:
                s = self.sessions.get(sid)
                idle = s is not None and not s.busy
            if idle:  # (off the lock: deleting may wait for its context's prefix to be stored)
                with contextlib.suppress(NotFound):
                    self.delete_session(sid)

    def _make_session_room(self, keep: str | None = None) -> None:
        """Below the cap on kept sessions, or at it with the least recently active idle Responses chain
        evicted (a stored chain is kept as room allows, as a cache is; sessions made by
        ``/v1/sessions`` are never evicted; nor ``keep``, the session being forked): otherwise
        Overloaded, which deleting sessions clears."""
        cap = self.profile.host.max_sessions
        kept = [s for s in self.sessions.values() if not s.ephemeral]
        if len(kept) < cap:
            return
        chains = self.journal.chain_sessions()
        # idle, and not storing its context as a prefix: deleting it then waits for nothing (under the lock)
        idle = [s for s in kept if s.id in chains and s.id != keep and not s.busy
                and (s.publishing is None or s.publishing.is_set())]
        if not idle:
            raise Overloaded(f"too many sessions ({cap} kept, none of them an idle Responses chain to evict): "
                             f"delete some (weave rm, DELETE /v1/sessions/ID), or raise the profile's [host] "
                             f"max_sessions", code="session_limit_reached", retryable=False)
        victim = min(idle, key=lambda s: s.last_active)
        self.log(f"session {victim.id}: evicted, the least recently used stored Responses chain "
                 f"({cap} sessions kept)")
        self.publish("eviction", {"session": victim.id, "reason": f"{cap} sessions kept"})
        self.delete_session(victim.id)

    def rewind_session(self, sid: str, turn: int) -> dict:
        """Take session ``sid`` back to the end of its ``turn``-th answer (0: before its first turn): the
        later transcript entries, their committed tokens and KV rows go - a cancelled or failed turn, or
        an answer to try again, without forking.  409 while a turn runs."""
        with self._lock:
            s = self._idle_kept(sid, "rewind", "rewound")
            if self.journal.stored_responses(sid):  # their ends would point past the session's
                raise Conflict(f"session {sid} holds stored responses (a Responses chain): continue from an earlier "
                               f"response with previous_response_id instead", param="session")
            rec = self.journal.get(sid)
            end = answer_end(rec.messages, turn, 0)
            if end < len(rec.messages):
                kv_at = rec.messages[end]["kv_at"] if end else 0
                # the transcript kept is the journal's (a raw prompt's input is only there until a restart)
                kept = transcript_of(rec.messages[:end])
                if s.rebuild:  # all of its context is unfed: the tokens stay, the tail is cut
                    committed, tail = list(s.committed), s.tail[:kv_at]
                else:  # the kept answer's last sampled token, never fed (or a cut prompt's rest): still the
                    # context's, as a fork at that turn - or a restart - has it
                    upto = SimpleNamespace(messages=rec.messages[:end], kv_length=kv_at, tokens=rec.tokens[:kv_at])
                    committed, tail = list(rec.tokens[:kv_at]), unfed_tail(upto) or unfed_prompt(upto)
                r = Rewound(end, len(rec.messages) - end, kv_at, kept, committed, tail)
                self._apply_rewind(s, r, f"rewound to its turn {turn} on request")
        return self.get_session(sid)

    def _rewind(self, s: Session, messages: int, why: str) -> None:
        """Take idle session ``s`` back to its first ``messages`` transcript entries (an answer's end):
        the later entries, their committed tokens and KV rows go (``why``: for the log).  Under the
        daemon's lock."""
        r = self._rewound(s, messages)
        if r is not None:
            self._apply_rewind(s, r, why)

    def _rewound(self, s: Session, messages: int) -> Rewound | None:
        """What ``_rewind`` would take ``s`` back to (None: nothing to drop); changes nothing."""
        if len(s.messages) <= messages:
            return None
        # the tokens committed when the first dropped entry was recorded - none before the first (a first
        # turn's prompt blocks copied from a kept prefix are committed before its message is recorded)
        kv_at = self.journal.get(s.id).messages[messages]["kv_at"] if messages else 0
        return Rewound(messages, len(s.messages) - messages, kv_at, *_context_at(s, messages, kv_at))

    def _apply_rewind(self, s: Session, r: Rewound, why: str) -> None:
        """Carry out ``r``: the journal first (a write that fails leaves the session as it was), then the KV
        rows and the transcript in memory (which may hold ``r``'s already: a turn judged on it)."""
        self.journal.rewind(s.id, r.end, r.kv_at)
        try:
            if not s.rebuild and isinstance(s.kv, KVCache):  # (the room its dropped rows held goes back)
                self.store.take_back(s.kv, r.kv_at)
            elif not s.rebuild:
                s.kv.truncate(r.kv_at)
        finally:  # (the journal is cut: memory follows it, whatever the rows' copy met - a full disk)
            s.messages[:], s.committed[:], s.tail = r.messages, r.committed, r.tail
        self.publish("rewind", {"session": s.id, "messages": r.dropped, "from": r.kv_at})
        self.log(f"session {s.id}: {r.dropped} transcript entries dropped, {why}; context back to {r.kv_at} "
                 f"tokens")


@dataclasses.dataclass(frozen=True)
class Rewound:
    """A session's context after its first ``end`` transcript entries (``_context_at``)."""

    end: int
    dropped: int  # the entries past ``end``
    kv_at: int
    messages: list
    committed: list
    tail: list


def _context_at(s: Session, end: int, kv_at: int) -> tuple[list, list, list]:
    """Session ``s``'s transcript, committed tokens and unfed tail as they stood after its first ``end``
    entries (``kv_at``: the tokens committed when entry ``end`` was recorded).  A session whose context is
    all unfed (its KV file was lost) keeps its committed tokens and loses the tail's; otherwise the
    committed tokens go back to ``kv_at`` and nothing is unfed (the next turn's rendering writes the
    answer's end again)."""
    if s.rebuild:
        return s.messages[:end], list(s.committed), s.tail[:kv_at]
    return s.messages[:end], s.committed[:kv_at], []
