"""Server-sent events: ``data: <json>`` frames, OpenAI's ``data: [DONE]`` terminator, keep-alive comments."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # a comment line: clients ignore it; a dead client makes the write fail
KEEPALIVE_S = 15.0  # a stream silent this long sends one: a client reading with a timeout (weave's CLI) can
# tell a daemon that is waiting - a turn queued behind others, or paced to a long budget - from a hung one


def progress_comment(ev: dict) -> bytes:
    """A prompt's progress event (``{"prefilled", "prompt"}``) as a comment line, ``: prefill 2048/8192``:
    OpenAI's clients skip it, weave's CLI shows it, and it keeps a long prefill's connection alive."""
    return f": prefill {int(ev['prefilled'])}/{int(ev['prompt'])}\n\n".encode()


def frame(data: dict, event: str | None = None, id: str | None = None) -> bytes:
    """One server-sent event: ``data`` as JSON, named ``event`` when given (the Responses API names each),
    with its ``id`` when given (what a reconnecting client sends back as ``Last-Event-ID``)."""
    head = (b"id: " + id.encode() + b"\n" if id else b"") + (b"event: " + event.encode() + b"\n" if event else b"")
    return head + b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def stream_chunk(meta, obj: str, choice: dict, *, usage: bool = False, weave: dict | None = None) -> dict:
    """One streamed chunk of a chat or text completion: OpenAI's envelope around ``choice``.
    ``meta`` carries ``id``, ``created`` and ``model``; ``usage`` is null on every chunk but the last."""
    out = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [choice]}
    if usage:
        out["usage"] = None
    if weave is not None:
        out["weave"] = weave
    return out


class _EventStream(StreamingResponse):
    """A streamed response whose ``on_close`` runs however it ends - also when the client is gone before
    its first frame, when the frames' generator never starts (so its own ``finally`` never runs)."""

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None] | None):
        # no-cache and X-Accel-Buffering keep proxies from holding frames back
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                self._on_close()


def sse_response(frames: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> StreamingResponse:
    """``frames`` as ``text/event-stream``, with a keep-alive comment whenever none came for ``KEEPALIVE_S``;
    ``on_close``: what must happen when the response is over, sent or not (the turns it streams let go
    of: cancelled if still running)."""
    return _EventStream(with_keepalives(frames), on_close)


async def with_keepalives(frames: AsyncIterator[bytes], every: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """``frames``, and ``KEEPALIVE`` whenever the next one has not come for ``every`` seconds.  The next frame
    is awaited in a task of its own, so that waiting past ``every`` does not cancel it; closing this
    generator (the client gone, the response cancelled) cancels that wait and closes ``frames``, whose
    own ``finally`` then runs as it would have."""
    it = aiter(frames)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield KEEPALIVE
                continue
            step, pending = pending, None
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, Exception):  # (its end is the close below's business)
                pass
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
