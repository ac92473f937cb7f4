"""Speculative decoding by prompt lookup: drafts from the sequence's own tokens, verified in one forward.

Agent transcripts repeat a lot (tool output quoted back, code edited and re-emitted, lists), so the
likeliest continuation of the context's last few tokens is often what followed them the last time
they occurred.  No draft model is needed: the drafter looks the context's last ``n`` tokens up in an
n-gram index of the sequence (session history + this turn's prompt and generated tokens), from the
largest ``n`` down, and proposes up to ``k`` of the tokens that followed the most recent earlier
occurrence.

The engine feeds ``[pending token] + draft`` as one chunk with every row of logits, then samples row
by row with the sequence's own sampler and keeps a draft token only while it equals the sampled one;
the first mismatch's sampled token is the correction, so a verify step yields at least one token.
Row ``i`` of the chunk is bit-identical to the logits plain decoding would compute at that position
(batch invariance), the sampler sees the same history, and it draws one random number per sampled
token in order - so the emitted tokens are exactly those of plain decoding, greedy or seeded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from weaved.config.profile import PoolConfig
    from weaved.engine.scheduler import Work
    from weaved.engine.sequence import Sequence

_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the n-gram hash (golden ratio, a good bit mixer)


@dataclass(frozen=True)
class SpecConfig:
    """The speculative variant of a pool.

    ``draft_tokens``: the most draft tokens one sequence verifies per step (each costs a row of the
    forward whether or not it is accepted).  ``ngram_sizes``: context suffix lengths looked up, tried
    from the largest down (a longer match predicts better; a shorter one drafts more often).
    ``max_concurrency``: drafting runs only while the pool decodes fewer sequences than this - at higher
    concurrency the batch itself fills the device and the draft rows stop being nearly free.
    """

    draft_tokens: int = 8
    ngram_sizes: tuple[int, ...] = (3, 2)
    max_concurrency: int = 4

    def __post_init__(self) -> None:
        sizes = tuple(sorted({int(n) for n in self.ngram_sizes}, reverse=True))
        object.__setattr__(self, "ngram_sizes", sizes)
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"ngram_sizes must be one or more sizes >= 1, got {self.ngram_sizes}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    @classmethod
    def from_pool(cls, pool: PoolConfig) -> SpecConfig:
        """The variant a profile's pool asks for (``speculative = true``)."""
        if not pool.speculative:
            raise ValueError(f"pool {pool.name!r} is not speculative")
        return cls(draft_tokens=pool.spec_draft_tokens,
                   ngram_sizes=tuple(range(pool.spec_ngram_max, pool.spec_ngram_min - 1, -1)),
                   max_concurrency=pool.spec_max_concurrency)


def _hash(tokens) -> int:
    """The n-gram hash ``NgramIndex`` keys by; equal to the vectorized one in ``_hashes``."""
    h = 0
    for t in tokens:
        h = (h * _MULT + t) & _MASK
    return h


def _hashes(toks: np.ndarray, n: int) -> np.ndarray:
    """Hashes of every n-gram of ``toks`` [m] (uint64 arithmetic wraps mod 2**64, like ``_hash``)."""
    m = toks.shape[0] - n + 1
    h = np.zeros(m, dtype=np.uint64)
    mult = np.uint64(_MULT)
    for j in range(n):
        h = h * mult + toks[j : j + m]
    return h


