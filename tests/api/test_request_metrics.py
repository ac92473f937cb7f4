"""The API's request counter counts what the client got: a request whose client left before the answer
began is 499 ("client closed request"), not the 200 its handler then sent to nobody."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from weaved.api.app import RequestMetrics
from weaved.metrics import Metrics


async def _answer_after_hangup(request: Request) -> JSONResponse:
    # a non-streamed turn: it runs until it ends, or until the client leaves and cancels it
    while (await request.receive())["type"] != "http.disconnect":
        pass
    return JSONResponse({"finish_reason": "cancelled"})


async def _answer(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


def _call(app, path: str, client_leaves: bool) -> list[dict]:
    incoming = [{"type": "http.request", "body": b"", "more_body": False}]
    if client_leaves:
        incoming.append({"type": "http.disconnect"})
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "scheme": "http", "server": ("weave", 80), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    return sent


def _count(metrics: Metrics, route: str, status: int) -> float:
    return metrics.registry.get_sample_value("weave_requests_total", {"route": route, "status": str(status)}) or 0.0


def test_a_request_whose_client_left_first_counts_as_499():
    metrics = Metrics()
    app = RequestMetrics(Starlette(routes=[Route("/turn", _answer_after_hangup), Route("/ok", _answer)]), metrics)
    _call(app, "/turn", client_leaves=True)
    assert _count(metrics, "/turn", 499) == 1 and _count(metrics, "/turn", 200) == 0
    # one answered before the client left is the status it was sent
    sent = _call(app, "/ok", client_leaves=False)
    assert sent[0]["status"] == 200 and _count(metrics, "/ok", 200) == 1 and _count(metrics, "/ok", 499) == 0
    assert any(k == b"x-request-id" for k, _ in sent[0]["headers"])
