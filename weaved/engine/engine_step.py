"""One step of a pool's batch engine: the scheduler's pick, KV rows reserved, one ``backend.forward``
over every chunk, then for each sequence its fed tokens committed, its next token sampled (the plain
rows drawn together), its stops checked and its events streamed.

A mixin of ``BatchEngine`` (``engine.py``), which holds the sequences, the backend, the counters and
the callbacks these methods use; everything here runs on the engine thread.
"""

from __future__ import annotations

import logging

import numpy as np

from weaved.backends.base import Logits, SeqChunk
from weaved.engine.sampling import sample_rows
from weaved.engine.scheduler import Work, schedule
from weaved.engine.sequence import SeqStatus, Sequence
from weaved.engine.speculative import verify
from weaved.engine.turn_output import PACE_WEIGHT

log = logging.getLogger("weave.engine")


class EngineStep:
    """The step of a ``BatchEngine`` (``self._active``, ``self.backend``, ``self.config``, ``self.out``,
    ``self.counters``, ``self._commit``, ``self._reserve``, ``self._drafter``, ``self._forward_lock``)."""

    def step(self) -> None:
        """One scheduling step over the active sequences (engine thread only)."""
        now = self._clock()
        before = {id(s): s.status for s in self._active}
        work = schedule(self._active, self._scheduling(), now)
        for s in self._active:
            if s.status == SeqStatus.PAUSED and before[id(s)] != SeqStatus.PAUSED:
                self.counters.preemptions += 1
                self._event("preemption", {"session": s.session_id, "pool": self.name})
        drafts = self._drafter.propose(work, self._active, self.config.token_budget) if self._drafter else {}
        work = [w for w in work if self._reserved(w, drafts)]
        if not work:
            return
        chunks = []
        for w in work:
            s = w.seq
            last = w.n_tokens == len(s.pending)
            want = Logits.ALL if (s.prompt_logprobs and s.prefilling) else (Logits.LAST if last else Logits.NONE)
            if s in drafts:  # verify the draft: every row, to sample each position as plain decoding would
                want = Logits.ALL
            chunks.append(SeqChunk(s.kv, np.asarray(s.pending[: w.n_tokens] + drafts.get(s, []), np.int32), want))
        for w, c in zip(work, chunks, strict=True):  # masks of the rows this step samples, during the forward
            if w.seq.constraint is not None and c.logits is not Logits.NONE:
                w.seq.constraint.prefetch()
        predicted = None if self.config.step_cost is None or drafts else self.config.step_cost.chunks_step_s(
            [(w.n_tokens, w.seq.kv.length) for w in work if w.seq.prefilling],
            [w.seq.kv.length for w in work if not w.seq.prefilling])
        t0 = self._clock()
        with self._forward_lock:
            t1 = self._clock()
            outs = self.backend.forward(chunks)
            ran = self._clock() - t1  # (without a wait for a backend another pool shares)
        took = self._clock() - t0
        if predicted is not None:
            self.step_drift.record(predicted, ran)
        self.counters.busy_s += took
        r = self.recent_step_s
        self.recent_step_s = took if not r else (1 - PACE_WEIGHT) * r + PACE_WEIGHT * took
        if self.capacity is not None:
            decoding = sum(1 for w in work if not w.seq.prefilling)
            self.capacity.record(decoding, sum(w.n_tokens for w in work if w.seq.prefilling), took)
        self.counters.steps += 1
        drawn = self._draw_plain(work, outs, drafts)
        generated = 0
        for w, logits in zip(work, outs, strict=True):
            if w.seq in drafts:
                generated += self._verify(w, logits, drafts[w.seq])
            else:
                generated += self._advance(w, logits, drawn.get(w.seq))
        for w in work:  # prefilled here, decoded elsewhere: leave now, with the first token sampled
            s = w.seq
            if s.handoff is not None and not s.prefilling and not s.status.done:
                handoff, s.handoff = s.handoff, None
                self._active.remove(s)
                self._hand_over_to(s, handoff)
        self.tps_window.append((self._clock(), generated))
        if len(self.tps_window) > 256:
            del self.tps_window[:128]

    def _reserved(self, w: Work, drafts: dict[Sequence, list[int]] | None = None, room_made: bool = False) -> bool:
        extra = len(drafts.get(w.seq, ())) if drafts else 0
        try:
            self.backend.prepare(w.seq.kv, w.seq.kv.length + w.n_tokens + extra)
            if self._reserve is not None:
                self._reserve(w.seq, w.seq.kv.length + w.n_tokens + extra)
            return True
        except Exception as exc:  # KV cap, full disk: that turn fails, the others go on
            if extra:  # only the draft's rows did not fit: decode this step plainly
                del drafts[w.seq]
                return self._reserved(w, room_made=room_made)
            need = getattr(exc, "need_bytes", 0)  # the device's own KV memory: idle sessions may leave it
            if need and not room_made and self._make_room is not None and self._make_room(self.backend, need):
                return self._reserved(w, room_made=True)
            # out of KV room (the node's cap, a ring's shards, the disk) is the server's capacity, not a bug
            log.warning("engine %s: session %s: its turn fails: %s", self.name, w.seq.session_id, exc)
            self.out.fail(w.seq, str(exc), getattr(exc, "http_status", None), cause=exc)
            return False

    def _verify(self, w: Work, logits: np.ndarray, draft: list[int]) -> int:
        """A decode step that fed ``[pending] + draft``: each accepted token goes through ``_advance``
        (commit, sample, stops, events) exactly as a plain decode step would have fed it."""
        generated, accepted = verify(w.seq, draft, logits, lambda rows: self._advance(w, rows))
        c = self.counters
        c.verify_steps += 1
        c.drafted += len(draft)
        c.accepted += accepted
        return generated

    def _draw_plain(self, work: list[Work], outs: list[np.ndarray], drafts: dict) -> dict[Sequence, int]:
        """The tokens of the sequences that sample this step from their row alone, drawn together - in parallel
        on the kernel thread when the backend's steps run there (``Backend.host_parallel``) - with the tokens
        one by one would give (``sampling.sample_rows``)."""
        plain = [(w.seq, out[-1]) for w, out in zip(work, outs, strict=True)
                 if w.seq not in drafts and w.n_tokens == len(w.seq.pending) and len(out) and w.seq.plain_sample]
        if len(plain) < 2:
            return {}
        tokens = sample_rows([s.sampler for s, _ in plain], [row for _, row in plain], self.backend.host_parallel)
        return {s: t for (s, _), t in zip(plain, tokens, strict=True) if t is not None}

    def _advance(self, w: Work, logits: np.ndarray, drawn: int | None = None) -> int:
        s = w.seq
        was_prefill = s.prefilling
        if s.prompt_logprobs and was_prefill and len(logits):
            self.out.prompt_logprobs(s, s.pending[: w.n_tokens], logits)
        if not self._feed(s, w.n_tokens, prefill=was_prefill):
            return 0
        if s.pending:  # more prompt to feed: say how far it came (a long prompt takes many steps)
            self.out.emit(s, {"type": "progress", "prefilled": s.prefilled, "prompt": s.prefilled + len(s.pending)})
            return 0
        if s.cancel_requested:  # cancelled (or deleted) during the step: its rows are kept, nothing sampled
            self.out.finish(s, SeqStatus.CANCELLED, "cancelled")
            return 0
        if s.params.max_tokens == 0:  # the prompt alone was asked for (scored, with echo): nothing is sampled
            self.out.finish(s, SeqStatus.FINISHED, "length")
            return 0
        return self.out.sample(s, logits[-1], drawn)

    def _feed(self, s: Sequence, n: int, prefill: bool) -> bool:
        """The first ``n`` pending tokens' KV rows are written: they join the history and are committed.
        False when committing them failed (the journal's disk is full): that turn has failed, no other."""
        fed = s.pending[:n]
        del s.pending[:n]
        s.history.extend(fed)
        if prefill:
            s.prefilled += len(fed)
            self.counters.tokens_prefilled += len(fed)
        if self._commit is None:
            return True
        try:
            self._commit(s, fed)
        except Exception as exc:
            self._fail_turn(s, exc, "committing the tokens of", "its tokens could not be recorded")
            return False
        return True
