"""The control plane a daemon serves to its peers: a small FastAPI app on its own TCP listener.

``GET /federation/v1/health``  liveness: ``{"status": "ok", "node": name}``
``GET /federation/v1/info``    the node report (``node_report``): model, hardware, free KV, load
``POST /federation/v1/groups`` a home asks this node to join a ring/pipeline group (202; 409 refused)

Every request must carry the federation's shared token, ``Authorization: Bearer <token>``.  The
guard runs before routing, so a request without the right token learns nothing - not even which
paths exist: every such request gets the same 401 in the standard error shape.  The comparison is
constant-time over SHA-256 digests, so neither the token's content nor its length shows in timing.
This app is separate from the Weave API (a peer must never reach sessions or turns through it).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from weaved import http_errors
from weaved.federation.probe import HEALTH_PATH, INFO_PATH
from weaved.http_errors import error_body

UNAUTHORIZED = "missing or wrong federation token: send 'Authorization: Bearer <token>'"


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


class TokenGuard:
    """Refuses (401) every request that does not carry ``token`` as a bearer token."""

    def __init__(self, app: ASGIApp, token: str):
        if not token:
            raise ValueError("the federation token must not be empty")
        self.app = app
        self._want = _digest(token.encode())

    def allowed(self, scope: Scope) -> bool:
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                if given is not None:
                    return False  # two Authorization headers: ambiguous, refuse
                given = value
        if given is None:
            return False
        scheme, _, token = given.partition(b" ")
        ok = hmac.compare_digest(_digest(token.strip()), self._want)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self.allowed(scope):
            body = error_body(401, UNAUTHORIZED, code="invalid_federation_token")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


class JoinBody(BaseModel):
    group: str = Field(min_length=1, max_length=200)
    rank: int = Field(ge=1)
    world: int = Field(ge=2, le=1024)
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    home: str = Field(max_length=200)
    fingerprint: str = Field(max_length=200)
    timeout_s: float = Field(gt=0, le=3600)
    idle_timeout_s: float = Field(gt=0, le=3600)


def create_federation_app(report: Callable[[], dict], token: str, node: str,
                          join: Callable | None = None) -> ASGIApp:
    """The control-plane app: ``report`` builds the node report (called in a worker thread);
    ``join`` (a ``MemberGroups.join``) follows a home's request to join a group."""
    from weaved.federation.member_groups import JoinRefused, JoinRequest
    from weaved.federation.ring_form import GROUPS_PATH

    app = FastAPI(title="Weave federation", docs_url=None, redoc_url=None, openapi_url=None)
    http_errors.install(app)

    @app.post(GROUPS_PATH, status_code=202)
    async def join_group(body: JoinBody):
        if join is None:
            return JSONResponse(error_body(409, "this node does not serve groups", code="join_refused"), 409)
        try:
            return join(JoinRequest(**body.model_dump()))
        except JoinRefused as e:
            return JSONResponse(error_body(409, str(e), code="join_refused"), 409)

    @app.get(HEALTH_PATH)
    async def health() -> dict:
        return {"status": "ok", "node": node}

    @app.get(INFO_PATH)
    async def info() -> dict:
        return await run_in_threadpool(report)

    return TokenGuard(app, token)
