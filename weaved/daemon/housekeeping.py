"""The daemon's periodic background work: a thread that calls one function every tick until stopped.

Idle demotion runs here (``Daemon.demote_idle``): a session whose KV sits idle on a GPU pool longer
than the pool's ``idle_demote_s`` gives the device memory back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger("weave.daemon")


class Housekeeper:
    """Calls ``work(time.time())`` every ``tick_s`` seconds in a daemon thread until ``stop``.  An
    exception is logged and the next tick tries again: housekeeping must never die."""

    def __init__(self, work: Callable[[float], object], tick_s: float, name: str = "weave-housekeeping"):
        self._work, self._tick = work, tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def for_idle_demotion(cls, limits: list[float], work: Callable[[float], object]) -> Housekeeper | None:
        """A housekeeper ticking at a quarter of the shortest idle limit (0.05-5 s), or None when no pool
        has a limit."""
        if not limits:
            return None
        return cls(work, min(5.0, max(0.05, min(limits) / 4)))

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self._work(time.time())
            except Exception:
                log.exception("housekeeping failed")

    def stop(self) -> None:
        self._stop.set()


class InlineExecutor:
    """``ThreadPoolExecutor``'s ``submit`` and ``shutdown``, running each job at once in the caller's
    thread: the daemon's background jobs when it runs without threads of its own (a simulation)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future, as a pool would
            f.set_exception(exc)
        return f

    def shutdown(self, wait: bool = True) -> None:
        return None
