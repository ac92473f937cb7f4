"""Serving the app: uvicorn on the Unix socket (mode 0600), and on TCP only behind an API key.

The sockets are bound here rather than by uvicorn, so that the Unix socket is never reachable with
looser permissions (uvicorn would make it 0666) and a TCP port of 0 reports the port it got.
Shutdown (SIGTERM, SIGINT or ``stop()``): stop accepting, remove the socket file, let the daemon
finish its step and commit, give in-flight responses a few seconds to end, then return.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from weaved.api.app import create_app
from weaved.api.auth import BearerAuth
from weaved.api.detached import resume_detached
from weaved.api.open_files import AcceptErrors, raise_open_files_limit
from weaved.api.sockets import ServerError, bind_tcp, bind_unix, hold_socket_lock, mark_serving, parse_listen

# An idle keep-alive connection is closed by the client first: httpx (and the openai SDK over it) lets
# one go after 5 s, uvicorn's default is also 5 s, and when both fire together a client sends its next
# request on a connection the server is closing (RemoteProtocolError under load).
KEEP_ALIVE_S = 65.0
GRACE_S = 10.0  # how long in-flight responses may take to finish once the daemon has stopped


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
