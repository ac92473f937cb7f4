"""Where the daemon's Unix socket lives.  Imported by every client command, so it imports nothing heavy."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

SOCKET_NAME = "weave.sock"


def default_socket_path() -> Path:
    """``$WEAVE_SOCKET``, else ``$XDG_RUNTIME_DIR/weave/weave.sock``, else ``~/.weave/weave.sock``.

    A relative ``XDG_RUNTIME_DIR`` is ignored, as the XDG base directory specification asks.
    """
    if env := os.environ.get("WEAVE_SOCKET"):
        return Path(env).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return Path(runtime) / "weave" / SOCKET_NAME
    return Path.home() / ".weave" / SOCKET_NAME


def daemon_starting(socket: str | Path) -> bool:
    """A daemon holds the lock beside ``socket`` (``<socket>.lock``), which ``weave serve`` takes before
    it loads its model and keeps for its life: while nothing answers on the socket yet, it is starting.
    (Asked by taking a shared lock for an instant: an exclusive one held means a daemon.)"""
    try:
        fd = os.open(f"{socket}.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases the shared lock, if taken)
    return False
