"""Engine events into the event loop: every event arrives, in order, and a burst wakes the loop once."""

from __future__ import annotations

import asyncio
import threading

from weaved.api import outbox as outbox_mod
from weaved.bursts import at_burst_end, burst


def test_a_burst_runs_each_waker_once_at_its_end_and_not_outside_one():
    ran: list[str] = []

    def a() -> None:
        ran.append("a")

    assert at_burst_end(a) is False and ran == []  # not in a burst: the caller wakes itself
    with burst():
        assert at_burst_end(a) and at_burst_end(lambda: ran.append("b")) and at_burst_end(a)
        with burst():  # nested: ends with the outer one
            at_burst_end(a)
        assert ran == []
    assert ran == ["a", "b"]

    def broken() -> None:
        raise RuntimeError("a waker that fails")

    with burst():
        at_burst_end(broken)
        at_burst_end(a)
    assert ran == ["a", "b", "a"]  # the failure is logged; the wake-ups after it still run


def _run_engine_bursts(box: outbox_mod.Outbox, q1: asyncio.Queue, q2: asyncio.Queue) -> threading.Thread:
    def engine() -> None:
        for step in range(3):
            with burst():  # one engine pass: a token for each of two turns
                box.put(q1, {"step": step})
                box.put(q2, {"step": step})
        box.put(q1, {"type": "done"})  # outside a burst: wakes at once

    t = threading.Thread(target=engine)
    t.start()
    return t


def test_events_put_from_another_thread_arrive_in_order_with_one_wake_per_burst(monkeypatch):
    rings = 0
    real_ring = outbox_mod._WakePipe.ring

    def counting_ring(self) -> None:
        nonlocal rings
        rings += 1
        real_ring(self)

    monkeypatch.setattr(outbox_mod._WakePipe, "ring", counting_ring)

    async def main() -> tuple[list[dict], list[dict], int]:
        loop = asyncio.get_running_loop()
        threadsafe = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            nonlocal threadsafe
            threadsafe += 1
            return real(cb, *args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        q1, q2 = asyncio.Queue(), asyncio.Queue()
        box = outbox_mod.outbox(loop)
        assert outbox_mod.outbox(loop) is box
        t = _run_engine_bursts(box, q1, q2)
        got1 = [await asyncio.wait_for(q1.get(), 5) for _ in range(4)]
        got2 = [await asyncio.wait_for(q2.get(), 5) for _ in range(3)]
        t.join()
        return got1, got2, threadsafe

    got1, got2, threadsafe = asyncio.run(main())
    assert got1 == [{"step": 0}, {"step": 1}, {"step": 2}, {"type": "done"}]
    assert got2 == [{"step": 0}, {"step": 1}, {"step": 2}]
    # made on the loop's thread, the outbox wakes the loop through its own pipe (a write that keeps the
    # GIL), at most once per burst and once for the lone event: never once per event
    assert 1 <= rings <= 4 and threadsafe == 0


def test_an_outbox_made_off_the_loop_wakes_it_through_call_soon_threadsafe():
    async def main() -> list[dict]:
        loop = asyncio.get_running_loop()
        box = await asyncio.to_thread(outbox_mod.Outbox, loop)  # not on the loop's thread: no pipe
        q1, q2 = asyncio.Queue(), asyncio.Queue()
        t = _run_engine_bursts(box, q1, q2)
        got = [await asyncio.wait_for(q1.get(), 5) for _ in range(4)]
        t.join()
        return got

    assert asyncio.run(main()) == [{"step": 0}, {"step": 1}, {"step": 2}, {"type": "done"}]


def test_events_for_a_closed_loop_are_dropped_and_the_pipe_is_closed_with_its_outbox():
    import gc
    import os

    async def make() -> tuple[outbox_mod.Outbox, int]:
        box = outbox_mod.Outbox(asyncio.get_running_loop())
        return box, box._pipe.r

    box, fd = asyncio.run(make())  # the loop is closed when run() returns
    box.put(asyncio.Queue(), {"late": True})  # nobody listens: dropped, no error
    del box
    gc.collect()
    try:
        os.fstat(fd)
    except OSError:
        pass
    else:
        raise AssertionError("the wake pipe outlived its outbox")


def test_the_wake_up_write_keeps_the_gil():
    """The pipe is rung through ctypes' PyDLL convention (the GIL held across the call): with the GIL
    released, the woken loop would take it and the engine thread would wait for it to come back."""
    import ctypes

    assert outbox_mod._write is not None
    assert outbox_mod._write._flags_ & ctypes._FUNCFLAG_PYTHONAPI
