"""``n`` > 1 on chat and completions: the daemon's forked choices (``Daemon.start_choices``) as ``Turn``s,
one per choice, and their events merged into one stream with each chunk's choice index."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from weaved.api.state import ApiState
from weaved.api.turn import Turn, TurnSpec, emitter
from weaved.errors import InvalidRequest, Overloaded
from weaved.routing.types import SLAClass


class ChoiceHandle:
    """A later choice's handle for its ``Turn``: usage and placement from its own turn once it has
    started; its answer parsed with choice 0's plan."""

    def __init__(self, late, plan):
        self._late = late
        self.answer = plan
        self.reprefilled = 0

    def _h(self):
        return self._late.handle

    @property
    def prompt_tokens(self) -> int:
        h = self._h()
        return h.prompt_tokens if h is not None else 0

    @property
    def cached_tokens(self) -> int:
        h = self._h()
        return h.cached_tokens if h is not None else 0

    @property
    def placement(self):
        h = self._h()
        return h.placement if h is not None else None

    def cancel(self) -> None:
        self._late.cancel()


async def start_choices(state: ApiState, spec: TurnSpec, n: int) -> list[Turn]:
    """Start ``n`` choices of a request without a session (InvalidRequest with a session)."""
    if spec.session_id is not None:
        raise InvalidRequest("n > 1 runs without a session (each choice is a fork of the first); drop the session",
                             param="n")
    if spec.echo:
        raise InvalidRequest("echo with logprobs cannot be combined with n > 1", param="n")
    if state.closing.is_set():
        raise Overloaded("the daemon is shutting down")
    arrived = time.monotonic()
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(n)]
    start = partial(state.daemon.start_choices, n, messages=spec.messages, prompt=spec.prompt, params=spec.params,
                    sla=spec.sla, emits=[emitter(loop, q) for q in queues], answer=spec.answer)
    handle0, late = await run_in_threadpool(start)
    cls = spec.sla.cls.value if spec.sla is not None else SLAClass.INTERACTIVE.value
    placement = getattr(handle0, "placement", None)
    turns = [Turn(state, handle0, queues[0], spec, cls, placement, arrived)]
    plan = getattr(handle0, "answer", None)
    turns += [Turn(state, ChoiceHandle(lh, plan), q, spec, cls, placement, arrived)
              for lh, q in zip(late, queues[1:], strict=True)]
    for t in turns[1:]:  # one prompt for the request, fed once: the metrics count it with choice 0
        t.shares_prompt = True
    return turns


async def collect_all(request: Request, turns: list[Turn]) -> list[list[dict]]:
    """Every choice's events (a non-streaming answer); the client hanging up cancels them all."""
    watcher = asyncio.create_task(watch(request, turns))

    async def events(t: Turn) -> list[dict]:
        return [ev async for ev in t.events()]

    try:
        results = list(await asyncio.gather(*(events(t) for t in turns)))
    finally:
        watcher.cancel()
        for t in turns:
            t.abandon()
    for t in turns:
        if t.error is not None:
            raise t.failure()
    return results


async def watch(request: Request, turns: list[Turn]) -> None:
    """Cancel every choice when the client disconnects."""
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            for t in turns:
                t.cancel()
            return


async def merged(turns: list[Turn], progress: bool = False) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, event) of all the choices, as they come (``progress``: as ``Turn.events``)."""
    out: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, t: Turn) -> None:
        try:
            async for ev in t.events(progress):
                await out.put((i, ev))
        finally:
            await out.put((i, None))

    tasks = [asyncio.create_task(pump(i, t)) for i, t in enumerate(turns)]
    open_ = len(turns)
    try:
        while open_:
            i, ev = await out.get()
            if ev is None:
                open_ -= 1
                continue
            yield i, ev
    finally:
        for task in tasks:
            task.cancel()


def total_usage(turns: list[Turn]) -> dict:
    """OpenAI's usage of n choices: the prompt counted once, the completions summed."""
    first = turns[0].usage
    completion = sum(t.usage["completion_tokens"] for t in turns)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion,
            "completion_tokens_details": {"reasoning_tokens": sum(t.reasoning_tokens for t in turns)}}
