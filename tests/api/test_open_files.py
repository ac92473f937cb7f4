"""The open-files limit: raised to the hard limit at start, and refused accepts logged once a minute."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from weaved.api.open_files import ACCEPT_LOG_EVERY_S, AcceptErrors


def test_the_soft_limit_is_raised_to_the_hard_one():
    code = (
        "import resource\n"
        "from weaved.api.open_files import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "got = raise_open_files_limit()\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got[0] > 64, got\n"
        "assert got[1] == hard\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_refused_accepts_are_one_line_a_minute_and_other_errors_go_to_the_default_handler():
    lines: list[str] = []
    now = [0.0]
    handler = AcceptErrors(lines.append, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    defaults: list[dict] = []
    loop.default_exception_handler = defaults.append  # (what the loop's own handler would log)
    try:
        refused = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
        for _ in range(1000):
            handler(loop, refused)
        assert len(lines) == 1 and "Too many open files" in lines[0] and "open-files limit" in lines[0]
        now[0] += ACCEPT_LOG_EVERY_S
        handler(loop, refused)
        assert len(lines) == 2 and "(1000 refused" in lines[1]  # those since the first line
        other = {"message": "Task exception was never retrieved", "exception": RuntimeError("x")}
        handler(loop, other)
        assert defaults == [other] and len(lines) == 2
    finally:
        loop.close()
