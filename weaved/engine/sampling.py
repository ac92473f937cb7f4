"""Token sampling: llama.cpp's default sampler chain on one row of logits.

The chain runs in llama.cpp's order - repetition penalty, top-k, top-p, min-p, temperature, draw - so
that a request means the same thing here as it does to llama.cpp: top-p and min-p see the
probabilities *before* temperature scaling.  Temperature 0 is greedy (argmax, ties to the lowest id)
and never touches the random generator.

A ``Sampler`` belongs to one sequence and owns that sequence's generator (PCG64), so a seeded request
draws the same tokens whatever else is in the batch.  Candidates are kept in a canonical order (by id,
or by descending logit then id once sorted) so that the inverse-CDF draw is reproducible too.

Speed: the vocabulary is ~49k, so nothing here sorts the whole vocabulary when it can be avoided:
top-k selects with one pass over the row (``kernels.topk``), top-p grows a partial
selection until it holds the nucleus, and the draw searches block sums before one block.  A chain
with top-k (the API's default) and nothing that edits the row runs compiled
(``kernels.sample_chain``), and ``sample_rows`` samples a whole step's such rows in one parallel
call: each row's token is the one the sampler gives it alone.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from weaved.engine.logit_edits import apply_logit_bias, apply_mask, apply_penalties
from weaved.kernels.sample_chain import ALL_NEG_INF, GREEDY, chain_row, chain_rows, chain_rows_serial
from weaved.kernels.threads import run_on_kernel_thread
from weaved.kernels.topk import top_k_positions

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit for top_logprobs)
_NUCLEUS_START = 256  # first partial selection tried by top-p over the full vocabulary
_DRAW_BLOCK = 1024  # block size of the two-level inverse-CDF search


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    ``repeat_last_n``: how many of the latest tokens the penalties (repetition, frequency, presence:
    llama.cpp's definitions, ``weaved.engine.logit_edits``) look at (0 = none, -1 = the whole history).
    ``logit_bias``: (token id, value) pairs added to the logits first.  ``min_tokens``: end-of-generation
    and stop token ids are masked until this many tokens are generated.  ``logprobs``: how many top
    alternatives to report per token (None = no log-probabilities).  ``stop`` strings and
    ``stop_token_ids`` are applied by the engine (see ``weaved.engine.stops``); they are validated here
    with the rest.
    """

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    seed: int | None = None  # None = a fresh random seed per sampler
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False  # keep generating past end-of-generation tokens (benchmarks)
    fit_context: bool = False  # max_tokens is only a bound: the daemon cuts it to what the context holds

    def __post_init__(self) -> None:
        # Accept lists from JSON bodies but store tuples, so the params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in self.logit_bias))
        _check_int("max_tokens", self.max_tokens, lo=0)  # 0: the prompt alone (its log-probabilities)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0)  # 0 keeps the most probable token (llama.cpp)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_int("repeat_last_n", self.repeat_last_n, lo=-1)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for t, v in self.logit_bias:
            _check_int("logit_bias token ids", t, lo=0)
            _check_float("logit_bias values", v, lo=-100.0, hi=100.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entries", t, lo=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, v: object, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {v}")


