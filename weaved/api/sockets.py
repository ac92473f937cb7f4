"""The daemon's sockets before its server runs: the ``--listen`` address, the Unix socket's path, and
the lock a daemon holds beside that socket (``<socket>.lock``) from before its model loads.

Two daemons starting at once cannot both decide the socket is stale, and a client that finds no socket
can tell a daemon still starting (the lock is held: it waits) from none.  Kept apart from the server
(whose imports take most of a second) so that ``weave serve`` checks its arguments and takes the lock
before importing it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
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
    deadline = time.monotonic() + LOCK_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:  # (a client asking whether a daemon starts holds it shared for an instant)
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            said = _read_lock(fd)
            os.close(fd)
            raise ServerError(_held_by(path, said)) from None
        except OSError as e:
            os.close(fd)
            raise ServerError(f"cannot lock {path}'s lock file: {e.strerror or e}") from None
    _say_in_lock(fd, "starting")
    return fd


LOCK_PATIENCE_S = 0.2  # how long a second daemon waits for the socket's lock before it is refused


def _read_lock(fd: int) -> list[str]:
    """What a held lock file says (``[state, pid]``; [] where it cannot be read)."""
    try:
        return os.pread(fd, 64, 0).decode("ascii", "replace").split()
    except OSError:
        return []


def _held_by(path: Path, said: list[str]) -> str:
    """The refusal of a second daemon on ``path``: who holds it, and what to do."""
    if len(said) != 2 or not said[1].isdigit() or not _alive(int(said[1])):  # (what a daemon gone wrote)
        return f"another daemon is starting or running on {path}"
    state, pid = said
    if state == "serving" and not path.exists():  # (its socket file was removed: nobody can reach it)
        return (f"another daemon (pid {pid}) serves on {path}, though its socket file is gone: stop it "
                f"(kill {pid}) and start again")
    return f"another daemon (pid {pid}) is {state} on {path}; stop it (kill {pid}), or pass another --socket"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: it exists)
        return True
    return True


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


def parse_listen(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6ADDR]:PORT`` -> (host, port)."""
    host, sep, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ServerError(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8080), got {spec!r}")
    return host, int(port)


def socket_is_live(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as e:  # EAGAIN (backlog full), EACCES (someone else's): somebody is there
        return e.errno != errno.ECONNREFUSED
    finally:
        s.close()


MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path holds 108, with the final NUL)


def check_socket_free(path: Path) -> None:
    """ServerError if ``path`` cannot be a socket (too long; its directory cannot be made or written)
    or is a live socket or not a socket at all (a stale socket is fine).  ``weave serve`` asks before
    loading the model, so a bad path costs no load."""
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ServerError(f"the socket path {path} is {len(os.fsencode(str(path)))} bytes; a Unix socket's "
                          f"path holds at most {MAX_SOCKET_PATH}: pass a shorter --socket")
    make_socket_dir(path.parent)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServerError(f"{path} exists and is not a socket; remove it or pass another --socket")
    if socket_is_live(path):
        raise ServerError(f"a daemon is already listening on {path}; stop it first or pass another --socket")


def bind_unix(path: Path) -> socket.socket:
    """A listening-ready Unix socket at ``path``, mode 0600; a stale socket file is replaced."""
    check_socket_free(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # stale: nobody answers on it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)  # before listen(): nobody can connect to it until then
    except OSError as e:
        sock.close()
        raise ServerError(f"cannot create the socket {path}: {e.strerror or e}") from None
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ServerError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
