"""The thread budget shared by every parallel kernel, and the CPU's instruction-set features.

Kernels split their work into ``get_threads()`` chunks (the gemm's ranges give up their tail to
threads that finish early: ``_steal``) and run them in numba's pool; the budget is process-wide
(numba's own ``set_num_threads`` is per calling thread, which would make the split depend on which
thread calls).  It can never exceed the pool numba started with (``NUMBA_NUM_THREADS``).
"""

from __future__ import annotations

import functools
import os
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


def in_own_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a short-lived thread and return its result (or raise its exception).

    Why: with numba's OpenMP layer, every thread that starts a parallel region gets its own libgomp
    team, and the team lives as long as that thread.  Once the teams' threads together outnumber the
    cores, libgomp stops spinning between regions (its "throttled" spin count) and every region pays
    a futex wake-up: measured on 2 cores, a decode step from an engine thread went from 4.3 ms to
    11 ms when the main thread had run one parallel kernel at load, and a daemon under 64 clients
    left a third of a core idle in those wake-ups.  Running one-off parallel work (repacking weights,
    the daemon's warm-up and calibration at load) in a thread that then exits leaves the team to the
    thread that steps the model.
    """
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))

    # (a daemon thread: a Ctrl-C that interrupts the caller's wait does not keep the process for the rest)
    t = threading.Thread(target=run, name="weave-kernels-once", daemon=True)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value
