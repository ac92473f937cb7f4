"""Fixtures for the API's tests: the app on a test double of the daemon, in-process or on a real socket."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.api.fake_daemon import FakeDaemon
from weaved.api.app import create_app
from weaved.api.server import Server

WAIT_S = 30.0  # bound on every wait for a server thread


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon(context_length=4096)


@pytest.fixture
def client(fake: FakeDaemon) -> Iterator[TestClient]:
    with TestClient(create_app(fake), raise_server_exceptions=False) as c:
        yield c


@contextmanager
def serving(daemon, socket_path: Path, **kw) -> Iterator[Server]:
    """``Server`` on a thread with its own event loop; stopped (and joined) on exit."""
    server = Server(daemon, socket_path, log=lambda m: None, **kw)
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(on_ready=lambda where: ready.set()))
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            failure.append(e)
            ready.set()

    thread = threading.Thread(target=run, name="weave-test-server", daemon=True)
    thread.start()
    try:
        assert ready.wait(WAIT_S), "the server did not become ready"
        if failure:
            raise failure[0]
        yield server
    finally:
        server.stop()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the server did not stop"


def uds_client(path: Path, timeout: float = WAIT_S) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://weave", timeout=timeout)


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "weave.sock"
