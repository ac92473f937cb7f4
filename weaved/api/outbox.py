"""Events from engine threads to the event loop, one wake-up per burst instead of one per event.

An engine step ends with an event for every sequence in it (a token each): handing each over with its
own ``call_soon_threadsafe`` wakes the loop once per token - a write to its self-pipe from the engine
thread, the GIL handed to the loop thread and back, and on the loop a select and a callback each.  An
``Outbox`` queues events and wakes the loop only when nothing is queued yet, and a thread inside a
``bursts.burst()`` (an engine's pass) wakes it once when the burst ends; the loop then moves everything
queued meanwhile into the requests' queues in one callback, in the order the events were put.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from weaved.bursts import at_burst_end

_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


class Outbox:
    """Moves ``(queue, event)`` pairs put from any thread into asyncio queues on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue, dict]] = deque()
        self._armed = False  # a drain is scheduled on the loop and has not started taking items

    def put(self, queue: asyncio.Queue, ev: dict) -> None:
        """Any thread.  Dropped silently once the loop is closed: nobody is listening any more."""
        with self._lock:
            self._items.append((queue, ev))
            if self._armed:
                return
            self._armed = True
        if not at_burst_end(self._wake):
            self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._items.clear()
                self._armed = False

    def _drain(self) -> None:  # the loop's thread
        with self._lock:
            items, self._items = self._items, deque()
            self._armed = False
        for queue, ev in items:
            queue.put_nowait(ev)


def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The loop's outbox (one per loop, made at first use)."""
    with _outboxes_lock:
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = Outbox(loop)
        return box
