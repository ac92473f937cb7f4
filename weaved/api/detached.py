"""Detached turns that a stop or a crash cut, run again when the daemon serves again.

A detached turn (``detach: true``: a task nobody waits on, e.g. ``weave submit``) is journaled with
its request until it ends (``Daemon.start_turn``'s ``detached``).  A restart finds the ones a stop or a
crash cut; each session is taken back to where its transcript stood before the turn (the cut answer,
marked ``shutdown`` or ``interrupted``, and the turn's own messages go: ``continues``) and the same
request runs again, detached.  The context before the turn is still in the session's KV file, so only
the turn's own messages are computed again.  A request the daemon now refuses (the model it names is
not served, its session's context was cut, ...) is not run again: its partial answer stays, and the
operator's log says why.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from weaved.api.chat import chat_spec
from weaved.api.models import ChatRequest
from weaved.api.state import ApiState
from weaved.api.turn import resolve, start_turn
from weaved.errors import WeaveError


async def resume_detached(state: ApiState, log: Callable[[str], None]) -> int:
    """Run again every detached turn the last stop cut; the number started."""
    daemon = state.daemon
    started = 0
    for sid, body, messages in await run_in_threadpool(daemon.cut_detached_turns):
        try:
            req = ChatRequest.model_validate(body)
            info, sla = await resolve(state, sid, req.sla, Headers())
            turn = await start_turn(state, chat_spec(state, req, sid, sla, continues=messages), info)
        except (WeaveError, ValidationError) as e:
            log(f"session {sid}: its detached turn, cut by the last stop or crash, is not run again: {e}")
            await run_in_threadpool(daemon.forget_detached_turn, sid)
            continue
        turn.detach()
        started += 1
    if started:
        log(f"{started} detached turn(s) cut by the last stop or crash run again")
    return started
