"""Errors the daemon reports to clients, each with its HTTP status and OpenAI error type."""

from __future__ import annotations


class WeaveError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SettingRefused(WeaveError):
    """What the profile or the daemon's arguments ask for, this host cannot give (a pool on a device it
    lacks, a KV cap that holds no session, a data directory that is a file): the fix is in them, so
    ``weave serve`` exits 2, as for bad usage."""


class InvalidRequest(WeaveError):
    status = 400
    type = "invalid_request_error"


class ContextTooLong(InvalidRequest):
    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class NotFound(WeaveError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    """A request named a model this daemon does not serve (OpenAI's shape of that error)."""

    type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, param="model", code="model_not_found")


class Conflict(WeaveError):
    status = 409
    type = "conflict_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, retryable: bool = False):
        super().__init__(message, param=param, code=code)
        # True where the conflict ends by itself (a turn running on the session): the answer then advises a
        # retry after a second; otherwise ``x-should-retry: false`` - the OpenAI SDKs retry a 409 twice
        self.retryable = retryable


class Unauthorized(WeaveError):
    status = 401
    type = "authentication_error"


class Overloaded(WeaveError):
    status = 503
    type = "overloaded_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, retry_after_s: float = 1.0,
                 retryable: bool = True):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s  # the Retry-After header: when the client should try again
        # False where waiting does not help (only deleting sessions or raising a cap does): the answer then
        # says ``x-should-retry: false``, which the OpenAI SDKs honour, instead of a Retry-After
        self.retryable = retryable


class InsufficientStorage(WeaveError):
    """The data directory's file system has no room for what the request must store (KV rows, the journal):
    the host's capacity, not the request's fault nor a bug."""

    status = 507
    type = "server_error"
    http_status = 507  # (the engine's name for the status of a turn that fails on it)
    retryable = False  # a full disk is freed by its owner, not in the seconds an SDK's retries wait

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="insufficient_storage")
