"""A client that finds no socket while a daemon starts (it holds the socket's lock from before its model
loads) waits for it, saying so once; without a way to say so it is told the daemon is starting; a daemon
that exits before serving ends the wait."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
from weaved.cli.client import Client
from weaved.cli.errors import DaemonNotRunning, DaemonStarting
from weaved.cli.socket_path import daemon_starting

from tests.cli.fake_server import FakeDaemon, short_socket_dir

WAIT_S = 30.0


def _hold(sock) -> int:
    """The lock a starting daemon holds beside its socket (``weaved.api.sockets.hold_socket_lock``)."""
    fd = os.open(f"{sock}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_the_lock_tells_a_starting_daemon_from_none():
    with short_socket_dir() as d:
        sock = d / "w.sock"
        assert not daemon_starting(sock)  # no lock file
        fd = _hold(sock)
        assert daemon_starting(sock)
        os.close(fd)
        assert not daemon_starting(sock)  # a lock file left by a daemon that exited


def test_a_request_waits_for_a_starting_daemon_and_is_answered_once_it_serves():
    with short_socket_dir() as d:
        sock = d / "w.sock"
        fd = _hold(sock)
        said: list[str] = []
        got: list = []
        client = Client(sock, on_starting=said.append)
        t = threading.Thread(target=lambda: got.append(client.health()), daemon=True)
        t.start()
        deadline = time.monotonic() + WAIT_S
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said and "is starting" in said[0]
        with FakeDaemon(sock):  # the daemon binds its socket
            t.join(WAIT_S)
            assert got and not t.is_alive()
        os.close(fd)
        assert len(said) == 1


def test_without_waiting_a_starting_daemon_is_an_error_that_says_so():
    with short_socket_dir() as d:
        sock = d / "w.sock"
        fd = _hold(sock)
        try:
            with pytest.raises(DaemonStarting, match="still starting"):
                Client(sock).health()
        finally:
            os.close(fd)


def test_a_daemon_that_exits_before_serving_ends_the_wait():
    with short_socket_dir() as d:
        sock = d / "w.sock"
        fd = _hold(sock)
        threading.Timer(0.5, os.close, args=(fd,)).start()  # its load failed: the lock goes with it
        with pytest.raises(DaemonNotRunning, match="no daemon running"):
            Client(sock, on_starting=lambda m: None).health()


def test_a_second_daemon_on_a_held_socket_is_told_who_holds_it():
    """The refusal names the holder's pid and what to do - also when its socket file was removed (it
    serves on, unreachable: only stopping it helps)."""
    from weaved.api.sockets import ServerError, hold_socket_lock, mark_serving

    with short_socket_dir() as d:
        sock = d / "w.sock"
        fd = hold_socket_lock(sock)
        try:
            with pytest.raises(ServerError, match=f"another daemon \\(pid {os.getpid()}\\) is starting on"):
                hold_socket_lock(sock)
            mark_serving(fd)
            with pytest.raises(ServerError, match=f"its socket file is gone: stop it \\(kill {os.getpid()}\\)"):
                hold_socket_lock(sock)
            sock.touch()
            with pytest.raises(ServerError, match="is serving on .*; stop it"):
                hold_socket_lock(sock)
            os.pwrite(fd, b"serving 4194304\n", 0)  # what a daemon now gone wrote: no pid to stop is named
            with pytest.raises(ServerError, match="^another daemon is starting or running on"):
                hold_socket_lock(sock)
        finally:
            os.close(fd)
