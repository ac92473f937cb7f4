"""The client's failures, each a one-line message a person can act on."""

from __future__ import annotations

import json
from typing import Any


class ClientError(Exception):
    """A failure the command line reports as one line (its ``str``)."""


class DaemonNotRunning(ClientError):
    def __init__(self, address: str):
        super().__init__(f"no daemon running at {address}; start one with `weave serve`")
        self.address = address


class NotASocket(DaemonNotRunning):
    def __init__(self, address: str, kind: str):
        ClientError.__init__(self, f"{address} is {kind}, not a socket: point --socket or $WEAVE_SOCKET at the "
                                   "daemon's socket (`weave serve` prints where it listens)")
        self.address = address


class DaemonStarting(DaemonNotRunning):
    def __init__(self, address: str):
        ClientError.__init__(self, f"the daemon at {address} is still starting (loading its model); try again "
                                   "when `weave serve` says it is ready")
        self.address = address


class ApiError(ClientError):
    """The daemon refused a request: its HTTP status and OpenAI-shaped error fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def api_error(status: int, payload: Any) -> ApiError:
    """An ApiError from an error body (``{"error": {...}}``), or from whatever else the daemon sent."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return ApiError(status, str(err["message"]), type=err.get("type"), param=err.get("param"),
                        code=err.get("code"))
    text = payload if isinstance(payload, str) else json.dumps(payload)
    text = " ".join(text.split())[:200] or "no details"
    return ApiError(status, f"the daemon answered HTTP {status}: {text}")


def error_from_bytes(status: int, raw: bytes) -> ApiError:
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = raw.decode("utf-8", errors="replace")
    return api_error(status, payload)
