"""What the daemon does as a turn runs and ends - on the engine's thread: reserving and committing KV
rows, passing the turn's events on, sharing its prompt's blocks once they are fed, recording the answer,
and letting go of an ephemeral session's KV.

A mixin of ``Daemon`` (``core.py``), which holds the sessions, the lock, the store and the journal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from weaved.daemon.session import Session, UnrecordedAnswer, transcript_entry
from weaved.daemon.turns import parsed_answer
from weaved.engine.sequence import Sequence
from weaved.errors import InsufficientStorage
from weaved.kv.cache import KVCache
from weaved.kv.errors import DiskFull
from weaved.kv.prefixes import BLOCK as PREFIX_BLOCK

log = logging.getLogger("weave.daemon")


class TurnEvents:
    """The engine-thread side of a turn (``Daemon``'s ``_lock``, ``sessions``, ``store``, ``journal``,
    ``pools``)."""

    def _drop_ephemeral(self, s: Session) -> None:
        with self._lock:
            self.sessions.pop(s.id, None)
        self._free_kv(s, wait=False)  # often on an engine thread, between two steps

    def _free_kv(self, s: Session, wait: bool = True) -> None:
        """A deleted session's KV goes now: its copy on a GPU pool (not whenever it is garbage-collected),
        its shards on a ring's nodes, its file (``wait=False``: the file's blocks are freed on the
        store's release thread, moments later)."""
        held = self.pools.get(s.kv_at) if s.kv_at else None
        if held is not None:
            with held.lock:
                held.backend.drop(s.kv)
            s.kv_at = None
        if isinstance(s.kv, KVCache):
            self.store.delete(s.id, wait=wait)
        elif s.placement.decode_pool in self.pools:
            self.pools[s.placement.decode_pool].backend.drop(s.kv)

    def _reserve(self, seq: Sequence, new_length: int) -> None:
        if isinstance(seq.kv, KVCache):  # a ring session's shards reserve their room when they open
            self.store.reserve(seq.kv, new_length)

    def _commit(self, seq: Sequence, fed: list[int]) -> None:
        s = self.sessions.get(seq.session_id)
        try:
            if s is not None and self.fsync and not s.ephemeral and isinstance(seq.kv, KVCache):
                self.store.flush(seq.kv)  # the rows reach the disk before the journal says they exist
            with self._lock:
                s = self.sessions.get(seq.session_id)
                if s is None:
                    return
                if not s.ephemeral:
                    self.journal.commit_tokens(s.id, fed, seq.kv.length)
                s.committed.extend(fed)
        except Exception:  # (a full disk): the rows the journal cannot name go, so the KV, the session and the
            with self._lock:  # journal agree again; this turn fails (the engine's), not the step's others
                s = self.sessions.get(seq.session_id)
                if s is not None and seq.kv.length > len(s.committed):
                    seq.kv.truncate(len(s.committed))
            raise

    def _on_turn_event(self, s: Session, seq: Sequence, ev: dict, emit: Callable[[dict], None],
                       n_prompt: int, first: bool = False) -> None:
        kind = ev["type"]
        if kind not in ("done", "error"):
            if first and kind == "token" and len(seq.generated) == 1:
                # the prompt is fed: its blocks can be shared now, while this turn decodes (its rows there
                # do not change any more), not only once it ends - its short tail blocks at once (a copy of
                # a few blocks), its 128-position blocks as a prefix file off this thread
                self._keep_short_prefix(s)
                self._publish_later(s, drop=False)
            emit(ev)
            return
        publishing, answer = False, None
        try:
            answer = self._record_turn_end(s, seq, kind)
            publishing = kind == "done" and s.ephemeral and self._publish_later(s, drop=True)
        except Exception:  # the stream must end whatever recording did
            log.exception("session %s: recording the end of its turn failed", s.id)
        if not s.ephemeral and self.sessions.get(s.id) is not s:
            self._drop_device_copies(s)
        if not s.ephemeral:  # (a supervisor follows kept sessions' turns without polling)
            reason = seq.finish_reason or "error"
            if reason == "stop" and answer and answer.get("tool_calls"):  # as the API gave it (``transcript_view``)
                reason = "tool_calls"
            self.publish("turn_end", {"session": s.id, "finish_reason": reason,
                                      "prompt_tokens": n_prompt, "computed_tokens": seq.prefilled,
                                      "completion_tokens": len(seq.generated),
                                      "seconds": round(self.clock() - seq.arrival, 3),
                                      **({"error": ev.get("message")} if kind == "error" else {})})
        try:
            emit({**ev, "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(seq.generated),
                                  "cached_tokens": n_prompt - seq.prefilled}})
        finally:
            if s.ephemeral and not publishing:  # else the publisher drops it once its rows are copied
                self._drop_ephemeral(s)
            seq.ended.set()

    def _drop_device_copies(self, s: Session) -> None:
        """The turn of a session deleted while it ran has ended: a device copy of its KV made after the
        deletion freed the last one (a move, or a step, already under way) goes now, not whenever its
        arrays are garbage-collected (engine thread, outside any step)."""
        if not isinstance(s.kv, KVCache):
            return
        for pool in self.pools.values():
            if pool.device_kind == "gpu":
                try:
                    with pool.lock:
                        pool.backend.drop(s.kv)
                except Exception:
                    log.exception("session %s: freeing its device copy on pool %s failed", s.id, pool.name)
        s.kv_at = None

    def _take_back_turn(self, s: Session) -> bool:
        """Take ``s`` back to before its turn's input (its messages, the tokens and KV rows the turn
        fed), so a client that retries the refused turn sends it once; False where that is not known
        (a raw-prompt turn's transcript is not the journal's).  Caller holds the daemon's lock."""
        if s.ephemeral or s.turn_from is None:
            return False
        rec = self.journal.get(s.id)
        if rec is None or len(rec.messages) != len(s.messages):
            return False
        self._rewind(s, s.turn_from, "its turn failed before its first token")
        return True

    def _record_unrecorded(self, s: Session) -> None:
        """Record the answer a full disk kept out of the journal (``Session.unrecorded``), then put it in
        the transcript: the journal first, so a write that fails again (JournalFull, a 507) leaves the
        session as it was.  Caller holds the daemon's lock."""
        a = s.unrecorded
        if a is None:
            return
        self.journal.finish_message(s.id, "assistant", a.text, a.tokens, a.reason,
                                    extra=None if a.answer is None else {"answer": a.answer})
        s.messages.append(a.entry())
        s.unrecorded = None

    def _keep_short_prefix(self, s: Session) -> None:
        with self._lock:
            tokens = list(s.committed) if self.sessions.get(s.id) is s else []
        if tokens and isinstance(s.kv, KVCache):
            try:
                self.store.keep_prefix(s.kv, tokens)
            except Exception:  # not kept is a later prefill, nothing worse
                log.exception("session %s: keeping its short prefix failed", s.id)

    def _publish_later(self, s: Session, drop: bool) -> bool:
        """Queue storing the full blocks of a session's committed context as a shared prefix, off the
        engine thread (the copy takes ~45 ms per 1,000 tokens of SmolLM2's KV): a first turn's prompt
        once it is fed (a system prompt and tools other sessions start with), and an ephemeral request's
        whole conversation at its end (what a stateless client sends again, one message longer).  Until
        it is done, the session's next turn and its deletion wait (``s.publishing``), so the rows it
        reads cannot change under it; with ``drop`` the publisher then drops the ephemeral session.
        False when there is nothing to publish."""
        with self._lock:
            tokens = list(s.committed) if self.sessions.get(s.id) is s else []
        if not (self.store.share and isinstance(s.kv, KVCache) and len(tokens) >= PREFIX_BLOCK):
            return False
        done = threading.Event()
        s.publishing = done
        tokens = tokens[: s.kv.length]  # (the rows written now: what the job copies, whenever it runs)
        self.store.prefixes.announce(tokens)

        def job() -> None:
            try:
                self.store.publish_prefix(s.kv, tokens)
            except DiskFull as e:  # a prefix not stored is a later prefill, nothing worse
                log.warning("session %s: its prefix is not stored: %s", s.id, e)
            except Exception:
                log.exception("session %s: storing its prefix failed", s.id)
            finally:
                self.store.prefixes.settle(tokens)
                done.set()
                if drop:
                    self._drop_ephemeral(s)

        try:
            self._publisher.submit(job)
        except RuntimeError:  # shutting down: the publisher takes no more work (a later prefill, nothing worse)
            self.store.prefixes.settle(tokens)
            s.publishing = None
            done.set()
            return False
        return True

    def _record_turn_end(self, s: Session, seq: Sequence, kind: str) -> dict | None:
        """The answer into the transcript and the journal - unless the session was deleted meanwhile; its
        parsed form (None for an ephemeral session's)."""
        text = "".join(seq.text)
        # its parsed form, off the lock (the turn has ended: nothing changes its plan now); an ephemeral
        # session's transcript goes with it, so it is not parsed
        answer = None if s.ephemeral else parsed_answer(s.answer_plan, s.call_seed, text)
        with self._lock:
            if self.sessions.get(s.id) is not s:
                return None
            s.tail = list(seq.pending) if kind == "done" else []
            # failed before its first token (no room for its KV, ...): as if it was never asked
            taken_back = kind == "error" and not seq.generated and self._take_back_turn(s)
            # else an answer - empty when the turn ended before its first token (cancelled or stopped in
            # its prefill) - so the transcript's roles keep alternating
            s.last_active = self.wall()
            if not taken_back and (seq.generated or kind == "error" or seq.finish_reason in ("cancelled",
                                                                                              "shutdown")):
                reason = seq.finish_reason or ("error" if kind == "error" else "stop")
                if s.ephemeral:
                    s.messages.append(transcript_entry("assistant", text, reason, answer))
                else:
                    s.unrecorded = UnrecordedAnswer(text, list(seq.generated), reason, answer)
                    try:
                        self._record_unrecorded(s)
                    except InsufficientStorage as e:  # its tokens are committed: the answer is recorded once the disk
                        # has room, before the session's next turn, fork or rewind (or, at a restart, as cut)
                        log.warning("session %s: its answer is not recorded yet: %s", s.id, e)
            if s.detached and seq.finish_reason != "shutdown":  # over: a stop's cut turn stays to run again
                self.journal.drop_detached(s.id)
                s.detached = False
        return answer
