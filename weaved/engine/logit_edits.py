"""What a request does to a row of logits before the sampler chain sees it.

In llama.cpp's order: the logit bias, then the penalties (repetition, frequency, presence over the
last ``last_n`` tokens), then the masks (tokens a grammar forbids, end-of-generation tokens before
``min_tokens``).  Each function returns its input untouched when it has nothing to do, else a copy,
so the engine's logits are never modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """``logits`` [vocab] with ``bias`` (token id, added value) pairs added (OpenAI's ``logit_bias``);
    ids past the row are ignored (the request checks them against the vocabulary)."""
    if not bias:
        return logits
    ids = np.fromiter((t for t, _ in bias), np.int64, len(bias))
    vals = np.fromiter((v for _, v in bias), np.float32, len(bias))
    keep = ids < logits.shape[0]
    out = logits.copy()
    np.add.at(out, ids[keep], vals[keep])
    return out


def apply_repetition_penalty(
    logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int
) -> np.ndarray:
    """llama.cpp's repetition penalty alone (see ``apply_penalties``)."""
    return apply_penalties(logits, history, last_n, repeat=penalty)


def apply_penalties(logits: np.ndarray, history: Sequence[int], last_n: int, *, repeat: float = 1.0,
                    frequency: float = 0.0, presence: float = 0.0) -> np.ndarray:
    """llama.cpp's penalties over the last ``last_n`` tokens of ``history`` (-1: all of it, 0: none).

    A token seen ``c`` > 0 times there has a positive logit divided by ``repeat`` and a non-positive
    one multiplied by it (once, however often it occurred), then ``c * frequency + presence``
    subtracted.  Returns ``logits`` itself when there is nothing to do, else a copy.
    """
    if (repeat == 1.0 and frequency == 0.0 and presence == 0.0) or last_n == 0 or len(history) == 0:
        return logits
    window = history if last_n < 0 else history[-last_n:]
    seen, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    inside = (seen >= 0) & (seen < logits.shape[0])
    seen, counts = seen[inside], counts[inside].astype(np.float32)
    out = logits.copy()
    v = out[seen]
    if repeat != 1.0:
        v = np.where(v <= 0, v * np.float32(repeat), v / np.float32(repeat))
    if frequency != 0.0 or presence != 0.0:
        v = v - (counts * np.float32(frequency) + np.float32(presence))
    out[seen] = v
    return out


def apply_mask(logits: np.ndarray, allowed: np.ndarray | None, banned: Iterable[int] = ()) -> np.ndarray:
    """``logits`` with every token outside ``allowed`` (bool [vocab], None: all) and every id in
    ``banned`` set to -inf."""
    banned = [t for t in banned if 0 <= t < logits.shape[0]]
    if allowed is None and not banned:
        return logits
    if allowed is not None and allowed.shape != logits.shape:
        raise ValueError(f"mask of shape {allowed.shape} for logits of shape {logits.shape}")
    out = np.where(allowed, logits, np.float32(-np.inf)) if allowed is not None else logits.copy()
    if banned:
        out[banned] = -np.inf
    return out
