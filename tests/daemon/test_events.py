"""The daemon's event stream: the backlog a new subscriber asks for, a subscriber joining as an event goes
out, one that falls behind (a ``lagged`` notice where events were lost), and a reconnection resuming
after the last id it saw."""

from __future__ import annotations

import asyncio
import threading

import pytest

from weaved.daemon import events
from weaved.daemon.events import BACKLOG, EventBus, Subscription
from weaved.errors import InvalidRequest


def _drain(sub) -> list[dict]:
    out = []
    while not sub.queue.empty() or sub.dropped:
        coro = sub.get()
        try:
            coro.send(None)
        except StopIteration as e:  # (nothing to wait for: each get returns at once)
            out.append(e.value)
    return out


def test_events_keep_a_backlog_for_new_subscribers():
    bus = EventBus()
    for i in range(BACKLOG + 5):  # published while nobody listens (e.g. while the daemon loads)
        bus.publish("placement", {"n": i})

    async def main() -> tuple[list[int], list[int]]:
        bus.attach_loop(asyncio.get_running_loop())
        fresh, late = bus.subscribe(), bus.subscribe(backlog=3)
        bus.publish("placement", {"n": -1})
        await asyncio.sleep(0)
        return [ev["n"] for _, ev in _drain(fresh)], [ev["n"] for _, ev in _drain(late)]

    fresh, late = asyncio.run(main())
    assert fresh == [-1] and late == [BACKLOG + 2, BACKLOG + 3, BACKLOG + 4, -1]


def test_a_subscriber_that_falls_behind_is_told_how_many_events_it_lost_where_it_lost_them(monkeypatch):
    monkeypatch.setattr(events, "QUEUE_SIZE", 3)
    bus = EventBus()

    async def main() -> list[tuple]:
        bus.attach_loop(asyncio.get_running_loop())
        sub = bus.subscribe()
        for i in range(10):
            bus.publish("placement", {"n": i})
        await asyncio.sleep(0)
        got = [(ev["type"], ev.get("n", ev.get("dropped"))) for _, ev in _drain(sub)]
        bus.publish("placement", {"n": 10})  # read up: events reach it again
        await asyncio.sleep(0)
        return got + [(ev["type"], ev["n"]) for _, ev in _drain(sub)]

    assert asyncio.run(main()) == [("placement", 0), ("placement", 1), ("placement", 2), ("lagged", 7),
                                   ("placement", 10)]


def test_a_reconnecting_subscriber_resumes_after_the_last_event_it_saw():
    bus = EventBus()
    ids = []

    async def main() -> None:
        bus.attach_loop(asyncio.get_running_loop())
        first = bus.subscribe()
        for i in range(5):
            bus.publish("placement", {"n": i})
        await asyncio.sleep(0)
        ids.extend(i for i, _ in _drain(first))

    asyncio.run(main())
    assert len(set(ids)) == 5
    again = bus.subscribe(backlog=BACKLOG, after=ids[1])  # the id wins over the backlog: nothing twice
    assert [ev["n"] for _, ev in _drain(again)] == [2, 3, 4]
    assert _drain(bus.subscribe(after=ids[-1])) == []
    for i in range(5, BACKLOG + 10):  # the backlog moves past what the client saw
        bus.publish("placement", {"n": i})
    got = _drain(bus.subscribe(after=ids[-1]))
    assert got[0][0] is None and got[0][1]["type"] == "lagged" and got[0][1]["dropped"] == 5
    assert [ev["n"] for _, ev in got[1:]] == list(range(10, BACKLOG + 10))
    restarted = _drain(EventBus().subscribe(after=ids[-1]))  # another run of the daemon: not known what was lost
    assert restarted == [(None, restarted[0][1])] and restarted[0][1]["dropped"] is None
    for bad in ("junk", f"{bus.run}-x", f"{bus.run}-{10 ** 6}"):
        with pytest.raises(InvalidRequest, match="Last-Event-ID"):
            bus.subscribe(after=bad)


def test_a_subscriber_joining_while_an_event_goes_out_gets_it_once():
    """A subscriber asking for the backlog as an event is being sent gets that event once: from the
    backlog or live, never both (its queue joins in the same step as the backlog is read)."""
    bus = EventBus()
    joined: list = []

    class JoinsAsItIsRead(set):  # another thread subscribes while the event is being sent out
        def __iter__(self):
            if not joined:
                t = threading.Thread(target=lambda: joined.append(bus.subscribe(backlog=5)))
                t.start()
                t.join(0.3)  # (it waits for the bus's lock while the event goes out)
                joined.append(t)
            return super().__iter__()

    async def main() -> list:
        bus.attach_loop(asyncio.get_running_loop())
        bus._subscribers = JoinsAsItIsRead()
        bus.publish("placement", {"n": 1})
        thread = next(x for x in joined if isinstance(x, threading.Thread))
        thread.join(10)
        await asyncio.sleep(0.05)
        sub = next(x for x in joined if isinstance(x, Subscription))
        return [ev["n"] for _, ev in _drain(sub)]

    assert asyncio.run(main()) == [1]
