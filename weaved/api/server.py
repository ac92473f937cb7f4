"""Serving the app: uvicorn on the Unix socket (mode 0600), and on TCP only behind an API key.

The sockets are bound here rather than by uvicorn, so that the Unix socket is never reachable with
looser permissions (uvicorn would make it 0666) and a TCP port of 0 reports the port it got.
Shutdown (SIGTERM, SIGINT or ``stop()``): stop accepting, remove the socket file, let the daemon
finish its step and commit, give in-flight responses a few seconds to end, then return.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from weaved.api.app import create_app
from weaved.api.auth import BearerAuth
from weaved.api.detached import resume_detached
from weaved.api.open_files import AcceptErrors, raise_open_files_limit
from weaved.api.socket_lock import ServerError, hold_socket_lock, make_socket_dir, mark_serving

__all__ = ["Server", "ServerError", "bind_tcp", "check_socket_free", "hold_socket_lock", "mark_serving",
           "parse_listen"]

# An idle keep-alive connection is closed by the client first: httpx (and the openai SDK over it) lets
# one go after 5 s, uvicorn's default is also 5 s, and when both fire together a client sends its next
# request on a connection the server is closing (RemoteProtocolError under load).
KEEP_ALIVE_S = 65.0
GRACE_S = 10.0  # how long in-flight responses may take to finish once the daemon has stopped


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


class Server:
    """Serves ``daemon`` (already loaded) until ``stop()`` or SIGTERM/SIGINT; ``serve`` then shuts the
    daemon down and removes the socket before returning."""

    def __init__(self, daemon, socket_path: Path, *, listen: str | None = None, api_key: str | None = None,
                 log: Callable[[str], None] = print, federation=None, lock_fd: int | None = None):
        if listen is not None and not api_key:
            raise ServerError("--listen needs an API key (--api-key or WEAVE_API_KEY): TCP has no file "
                              "permissions to protect it")
        self.daemon = daemon
        self.socket_path = Path(socket_path)
        self.lock_fd = lock_fd  # the socket's lock, when the caller took it before loading (else serve takes it)
        self.listen = parse_listen(listen) if listen is not None else None
        self.api_key = api_key
        self.log = log
        self.tcp_address: tuple[str, int] | None = None
        # the control plane for peers (weaved.federation.service.FederationListen), on its own listener
        self.federation = federation
        self.federation_address: tuple[str, int] | None = None
        self.app = create_app(daemon)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()

    def stop(self) -> None:
        """Ask a running ``serve`` to shut down (from any thread)."""
        self._stop_requested.set()
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already finished
                self._loop.call_soon_threadsafe(self._stop.set)

    def _uvicorn(self, app) -> uvicorn.Server:
        config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, log_level="warning",
                                proxy_headers=False, server_header=False, timeout_graceful_shutdown=GRACE_S,
                                timeout_keep_alive=KEEP_ALIVE_S)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # what uvicorn's own serve() sets up (lifespan off)
        return server

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        raise_open_files_limit()  # every client is a descriptor: a shell's 1,024 is not a server's
        handler = loop.get_exception_handler()
        loop.set_exception_handler(AcceptErrors(self.log))
        self._stop = asyncio.Event()
        if self._stop_requested.is_set():
            self._stop.set()
        self.daemon.attach_loop(loop)
        lock: int | None = self.lock_fd
        listeners: list[tuple[uvicorn.Server, socket.socket]] = []
        try:
            if lock is None:
                lock = hold_socket_lock(self.socket_path)
            # before any client can connect: a cut task's session is taken back and its turn started again
            await resume_detached(self.app.state.weave, self.log)
            listeners.append((self._uvicorn(self.app), bind_unix(self.socket_path)))
            where = str(self.socket_path)
            if self.listen is not None:
                assert self.api_key is not None
                tcp = bind_tcp(*self.listen)
                self.tcp_address = tcp.getsockname()[:2]
                listeners.append((self._uvicorn(BearerAuth(self.app, self.api_key)), tcp))
                host, port = self.tcp_address
                where += f" and http://{f'[{host}]' if ':' in host else host}:{port}"
            if self.federation is not None:
                from weaved.federation.service import federation_app

                fed = bind_tcp(self.federation.host, self.federation.port)
                self.federation_address = fed.getsockname()[:2]
                listeners.append((self._uvicorn(federation_app(self.daemon, self.federation)), fed))
                host, port = self.federation_address
                where += f"; federation on http://{f'[{host}]' if ':' in host else host}:{port}"
            for server, sock in listeners:
                await server.startup(sockets=[sock])
            self._signals(loop, install=True)
            mark_serving(lock)
            if on_ready is not None:
                on_ready(where)
            await self._stop.wait()
        finally:
            self._signals(loop, install=False)
            await self._shutdown(listeners)
            if lock is not None:
                os.close(lock)
            loop.set_exception_handler(handler)

    async def _shutdown(self, listeners: list[tuple[uvicorn.Server, socket.socket]]) -> None:
        self.app.state.weave.closing.set()
        for server, _ in listeners:  # stop accepting: new clients find no daemon
            for s in getattr(server, "servers", []):
                s.close()
        if listeners:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.daemon.stop_turns)  # finish the step: running turns end
        for server, sock in listeners:  # their responses finish (a stored response is recorded)
            if server.started:
                await server.shutdown(sockets=[sock])
            else:
                sock.close()
        await loop.run_in_executor(None, self.daemon.shutdown)  # then the journal and the files close

    def _signals(self, loop: asyncio.AbstractEventLoop, *, install: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only; an embedding program calls stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if install:
                loop.add_signal_handler(sig, self.stop)
            else:
                loop.remove_signal_handler(sig)
