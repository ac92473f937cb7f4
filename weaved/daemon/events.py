"""The daemon's event stream (``/v1/events``): placements, migrations, pool notes, as they happen.

Engines and movers publish from their own threads; subscribers are asyncio queues read by the API's
event loop, so a publish hops onto that loop (``call_soon_threadsafe``).  The last ``BACKLOG`` events are
kept, so a new subscriber may start with what just happened (``/v1/events?backlog=N``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

QUEUE_SIZE = 10000  # events a slow subscriber may fall behind by before the queue refuses more
BACKLOG = 200  # recent events kept for a new subscriber that asks for them (weave top's first screen)


class EventBus:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._recent: deque[dict] = deque(maxlen=BACKLOG)
        self._lock = threading.Lock()

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the subscribers' queues belong to."""
        self._loop = loop

    def publish(self, kind: str, data: dict) -> None:
        """Send ``{"type": kind, "time": now, **data}`` to every subscriber (any thread)."""
        ev = {"type": kind, "time": time.time(), **data}
        loop = self._loop
        with self._lock:  # (the backlog and the live queues in one step: a subscriber joining now gets the
            # event once, from one or the other, and every queue gets the events in the backlog's order)
            self._recent.append(ev)
            if loop is not None:
                for q in self._subscribers:
                    loop.call_soon_threadsafe(q.put_nowait, ev)

    def subscribe(self, backlog: int = 0) -> asyncio.Queue:
        """A queue of the events from now on, after the last ``backlog`` (at most ``BACKLOG``) before it
        (call on the subscribers' loop)."""
        q: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_SIZE)
        with self._lock:
            for ev in list(self._recent)[-backlog:] if backlog > 0 else []:
                q.put_nowait(ev)
            self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subscribers.discard(q)
