"""Events from engine threads to the event loop, one wake-up per burst instead of one per event.

An engine step ends with an event for every sequence in it (a token each): handing each over with its
own ``call_soon_threadsafe`` wakes the loop once per token - a write to its self-pipe from the engine
thread, the GIL handed to the loop thread and back, and on the loop a select and a callback each.  An
``Outbox`` queues events and wakes the loop only when nothing is queued yet, and a thread inside a
``bursts.burst()`` (an engine's pass) wakes it once when the burst ends; the loop then moves everything
queued meanwhile into the requests' queues in one callback, in the order the events were put.

The wake-up itself keeps the GIL.  ``call_soon_threadsafe`` writes to the loop's self-pipe with the GIL
released; the loop thread, woken by that very write, takes the GIL and keeps it while it streams the
step's tokens out, and the engine thread waits for it to come back before it can start its next forward
(a convoy: 6-7 % of the engine thread's time under 64 streaming clients, the write's share of its
samples).  So an outbox wakes its loop through a pipe of its own, written by a libc call made with the
GIL held: the engine thread carries on to its next forward, whose kernels release the GIL, and the
loop's work overlaps it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import weakref
from collections import deque

from weaved.bursts import at_burst_end

_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


def _gil_holding_write():
    """libc ``write(fd, buf, n)`` called without releasing the GIL (ctypes' PyDLL convention), or None
    where the C library cannot be reached this way."""
    try:
        write = ctypes.PyDLL(None).write
    except (AttributeError, OSError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_write = _gil_holding_write()


class _WakePipe:
    """A non-blocking pipe whose read end the loop watches.  Closed when its outbox is collected: by
    then no engine can write to it (every emitter holds the outbox) and the loop is gone (the registry
    keeps an outbox as long as its loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_wake) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            loop.add_reader(self.r, on_wake)
        except (NotImplementedError, RuntimeError):  # a loop that cannot watch descriptors
            self.close()
            raise

    def ring(self) -> None:
        # a full pipe (-1, EAGAIN) already holds a wake-up the loop has not read: nothing is lost
        _write(self.w, b"\0", 1)

    def clear(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


class Outbox:
    """Moves ``(queue, event)`` pairs put from any thread into asyncio queues on ``loop``.  Made on the
    loop's thread (``outbox``) it wakes the loop through its own pipe; elsewhere, or on a loop that
    cannot watch a descriptor, through ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop_ref = weakref.ref(loop)  # the outbox must not keep its loop (the registry's key) alive
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue, dict]] = deque()
        self._armed = False  # a drain is scheduled on the loop and has not started taking items
        self._pipe: _WakePipe | None = None
        if _write is not None and _running_loop() is loop:
            try:
                self._pipe = _WakePipe(loop, self._on_wake)
            except (OSError, NotImplementedError, RuntimeError):
                self._pipe = None
            else:
                weakref.finalize(self, self._pipe.close)

    def put(self, queue: asyncio.Queue, ev: dict) -> None:
        """Any thread.  Dropped silently once the loop is closed: nobody is listening any more."""
        loop = self._loop_ref()
        if loop is None or loop.is_closed():
            return
        with self._lock:
            self._items.append((queue, ev))
            if self._armed:
                return
            self._armed = True
        if not at_burst_end(self._wake):
            self._wake()

    def _wake(self) -> None:
        loop = self._loop_ref()
        if self._pipe is not None and loop is not None and not loop.is_closed():
            self._pipe.ring()
            return
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._items.clear()
                self._armed = False

    def _on_wake(self) -> None:  # the loop's thread: the pipe is readable
        self._pipe.clear()
        self._drain()

    def _drain(self) -> None:  # the loop's thread
        with self._lock:
            items, self._items = self._items, deque()
            self._armed = False
        for queue, ev in items:
            queue.put_nowait(ev)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def outbox(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The loop's outbox (one per loop, made at first use)."""
    with _outboxes_lock:
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = Outbox(loop)
        return box
