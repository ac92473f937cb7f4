"""Forking a session: a new session that starts where its parent is (or was, after turn k), sharing
the parent's KV instead of computing it again - for sub-agents, retries and tree search.

The parent's context's full blocks become a shared prefix (``weaved.kv.prefixes``; published once, the
parent maps it too) that the fork maps over its first positions; the rows past the last full block are
copied (fewer than a block).  The fork has its own SLA and placement, its own journal record, and lives
on if the parent is deleted.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from weaved.daemon.recovery import answer_end, unfed_tail
from weaved.daemon.session import Session
from weaved.daemon.turns import message_extra
from weaved.errors import Conflict, ContextTooLong, InvalidRequest, NotFound
from weaved.kv.cache import KVCache
from weaved.routing.types import SLA

FORKING = "forking"  # a fork's journal status until its context is copied (the next start removes it)


class SessionForks:
    """``Daemon.fork_session`` (a mixin of the daemon: it uses the daemon's lock, sessions and stores)."""

    def fork_session(self, sid: str, turn: int | None = None, sla: SLA | None = None,
                     max_context: int | None = None) -> dict:
        """A new session with ``sid``'s transcript and KV - all of it, or through its ``turn``-th answer;
        ``max_context`` (default: the parent's) at least that context, at most the model's."""
        with self._lock:
            parent = self._idle_kept(sid, "fork", "forked")
            if not isinstance(parent.kv, KVCache):
                raise InvalidRequest("a session decoded on a ring cannot be forked", param="session")
            if parent.rebuild:  # its file was lost: its rows exist again only once its next turn computes them
                raise Conflict(f"session {sid} was rebuilt from its journal at the last start and holds no KV "
                               f"until its next turn computes its context again; fork it after that turn",
                               param="session")
            messages, tokens, tail, records = self._fork_point(parent, turn)
        if max_context is not None and max_context < len(tokens) + len(tail) + 1:
            raise ContextTooLong(f"max_context {max_context} does not hold the fork's {len(tokens) + len(tail)} "
                                 f"tokens of context and an answer", param="max_context")
        info = self.create_session(sla or parent.sla, max_context or parent.max_context, parent.system,
                                   forked_from=sid)
        cid = info["id"]
        try:
            shared = self._fill_fork(sid, parent, cid, messages, tokens, tail, records)
            self.journal.set_status(cid, "active")  # complete: a restart keeps it from now on
        except BaseException:  # (a full disk, a parent that changed): no half-made fork is left behind
            with contextlib.suppress(NotFound):
                self.delete_session(cid)
            raise
        self.publish("fork", {"session": cid, "parent": sid, "turn": turn, "tokens": len(tokens),
                              "shared_tokens": shared})
        return {**self.get_session(cid), "shared_tokens": shared}

    def _fill_fork(self, sid: str, parent: Session, cid: str, messages: list[dict], tokens: list[int],
                   tail: list[int], records: list[dict] | None) -> int:
        """The new session ``cid`` given ``parent``'s KV rows, tokens and transcript; the positions shared.
        ``records``: the parent's journal entries of ``messages``, copied as they are (each where the
        context stood when it was recorded, so a fork of this fork at an earlier turn finds its tokens)."""
        with self._lock:
            child = self.sessions.get(cid)
            # the parent still holds the fork point: a turn that started and ended meanwhile (a rewrite of
            # its history, a rewind, a turn taken back) would give the fork rows its tokens do not name -
            # and, published, a shared prefix others would map
            if (self.sessions.get(sid) is not parent or parent.busy or child is None or parent.rebuild
                    or parent.committed[:len(tokens)] != tokens or parent.kv.length < len(tokens)):
                raise Conflict(f"session {sid} changed while it was being forked; try again", param="session",
                               retryable=True)
            if not isinstance(child.kv, KVCache):  # (its max_context put it on a Q-Ring across peers)
                raise InvalidRequest(f"a fork of {child.max_context} tokens of context would be placed on a "
                                     f"Q-Ring across peers, which cannot take its parent's KV: give a max_context "
                                     f"this node holds", param="max_context")
            shared = self.store.fork_prefix(parent.kv, child.kv, tokens)
            if self.fsync and not child.ephemeral:
                self.store.flush(child.kv)  # the rows copied reach the disk before the journal names them
            child.committed.extend(tokens)
            child.tail = tail
            child.messages.extend(dict(m) for m in messages)
            if records is not None:
                self._copy_records(cid, messages, tokens, records)
                return shared
            self.journal.commit_tokens(cid, tokens, len(tokens))
            last = len(messages) - 1
            for i, m in enumerate(messages):  # recorded after the tokens: a restart sees finished turns
                # the unfed tail (the last answer's sampled token) is recorded as that answer's ids past an
                # empty input, which is how a restart finds it (``recovery.unfed_tail``)
                ids = (tail if i == last else []) if tail and i >= last - 1 else None
                if m.get("finish_reason") is not None:  # an answer keeps why it ended (a cut call says so)
                    self.journal.finish_message(cid, m["role"], m["content"], ids, m["finish_reason"],
                                                extra=message_extra(m))
                else:
                    self.journal.add_message(cid, m["role"], m["content"], ids, extra=message_extra(m))
        return shared

    def _copy_records(self, cid: str, messages: list[dict], tokens: list[int], records: list[dict]) -> None:
        """``messages`` into ``cid``'s journal as the parent recorded them: its tokens committed up to each
        entry's place first, the entry's own token ids with it (a finished answer's, with its unfed tail)."""
        pos = 0
        for m, r in zip(messages, records, strict=True):
            at = min(r["kv_at"], len(tokens))
            if at > pos:
                self.journal.commit_tokens(cid, tokens[pos:at], at)
                pos = at
            if m.get("finish_reason") is not None:
                self.journal.finish_message(cid, m["role"], m["content"], r["token_ids"], m["finish_reason"],
                                            extra=message_extra(m))
            else:
                self.journal.add_message(cid, m["role"], m["content"], r["token_ids"], extra=message_extra(m))
        if pos < len(tokens):
            self.journal.commit_tokens(cid, tokens[pos:], len(tokens))

    def _fork_point(self, parent: Session, turn: int | None
                    ) -> tuple[list[dict], list[int], list[int], list[dict] | None]:
        """(messages, committed tokens, unfed tail, the messages' journal entries - None where the journal
        does not hold them as they are now) of the parent now, or through its ``turn``-th answer (then the
        tail is that answer's token sampled but never fed, if any)."""
        rec = self.journal.get(parent.id)
        if turn is None:
            same = (not parent.rebuild and rec.kv_length == len(parent.committed)
                    and len(rec.messages) == len(parent.messages))
            return (list(parent.messages), list(parent.committed), list(parent.tail),
                    rec.messages if same else None)
        cut = answer_end(rec.messages, turn, 1)
        if cut == len(rec.messages):
            return self._fork_point(parent, None)
        kv_at = rec.messages[cut]["kv_at"]
        keys = ("role", "content", "finish_reason", "name", "tool_calls", "tool_call_id", "reasoning_content",
                "answer")
        messages = [{k: m[k] for k in keys if m.get(k) is not None} for m in rec.messages[:cut]]
        # the answer's last sampled token, never fed then: the fork's own tail, as a restart finds it
        upto = SimpleNamespace(messages=rec.messages[:cut], kv_length=kv_at, tokens=rec.tokens[:kv_at])
        return messages, list(rec.tokens[:kv_at]), unfed_tail(upto), rec.messages[:cut]
