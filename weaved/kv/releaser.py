"""One thread that lets go of deleted sessions' files, so the thread that deleted them does not wait.

Dropping the last reference to a deleted KV file is where the kernel frees its blocks.  A session's
blocks lie in one run per (layer, k|v, head), so that is hundreds of extents: about 7 ms for a SmolLM2
session at 1,024 positions or more, measured on ext4 - work an engine thread ending an ephemeral turn
would otherwise do between two steps, while the cores it drives wait.  Releases run in the order they
were queued; ``settle`` waits for those queued so far (the store's ``close`` does, so nothing is left
mapped when the daemon stops).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("weave.kv")


class Releaser:
    """Runs queued calls on its own daemon thread, started at the first ``submit``."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._queued = 0
        self._done = 0
        self._cond = threading.Condition(self._lock)

    def submit(self, fn: Callable[[], object]) -> None:
        with self._lock:
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._q.put(fn)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every call submitted before this one has run; False if ``timeout`` passed first."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            try:
                fn()
            except Exception:  # one failed release must not stop the ones after it
                log.exception("%s: a release failed", self.name)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
