"""The benchmark workload, written once for both sides against the ``Engine`` interface.

Timing rules (identical on both sides):
- wall clock (``time.perf_counter``) around the engine calls, Python loop included;
- decode loops feed back the greedy argmax of each step's logits, and the argmax is inside the
  timed region (it is part of producing a token);
- every measurement runs once unrecorded (warm-up: pages in weights, compiles, allocates) and then
  ``cfg.reps`` times; the reported figure is the median;
- repetitions rewind a sequence with ``truncate`` instead of re-running its prompt, so the 2,000
  token context is prefilled once per side, not once per repetition.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from weaved.bench import KEYS, BenchConfig, batch_size

Progress = Callable[[str], None]


class Engine(Protocol):
    """One side of the benchmark: ``n_seqs`` sequences with their own KV, positions tracked inside."""

    def open(self, n_seqs: int, capacity: int) -> None:
        """Start fresh: ``n_seqs`` empty sequences with room for ``capacity`` positions each."""

    def prefill(self, seqs: Sequence[int], prompts: Sequence[Sequence[int]], want_logits: bool) -> list[int]:
        """Append each prompt to its sequence in one forward call; the argmax of each sequence's last
        logits (an empty list when ``want_logits`` is false)."""

    def step(self, tokens: Sequence[int]) -> list[int]:
        """Append one token to every open sequence in one forward call; the argmax per sequence."""

    def truncate(self, seq: int, length: int) -> None:
        """Forget positions ``length ...`` of ``seq``."""


def filler_text(n_words: int = 12000) -> str:
    """Deterministic, varied English-like text (content does not matter for speed)."""
    rng = np.random.default_rng(1234)
    words = (
        "the model reads a long report about rivers mountains cities markets weather trains "
        "music history science cooking gardens oceans stars software bridges schools games "
        "and then writes careful notes for every section while counting each number from "
        "one to ninety with small remarks on colour shape sound distance and time"
    ).split()
    out = []
    for i in range(n_words):
        out.append(words[rng.integers(len(words))])
        if i % 17 == 16:
            out.append(f"({i}).")
    return " ".join(out)


def filler_tokens(model: os.PathLike | str, n: int) -> list[int]:
    """The first ``n`` tokens of the filler text under the model's own tokenizer."""
    from weaved.model.tokenizer import Tokenizer

    tokens = Tokenizer(model).encode(filler_text(), add_bos=False)
    if len(tokens) < n:
        raise ValueError(f"filler text gives {len(tokens)} tokens, the workload needs {n}")
    return [int(t) for t in tokens[:n]]


def _prefill_long(engine: Engine, seq: int, prompt: Sequence[int], n_batch: int) -> int:
    """Prefill one prompt in ``n_batch`` pieces (logits for the last piece only)."""
    nxt: list[int] = []
    for s in range(0, len(prompt), n_batch):
        last = s + n_batch >= len(prompt)
        nxt = engine.prefill([seq], [prompt[s : s + n_batch]], want_logits=last)
    return nxt[0]


def _decode(engine: Engine, first: int, n: int) -> float:
    """Seconds to decode ``n`` greedy tokens on sequence 0, starting by feeding ``first``."""
    tok = first
    t0 = time.perf_counter()
    for _ in range(n):
        tok = engine.step([tok])[0]
    return time.perf_counter() - t0


def _reps(cfg: BenchConfig, progress: Progress, key: str, once: Callable[[], float]) -> float:
    once()  # warm-up, unrecorded
    xs = []
    for r in range(cfg.reps):
        xs.append(once())
        progress(f"{key} rep {r + 1}/{cfg.reps}: {xs[-1]:.1f} tok/s")
    return statistics.median(xs)


def _prefill_tps(engine: Engine, cfg: BenchConfig, tokens: Sequence[int], progress: Progress) -> float:
    prompt = tokens[: cfg.n_prefill]
    engine.open(1, cfg.n_prefill)

    def once() -> float:
        engine.truncate(0, 0)
        t0 = time.perf_counter()
        engine.prefill([0], [prompt], want_logits=True)
        return len(prompt) / (time.perf_counter() - t0)

    return _reps(cfg, progress, "prefill_tps", once)


