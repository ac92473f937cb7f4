"""The daemon's event stream (``/v1/events``): placements, migrations, pool notes, as they happen.

Engines and movers publish from their own threads; subscribers are asyncio queues read by the API's
event loop, so a publish hops onto that loop (``call_soon_threadsafe``).  The last ``BACKLOG`` events are
kept, so a new subscriber may start with what just happened (``/v1/events?backlog=N``).

Every event has an id, ``<run>-<n>``: the daemon's run (a random token drawn at start) and the event's
number in it.  A client that reconnects with the last id it saw (SSE's ``Last-Event-ID``) gets the events
after it that the backlog still holds.  Events a subscriber cannot get - it fell ``QUEUE_SIZE`` behind, or
reconnected past what the backlog holds, or across a restart - are never skipped silently: a ``lagged``
event (``dropped``: how many, null where unknown) stands where they were.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from weaved.errors import InvalidRequest

QUEUE_SIZE = 10000  # events a slow subscriber may fall behind by before the next ones are counted as lost
BACKLOG = 200  # recent events kept for a new subscriber that asks for them (weave top's first screen)


def lagged(dropped: int | None, **extra) -> tuple[None, dict]:
    """The notice standing for events a subscriber did not get (it has no id: a reconnection resumes
    after the last real event seen)."""
    return None, {"type": "lagged", "time": time.time(), "dropped": dropped, **extra}


@dataclass(eq=False)
class Subscription:
    """One subscriber's events, ``(id, event)`` in order.  Once its queue is full the events that do not
    fit are counted, and a ``lagged`` notice with the count comes in their place when the subscriber has
    read the rest (the queue is only ever touched on the subscribers' loop)."""

    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=QUEUE_SIZE))
    dropped: int = 0

    def offer(self, item: tuple[str | None, dict]) -> None:
        if self.dropped or self.queue.full():
            self.dropped += 1
        else:
            self.queue.put_nowait(item)

    async def get(self) -> tuple[str | None, dict]:
        """The next event and its id; waits for one."""
        if self.dropped and self.queue.empty():
            n, self.dropped = self.dropped, 0
            return lagged(n)
        return await self.queue.get()


class EventBus:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribers: set[Subscription] = set()
        self._recent: deque[tuple[int, dict]] = deque(maxlen=BACKLOG)
        self._lock = threading.Lock()
        self.run = secrets.token_hex(4)  # an id from another run of the daemon names nothing kept here
        self._n = 0

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the subscribers' queues belong to."""
        self._loop = loop

    def _id(self, n: int) -> str:
        return f"{self.run}-{n}"

    def publish(self, kind: str, data: dict) -> None:
        """Send ``{"type": kind, "time": now, **data}`` to every subscriber (any thread)."""
        ev = {"type": kind, "time": time.time(), **data}
        loop = self._loop
        with self._lock:  # (the backlog and the live queues in one step: a subscriber joining now gets the
            # event once, from one or the other, and every queue gets the events in the backlog's order)
            self._n += 1
            self._recent.append((self._n, ev))
            item = (self._id(self._n), ev)
            if loop is not None:
                try:
                    for sub in self._subscribers:
                        loop.call_soon_threadsafe(sub.offer, item)
                except RuntimeError:  # the loop is closed (the API has stopped): nobody reads any more
                    self._subscribers.clear()

    def subscribe(self, backlog: int = 0, after: str | None = None) -> Subscription:
        """The events from now on, after the last ``backlog`` (at most ``BACKLOG``) before them - or, with
        ``after`` (a reconnecting client's ``Last-Event-ID``), after that event (call on the subscribers'
        loop).  An ``after`` that names no event of this run is a 400."""
        sub = Subscription()
        with self._lock:
            for item in self._since(after) if after is not None else self._last(backlog):
                sub.queue.put_nowait(item)
            self._subscribers.add(sub)
        return sub

    def _last(self, backlog: int) -> list[tuple[str | None, dict]]:
        kept = list(self._recent)[-backlog:] if backlog > 0 else []
        return [(self._id(n), ev) for n, ev in kept]

    def _since(self, after: str) -> list[tuple[str | None, dict]]:
        run, _, n = after.rpartition("-")
        if not run or not n.isdigit():
            raise InvalidRequest(f"Last-Event-ID {after!r} is not an event id of this daemon ('<run>-<n>')",
                                 param="Last-Event-ID")
        if run != self.run:  # the daemon restarted since: what the client missed is not known
            return [lagged(None, restarted=True), *self._last(BACKLOG)]
        last = int(n)
        if last > self._n:
            raise InvalidRequest(f"Last-Event-ID {after!r} names an event not sent yet", param="Last-Event-ID")
        first = self._recent[0][0] if self._recent else self._n + 1
        out: list[tuple[str | None, dict]] = [lagged(first - last - 1)] if first > last + 1 else []
        return out + [(self._id(m), ev) for m, ev in self._recent if m > last]

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(sub)