def _check_float(name: str, v: object, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {v!r}")
    v = float(v)
    bad_lo = v <= lo if lo_open else v < lo
    if not math.isfinite(v) or bad_lo or (hi is not None and v > hi):
        if hi is None:
            bound = f"> {lo}" if lo_open else f">= {lo}"
        else:
            bound = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be a finite number {bound}, got {v}")


class Sampler:
    """Samples the next token of one sequence; owns the sequence's random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        # The seed actually used, so that an unseeded run can still be replayed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def sample(self, logits: np.ndarray, history: Sequence[int], *, allowed: np.ndarray | None = None,
               banned: Iterable[int] = ()) -> int:
        """The next token id, given float32 ``logits`` [vocab] and the sequence's tokens so far;
        ``allowed`` (bool [vocab]) and ``banned`` ids restrict the choice (a grammar, ``min_tokens``).

        ``logits`` is not modified.  Raises ``ValueError`` on NaN logits or when every logit is -inf.
        """
        p = self.params
        x = np.asarray(logits, dtype=np.float32)  # [vocab]
        if x.ndim != 1:
            raise ValueError(f"logits must be one row [vocab], got shape {x.shape}")
        if np.isnan(x).any():
            raise ValueError("logits contain NaN")
        x = apply_logit_bias(x, p.logit_bias)
        x = apply_penalties(x, history, p.repeat_last_n, repeat=p.repetition_penalty,
                            frequency=p.frequency_penalty, presence=p.presence_penalty)
        x = apply_mask(x, allowed, banned)
        if p.greedy:
            # top-k, top-p and min-p always keep the most likely token, so they cannot change argmax.
            best = int(np.argmax(x))  # first maximum = lowest id
            if x[best] == -np.inf:
                raise ValueError("every logit is -inf")
            return best

        if p.top_k > 0:  # the compiled chain: the same code samples a step's rows together
            k, top_p, min_p, inv_t = self.chain_args()
            tok = int(chain_row(np.ascontiguousarray(x), k, top_p, min_p, inv_t, self.rng.random()))
            if tok == ALL_NEG_INF:
                raise ValueError("every logit is -inf")
            return tok
        ids, vals = np.arange(x.shape[0]), x  # [n] every id, in canonical order
        if p.top_p < 1.0:
            ids, vals = top_p_filter(ids, vals, p.top_p)
        if p.min_p > 0.0:
            ids, vals = min_p_filter(ids, vals, p.min_p)
        w = _weights(vals, p.temperature)  # [n] unnormalized probabilities
        return int(ids[_draw(w, self.rng.random())])

    @property
    def plain(self) -> bool:
        """Whether the next token depends on the row of logits alone through the compiled chain
        (``sample_rows``): greedy or top-k, and nothing that edits the row (bias, penalties)."""
        p = self.params
        edits = p.logit_bias or (p.repeat_last_n != 0 and (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                                                          or p.presence_penalty != 0.0))
        return not edits and (p.greedy or p.top_k > 0)

    def chain_args(self) -> tuple[int, float, float, np.float32]:
        """(k, top_p, min_p, 1 / temperature) as ``kernels.sample_chain`` takes them (k = GREEDY:
        argmax)."""
        p = self.params
        if p.greedy:
            return GREEDY, 1.0, 0.0, np.float32(1.0)
        return p.top_k, float(p.top_p), float(p.min_p), _inverse_temperature(p.temperature)


def sample_rows(samplers: Sequence[Sampler], rows: Sequence[np.ndarray], parallel: bool = True
                ) -> list[int | None]:
    """The next token of each sampler (all ``plain``) from its row of logits (float32 [vocab]), rows
    sampled in parallel (or one after another: ``parallel=False``); each token is the one
    ``Sampler.sample`` gives the row alone, and each non-greedy sampler draws one number from its
    generator, as it would there.  None for a row the chain cannot sample (NaN, +inf, every logit
    -inf): ``Sampler.sample`` then says why."""
    n = len(rows)
    if n == 0:
        return []
    base, which = _one_array(rows)
    args = [s.chain_args() for s in samplers]
    ks = np.fromiter((a[0] for a in args), np.int64, n)
    top_ps = np.fromiter((a[1] for a in args), np.float64, n)
    min_ps = np.fromiter((a[2] for a in args), np.float64, n)
    inv_ts = np.fromiter((a[3] for a in args), np.float32, n)
    us = np.fromiter((s.rng.random() if a[0] != GREEDY else 0.0 for s, a in zip(samplers, args, strict=True)),
                     np.float64, n)
    out = np.empty(n, np.int64)
    if parallel:  # (a parallel region: started from the process's one kernel thread)
        run_on_kernel_thread(lambda: chain_rows(base, which, ks, top_ps, min_ps, inv_ts, us, out))
    else:
        chain_rows_serial(base, which, ks, top_ps, min_ps, inv_ts, us, out)
    return [int(t) if t >= 0 else None for t in out]


def _one_array(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [m, vocab], int64 [n]): the rows as one 2-D array and their indices in it - the array the
    rows are views of when they are (a backend's logits of one step), else a stacked copy."""
    first = rows[0]
    base = _owner(first)
    V = first.shape[0]
    if base.ndim == 2 and base.dtype == np.float32 and base.shape[1] >= V and base.strides[1] == 4:
        start, stride = base.__array_interface__["data"][0], base.strides[0]
        which = []
        for r in rows:
            off = r.__array_interface__["data"][0] - start
            i, rem = divmod(off, stride)
            if _owner(r) is not base or r.dtype != np.float32 or r.ndim != 1 or r.shape[0] != V or r.strides[0] != 4 \
                    or rem or not 0 <= i < base.shape[0]:
                break
            which.append(i)
        else:
            return base[:, :V], np.asarray(which, np.int64)
    return np.stack([np.asarray(r, np.float32) for r in rows]), np.arange(len(rows), dtype=np.int64)


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that ``a`` is a view of, through any chain of views (``a`` itself when it owns its data)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def top_k_filter(ids: np.ndarray, vals: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest-logit candidates (ties at the boundary go to the lowest ids), sorted
    descending.  Positions ascend with id among equal logits (candidates are in id order or sorted by
    logit then id), so ties by position are ties by id.  O(n) selection plus a sort of a few hundred
    items (``kernels.topk``); never a sort of the vocabulary."""
    pos = top_k_positions(vals, k)
    return ids[pos], vals[pos]


def top_p_filter(ids: np.ndarray, vals: np.ndarray, p: float, sorted_desc: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Nucleus: the shortest prefix of the candidates sorted by probability whose total reaches ``p``
    (llama.cpp: keep up to and including the token where the running sum first reaches ``p``).
    Returns the prefix sorted descending.  ``sorted_desc``: the candidates already are (top-k's output),
    so their order is taken as it is."""
    n = vals.shape[0]
    w = _weights(vals, 1.0)  # [n] unnormalized probabilities
    target = p * float(w.sum(dtype=np.float64))
    m = min(n, _NUCLEUS_START)
    while True:
        # Only the m most probable candidates are sorted; if they already hold mass p, the nucleus
        # lies inside them (a full sort is the last resort, for a very flat distribution).
        order = np.arange(m) if sorted_desc else top_k_positions(vals, m)  # the m largest, descending
        cum = np.cumsum(w[order], dtype=np.float64)
        if cum[-1] >= target or m >= n:
            keep = min(int(np.searchsorted(cum, target, side="left")) + 1, m)
            order = order[:keep]
            return ids[order], vals[order]
        m = min(n, m * 8)


def min_p_filter(ids: np.ndarray, vals: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep candidates whose probability is at least ``min_p`` times the top one's (compared in logit
    space, as llama.cpp does: logit >= max_logit + log(min_p)).  Order is preserved."""
    threshold = np.max(vals) + np.float32(math.log(min_p))
    keep = vals >= threshold
    return ids[keep], vals[keep]


def _weights(vals: np.ndarray, temperature: float) -> np.ndarray:
    """Unnormalized softmax of ``vals / temperature`` (float32, the largest is 1); raises when no
    candidate has a finite logit.  float32 is enough for drawing and ~10x faster than float64."""
    mx = vals.max()
    if mx == -np.inf:
        raise ValueError("every logit is -inf")
    # Subtract the maximum first, so nothing overflows.
    return np.exp((vals - mx) * _inverse_temperature(temperature))


def _inverse_temperature(temperature: float) -> np.float32:
    """1 / temperature in float32, capped so that 0 * inf cannot occur."""
    return np.float32(min(1.0 / temperature, 1e30))


def _draw(w: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the position where the running sum of ``w`` [n] passes ``u`` (in [0, 1))
    times the total.  Large ``w`` is searched block by block, so there is no cumsum over all of it."""
    n = w.shape[0]
    if n <= 4 * _DRAW_BLOCK:
        c = np.cumsum(w, dtype=np.float64)
        i = int(np.searchsorted(c, u * c[-1], side="right"))
    else:
        starts = np.arange(0, n, _DRAW_BLOCK)
        cb = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))  # [n_blocks] running block sums
        t = u * cb[-1]
        b = min(int(np.searchsorted(cb, t, side="right")), starts.shape[0] - 1)
        t -= cb[b - 1] if b else 0.0
        c = np.cumsum(w[starts[b] : starts[b] + _DRAW_BLOCK], dtype=np.float64)
        i = int(starts[b]) + int(np.searchsorted(c, t, side="right"))
    if i >= n or w[i] == 0:
        # Rounding put the target at (or past) the very end: take the last token that has weight,
        # never a masked one.
        pos = np.flatnonzero(w[: min(i, n - 1) + 1] > 0)
        i = int(pos[-1]) if pos.shape[0] else int(np.flatnonzero(w > 0)[0])
    return i


def logprobs_of(logits: np.ndarray, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` under ``logits`` [vocab], and the ``top_n`` most likely tokens
    with theirs (descending, ties to the lowest id).  Log-softmax in float64 for stability."""
    z = np.asarray(logits, dtype=np.float64)  # [vocab]
    mx = z.max()
    lse = mx + math.log(float(np.exp(z - mx).sum()))
    lp_token = float(z[token] - lse)
    if top_n <= 0:
        return lp_token, []
    ids = top_k_positions(z, top_n)
    return lp_token, [(int(i), float(z[i] - lse)) for i in ids]
