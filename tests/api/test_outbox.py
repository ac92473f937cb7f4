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


def test_events_put_from_another_thread_arrive_in_order_with_one_wake_per_burst(monkeypatch):
    async def main() -> tuple[list[dict], list[dict], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            nonlocal wakes
            wakes += 1
            return real(cb, *args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        q1, q2 = asyncio.Queue(), asyncio.Queue()
        box = outbox_mod.outbox(loop)
        assert outbox_mod.outbox(loop) is box

        def engine() -> None:
            for step in range(3):
                with burst():  # one engine pass: a token for each of two turns
                    box.put(q1, {"step": step})
                    box.put(q2, {"step": step})
            box.put(q1, {"type": "done"})  # outside a burst: wakes at once

        t = threading.Thread(target=engine)
        t.start()
        got1 = [await asyncio.wait_for(q1.get(), 5) for _ in range(4)]
        got2 = [await asyncio.wait_for(q2.get(), 5) for _ in range(3)]
        t.join()
        return got1, got2, wakes

    got1, got2, wakes = asyncio.run(main())
    assert got1 == [{"step": 0}, {"step": 1}, {"step": 2}, {"type": "done"}]
    assert got2 == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert 1 <= wakes <= 4  # at most one per burst and one for the lone event: never one per event
