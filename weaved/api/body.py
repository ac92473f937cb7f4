"""Reading a request body: UTF-8, then strict JSON, then a pydantic model - each failure a clear 400."""

from __future__ import annotations

import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from weaved.errors import InvalidRequest
from weaved.http_errors import validation_error

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 32 * 2**20  # far above any prompt that fits a context; a bound on what one request costs
MAX_DEPTH = 64  # JSON nesting: a JSON schema or tool definition needs a dozen levels, never this many
_SURROGATE = re.compile("[\ud800-\udfff]")  # "\ud800" escapes JSON allows but UTF-8 cannot encode


class TooLarge(InvalidRequest):
    status = 413


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> object:
    """The JSON value of ``raw``; InvalidRequest for bad UTF-8, malformed JSON, NaN or Infinity."""
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                             f"column {e.colno}") from None
    except ValueError as e:  # NaN, Infinity
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest(f"the request body nests JSON more than {MAX_DEPTH} levels deep") from None
    _check_value(value)
    return value


def _check_value(value: object) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings holding lone surrogates (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m:
                raise InvalidRequest(f"the request body holds a lone surrogate (\\u{ord(m.group()):04x}), "
                                     "which is not a Unicode character; send valid UTF-16 pairs or UTF-8")
        elif isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"the request body nests JSON more than {MAX_DEPTH} levels deep")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                stack.append((k, depth))  # keys are strings too
                stack.append((x, depth + 1))


def validate(model: type[M], data: object) -> M:
    """``data`` as ``model``; the first problem becomes an InvalidRequest naming its field."""
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def _raw(request: Request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES without reading the rest."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise TooLarge(f"the request body is larger than {MAX_BODY_BYTES} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise TooLarge(f"the request body is larger than {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)


async def read(request: Request, model: type[M]) -> M:
    return validate(model, parse_json(await _raw(request)))


async def read_optional(request: Request, model: type[M]) -> M:
    """Like ``read``, but an empty body means ``{}`` (for endpoints whose fields are all optional)."""
    raw = await _raw(request)
    return validate(model, parse_json(raw) if raw.strip() else {})
