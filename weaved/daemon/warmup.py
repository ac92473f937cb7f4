"""Compiling the host kernels before the first request, and telling whether that compiled anything.

numba compiles a kernel on its first call with new argument types and keeps the machine code in its
disk cache, from which a later process loads it in milliseconds.  With a cold cache (a new machine,
a new version of the kernels) compiling takes about a minute on two cores - which, without a warm-up,
the first request waits for - and leaves LLVM's modules of every compiled kernel resident for the
life of the process: measured on the default model, 850 MB resident after a first turn compiled its
kernels against 350 MB when they came from the cache.  So the daemon runs the step shapes its engines
run (a prompt, a batch of decode rows, the sampler's paths) once at load, counts what that compiled
(``CompileWatch``), and ``weave serve`` starts itself afresh when it compiled anything, to serve from
a process that loaded the kernels from the cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from numba.core import event as numba_event

from weaved.backends.base import Backend, BackendStats, Logits, SeqChunk
from weaved.engine.sampling import Sampler, SamplingParams, logprobs_of, sample_rows

# what a request's sampling most often is (the API's defaults), greedy, and penalties (the row edited
# in numpy first, then the uncompiled chain)
_PARAMS = (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0),
           SamplingParams(temperature=0.0),
           SamplingParams(temperature=0.7, repetition_penalty=1.1, seed=0))
_PROMPT = 12  # tokens of the warm-up's prompts


class CompileWatch(numba_event.Listener):
    """Counts numba's compilations of Weave's kernels (not their cache loads) while installed, from
    any thread.

    ``kernels`` is the number of outermost compilations of functions of Weave's packages (a kernel
    compiled with the functions it calls counts once) and ``seconds`` their time; ``on_first`` is
    called when the first begins.  numba's own helpers (the typed list's constructor and ``append``,
    which it compiles in every process, ~0.1 s) are not counted."""

    def __init__(self, on_first: Callable[[], None] | None = None) -> None:
        self.kernels = 0
        self.seconds = 0.0
        self._on_first = on_first
        self._depth: dict[int, int] = {}  # thread id -> nesting of compilations in flight
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def on_start(self, event) -> None:
        tid = threading.get_ident()
        with self._lock:
            depth = self._depth.get(tid, 0)
            self._depth[tid] = depth + 1
            if depth or not _ours(event):
                return
            self._started[tid] = time.monotonic()
            first = self.kernels == 0
            self.kernels += 1
        if first and self._on_first is not None:
            self._on_first()

    def on_end(self, event) -> None:
        tid = threading.get_ident()
        with self._lock:
            self._depth[tid] -= 1
            if not self._depth[tid] and tid in self._started:
                self.seconds += time.monotonic() - self._started.pop(tid)

    def __enter__(self) -> CompileWatch:
        numba_event.register("numba:compile", self)
        return self

    def __exit__(self, *exc) -> None:
        numba_event.unregister("numba:compile", self)


def _ours(event) -> bool:
    func = getattr(event.data.get("dispatcher"), "py_func", None)
    return getattr(func, "__module__", "").startswith("weaved.")


def warm_up(backend: Backend, vocab: int) -> None:
    """Run the step shapes a pool's engine runs on ``backend`` once, on scratch KV caches (nothing of
    a session is touched): two prompts with their last rows and one with every row (prompt
    log-probabilities), a decode step of both sequences together and one alone, and the sampler's
    paths on their rows (a step's rows together, one row alone, log-probabilities).  The backend's
    ``stats`` are left as they were."""
    kept, backend.stats = backend.stats, BackendStats()  # the warm-up is no step of the pool's
    try:
        _run_shapes(backend, vocab)
    finally:
        backend.stats = kept


def _run_shapes(backend: Backend, vocab: int) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, _PROMPT, dtype=np.int32) for _ in range(2)]
    kvs = [backend.new_kv(2 * _PROMPT) for _ in prompts]
    rows = backend.forward([SeqChunk(kv, p, Logits.LAST) for kv, p in zip(kvs, prompts, strict=True)])
    every = backend.forward([SeqChunk(backend.new_kv(_PROMPT), prompts[0], Logits.ALL)])[0]  # [n, vocab]
    for _ in range(2):
        samplers = [Sampler(p) for p in _PARAMS[:2]]
        nxt = sample_rows(samplers, [r[-1] for r in rows], backend.host_parallel)
        rows = backend.forward([SeqChunk(kv, np.array([t], np.int32), Logits.LAST)
                                for kv, t in zip(kvs, nxt, strict=True)])
    rows = backend.forward([SeqChunk(kvs[0], np.array([nxt[0]], np.int32), Logits.LAST)])
    for p in _PARAMS:
        Sampler(p).sample(rows[0][-1], list(prompts[0]))
    logprobs_of(every[-1], int(prompts[0][-1]), 5)
