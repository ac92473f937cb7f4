"""One daemon per data directory: an exclusive lock on ``<data dir>/daemon.lock`` for the daemon's
life.  Two daemons on one directory - through different sockets - would both recover its sessions and
write the same KV files and journal.  The lock file holds the owner's pid, for the refusal's message;
it stays when the daemon stops (removing it would race a starting daemon), and the kernel lets go of
the lock when the owner exits, however it exits.  A daemon that starts itself again in its own process
(``exec``, after compiling the kernels) hands its descriptor over (``INHERITED_ENV``): the directory is
never free in between."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from weaved.errors import Conflict, WeaveError

LOCK_NAME = "daemon.lock"
INHERITED_ENV = "WEAVE_DATA_LOCK_FD"  # the lock's descriptor, held across this process's own exec


def lock_data_dir(data_dir: Path) -> int:
    """Take the directory's lock (a descriptor: closing it releases the lock); Conflict, naming the
    owner, when another process holds it."""
    path = Path(data_dir) / LOCK_NAME
    held = _inherited(path)
    if held is not None:
        return held
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # (read-only, not ours): said before anything else fails on it
        raise WeaveError(f"cannot write in the data directory {data_dir}: {e.strerror or e}; pass another "
                         "--data-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        who = f"another daemon (pid {owner})" if owner else "another daemon"
        raise Conflict(f"{who} uses the data directory {data_dir}; stop it, or pass another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def data_dir_owner(data_dir: Path) -> str | None:
    """Who holds the directory's lock now - the owner's pid as it wrote it, or "" when unreadable - or
    None when nobody does (a probe: the lock is not kept)."""
    path = Path(data_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _owner(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _owner(fd: int) -> str:
    """The pid the lock's holder wrote in the file, or "" when it is not one (yet)."""
    owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return owner if owner.isdigit() else ""


def _inherited(path: Path) -> int | None:
    """The descriptor this process held on ``path``'s lock before it exec'd itself, if it names that file
    (it still holds the lock: an flock belongs to the open file, which the exec kept); else None."""
    fd = os.environ.pop(INHERITED_ENV, None)
    if fd is None or not fd.isdigit():
        return None
    fd_n = int(fd)
    try:
        mine, there = os.fstat(fd_n), os.stat(path)
    except OSError:
        return None
    if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):  # (another --data-dir this time)
        os.close(fd_n)
        return None
    os.set_inheritable(fd_n, False)
    return fd_n
