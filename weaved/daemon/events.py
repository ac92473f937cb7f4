"""The daemon's event stream (``/v1/events``): placements, migrations, pool notes, as they happen.

Engines and movers publish from their own threads; subscribers are asyncio queues read by the API's
event loop, so a publish hops onto that loop (``call_soon_threadsafe``).  Before the loop is attached
(while the daemon loads) events have no subscriber and are dropped.
"""

from __future__ import annotations

import asyncio
import time

QUEUE_SIZE = 10000  # events a slow subscriber may fall behind by before the queue refuses more


class EventBus:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[asyncio.Queue] = set()

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the subscribers' queues belong to."""
        self._loop = loop

    def publish(self, kind: str, data: dict) -> None:
        """Send ``{"type": kind, "time": now, **data}`` to every subscriber (any thread)."""
        ev = {"type": kind, "time": time.time(), **data}
        loop = self._loop
        if loop is None:
            return
        for q in list(self._subscribers):
            loop.call_soon_threadsafe(q.put_nowait, ev)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)
