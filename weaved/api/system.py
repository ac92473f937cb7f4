"""The daemon's own routes: ``/health``, ``/v1/status``, ``/v1/events`` (SSE), ``/metrics`` and
``DELETE /v1/prefixes`` (the stored prefixes emptied)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from weaved.api.sse import KEEPALIVE, frame, sse_response
from weaved.api.state import ApiState, state_of
from weaved.daemon.events import BACKLOG, Subscription
from weaved.errors import InvalidRequest
from weaved.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    state = state_of(request)
    return {"status": "closing" if state.closing.is_set() else "ok", "model": state.daemon.model_name}


@router.get("/v1/status")
async def status(request: Request) -> dict:
    return await run_in_threadpool(state_of(request).daemon.status)


@router.delete("/v1/prefixes")
async def clear_prefixes(request: Request) -> dict:
    """Every stored prefix no session maps goes, from the disk and from memory: what a deleted session
    left in the shared cache (its first prompt, the context a fork shared) with it."""
    return {"object": "prefixes.cleared", **await run_in_threadpool(state_of(request).daemon.clear_prefixes)}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    daemon_status = await run_in_threadpool(state.daemon.status)
    return Response(state.metrics.render(daemon_status), media_type=CONTENT_TYPE)


@router.get("/v1/events")
async def events(request: Request, backlog: int = 0) -> Response:
    """Placements, preemptions, promotions and demotions as they happen, one JSON object per event, each
    with its id; ``?backlog=N`` first sends the last N (at most 200) that happened before, and a client
    reconnecting with ``Last-Event-ID`` gets the kept events after that one instead."""
    if not 0 <= backlog <= BACKLOG:
        raise InvalidRequest(f"backlog must be between 0 and {BACKLOG}", param="backlog")
    state = state_of(request)
    sub = state.daemon.subscribe(backlog, request.headers.get("last-event-id"))
    return sse_response(_event_frames(request, state, sub), on_close=lambda: state.daemon.unsubscribe(sub))


async def _event_frames(request: Request, state: ApiState, sub: Subscription) -> AsyncIterator[bytes]:
    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    stop = {asyncio.create_task(hung_up()), asyncio.create_task(state.closing.wait())}
    get: asyncio.Task | None = None
    try:
        yield KEEPALIVE  # sends the headers now, so a client knows it is subscribed (then, while idle, the
        while True:  # stream's own keep-alives: sse_response)
            get = asyncio.create_task(sub.get())
            done, _ = await asyncio.wait({get, *stop}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client left or the daemon is closing
                get.cancel()
                return
            event_id, ev = get.result()
            yield frame(ev, id=event_id)
    finally:  # (the wait may be cancelled mid-way, its queue read still pending; the response's close
        # unsubscribes, also when this generator never started)
        for t in (*stop, *([get] if get is not None else [])):
            t.cancel()
