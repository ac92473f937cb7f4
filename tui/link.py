"""``weave top``'s connection to the daemon: httpx's async client on the Unix socket (or TCP).

Async so the status poll and the event stream run as textual workers on the app's loop, and stop
the moment the app cancels them.  Failures are the command line's ``ClientError`` family.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
from weaved.cli.client import CONNECT_TIMEOUT_S, is_url, not_running
from weaved.cli.errors import ClientError, error_from_bytes
from weaved.cli.sse import DONE, SSEDecoder

REQUEST_TIMEOUT_S = 10.0
EVENT_BACKLOG = 100  # events that happened before weave top connected, shown on its first screen


class DaemonLink:
    def __init__(self, address: str, api_key: str | None = None):
        self.address = address
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        transport = None if is_url(address) else httpx.AsyncHTTPTransport(uds=address)
        base = address.rstrip("/") if is_url(address) else "http://weave"
        self._http = httpx.AsyncClient(transport=transport, base_url=base, headers=headers,
                                       timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self.last_event_id: str | None = None  # a reconnection resumes after it (nothing shown twice)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _failure(self, e: httpx.HTTPError) -> ClientError:
        if isinstance(e, httpx.ConnectError):
            return not_running(self.address)
        if isinstance(e, httpx.TimeoutException):
            return ClientError(f"the daemon at {self.address} did not answer in time")
        return ClientError(f"lost the connection to the daemon at {self.address}: {e or type(e).__name__}")

    async def request(self, method: str, path: str) -> Any:
        try:
            r = await self._http.request(method, path)
        except httpx.HTTPError as e:
            raise self._failure(e) from e
        if r.status_code >= 400:
            raise error_from_bytes(r.status_code, r.content)
        try:
            return r.json()
        except ValueError:
            raise ClientError(f"the daemon's answer to {method} {path} is not JSON") from None

    async def status(self) -> dict:
        return await self.request("GET", "/v1/status")

    async def promote(self, session_id: str) -> dict:
        return await self.request("POST", f"/v1/sessions/{quote(session_id, safe='')}/promote")

    async def demote(self, session_id: str) -> dict:
        return await self.request("POST", f"/v1/sessions/{quote(session_id, safe='')}/demote")

    async def delete(self, session_id: str) -> dict:
        return await self.request("DELETE", f"/v1/sessions/{quote(session_id, safe='')}")

    async def events(self) -> AsyncIterator[dict]:
        """``/v1/events`` until the daemon ends the stream (or the caller is cancelled)."""
        try:
            endless = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
            # the first time, what happened before; after a lost connection, what happened since the last
            # event shown (the daemon's backlog, or a "lagged" event saying what it no longer holds)
            resume = {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}
            async with self._http.stream("GET", "/v1/events", params={"backlog": EVENT_BACKLOG},
                                         headers=resume, timeout=endless) as r:
                if r.status_code >= 400:
                    if resume and r.status_code == 400:  # (an id this daemon does not know: start afresh)
                        self.last_event_id = None
                    raise error_from_bytes(r.status_code, await r.aread())
                decoder = SSEDecoder(self.last_event_id)
                async for line in r.aiter_lines():
                    obj = decoder.feed(line)
                    self.last_event_id = decoder.last_id
                    if obj is DONE:
                        return
                    if isinstance(obj, dict):
                        yield obj
        except httpx.HTTPError as e:
            raise self._failure(e) from e
