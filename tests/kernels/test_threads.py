"""``in_own_thread``: one-off parallel work runs in a thread that exits, with its result or error."""

from __future__ import annotations

import threading

import pytest
from weaved.kernels.threads import in_own_thread


def test_runs_in_another_thread_that_is_gone_afterwards():
    seen: list[threading.Thread] = []
    assert in_own_thread(lambda: seen.append(threading.current_thread()) or 42) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_raises_the_callers_exception():
    def boom():
        raise KeyError("missing tensor")

    with pytest.raises(KeyError, match="missing tensor"):
        in_own_thread(boom)


def test_the_cpu_backend_loads_in_a_thread_of_its_own(tiny_llama, monkeypatch):
    """Repacking weights runs parallel kernels: it must not make the constructing thread an OpenMP
    master (kernels.threads.in_own_thread says why)."""
    from weaved.backends.cpu import CPUBackend

    where: list[threading.Thread] = []
    real = CPUBackend._load

    def spy(self, *a):
        where.append(threading.current_thread())
        return real(self, *a)

    monkeypatch.setattr(CPUBackend, "_load", spy)
    CPUBackend.from_file(tiny_llama, threads=2)
    assert where and where[0] is not threading.current_thread()
