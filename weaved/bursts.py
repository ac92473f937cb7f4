"""Work a thread does in bursts, with wake-ups of other threads deferred to the burst's end.

An engine step samples a token for every sequence in it and emits an event for each; waking the event
loop for each one costs a write to its self-pipe and, worse, a hand-over of the GIL to the loop thread
and back - per token.  Inside ``burst()`` a waker registered with ``at_burst_end`` runs once, when the
burst ends (on the same thread), instead of at once.  Outside a burst ``at_burst_end`` returns False
and the caller wakes now.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()
log = logging.getLogger("weave.bursts")


@contextmanager
def burst() -> Iterator[None]:
    """Defer this thread's ``at_burst_end`` callbacks until the block ends; they then run in the order
    first registered, each once.  Nested bursts end with the outermost."""
    if getattr(_local, "pending", None) is not None:
        yield
        return
    _local.pending = {}
    try:
        yield
    finally:
        pending, _local.pending = _local.pending, None
        for fn in pending:
            try:
                fn()
            except Exception:  # one failed wake-up must not keep the others' listeners waiting
                log.exception("a deferred wake-up failed")


def at_burst_end(fn: Callable[[], object]) -> bool:
    """Run ``fn`` when this thread's current burst ends (once however often it is registered); False,
    and nothing registered, when the thread is not in a burst."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        return False
    pending[fn] = None
    return True
