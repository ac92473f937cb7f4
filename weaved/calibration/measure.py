"""Measuring a backend's step-time model: timed prefill chunks and decode steps, fitted to ``StepCost``.

A step's time depends on how many tokens it holds and how far back they attend, not on the values in
the KV cache, so each measured sequence starts from a cache filled with random rows up to the wanted
context - no prompt is computed to get there - and is truncated back after each timed step.  Every
point is the median of a few repetitions after a warm-up; the whole measurement takes seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from weaved.backends.base import Backend, Logits, SeqChunk
from weaved.calibration.cost import Linear, StepCost, chunk_token_context
from weaved.kv.cache import KVCache

REPS = {"prefill": 2, "decode": 5}  # timed repetitions per point (decode steps are short and noisier)


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill" | "decode"
    tokens: int  # tokens in the step
    context: int  # positions before each sequence's new tokens
    batch: int  # sequences in the step
    seconds: float  # median

    @property
    def token_context(self) -> float:
        if self.kind == "prefill":
            return chunk_token_context(self.tokens, self.context)
        return self.batch * self.context

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokens": self.tokens, "context": self.context, "batch": self.batch,
                "seconds": self.seconds}


@dataclass
class Measurement:
    cost: StepCost
    points: list[Point] = field(default_factory=list)
    seconds: float = 0.0  # the measurement's own time

    def predicted(self, p: Point) -> float:
        part = self.cost.prefill if p.kind == "prefill" else self.cost.decode
        return part.s(p.tokens, p.token_context)

    def max_error(self) -> float:
        """The fit's largest relative error over the measured points."""
        return max(abs(self.predicted(p) / p.seconds - 1) for p in self.points)


def _kv(be: Backend, context: int, room: int, rng: np.random.Generator) -> KVCache:
    kv = be.new_kv(context + room)
    if context:
        shape = kv.data[:, :, :, :context].shape
        kv.data[:, :, :, :context] = (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(np.float16)
    kv.length = context
    return kv


def _timed(be: Backend, chunks: list[SeqChunk], reps: int) -> float:
    lengths = [c.kv.length for c in chunks]
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        be.forward(chunks)
        if i:
            times.append(time.perf_counter() - t0)
        for c, n in zip(chunks, lengths, strict=True):
            c.kv.truncate(n)
    return statistics.median(times)


def plan(chunk: int, max_batch: int, context: int) -> list[tuple[str, int, int, int]]:
    """(kind, tokens per sequence, context, batch) of every point measured."""
    chunks = sorted({max(16, chunk // 4), max(16, chunk // 2), chunk})
    batches = sorted({1, max(2, max_batch // 4), max_batch})
    out = [("prefill", n, c, 1) for c in (0, context // 2) for n in chunks]
    out += [("decode", 1, c, b) for c in (64, context // 2) for b in batches]
    return out


def measure(be: Backend, *, chunk: int, max_batch: int, context: int = 2048,
            progress: Callable[[int, int, str], None] | None = None, seed: int = 0) -> Measurement:
    """Time ``be`` on prefill chunks up to ``chunk`` tokens and decode batches up to ``max_batch``, at
    contexts up to ``context``; fit the step-time model."""
    t_start = time.perf_counter()
    rng = np.random.default_rng(seed)
    vocab = be.config.vocab_size
    points: list[Point] = []
    todo = plan(chunk, max_batch, context)
    for i, (kind, n, ctx, batch) in enumerate(todo):
        if progress is not None:
            what = f"a prefill of {n} tokens" if kind == "prefill" else f"a decode step of {batch} rows"
            progress(i, len(todo), f"{what} at context {ctx}")
        kvs = [_kv(be, ctx, n, rng) for _ in range(batch)]
        chunks = [SeqChunk(kv, rng.integers(10, min(vocab, 30000), n).astype(np.int32), Logits.LAST) for kv in kvs]
        secs = _timed(be, chunks, REPS[kind])
        for kv in kvs:
            be.release(kv)
        points.append(Point(kind, n * batch, ctx, batch, secs))
    if progress is not None:
        progress(len(todo), len(todo), "fitted")
    cost = StepCost(fit([p for p in points if p.kind == "prefill"]), fit([p for p in points if p.kind == "decode"]))
    return Measurement(cost, points, time.perf_counter() - t_start)


def fit(points: list[Point]) -> Linear:
    """Least squares of relative error, with every coefficient kept non-negative (a negative one is
    dropped and the rest fitted again)."""
    x = np.array([[1.0, p.tokens, p.token_context] for p in points])
    y = np.array([p.seconds for p in points])
    w = 1.0 / y  # relative error: a 10 ms step counts as much as a 1 s one
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = np.maximum(coef, 0.0)
    return Linear(float(full[0]), float(full[1]), float(full[2]))
