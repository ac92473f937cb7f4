"""The lock a daemon holds beside its socket (``<socket>.lock``) from the moment ``weave serve`` starts.

Two daemons starting at once cannot both decide the socket is stale, and a client that finds no socket
can tell a daemon still starting (the lock is held: it waits) from none.  Kept apart from the server
(whose imports take most of a second) so that ``weave serve`` takes it before anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class ServerError(Exception):
    """The server cannot start as asked (the message says why and what to do)."""


def hold_socket_lock(path: Path) -> int:
    """Hold an exclusive lock beside the socket (``<socket>.lock``) from before the model loads for the
    daemon's life, so that two daemons starting at once cannot both decide the socket is stale, and so
    that a client finding no socket can tell a daemon that is still starting (the lock is held: it
    waits) from none (``weaved.cli.socket_path.daemon_starting``).  The file says ``starting <pid>``,
    then ``serving <pid>`` (``mark_serving``).  It stays after the daemon exits (removing it would race);
    the lock goes with the process."""
    make_socket_dir(path.parent)
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ServerError(f"cannot create the socket's lock file beside {path}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        said = _read_lock(fd)
        os.close(fd)
        raise ServerError(_held_by(path, said)) from None
    _say_in_lock(fd, "starting")
    return fd


def _read_lock(fd: int) -> list[str]:
    """What a held lock file says (``[state, pid]``; [] where it cannot be read)."""
    try:
        return os.pread(fd, 64, 0).decode("ascii", "replace").split()
    except OSError:
        return []


def _held_by(path: Path, said: list[str]) -> str:
    """The refusal of a second daemon on ``path``: who holds it, and what to do."""
    if len(said) != 2 or not said[1].isdigit():
        return f"another daemon is starting or running on {path}"
    state, pid = said
    if state == "serving" and not path.exists():  # (its socket file was removed: nobody can reach it)
        return (f"another daemon (pid {pid}) serves on {path}, though its socket file is gone: stop it "
                f"(kill {pid}) and start again")
    return f"another daemon (pid {pid}) is {state} on {path}; stop it (kill {pid}), or pass another --socket"


def mark_serving(fd: int) -> None:
    """The held lock file (``hold_socket_lock``) now says the daemon serves."""
    _say_in_lock(fd, "serving")


def _say_in_lock(fd: int, state: str) -> None:
    with contextlib.suppress(OSError):  # what it says is a courtesy; the lock is what counts
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{state} {os.getpid()}\n".encode(), 0)


def make_socket_dir(d: Path) -> None:
    """``d``, made if needed (mode 0700); ServerError where the socket cannot be created in it."""
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ServerError(f"cannot make the socket's directory {d}: {e.strerror or e}; pass another "
                          "--socket") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise ServerError(f"cannot create the socket in {d}: permission denied; pass another --socket")
