"""The batch engine on a real (tiny) model: SLA order of events, cancellation, failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from weaved.backends.cpu import CPUBackend
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import Sequence, SLARank


@pytest.fixture(scope="module")
def backend(tiny_llama):
    return CPUBackend.from_file(tiny_llama, threads=2)


def _seq(be, name, rank, log, done, n_prompt=24, max_tokens=8):
    def emit(ev, name=name):
        log.append((name, ev["type"]))
        if ev["type"] in ("done", "error"):
            done[name].set()

    done[name] = threading.Event()
    prompt = list(range(10 + len(done), 10 + len(done) + n_prompt))
    return Sequence(name, be.new_kv(128), prompt, SamplingParams(max_tokens=max_tokens, temperature=0), rank,
                    emit=emit)


def test_interactive_first_token_before_waiting_background_prefills(backend):
    """Pool saturated by background decodes, more background turns waiting: an interactive turn's
    first token comes before any waiting background turn is admitted (order of events only)."""
    log: list[tuple[str, str]] = []
    done: dict[str, threading.Event] = {}
    # one sequence per step, so every waiting turn is visibly queued behind the running ones
    eng = BatchEngine("cpu", backend, SchedulerConfig(token_budget=32, max_batch=2, prefill_chunk=32))
    running = [_seq(backend, f"bg-run{i}", SLARank.BACKGROUND, log, done, max_tokens=40) for i in range(2)]
    for s in running:
        eng.submit(s)
    eng.start()
    try:
        deadline = time.monotonic() + 60  # until the running turns decode
        while ("bg-run0", "token") not in log and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ("bg-run0", "token") in log
        waiting = [_seq(backend, f"bg-wait{i}", SLARank.BACKGROUND, log, done) for i in range(3)]
        for s in waiting:
            eng.submit(s)
        inter = _seq(backend, "inter", SLARank.INTERACTIVE, log, done)
        eng.submit(inter)
        for e in done.values():
            assert e.wait(120)
    finally:
        eng.stop()
    firsts = [name for name, kind in log if kind == "token"]
    order = list(dict.fromkeys(firsts))  # first token of each turn, in order
    assert order.index("inter") < min(order.index(f"bg-wait{i}") for i in range(3)), order
    assert eng.counters.preemptions > 0  # running background decodes were paused for it


def test_cancel_frees_the_slot_and_reserve_failure_fails_one_turn(backend):
    log: list[tuple[str, str]] = []
    done: dict[str, threading.Event] = {}

    def reserve(seq, n):
        if seq.session_id == "doomed":
            raise RuntimeError("KV cap reached for session doomed")

    eng = BatchEngine("cpu", backend, SchedulerConfig(token_budget=64, max_batch=4, prefill_chunk=32),
                      reserve=reserve)
    long = _seq(backend, "long", SLARank.BACKGROUND, log, done, max_tokens=100)
    doomed = _seq(backend, "doomed", SLARank.BACKGROUND, log, done)
    ok = _seq(backend, "ok", SLARank.BACKGROUND, log, done)
    eng.start()
    try:
        for s in (long, doomed, ok):
            eng.submit(s)
        assert done["doomed"].wait(60) and done["ok"].wait(60)
        eng.cancel("long")
        assert done["long"].wait(60)
    finally:
        eng.stop()
    assert doomed.status.value == "failed" and "KV cap" in doomed.error
    assert ok.status.value == "finished" and len(ok.generated) == 8
    assert long.status.value == "cancelled" and len(long.generated) < 100
    assert eng.depth == 0
    assert np.isfinite(ok.kv.data[:, :, :, : ok.kv.length].astype(np.float32)).all()


def test_the_pool_learns_its_pace_and_how_late_its_turns_end_against_their_forecasts(backend):
    """A turn that carries the router's forecast (seconds to first token, per answer token) moves the
    pool's lateness toward its time over the forecast for what it generated (one turn's ratio clipped
    to [0.5, 4]); the pool's pace is a moving mean of its steps' times."""
    now = [0.0]

    class Timed:  # the backend, each forward taking 0.5 s of the engine's clock
        config = backend.config

        def forward(self, chunks):
            now[0] += 0.5
            return backend.forward(chunks)

        def __getattr__(self, name):
            return getattr(backend, name)

    eng = BatchEngine("cpu", Timed(), SchedulerConfig(token_budget=64, max_batch=4, prefill_chunk=64),
                      clock=lambda: now[0])

    def run(name: str, forecast) -> None:
        s = _seq(backend, name, SLARank.BACKGROUND, [], {}, n_prompt=8, max_tokens=4)
        s.arrival, s.forecast = now[0], forecast
        eng.submit(s)
        while not s.status.done:
            eng.run_once()
        assert s.status.name == "FINISHED"

    assert eng.lateness == 1.0 and eng.recent_step_s == 0.0
    run("slow", (0.0, 0.01))  # forecast 4 x 10 ms; it took seconds: clipped to 4
    assert eng.lateness == pytest.approx(0.8 + 0.2 * 4.0) and eng.recent_step_s == pytest.approx(0.5)
    run("unforecast", None)  # no forecast: nothing learned
    assert eng.lateness == pytest.approx(1.6)
    run("early", (0.0, 100.0))  # far quicker than forecast: clipped to 0.5
    assert eng.lateness == pytest.approx(0.8 * 1.6 + 0.2 * 0.5)


def test_a_prompt_of_several_chunks_says_how_far_it_came_before_its_first_token(backend):
    events: dict[str, list[dict]] = {"long": [], "short": []}
    done: dict[str, threading.Event] = {k: threading.Event() for k in events}

    def seq(name, n_prompt):
        def emit(ev):
            events[name].append(ev)
            if ev["type"] in ("done", "error"):
                done[name].set()
        return Sequence(name, backend.new_kv(128), list(range(10, 10 + n_prompt)),
                        SamplingParams(max_tokens=3, temperature=0), SLARank.INTERACTIVE, emit=emit)

    eng = BatchEngine("cpu", backend, SchedulerConfig(token_budget=64, max_batch=2, prefill_chunk=16))
    eng.submit(seq("long", 40))  # chunks of 16, 16 and 8 tokens
    eng.submit(seq("short", 10))  # one chunk
    eng.start()
    try:
        assert all(e.wait(120) for e in done.values())
    finally:
        eng.stop()
    kinds = [ev["type"] for ev in events["long"]]
    assert kinds[:3] == ["progress", "progress", "token"], kinds
    assert [(ev["prefilled"], ev["prompt"]) for ev in events["long"][:2]] == [(16, 40), (32, 40)]
    assert "progress" not in kinds[2:]
    assert [ev["type"] for ev in events["short"]][0] == "token"
    assert not any(ev["type"] == "progress" for ev in events["short"])


def test_the_step_model_follows_a_host_slower_than_its_calibration(backend):
    """Steps that take twice what the pool's step model predicts move the model's factor toward 2 (a
    moving geometric mean); admission then judges interactive turns with the model so scaled, and refuses
    one whose step the calibrated model alone would have let in."""
    from weaved.calibration.cost import Linear, StepCost
    from weaved.engine.admission import Capacity

    cost = StepCost(prefill=Linear(0.01, 0.001, 0.0), decode=Linear(0.01, 0.01, 0.0))
    now = [0.0]

    class Slow:  # the backend, each forward taking twice the model's time on the engine's clock
        config = backend.config

        def forward(self, chunks):
            n_pre = sum(len(c.tokens) for c in chunks if len(c.tokens) > 1)
            rows = sum(1 for c in chunks if len(c.tokens) == 1)
            now[0] += 2 * cost.step_s(n_pre, 0.0, rows, 0.0)
            return backend.forward(chunks)

        def __getattr__(self, name):
            return getattr(backend, name)

    def engine() -> BatchEngine:
        cfg = SchedulerConfig(token_budget=64, max_batch=8, prefill_chunk=64, step_cost=cost, step_target_s=0.08)
        return BatchEngine("cpu", Slow(), cfg, capacity=Capacity(8, 1000.0, 1.0), clock=lambda: now[0])

    def probe(eng: BatchEngine):  # a fourth interactive turn beside three: 10 + 4 x 10 ms by the model
        for i in range(3):
            eng.submit(_seq(backend, f"i{i}", SLARank.INTERACTIVE, [], {}, n_prompt=4))
        return eng.refusal(_seq(backend, "new", SLARank.INTERACTIVE, [], {}, n_prompt=4))

    assert probe(engine()) is None  # as calibrated: 50 ms, within the 80 ms target
    eng = engine()
    s = _seq(backend, "bg", SLARank.BACKGROUND, [], {}, n_prompt=8, max_tokens=70)
    eng.submit(s)
    while not s.status.done:
        eng.run_once()
    assert 1.8 < eng.step_drift.factor <= 2.0 and eng.step_drift.samples > 60
    refused = probe(eng)  # as the host runs it: ~97 ms
    assert refused is not None and "past the 80 ms" in refused.reason


def test_a_cancel_that_lands_during_a_step_samples_nothing_more(backend):
    """A turn cancelled (or its session deleted) while its step runs keeps the rows that step wrote
    but gets no further token: its stream ends with the tokens it had."""
    log: list[tuple[str, str]] = []
    done: dict[str, threading.Event] = {}
    seq = _seq(backend, "cut", SLARank.INTERACTIVE, log, done, max_tokens=50)
    seen: dict[str, int] = {}

    class CancelDuringStep:
        def __getattr__(self, name):
            return getattr(backend, name)

        def forward(self, chunks):
            out = backend.forward(chunks)
            if len(seq.generated) >= 2 and "at" not in seen:  # as a DELETE would, between two steps' checks
                seq.cancel_requested = True
                seen["at"] = len(seq.generated)
            return out

    eng = BatchEngine("cpu", CancelDuringStep(), SchedulerConfig(token_budget=64, max_batch=2, prefill_chunk=32))
    eng.start()
    try:
        eng.submit(seq)
        assert done["cut"].wait(60)
    finally:
        eng.stop()
    assert seq.status.value == "cancelled"
    assert len(seq.generated) == seen["at"]
    assert sum(1 for name, kind in log if kind == "token") == seen["at"]
