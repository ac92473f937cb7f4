"""Starting a turn, the daemon's busiest path: the request checked against the session (tool results,
names the template renders, the context), the router's admission and where the turn runs, a stored
prefix taken for a fresh session's prompt, the transcript and journal written, the sequence submitted.
Also the wait for a session's previous turn to end and a turn's cancel.

A mixin of ``weaved.daemon.core.Daemon``: what a method changes, it changes under the daemon's lock.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from weaved.agent.plan import AnswerPlan, AnswerSpec
from weaved.agent.tool_results import answered_calls, check_tool_results, cut_calls
from weaved.daemon.session import Session
from weaved.daemon.turns import (
    Context,
    TokensAhead,
    TurnHandle,
    chat_turn_tokens,
    check_fits,
    check_names_rendered,
    fitted,
    message_extra,
    no_chat_template,
    prompt_turn_tokens,
    turn_constraint,
    turn_sequence,
)
from weaved.engine.sampling import SamplingParams
from weaved.engine.sequence import Sequence
from weaved.errors import Conflict, InvalidRequest, Overloaded, WeaveError
from weaved.kv.cache import KVCache
from weaved.kv.errors import KVFileLost
from weaved.routing.types import SLA, Placement, SLAClass

CANCEL_WAIT_S = 30.0  # how long a new turn waits for its session's cancelled turn to end (one engine step)


class TurnStarts:
    """Turns begin (and are cancelled) here; their events and ends are ``TurnEvents``'."""

    def start_turn(self, *, session_id: str | None, messages: list[dict] | None = None,
                   prompt: str | list[int] | None = None, params: SamplingParams, sla: SLA | None = None,
                   echo: bool = False, emit: Callable[[dict], None], answer: AnswerSpec | None = None,
                   answer_plan: AnswerPlan | None = None, continues: int | None = None,
                   detached: dict | None = None, system: str | None = None, replaces_system: bool = False
                   ) -> TurnHandle:
        """Start a turn: ``messages`` (a chat turn; ``answer`` says what its answer may hold - tools,
        response format - see ``weaved.agent``) or a raw ``prompt`` (``answer_plan``: a prompt that ends
        where a chat answer starts - a forked choice - and is constrained as that answer).  ``continues``:
        the transcript length the turn follows (a stored response's end, ``chains``): entries past it are
        dropped first.  ``detached``: the request of a turn nobody listens to, journaled until the turn
        ends, so that a stop or a crash before then leaves it to be run again (``resume_detached``).
        ``replaces_system``: the session's system prompt becomes ``system`` with this turn (a Responses
        chain continued with other instructions), only if the turn starts.
        WeaveError for a turn it refuses; nothing else has changed then."""
        arrival = self.clock()  # its deadlines count from here: waits for a previous turn, tokenizing, the lock
        if (messages is None) == (prompt is None):
            raise InvalidRequest("a turn needs either messages or a prompt")
        if messages is not None and not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if messages is not None and not self.tokenizer.chat_template:
            raise no_chat_template(self.model_name)
        plan = AnswerPlan(answer or AnswerSpec(), self.tokenizer, self.grammar) if messages is not None else answer_plan
        if plan is not None and plan.spec.constrained:
            _ = self.grammar.lltokenizer  # built once (seconds for a large vocabulary), not under the lock
        if session_id is None:
            info = self.create_session(sla or SLA(SLAClass.INTERACTIVE), ephemeral=True)
            session_id = info["id"]
        self._await_previous_turn(session_id)

        def tokens(view: Session | Context) -> tuple[list[int], int]:
            if messages is None:
                return prompt_turn_tokens(self.tokenizer, view, prompt)
            check_names_rendered(plan.render, list(view.messages) + list(messages))
            return chat_turn_tokens(self.tokenizer, view, messages, render=plan.render)

        with self._lock:  # (a continuation that drops turns first is computed under the lock, after that)
            s = self._get(session_id)
            view = Context.of(s) if continues is None or continues >= len(s.messages) else None
            if view is not None and replaces_system:
                view = dataclasses.replace(view, system=system)
        ahead = TokensAhead.compute(view, tokens) if view is not None else None
        if (ahead is not None and ahead.tokens is not None and not view.committed and not echo and self.store.share
                and isinstance(s.kv, KVCache)):
            # a fresh session's prompt whose blocks another turn is storing right now: wait for them here,
            # holding no lock, rather than compute them again
            self.store.prefixes.await_announced(ahead.tokens[0][:-1])
        with self._lock:
            s = self._get(session_id)
            if s.turn is not None and not s.turn.ended.is_set():
                raise Conflict(f"session {session_id} is already generating a turn", param="session",
                               retryable=True)
            if isinstance(s.kv, KVCache):
                try:
                    self.store.check_file(s.kv)
                except KVFileLost as e:
                    raise Conflict(str(e), param="session") from None
            self._record_unrecorded(s)  # (its last answer, if a full disk kept it out: 507 while it still does)
            # the turn is judged on the session as it will be - its transcript taken back to ``continues``,
            # its new system prompt - in memory only: a refused turn leaves the session as it was
            rewound = self._rewound(s, continues) if continues is not None else None
            kept_system, kept = s.system, (list(s.messages), list(s.committed), list(s.tail))
            if rewound is not None:
                s.messages[:], s.committed[:], s.tail = list(rewound.messages), list(rewound.committed), \
                    list(rewound.tail)
            if replaces_system:
                s.system = system

            def undo() -> None:  # the session as it was before this turn was judged
                s.system = kept_system
                s.messages[:], s.committed[:], s.tail = kept

            try:
                if messages is not None:
                    check_tool_results(messages, answered_calls(s.messages), cut=cut_calls(s.messages))
                new, keep = ahead.get(s, tokens) if ahead is not None else tokens(s)
                # the answer the router budgets for: what max_tokens allows, or a typical one when unset
                answer = min(params.max_tokens, self.profile.routing.answer_tokens) if params.fit_context \
                    else params.max_tokens
                params = fitted(params, s, keep, new)
                check_fits(s, keep, new, params.max_tokens, self.config.context_length)
                constraint = turn_constraint(plan, params)
                # a fresh session's prompt may start with a stored prefix: its prefill cost is the rest
                cached = self.store.cached_prefix(new[:-1]) if (
                    not s.committed and isinstance(s.kv, KVCache) and self.store.share and not echo) else 0
                moved, predicted = self._admit(s, new[cached:], params, sla or s.sla, answer, arrival)
            except WeaveError:
                undo()
                if s.ephemeral:
                    self._drop_ephemeral(s)
                raise
            if rewound is not None:  # accepted: the journal and the rows are taken back now
                try:
                    self._apply_rewind(s, rewound, "its detached turn, cut by the last stop or crash, runs again"
                                       if detached else "past the continued response (a turn no stored response holds)")
                except BaseException:
                    undo()
                    raise
                kept = (list(s.messages), list(s.committed), list(s.tail))  # (done: a later undo keeps it)
            reprefilled = len(s.committed) - keep
            try:  # the journal first: a write that fails (a full disk) leaves the session as it was
                if s.rebuild:  # this turn feeds its lost context again: the journal records it anew as it commits
                    self.journal.truncate(s.id, 0)
                elif reprefilled and not s.ephemeral:
                    self.journal.truncate(s.id, keep)
            except BaseException:
                undo()
                raise
            if s.rebuild:
                if isinstance(s.kv, KVCache):
                    self.store.filled(s.kv)  # (after the journal: a stop between leaves 0 of 0 rows unfilled)
                s.rebuild = False
            if reprefilled:  # the template rewrote history (e.g. dropped earlier thinking): re-prefill from there
                self.publish("reprefill", {"session": s.id, "from": keep, "tokens": reprefilled})
                try:
                    if isinstance(s.kv, KVCache):
                        self.store.unshare(s.kv, keep)
                finally:  # (the journal is cut: memory follows it, whatever the rows' copy met)
                    s.kv.truncate(keep)
                    del s.committed[keep:]
            tail, s.tail = s.tail, []
            first = not s.committed  # the session's first turn: its prompt may start with a stored prefix
            # (not when the prompt's own log-probabilities are asked for: a stored prefix has no logits)
            if first and isinstance(s.kv, KVCache) and not echo:
                shared = self.store.share_prefix(s.kv, new)
                held = self.store.copy_prefix(s.kv, new, shared)  # kept short blocks past it, copied
                if held:  # those rows are mapped or copied, not computed: the turn feeds the rest
                    if not s.ephemeral:
                        try:
                            if self.fsync and held > shared:
                                self.store.flush(s.kv)  # the copied rows reach the disk before the journal
                            self.journal.commit_tokens(s.id, new[:held], held)
                        except BaseException:  # (a full disk): the rows the journal cannot name go again
                            self.store.take_back(s.kv, 0)
                            if not reprefilled:
                                s.tail = tail
                            s.system = kept_system
                            raise
                    s.committed.extend(new[:held])
                    new, keep = new[held:], held
            resla = sla is not None and sla.cls != s.sla.cls
            if sla is not None and sla != s.sla:
                s.sla = sla
            placed = None  # where a move put the session now
            if resla or self.moves.misplaced(s):  # a check-in: the router re-places the session first
                placed = self.moves.replace(s, "promotion" if s.sla.cls is SLAClass.INTERACTIVE else "demotion",
                                            len(new), moved)
            elif moved is not None:  # a throughput-tolerant turn spills to a GPU pool, or returns to the CPU
                self.moves.send(s, moved, "spill" if self.pools[moved.decode_pool].device_kind == "gpu" else "return")
                placed = moved
            elif first and self.moves.place_first_turn(s, len(new)) is not None:  # its first turn: the router
                placed = s.placement  # sees the real prompt now (what a stored prefix leaves)
            if placed is not None and not s.ephemeral:  # (a stateless request's turn is no event: under load
                # they would crowd the kept sessions' events out of the backlog)
                self.publish("placement", {"session": s.id, "placement": placed.to_dict()})
            if not s.ephemeral:  # recorded in one transaction before the transcript changes: a write that
                # fails (a full disk) leaves the session as it was
                if messages is not None:  # the last message carries the turn's prompt tokens (see recovery)
                    rows = [(m["role"], m["content"], list(new) if i == len(messages) - 1 else None,
                             message_extra(m)) for i, m in enumerate(messages)]
                else:
                    rows = [("prompt", prompt if isinstance(prompt, str) else "", list(new), None)]
                try:
                    if s.system != kept_system:
                        self.journal.set_system(s.id, s.system)
                    self.journal.add_turn_input(s.id, rows, (detached, len(s.messages)) if detached is not None
                                                else None)
                except BaseException:
                    if not reprefilled:  # the last answer's unfed token still follows the context
                        s.tail = tail
                    s.system = kept_system
                    raise
            s.detached = detached is not None and not s.ephemeral
            s.turn_from = len(s.messages) if messages is not None else None
            if messages is not None:
                s.messages.extend(dict(m) for m in messages)
            seq = turn_sequence(s, new, params, self.tokenizer, echo=echo, arrival=arrival,
                                default_ttlt_s=self.moves.turn_budget(s.sla), constraint=constraint,
                                stops_until=plan.stops_until if plan is not None else None, expected_tokens=answer,
                                plan=plan)
            seq.forecast = predicted
            n_prompt = len(s.committed) + len(new)
            seq.emit = lambda ev, s=s, seq=seq: self._on_turn_event(s, seq, ev, emit, n_prompt, first)
            s.turn = seq
            s.answer_plan, s.call_seed = plan, secrets.token_hex(8)
            s.last_active = self.wall()
            run_in = self.moves.prepare_turn(s, seq, len(new))
            handle = TurnHandle(s.id, n_prompt, keep, cancel=lambda sid=s.id, seq=seq: self.cancel_turn(sid, seq),
                                placement=s.placement.to_dict(), answer=plan,
                                reprefilled=reprefilled, call_seed=s.call_seed,
                                placement_now=lambda sess=s: sess.placement.to_dict())
            # submitted under the lock: a move decided meanwhile (a promotion) finds the turn in its engine
            self.engines[run_in].submit(seq)
            if not s.ephemeral:
                self.publish("turn_start", {"session": s.id, "pool": run_in, "prompt_tokens": n_prompt,
                                            "to_compute": len(new), "detached": s.detached})
        return handle

    def _admit(self, s: Session, new: list[int], params: SamplingParams, sla: SLA, answer: int, arrival: float
               ) -> tuple[Placement | None, tuple[float, float] | None]:
        """Where the turn runs (``SessionMoves.route_turn``: a placement to move the session to, or None to
        stay) and the router's forecast for it there, or Overloaded (503 with Retry-After) for a turn no
        pool can take without missing an SLA it has accepted (``weaved.engine.admission``); nothing has
        changed yet when it refuses.  The probe runs at the rank the placement gives (set by route_turn)."""
        probe = Sequence(session_id=s.id, kv=s.kv, pending=list(new), params=params,
                         rank=s.rank, ttft_s=sla.ttft_ms / 1000 if sla.ttft_ms else None,
                         ttlt_s=self.moves.turn_budget(sla), expected_tokens=answer, arrival=arrival)
        moved, pool, refusal = self.moves.route_turn(s, probe, sla, answer)
        if refusal is not None:
            self.publish("refusal", {"session": s.id, "pool": pool, "class": sla.cls.value,
                                     "reason": refusal.reason, "retry_after_s": round(refusal.retry_after_s, 1)})
            raise Overloaded(f"pool {pool!r} is at capacity: {refusal.reason}; retry in "
                             f"{refusal.retry_after_s:.0f} s", retry_after_s=refusal.retry_after_s)
        return moved, probe.forecast

    def _await_previous_turn(self, sid: str) -> None:
        """Wait (bounded) for the session's last turn to be over when it is only ending: cancelled by a
        client that hung up and came back, or finished but not yet recorded.  A turn still generating
        is left alone (start_turn refuses the new one)."""
        with self._lock:
            s = self.sessions.get(sid)
            turn = s.turn if s is not None else None
        if turn is not None and (turn.cancel_requested or turn.status.done):
            turn.ended.wait(CANCEL_WAIT_S)
        if s is not None and s.publishing is not None and not s.publishing.wait(CANCEL_WAIT_S):
            # its prefix is being copied, and its rows must hold still until then: a turn now could rewrite
            # rows the copy then stores under the tokens they no longer hold
            raise Overloaded("the session's context is still being stored as a shared prefix (the host is busy); "
                             "retry shortly", retry_after_s=5.0)

    def cancel_turn(self, sid: str, turn: Sequence | None = None) -> None:
        """Cancel the session's running turn - only if it is still ``turn`` when one is named (a client
        that hung up on its turn never cancels the next one its session started meanwhile)."""
        with self._lock:
            s = self.sessions.get(sid)
            if s is None or not s.busy or (turn is not None and s.turn is not turn):
                return
            s.turn.cancel_requested = True
        self.engines[s.pool].cancel(sid)