class NgramIndex:
    """For each size ``n``: where each n-gram of a growing token stream last occurred.

    Only n-grams that have a following token are indexed (key: hash of ``tokens[j-n:j]``, value: ``j``,
    the position of the token after it), so the stream's own suffix is never its own "earlier"
    occurrence.  Appending a token updates one entry per size; building over a long history (tens of
    thousands of tokens) hashes with numpy and fills each dict in one pass, later entries winning.
    Hash collisions are harmless: a lookup compares the tokens before trusting an entry.
    """

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes
        self.tokens: list[int] = []
        self._last: dict[int, dict[int, int]] = {n: {} for n in sizes}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        if not new:
            return
        start = len(self.tokens)
        self.tokens.extend(new)
        if len(new) > 64:
            self._bulk(start)
            return
        toks = self.tokens
        for j in range(max(start, 1), len(toks)):
            for n, last in self._last.items():
                if j >= n:
                    last[_hash(toks[j - n : j])] = j

    def _bulk(self, start: int) -> None:
        arr = np.asarray(self.tokens, dtype=np.uint64)
        for n, last in self._last.items():
            j0 = max(start, n)  # first continuation position to index
            if j0 >= len(arr):
                continue
            keys = _hashes(arr[j0 - n : len(arr) - 1], n)  # n-grams ending at j0-1 .. len-2
            last.update(zip(keys.tolist(), range(j0, len(arr)), strict=True))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens predicted to follow the stream: what followed the most recent earlier
        occurrence of its last ``n`` tokens, for the largest ``n`` that has one ([] if none does).

        A continuation that runs into the suffix itself (a repetition of period ``p`` shorter than
        ``k``) is continued periodically, as the repetition would continue."""
        toks = self.tokens
        total = len(toks)
        for n in self.sizes:
            if total <= n:
                continue
            suffix = toks[total - n :]
            j = self._last[n].get(_hash(suffix))
            if j is None or toks[j - n : j] != suffix:
                continue
            out: list[int] = []
            for i in range(k):
                src = j + i
                out.append(toks[src] if src < total else out[src - total])
            return out
        return []


class Drafter:
    """Drafts for the decoding sequences of one engine; keeps one ``NgramIndex`` per live sequence."""

    def __init__(self, config: SpecConfig):
        self.config = config
        # Keyed weakly: a finished turn's index goes with its Sequence.  A sequence that moves to another
        # engine is indexed again there from its tokens (one numpy pass).
        self._index: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, work: list[Work], active: list[Sequence], token_budget: int) -> dict[Sequence, list[int]]:
        """Drafts for this step's decode work: {sequence: draft tokens}, empty while the pool decodes
        ``max_concurrency`` sequences or more.  Drafts share what the step leaves of ``token_budget``
        (in the step's priority order), and never run past ``max_tokens`` or the KV capacity."""
        cfg = self.config
        decoding = sum(1 for s in active if not s.prefilling and not s.status.done)
        if decoding >= cfg.max_concurrency:
            return {}
        room = token_budget - sum(w.n_tokens for w in work)
        drafts: dict[Sequence, list[int]] = {}
        for w in work:
            s = w.seq
            if room <= 0:
                break
            if s.prefilling or w.n_tokens != 1 or len(s.pending) != 1:
                continue
            # Plain decoding samples at most max_tokens - generated more tokens, the first from the
            # pending token's row; and it stops once kv.length + 1 reaches the capacity, so a draft
            # token at position kv.length + i is only ever accepted while kv.length + i + 2 <= capacity.
            k = min(cfg.draft_tokens, room, s.params.max_tokens - len(s.generated) - 1,
                    s.kv.capacity - s.kv.length - 2)
            if k < 1:
                continue
            draft = self._synced(s).draft(k)
            if draft and s.constraint is not None:  # a draft token the grammar refuses would never be accepted
                draft = draft[: s.constraint.valid_prefix(draft)]
            if draft:
                drafts[s] = draft
                room -= len(draft)
        return drafts

    def _synced(self, s: Sequence) -> NgramIndex:
        """The sequence's index, brought up to its tokens: ``history + pending`` (append-only while a
        turn runs: fed tokens move from ``pending`` to ``history``, sampled ones join ``pending``)."""
        h, p = s.history, s.pending
        total = len(h) + len(p)
        idx = self._index.get(s)
        if idx is not None:
            have = len(idx)
            last = have - 1
            if have > total or (have and idx.tokens[last] != (h[last] if last < len(h) else p[last - len(h)])):
                idx = None  # the tokens were replaced, not extended: index them again
        if idx is None:
            idx = self._index[s] = NgramIndex(self.config.ngram_sizes)
        have = len(idx)
        if have < total:
            idx.extend(h[have:] + p if have < len(h) else p[have - len(h) :])
        return idx


def verify(seq: Sequence, draft: list[int], logits: np.ndarray,
           advance: Callable[[np.ndarray], int]) -> tuple[int, int]:
    """Turn a verify step's rows into the tokens plain decoding would have produced.

    The forward fed ``[pending] + draft`` at positions ``L ..`` and returned one row per token.
    ``advance(rows)`` is the engine's plain decode path for one fed token: it moves ``seq.pending``
    into the history, commits it (at the current ``kv.length``), samples from ``rows[-1]`` and emits
    the token (stop strings, max_tokens, logprobs, events).  Draft token ``i`` is fed - its KV row
    counted and committed - only when the token sampled before it equals it, i.e. when plain decoding
    would have fed exactly that token at that position, so its KV row (already written by the forward)
    is the one plain decoding would write.  Returns (tokens generated, draft tokens accepted); on
    return ``kv.length`` counts exactly the committed tokens.
    """
    base = seq.kv.length - len(draft)  # the pending token's row is valid; the draft rows not yet
    seq.kv.truncate(base)
    generated = advance(logits[0:1])
    accepted = 0
    for i, tok in enumerate(draft):
        if seq.status.done or seq.pending != [tok]:
            break  # finished, or the sampled token is the correction: the rest of the draft is void
        seq.kv.length = base + i + 1  # take back the draft row the forward wrote for this very token
        generated += advance(logits[i + 1 : i + 2])
        accepted += 1
    return generated, accepted
