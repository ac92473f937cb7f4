"""llama.cpp (through llama-cpp-python) as the practical oracle, and distribution metrics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over rows of KL(ref || other) of the next-token distributions."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))


def llama_model(path, n_ctx: int = 1024, flash_attn: bool | None = None, logits_all: bool = True):
    import llama_cpp

    kw = dict(n_ctx=n_ctx, n_threads=2, n_batch=512, logits_all=logits_all, verbose=False)
    if flash_attn is not None:
        kw["flash_attn"] = flash_attn
    return llama_cpp.Llama(str(path), **kw)


def llama_logits(llm, tokens: list[int]) -> np.ndarray:
    """Teacher-forced next-token logits after every prefix: [T, vocab] float32."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def llama_greedy(llm, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation and the logits it chose each token from: [n, vocab]."""
    llm.reset()
    llm.eval(prompt)
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        if not np.isfinite(row).all() or row.std() == 0:  # e.g. a model made without logits_all
            raise RuntimeError("llama.cpp returned no logits for the last position")
        tok = int(np.argmax(row))
        out.append(tok)
        rows.append(row)
        llm.eval([tok])
    return out, np.stack(rows)


@dataclass(frozen=True)
class Divergence:
    index: int  # position in the continuation where the tokens first differ
    ours: int
    theirs: int
    margin: float  # llama.cpp's logit of its token minus its logit of ours


def first_divergence(ours: list[int], theirs: list[int], their_logits: np.ndarray) -> Divergence | None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return Divergence(i, a, b, float(their_logits[i, b] - their_logits[i, a]))
    return None
