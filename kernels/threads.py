"""The thread budget shared by every parallel kernel, the one thread that starts them
(``on_kernel_thread``), and the CPU's instruction-set features.

Kernels split their work into ``get_threads()`` chunks (the gemm's ranges give up their tail to
threads that finish early: ``_steal``) and run them in numba's pool; the budget is process-wide
(numba's own ``set_num_threads`` is per calling thread, which would make the split depend on which
thread calls).  It can never exceed the pool numba started with (``NUMBA_NUM_THREADS``).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import numba

_threads: int | None = None
T = TypeVar("T")


def max_threads() -> int:
    """Size of numba's thread pool (fixed when numba starts)."""
    return int(numba.config.NUMBA_NUM_THREADS)


def set_threads(n: int) -> None:
    """Use ``n`` threads in parallel kernels (clamped to ``max_threads()``)."""
    global _threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"thread count must be an int >= 1, got {n!r}")
    _threads = min(n, max_threads())


def get_threads() -> int:
    """Threads parallel kernels use: set_threads' value, else the CPUs this process may run on."""
    return _threads or _default_threads()


@functools.cache
def _default_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, max_threads()))


# LLVM feature names whose /proc/cpuinfo spelling differs (we report the cpuinfo spelling)
_CPUINFO_NAMES = {
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq", "avxvnni": "avx_vnni",
    "avx512fp16": "avx512_fp16",
}


@functools.cache
def cpu_features() -> frozenset[str]:
    """Instruction-set features of this CPU as LLVM (hence numba) sees them, e.g.
    ``{"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", ...}`` (cpuinfo spellings)."""
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return frozenset(_CPUINFO_NAMES.get(name, name) for name, on in feats.items() if on)


class _KernelThread:
    """The one thread that runs the process's parallel kernels; see ``on_kernel_thread``."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # (a daemon thread: a Ctrl-C that interrupts a caller's wait does not keep the process for the rest)
        self._thread = threading.Thread(target=self._serve, name="weave-kernels", daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def _serve(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            # dropped before the caller resumes: holding the job until the next one would keep its
            # arguments alive - a session's KV (its mapping and file) must go when its owner drops it
            del fn, box
            done.release()

    def run(self, fn: Callable[[], T]) -> T:
        done = threading.Lock()
        done.acquire()
        box: list = []
        self._jobs.put((fn, box, done))
        del fn  # (a raised exception's traceback holds this frame: it must not keep the job's arguments)
        done.acquire()  # released by the kernel thread once fn has run
        ok, value = box.pop()
        if ok:
            return value
        try:
            raise value
        finally:  # nor the exception itself: exception -> traceback -> this frame -> exception is a cycle
            del value


_kernel_thread: _KernelThread | None = None
_ident = 0  # the kernel thread's get_ident() once started
_start_lock = threading.Lock()


def _reset_after_fork() -> None:  # a forked child has none of its parent's threads
    global _kernel_thread, _ident, _start_lock
    _kernel_thread, _ident, _start_lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _started() -> _KernelThread:
    global _kernel_thread, _ident
    if _kernel_thread is None:
        with _start_lock:
            if _kernel_thread is None:
                started = _KernelThread()
                # its ident first: a thread that sees the thread published may hand it a job at once, and
                # the job's nested calls must find themselves on the kernel thread
                _ident = started.ident
                _kernel_thread = started
    return _kernel_thread


def kernel_thread_ident() -> int:
    """``threading.get_ident()`` of the kernel thread (started on first use)."""
    return _started().ident


def run_on_kernel_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on the kernel thread (at once when called from it, or when numba's pool has one
    thread: its regions start no other threads to keep spinning); its result, or its exception."""
    if threading.get_ident() == _ident or max_threads() == 1:
        return fn()
    return _started().run(fn)


def on_kernel_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a function that runs parallel kernels so that its every call runs on the kernel thread.

    Why one thread: with numba's OpenMP layer, every thread that starts a parallel region gets its own
    libgomp team, and the team lives as long as that thread.  Once the teams' threads together
    outnumber the cores, libgomp stops spinning between regions (its "throttled" spin count) and every
    region pays a futex wake-up: measured on 2 cores, a decode step from an engine thread went from
    4.3 ms to 11 ms when the main thread had run one parallel kernel at load, a daemon under 64 clients
    left a third of a core idle in those wake-ups, and a second thread that had run one forward slowed
    another's single-stream decode by a sixth.  A daemon steps its pools, repacks weights, warms up,
    samples and serves its federation peers from several threads, and tests call kernels from theirs;
    every public function of the kernels that starts a parallel region carries this decorator, and so
    do coarser entry points above them (the CPU backend's forward and its pieces, federation's layer
    runs and partial attention: one hand-off for many kernels), so every region starts from one
    thread and the process has one team.  A call made on the kernel thread runs at once (entry points
    nest); a call from another thread waits for the thread, which runs one caller's call at a time -
    on shared cores that is what the regions would do anyway.  The hand-off is two thread switches
    (~20 us, within the noise of a 7 ms SmolLM2 decode step).
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if threading.get_ident() == _ident:  # (the common case, nested entry points: ~0.1 us)
            return fn(*args, **kwargs)
        return run_on_kernel_thread(functools.partial(fn, *args, **kwargs))

    return call
