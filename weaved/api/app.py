"""The FastAPI app: OpenAI-compatible routes, Weave's session and status routes, errors in one shape."""

from __future__ import annotations

import secrets

from fastapi import Depends, FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from weaved import http_errors
from weaved.api import input_items, openai, peers, response_counts, responses, sessions, system
from weaved.api.query import known_query
from weaved.api.state import ApiState
from weaved.metrics import Metrics

STREAMS = ("/v1/events",)  # GET routes whose answer never ends by itself


CLIENT_CLOSED = 499  # the status a request is counted under when its client left before the answer began


class RequestMetrics:
    """Counts requests by route template (never the raw path: session ids would explode the labels), and
    gives each an id, sent back as ``x-request-id`` (as OpenAI does: SDKs expose it, logs name it).

    A request whose client hung up before its answer started (a non-streamed turn cancelled by it) is
    counted as 499, "client closed request", not as the 200 its handler went on to send to nobody."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = left = False
        request_id = scope["weave_request_id"] = f"req_{secrets.token_hex(12)}"
        http_errors.REQUEST_ID.set(request_id)

        async def listen() -> dict:
            nonlocal left
            message = await receive()
            if message["type"] == "http.disconnect" and not started:
                left = True
            return message

        async def watch(message: dict) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, listen, watch)
        finally:
            route = scope.get("route")
            self.metrics.observe_request(getattr(route, "path", "unmatched"), CLIENT_CLOSED if left else status)


def create_app(daemon, *, metrics: Metrics | None = None) -> FastAPI:
    """The app serving ``daemon`` (a loaded ``weaved.daemon.core.Daemon`` or anything with its interface)."""
    # no redirect from "/v1/sessions/" to "/v1/sessions": a path with an empty id is not an endpoint,
    # and a bare 307 with no body is not the OpenAI-shaped error every other unknown path gets
    app = FastAPI(title="Weave", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  dependencies=[Depends(known_query)])
    state = ApiState(daemon, metrics or Metrics())
    app.state.weave = state
    http_errors.install(app)
    for module in (openai, response_counts, responses, input_items, sessions, system, peers):
        for route in module.router.routes:  # HEAD wherever GET answers (RFC 9110; probes use it), not a stream
            if isinstance(route, APIRoute) and "GET" in route.methods and route.path not in STREAMS:
                route.methods.add("HEAD")
        app.include_router(module.router)
    app.add_middleware(RequestMetrics, metrics=state.metrics)
    return app
