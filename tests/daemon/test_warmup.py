"""``CompileWatch`` counts numba's compilations of Weave's functions - once per new signature, the
functions they call included in it - and nothing else; ``warm_up`` leaves no trace in the backend."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numba import njit
from weaved.kernels.threads import kernel_thread_ident, max_threads

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.daemon.warmup import CompileWatch, warm_up


def _compiled(module: str, source: str, name: str):
    """A fresh function (never compiled, never cached) that looks defined in ``module``."""
    ns = {"__name__": module, "njit": njit}
    exec(source, ns)
    return ns[name]


def test_the_watch_counts_new_signatures_of_weaves_functions_once_each():
    helper = _compiled("weaved.probe", "@njit\ndef inner(x):\n    return x * 2\n", "inner")
    ns_src = "def outer(x):\n    return inner(x) + 1\n"
    outer = _compiled("weaved.probe", ns_src, "outer")
    outer.__globals__["inner"] = helper
    outer = njit(outer)
    firsts = []
    with CompileWatch(on_first=lambda: firsts.append(1)) as w:
        assert outer(1) == 3
        assert (w.kernels, len(firsts)) == (1, 1)  # inner compiled inside outer's compilation: one
        assert outer(2) == 5
        assert w.kernels == 1  # the same signature: no compilation
        assert outer(1.5) == 4.0
        assert (w.kernels, len(firsts)) == (2, 1)
        assert w.seconds > 0
    assert outer(np.int8(1)) == 3  # uninstalled: not counted
    assert w.kernels == 2


def test_the_watch_leaves_out_functions_of_other_packages_and_counts_other_threads():
    theirs = njit(_compiled("elsewhere.mod", "def f(x):\n    return x - 1\n", "f"))
    ours = njit(_compiled("weaved.probe2", "def g(x):\n    return x + 2\n", "g"))
    with CompileWatch() as w:
        assert theirs(3) == 2
        assert w.kernels == 0
        t = threading.Thread(target=ours, args=(1,))
        t.start()
        t.join()
        assert w.kernels == 1


def test_warm_up_touches_no_state_a_session_sees(tiny_qwen3):
    """The same prompt's logits before and after a warm-up, on a fresh cache: bit-identical."""
    be = CPUBackend.from_file(tiny_qwen3)
    prompt = np.arange(3, 19, dtype=np.int32)
    before = be.forward([SeqChunk(be.new_kv(32), prompt, Logits.ALL)])[0].copy()
    stats = be.stats
    steps = stats.steps
    warm_up(be, be.config.vocab_size)
    assert be.stats is stats and stats.steps == steps  # no step of a pool's
    after = be.forward([SeqChunk(be.new_kv(32), prompt, Logits.ALL)])[0]
    np.testing.assert_array_equal(before, after)


@pytest.mark.skipif(max_threads() == 1, reason="numba's pool has one thread: kernels run on their caller")
def test_loading_a_daemon_runs_its_kernels_on_the_kernel_thread(tiny_llama, tmp_path, monkeypatch):
    """The warm-up and the calibration step the model at load, from the loading thread: their kernels run
    on the process's kernel thread, where the engine's steps run too.  A thread that has run a parallel
    kernel keeps its own team of kernel threads for its life, and with two teams on the cores the
    engine's regions stop spinning and sleep at every boundary (kernels.threads.on_kernel_thread)."""
    from weaved.config.load import load_profile
    from weaved.daemon.core import Daemon

    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))  # (calibrated afresh: it steps the model)
    where: list[int] = []
    real = CPUBackend.embed  # (called by each forward, on the thread the forward runs on)

    def spy(self, ids):
        where.append(threading.get_ident())
        return real(self, ids)

    monkeypatch.setattr(CPUBackend, "embed", spy)
    d = Daemon(load_profile("cpu-only"), tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None)
    said: list[str] = []
    d.load(progress=said.append)
    try:
        assert any("calibrat" in m for m in said) and len(where) > 10  # warmed up and calibrated here
        assert set(where) == {kernel_thread_ident()} != {threading.get_ident()}
    finally:
        d.shutdown()
