"""A client gone before its stream's first frame: the turn it asked for is cancelled, not left to run to
its end with nobody reading (the stream's own cleanup never runs when its first frame cannot be sent)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from starlette.requests import ClientDisconnect

from tests.api.fake_daemon import FakeDaemon
from weaved.api.server import create_app


async def _gone_at_once(app, path: str, body: dict) -> None:
    """One request, as an ASGI 2.4 server runs it, whose client left before the response started."""
    data, asked = json.dumps(body).encode(), []

    async def receive() -> dict:
        if not asked:
            asked.append(True)
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(60)  # (a 2.4 server's app never waits for the disconnect here)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            raise OSError("the client is gone")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "scheme": "http", "server": ("weave", 80), "client": ("client", 1)}
    with pytest.raises(ClientDisconnect):
        await asyncio.wait_for(app(scope, receive, send), 30)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "stream": True, "store": False}),
], ids=["chat", "completions", "responses"])
def test_a_stream_whose_client_left_before_it_started_cancels_its_turn(path, body):
    fake = FakeDaemon(hold=True)  # (its turns wait, so only a cancel ends them)
    asyncio.run(_gone_at_once(create_app(fake), path, body))
    deadline = time.monotonic() + 10
    while not fake.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.cancelled) == 1


def _wait(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_first_response_that_stores_nothing_leaves_no_session():
    """A new chain's session is made for its first response: when that response stores nothing - its
    client left before the stream started, or it failed - the session goes (it held a session slot and
    its KV for good); a stored one keeps it."""
    fake = FakeDaemon(hold=True)
    asyncio.run(_gone_at_once(create_app(fake), "/v1/responses", {"input": "hi", "stream": True}))
    assert _wait(lambda: not fake.sessions), fake.sessions

    from fastapi.testclient import TestClient

    failing = FakeDaemon(fail="the KV cap is full")
    with TestClient(create_app(failing)) as client:
        r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
        assert r.status_code == 500 and "KV cap" in r.json()["error"]["message"]
        assert _wait(lambda: not failing.sessions), failing.sessions
    fine = FakeDaemon()
    with TestClient(create_app(fine)) as client:
        assert client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4}).json()["status"] in (
            "completed", "incomplete")
        time.sleep(0.2)
        assert len(fine.sessions) == 1