def _single_stream_tps(
    engine: Engine, cfg: BenchConfig, tokens: Sequence[int], progress: Progress, key: str, n_ctx: int
) -> tuple[float, float]:
    """(decode tokens/s after an ``n_ctx``-token context, the rate that context was prefilled at)."""
    engine.open(1, n_ctx + cfg.n_gen + 1)
    if n_ctx > cfg.n_batch:
        progress(f"{key}: prefilling a {n_ctx}-token context")
    t0 = time.perf_counter()
    first = _prefill_long(engine, 0, tokens[:n_ctx], cfg.n_batch)
    prefill_tps = n_ctx / (time.perf_counter() - t0)
    if n_ctx > cfg.n_batch:
        progress(f"{key}: prefilled at {prefill_tps:.1f} tok/s")

    def once() -> float:
        engine.truncate(0, n_ctx)
        return cfg.n_gen / _decode(engine, first, cfg.n_gen)

    return _reps(cfg, progress, key, once), prefill_tps


def _batch_tps(
    engine: Engine, cfg: BenchConfig, tokens: Sequence[int], progress: Progress, key: str
) -> float:
    B = batch_size(key)
    assert B is not None
    n_p = cfg.n_batch_prompt
    engine.open(B, n_p + cfg.batch_steps + 1)
    # Distinct prompts, packed into forward calls of at most n_batch tokens.
    prompts = [tokens[(i * n_p) % (len(tokens) - n_p) :][:n_p] for i in range(B)]
    per_call = max(1, cfg.n_batch // n_p)
    first: list[int] = []
    for s0 in range(0, B, per_call):
        seqs = list(range(s0, min(B, s0 + per_call)))
        first += engine.prefill(seqs, [prompts[s] for s in seqs], want_logits=True)

    def once() -> float:
        for s in range(B):
            engine.truncate(s, n_p)
        cur = first
        t0 = time.perf_counter()
        for _ in range(cfg.batch_steps):
            cur = engine.step(cur)
        return B * cfg.batch_steps / (time.perf_counter() - t0)

    return _reps(cfg, progress, key, once)


def measure(engine: Engine, cfg: BenchConfig, tokens: Sequence[int], progress: Progress) -> dict[str, float]:
    """Run the selected measurements on ``engine``; ``{key: tokens/s}`` in ``KEYS`` order (with
    ``prefill_8k_tps`` after ``decode_8k_tps``, which measures it)."""
    out: dict[str, float] = {}
    for key in (k for k in KEYS if k in cfg.keys):
        progress(f"{key} ...")
        if key == "prefill_tps":
            out[key] = _prefill_tps(engine, cfg, tokens, progress)
        elif key == "decode_tps":
            out[key] = _single_stream_tps(engine, cfg, tokens, progress, key, cfg.n_short)[0]
        elif key == "decode_2k_tps":
            out[key] = _single_stream_tps(engine, cfg, tokens, progress, key, cfg.n_long)[0]
        elif key == "decode_8k_tps":
            out[key], out["prefill_8k_tps"] = _single_stream_tps(engine, cfg, tokens, progress, key, cfg.n_longer)
        else:
            out[key] = _batch_tps(engine, cfg, tokens, progress, key)
    return out


def resident_mb() -> float:
    """This process's resident memory in MB: what each side reports after loading and at its end."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def memory_after_load() -> dict[str, float]:
    """What each side reports right after loading: ``rss_mb`` and, where the kernel says, ``rss_anon_mb``."""
    anon = anonymous_mb()
    return {"rss_mb": resident_mb(), **({} if anon is None else {"rss_anon_mb": anon})}


def anonymous_mb() -> float | None:
    """This process's resident memory that is its own (``RssAnon``: not the clean pages of mapped files,
    which the page cache holds and the kernel may drop): a side that keeps the model file mapped beside
    its repacked weights counts the file's pages in its resident figure, one that let them go does not.
    None where the kernel does not say (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def stderr_progress(side: str) -> Progress:
    def progress(msg: str) -> None:
        print(f"[{side}] {msg}", file=sys.stderr, flush=True)

    return progress
