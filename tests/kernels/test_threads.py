"""The kernel thread: every parallel kernel of the process starts from one thread, so the process has one
team of OpenMP threads (``kernels.threads.on_kernel_thread`` says why)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
from weaved.kernels.threads import kernel_thread_ident, max_threads, on_kernel_thread, run_on_kernel_thread

# with a pool of one thread numba's regions start no threads, and kernels run on their caller
needs_a_pool = pytest.mark.skipif(max_threads() == 1, reason="numba's pool has one thread")


@needs_a_pool
def test_calls_run_on_one_other_thread_and_nest_without_waiting():
    @on_kernel_thread
    def where(depth: int) -> list[int]:
        inner = where(depth - 1) if depth else []
        return [threading.get_ident(), *inner]

    seen = where(3) + run_on_kernel_thread(lambda: where(1))
    assert set(seen) == {kernel_thread_ident()} != {threading.get_ident()}


def test_raises_the_callers_exception_and_keeps_serving():
    def boom():
        raise KeyError("missing tensor")

    with pytest.raises(KeyError, match="missing tensor"):
        run_on_kernel_thread(boom)
    assert run_on_kernel_thread(lambda: 42) == 42


@needs_a_pool
def test_the_cpu_backend_loads_on_the_kernel_thread(tiny_llama, monkeypatch):
    """Repacking weights runs parallel kernels."""
    from weaved.kernels import matmul

    from weaved.backends import cpu

    where: list[int] = []
    real = matmul.pack_weight

    def spy(*a, **kw):
        where.append(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(matmul, "pack_weight", spy)
    cpu.CPUBackend.from_file(tiny_llama, threads=2)
    assert where and set(where) == {kernel_thread_ident()}


# Three threads stay alive after each ran its work: two stepping a CPU backend (as a daemon's CPU pool
# and its ring pool do) and one sampling rows in parallel (as an engine does) - or, for comparison, two
# calling a parallel kernel undecorated (``__wrapped__``).  It prints how many native threads (not
# Python's) appeared: the OpenMP workers, one fewer than the team size per team.
_SCRIPT = textwrap.dedent("""
    import os, sys, threading
    import numpy as np
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.cpu import CPUBackend
    from weaved.engine.sampling import Sampler, SamplingParams, sample_rows
    from weaved.kernels import elementwise

    def native():
        return set(map(int, os.listdir("/proc/self/task"))) - {t.native_id for t in threading.enumerate()}

    mode, model = sys.argv[1], sys.argv[2]
    before = native()
    be = CPUBackend.from_file(model, threads=2) if mode == "entry-points" else None
    x, w = np.ones((4096, 512), np.float32), np.ones(512, np.float32)

    def step():
        be.forward([SeqChunk(be.new_kv(8), np.arange(4, dtype=np.int32), Logits.LAST)])

    def sample():
        rows = np.random.default_rng(0).standard_normal((4, be.config.vocab_size)).astype(np.float32)
        sample_rows([Sampler(SamplingParams(temperature=0.7)) for _ in range(4)], list(rows), True)

    undecorated = elementwise.rmsnorm.__wrapped__
    work = [step, step, sample] if mode == "entry-points" else [lambda: undecorated(x, w, 1e-5)] * 2
    ran, hold = [], threading.Event()

    def run(fn):
        fn()
        ran.append(1)
        hold.wait()

    threads = [threading.Thread(target=run, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    while len(ran) < len(threads):
        hold.wait(0.01)
    print(len(native() - before))
    hold.set()
""")


def _new_native_threads(mode: str, model) -> int:
    env = {"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode, str(model)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def test_a_process_stepping_and_sampling_from_three_threads_has_one_team_of_kernel_threads(tiny_llama):
    # what the count sees: two threads calling a parallel kernel themselves start two teams
    assert _new_native_threads("direct", tiny_llama) == 2
    assert _new_native_threads("entry-points", tiny_llama) == 1


@needs_a_pool
def test_a_calls_arguments_are_not_kept_once_it_returns():
    """A session's KV must go when its owner drops it (its mapping and file released), not at the next
    call: the kernel thread keeps nothing of a call it has run."""

    class Arg:
        pass

    arg = Arg()
    gone = weakref.ref(arg)
    assert run_on_kernel_thread(functools.partial(id, arg)) == id(arg)
    del arg
    assert gone() is None


@needs_a_pool
def test_a_failed_calls_arguments_are_not_kept_once_it_is_handled():
    """Nor through the exception: it comes back without a reference cycle that would keep the call's
    arguments until the garbage collector runs."""
    import gc

    class Arg:
        pass

    def fail(arg: Arg) -> None:
        raise ValueError("bad shape")

    arg = Arg()
    gone = weakref.ref(arg)
    gc.disable()
    try:
        with pytest.raises(ValueError, match="bad shape"):
            run_on_kernel_thread(functools.partial(fail, arg))
        del arg
        assert gone() is None
    finally:
        gc.enable()


_START_RACE = """
import sys, threading, time
from weaved.kernels import threads as kt

@kt.on_kernel_thread
def inner():
    return "nested"

@kt.on_kernel_thread
def outer():  # an entry point that calls another (the backend's forward, its embedding)
    return inner()

def slow_start():  # the starting thread loses its core after every line of the start
    def tracer(frame, event, arg):
        if frame.f_code is kt._started.__code__:
            return lambda f, e, a: time.sleep(0.2) if e == "line" else None
    sys.settrace(tracer)
    kt.kernel_thread_ident()

threading.Thread(target=slow_start, daemon=True).start()
while kt._kernel_thread is None:  # the first moment another thread can see the kernel thread
    time.sleep(0.0005)
got = []
t = threading.Thread(target=lambda: got.append(outer()), daemon=True)
t.start()
t.join(10)
print(got[0] if got else "hung")
"""


@needs_a_pool
def test_a_thread_that_sees_the_kernel_thread_starting_hands_it_work_that_nests():
    """A job handed over while the starting thread is still inside the start: its nested calls run on
    the kernel thread at once (had the thread been published before its identity, they would have
    been queued behind the job itself, and every call of the process would wait forever)."""
    out = subprocess.run([sys.executable, "-c", _START_RACE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NUMBA_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "nested"


def test_numbas_openmp_layer_comes_first_unless_the_environment_says_otherwise():
    """The thread plan above is OpenMP's (numba's own order would take TBB first where it is installed)."""
    import numba

    if os.environ.get("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue") == "omp tbb workqueue":
        assert numba.config.THREADING_LAYER_PRIORITY == ["omp", "tbb", "workqueue"]
    out = subprocess.run([sys.executable, "-c", "import numba, weaved.kernels.threads; "
                          "print(' '.join(numba.config.THREADING_LAYER_PRIORITY))"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER_PRIORITY"})
    assert out.returncode == 0 and out.stdout.split() == ["omp", "tbb", "workqueue"], out.stderr[-2000:]
