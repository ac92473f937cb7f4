"""Weave's session API: create with SLA tags (the answer carries the placement), inspect, list,
delete, take turns, fork, rewind, promote and demote."""

from __future__ import annotations

from functools import partial
from typing import Literal

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from weaved.api import body
from weaved.api.chat import answer_chat
from weaved.api.models import ChatRequest, SessionCreate, SessionFork, SessionRewind
from weaved.api.paging import page
from weaved.api.params import SESSION_HEADER, SLA_HEADERS, sla_from
from weaved.api.state import state_of
from weaved.errors import InvalidRequest, Overloaded
from weaved.routing.types import SLA, SLAClass

router = APIRouter(prefix="/v1/sessions")


@router.post("")
async def create_session(request: Request) -> dict:
    state = state_of(request)
    if state.closing.is_set():
        raise Overloaded("the daemon is shutting down")
    req = await body.read_optional(request, SessionCreate)
    sla = sla_from(req.sla, request.headers) or SLA(SLAClass.INTERACTIVE)
    return await run_in_threadpool(state.daemon.create_session, sla, req.max_context, req.system)


@router.get("")
async def list_sessions(request: Request, order: Literal["asc", "desc"] = "asc",
                        limit: int | None = Query(None, ge=1, le=1000), after: str | None = None,
                        messages: bool = True) -> dict:
    """Every session, oldest first (``order=desc``: newest first); ``limit`` makes it a page, ``after`` a
    session id starts the page after it (OpenAI's list shape: ``first_id``, ``last_id``, ``has_more``);
    ``messages=false`` leaves the transcripts out (``messages``: null)."""
    daemon = state_of(request).daemon
    sessions = await run_in_threadpool(daemon.list_sessions, messages)
    if order == "desc":  # (the daemon lists them in creation order)
        sessions.reverse()

    def gone(sid: str):
        """A session deleted since the client's last page: the page goes on from where it stood."""
        created = daemon.deleted_created.get(sid)
        if created is None:
            return None
        return (lambda s: s["created"] > created) if order == "asc" else (lambda s: s["created"] < created)

    return page(sessions, after, limit, f"no session {after!r}", gone)


@router.get("/{session_id}")
async def get_session(request: Request, session_id: str) -> dict:
    return await run_in_threadpool(state_of(request).daemon.get_session, session_id)


@router.delete("/{session_id}")
async def delete_session(request: Request, session_id: str) -> dict:
    await run_in_threadpool(state_of(request).daemon.delete_session, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/turns")
async def take_turn(request: Request, session_id: str) -> Response:
    req = await body.read(request, ChatRequest)
    if req.session is not None and req.session != session_id:
        raise InvalidRequest(f"the body names session {req.session!r} but the path {session_id!r}",
                             param="session")
    header = request.headers.get(SESSION_HEADER)
    if header is not None and header != session_id:
        raise InvalidRequest(f"the X-Weave-Session header names session {header!r} but the path {session_id!r}",
                             param="session")
    return await answer_chat(request, req, session_id)


@router.post("/{session_id}/fork")
async def fork(request: Request, session_id: str) -> dict:
    """A new session sharing this one's context (all of it, or through answer ``turn``) without
    computing it again; its own SLA (``sla``, else the parent's), placement and ``max_context`` (else the
    parent's)."""
    state = state_of(request)
    if state.closing.is_set():
        raise Overloaded("the daemon is shutting down")
    req = await body.read_optional(request, SessionFork)
    parent = await run_in_threadpool(state.daemon.get_session, session_id)
    sla = sla_from(req.sla, request.headers, SLA.from_dict(parent["sla"]))  # what it leaves out: the parent's
    return await run_in_threadpool(partial(state.daemon.fork_session, session_id, req.turn, sla, req.max_context))


@router.post("/{session_id}/rewind")
async def rewind(request: Request, session_id: str) -> dict:
    """Take the session back to the end of answer ``turn`` (0: before its first turn): what came after
    goes, from the transcript, the journal and the KV cache."""
    req = await body.read(request, SessionRewind)
    return await run_in_threadpool(state_of(request).daemon.rewind_session, session_id, req.turn)


@router.post("/{session_id}/promote")
async def promote(request: Request, session_id: str) -> dict:
    await _no_sla_given(request, "promote")
    return await run_in_threadpool(state_of(request).daemon.promote, session_id)


@router.post("/{session_id}/demote")
async def demote(request: Request, session_id: str) -> dict:
    await _no_sla_given(request, "demote")
    return await run_in_threadpool(state_of(request).daemon.demote, session_id)


async def _no_sla_given(request: Request, what: str) -> None:
    """A promotion or demotion sets the class (interactive, background) and nothing else: a body or an SLA
    header would be ignored, so it is refused - an SLA of one's own goes with the session's next turn."""
    raw = (await request.body()).strip()
    given = [h for h in SLA_HEADERS.values() if h in request.headers]
    if (raw and raw != b"{}") or given:
        raise InvalidRequest(f"{what} takes no body and no SLA header: it sets the session's class; send an SLA "
                             f"of your own with the session's next turn (its sla field)",
                             param=given[0] if given and not raw else None)
