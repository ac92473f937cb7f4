"""Moving a running turn between engines: ``detach`` at a step boundary, the prefill ``handoff`` and
``on_admit``.  The turn's tokens must be exactly those of a turn that never moved (same backend
arithmetic, batch invariance), and nothing is fed twice."""

from __future__ import annotations

import threading
import time

import pytest

from weaved.backends.cpu import CPUBackend
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import Sequence, SLARank

PROMPT = list(range(40, 70))
N_GEN = 24


@pytest.fixture(scope="module")
def backend(tiny_llama):
    return CPUBackend.from_file(tiny_llama, threads=2)


def _turn(be, events: list, done: threading.Event) -> Sequence:
    def emit(ev):
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    return Sequence("s", be.new_kv(128), list(PROMPT), SamplingParams(max_tokens=N_GEN, temperature=0),
                    SLARank.BACKGROUND, emit=emit)


def _engines(be, n=2):
    lock = threading.Lock()
    cfg = SchedulerConfig(token_budget=64, max_batch=4, prefill_chunk=8)
    return [BatchEngine(f"e{i}", be, cfg, forward_lock=lock) for i in range(n)]


def _reference(be) -> list[int]:
    (eng,) = _engines(be, 1)
    events, done = [], threading.Event()
    seq = _turn(be, events, done)
    eng.submit(seq)
    eng.start()
    try:
        assert done.wait(60)
    finally:
        eng.stop()
    return list(seq.generated)


def test_detach_mid_generation_continues_exactly(backend):
    want = _reference(backend)
    a, b = _engines(backend)
    events, done = [], threading.Event()
    seq = _turn(backend, events, done)
    moved = threading.Event()
    fed_before: list[int] = []

    def arrive(s):
        assert s is seq and not s.status.done
        fed_before.append(s.kv.length)
        b.submit(s)
        moved.set()

    a.submit(seq)
    a.start()
    b.start()
    try:
        deadline = time.monotonic() + 60
        while len(seq.generated) < 5 and time.monotonic() < deadline:
            time.sleep(0.002)
        a.detach("s", arrive)
        assert moved.wait(30)
        assert done.wait(60)
    finally:
        a.stop()
        b.stop()
    assert seq.generated == want
    assert N_GEN > len(fed_before) and 0 < fed_before[0] < len(PROMPT) + N_GEN
    # one prompt, each generated token but the last fed exactly once: nothing was recomputed
    assert seq.kv.length == len(PROMPT) + N_GEN - 1
    assert sum(ev["type"] == "token" for ev in events) == N_GEN
    assert events[-1]["type"] == "done"


def test_detach_of_an_unknown_session_reports_none(backend):
    (a,) = _engines(backend, 1)
    got = []
    ev = threading.Event()
    a.start()
    try:
        a.detach("nobody", lambda s: (got.append(s), ev.set()))
        assert ev.wait(10)
    finally:
        a.stop()
    assert got == [None]


def test_handoff_after_prefill_and_on_admit(backend):
    want = _reference(backend)
    a, b = _engines(backend)
    events, done = [], threading.Event()
    seq = _turn(backend, events, done)
    admitted, handed = [], []

    def handoff(s):
        handed.append((s.kv.length, len(s.generated)))
        s.on_admit = lambda: admitted.append("b")
        b.submit(s)

    seq.on_admit = lambda: admitted.append("a")
    seq.handoff = handoff
    a.submit(seq)
    a.start()
    b.start()
    try:
        assert done.wait(60)
    finally:
        a.stop()
        b.stop()
    assert seq.generated == want
    # it left right after the prefill, with the first token sampled and nothing more fed
    assert handed == [(len(PROMPT), 1)]
    assert admitted == ["a", "b"]
    assert a.counters.tokens_prefilled == len(PROMPT) and b.counters.tokens_prefilled == 0
    assert a.counters.tokens_generated == 1 and b.counters.tokens_generated == N_GEN - 1


def test_failing_handover_fails_only_that_turn(backend):
    a, b = _engines(backend)
    events, done = [], threading.Event()
    seq = _turn(backend, events, done)

    def broken(s):
        raise RuntimeError("no room on the destination")

    seq.handoff = broken
    a.submit(seq)
    a.start()
    try:
        assert done.wait(60)
    finally:
        a.stop()
    assert events[-1]["type"] == "error" and "no room on the destination" in events[-1]["message"]
