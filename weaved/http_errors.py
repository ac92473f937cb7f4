"""Every error leaves an HTTP app of the daemon in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

Shared by the Weave API (``weaved.api``) and the federation's control plane
(``weaved.federation.control``), which are separate apps on separate listeners.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from weaved.errors import InvalidRequest, WeaveError

log = logging.getLogger("weave.http")

# the id of the request a coroutine (or a thread it started) serves: what the log names beside an error
REQUEST_ID: ContextVar[str | None] = ContextVar("weave_request_id", default=None)

_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 503: "overloaded_error"}


def status_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or status_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, **kw: str | None) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status)


def retry_headers(exc: WeaveError) -> dict[str, str] | None:
    """The advice to the client of an error the OpenAI SDKs would retry (409, 5xx): ``Retry-After`` when
    waiting helps (a busy host, a turn still running on the session), ``x-should-retry: false`` when it
    does not (a cap only deleting sessions clears, a lost KV file, a full disk): the SDKs would otherwise
    retry twice, and tell the user only after."""
    if exc.status not in (409, 503, 507):
        return None
    if not getattr(exc, "retryable", exc.status == 503):
        return {"x-should-retry": "false"}
    return {"Retry-After": str(max(1, round(getattr(exc, "retry_after_s", 1))))}


def weave_error_response(exc: WeaveError) -> JSONResponse:
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=retry_headers(exc))


def validation_error(errors: list) -> InvalidRequest:
    """An InvalidRequest from pydantic's (or FastAPI's) error list: the first error, its field as param."""
    if not errors:
        return InvalidRequest("invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    # unions report one error per member ("prompt.str", "prompt.list[int]"), or the tag of the member a
    # discriminator chose ("tag:message"): name the field only
    loc = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")  # a validator's own message
    named = bool(param)
    if first.get("type") == "extra_forbidden" and loc:  # the wording the top-level fields get
        msg = f"unknown or unsupported field {loc[-1]!r}"
        named = len(loc) > 1  # (a top-level field: its name once)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return InvalidRequest(f"{param}: {msg}{more}" if named else f"{msg}{more}", param=param)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("tag:", "list[", "function-", "literal[",
                                                                       "constrained-"))


def _request_id(request: Request) -> str:
    return request.scope.get("weave_request_id", "no request id")


def install(app: FastAPI) -> None:
    """Route WeaveError, FastAPI's validation errors, HTTP errors and bugs to the OpenAI shape."""

    @app.exception_handler(WeaveError)
    async def _weave(request: Request, exc: WeaveError) -> JSONResponse:
        if exc.status == 507 and not getattr(exc, "logged", False):  # the operator's to fix (a full disk): one
            # line in the log, no traceback (a turn's failure the engine has logged is not said twice)
            log.warning("%s %s (%s): %s", request.method, request.url.path, _request_id(request), exc.message)
        return weave_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return weave_error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s (%s)", request.method, request.url.path, _request_id(request))
        # the server closes the connection after an unhandled error: say so, or a client that keeps it
        # alive sends its next request into a closed socket
        response = error_response(500, f"internal error: {type(exc).__name__}: {exc}")
        response.headers["Connection"] = "close"
        return response
