"""Server-sent events: ``data: <json>`` frames, OpenAI's ``data: [DONE]`` terminator, keep-alive comments."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # a comment line: clients ignore it; a dead client makes the write fail


def frame(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_response(frames: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache and X-Accel-Buffering keep proxies from holding frames back
    return StreamingResponse(frames, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
