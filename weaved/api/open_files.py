"""The daemon's open-files limit: every client connection is a descriptor.

A shell's soft limit is often 1,024 while the hard limit allows far more; a daemon past its soft limit
cannot accept a connection (``EMFILE``), and asyncio logs a traceback for every refused accept -
thousands a second while the clients retry.  So the daemon raises its soft limit to the hard one at
start (as other servers do), and a refused accept is logged as one line a minute that says what to do.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable

ACCEPT_LOG_EVERY_S = 60.0


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where it is lower; the (soft, hard) limits then."""
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != inf and (hard == inf or soft < hard):
        target = hard if hard != inf else max(soft, 1 << 20)  # (Linux's usual per-process ceiling)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


class AcceptErrors:
    """An event loop's exception handler that turns refused accepts (no descriptor left) into one log line
    a minute with the count; everything else goes to the loop's default handler."""

    def __init__(self, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.log = log
        self.clock = clock
        self.refused = 0  # since the last line
        self._last: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and "accept" in str(context.get("message", ""))):
            loop.default_exception_handler(context)
            return
        self.refused += 1
        now = self.clock()
        if self._last is not None and now - self._last < ACCEPT_LOG_EVERY_S:
            return
        self._last = now
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.log(f"cannot accept connections: {exc.strerror or exc} ({self.refused} refused; the open-files "
                 f"limit is {soft}): clients wait until connections close; raise the limit (ulimit -n, or "
                 f"LimitNOFILE= for a service) to serve more at once")
        self.refused = 0
