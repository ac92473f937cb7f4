"""``POST /v1/responses`` (OpenAI's Responses API, the subset agents use), ``GET`` and ``DELETE`` of a
stored response.

A stored response chain lives in one Weave session: the first request (``store`` true, the default)
creates it with ``instructions`` as its system prompt, and a request naming ``previous_response_id``
continues that session - its KV already holds the chain, so only the new items are prefilled, and the
chain survives a daemon restart with the session.  Only a chain's latest response can be continued
(branching is a fork, not offered here); ``store: false`` answers in a throwaway session.  Weave's
``sla`` works here as on chat completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weaved.agent.plan import DEFAULT_PARALLEL
from weaved.agent.stream import AnswerParser
from weaved.agent.tool_results import RESPONSES_WORDS, check_tool_results
from weaved.api import body
from weaved.api.params import FIT_CONTEXT_MAX_TOKENS, SAMPLING_DEFAULTS, check_model, sampling_refusal, sla_from
from weaved.api.response_items import OutputItems, new_id
from weaved.api.responses_models import ResponsesRequest
from weaved.api.sse import frame, progress_comment, sse_response
from weaved.api.state import state_of
from weaved.api.turn import Turn, TurnSpec, start_turn
from weaved.engine.sampling import SamplingParams
from weaved.errors import Conflict, InvalidRequest, NotFound
from weaved.routing.types import SLA, SLAClass

router = APIRouter()


def _params(req: ResponsesRequest) -> SamplingParams:
    kw = dict(SAMPLING_DEFAULTS)
    kw.update({k: getattr(req, k) for k in ("temperature", "top_p", "seed") if getattr(req, k) is not None})
    if req.seed == -1:  # llama.cpp's "no seed", as on chat completions: a fresh random one
        kw.pop("seed")
    elif req.seed is not None:
        kw["seed"] = req.seed % 2**64  # (a negative one as its two's complement)
    try:
        return SamplingParams(max_tokens=req.max_output_tokens or FIT_CONTEXT_MAX_TOKENS,
                              fit_context=req.max_output_tokens is None, **kw)
    except ValueError as e:
        raise sampling_refusal(e, "max_output_tokens") from None


async def continued_chain(state, rid: str, messages: list[dict]) -> str:
    """The session of stored response ``rid``, which ``messages`` continue (NotFound naming
    ``previous_response_id``; Conflict while it is being generated); InvalidRequest for tool results
    that answer none of its calls."""
    if rid in state.running_responses:
        raise Conflict(f"response {rid} is still being generated; continue it once it has ended",
                       param="previous_response_id", retryable=True)
    try:
        sid, previous = await run_in_threadpool(state.daemon.get_response, rid)
    except NotFound as e:
        raise NotFound(e.message, param="previous_response_id") from None
    calls = [i for i in previous.get("output") or () if i.get("type") == "function_call"]
    check_tool_results(messages, {i.get("call_id") for i in calls}, RESPONSES_WORDS,
                       cut={i.get("call_id") for i in calls if i.get("status") == "incomplete"})
    return sid


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    req = await body.read(request, ResponsesRequest)
    state = state_of(request)
    daemon = state.daemon
    check_model(state, req.model)
    bad = req.unsupported()
    if bad is not None:
        raise InvalidRequest(bad[1], param=bad[0])
    params, answer, messages = _params(req), req.answer(), req.messages()
    sla = sla_from(req.sla, request.headers)
    created_session, continues = False, None
    if req.previous_response_id is not None:
        if not req.store:
            raise InvalidRequest("store: false cannot continue a stored chain (the turn would enter it unrecorded)",
                                 param="store")
        sid = await continued_chain(state, req.previous_response_id, messages)
        latest = await run_in_threadpool(daemon.latest_response, sid)
        if latest != req.previous_response_id:  # its chain went on past it: a new chain branches off there
            try:
                sid = await run_in_threadpool(partial(daemon.branch_response, req.previous_response_id, sla))
            except Conflict as e:  # (its chain's session is generating a turn)
                raise Conflict(f"response {req.previous_response_id} cannot be branched from while its chain "
                               f"generates a response; retry when that one ends", param="previous_response_id",
                               retryable=True) from e
            created_session = True
        continues = await run_in_threadpool(daemon.response_end, req.previous_response_id)
        info = await run_in_threadpool(daemon.get_session, sid)
        # other instructions than the chain's so far: the session's system prompt changes with the turn
        # (and only if it starts: a refused continuation leaves the chain as it was)
        new_system = (info.get("system") or None) != (req.instructions or None)
    else:
        new_system = False
        check_tool_results(messages, set(), RESPONSES_WORDS)  # (a fresh chain: no call before its input)
        if req.store:
            info = await run_in_threadpool(partial(daemon.create_session, sla or SLA(SLAClass.INTERACTIVE), None,
                                                   req.instructions))
            sid, created_session = info["id"], True
        else:
            sid, info = None, None
            if req.instructions:
                messages = [{"role": "system", "content": req.instructions}, *messages]
    try:
        turn = await start_turn(state, TurnSpec(sid, params, sla, messages=messages, answer=answer,
                                                   continues=continues, limit_field="max_output_tokens",
                                                   input_field="input", system=req.instructions,
                                                   replaces_system=new_system), info)
    except BaseException as e:
        if created_session:
            with contextlib.suppress(NotFound):
                await run_in_threadpool(daemon.delete_session, sid)
        if isinstance(e, Conflict) and e.param == "session" and req.previous_response_id:
            raise Conflict(f"response {req.previous_response_id} is already being continued by another request; "
                           f"continue from the response that one makes", param="previous_response_id") from None
        raise
    reply = _Reply(req, turn, daemon.model_name, sid, new_session=created_session)
    if req.stream:
        def closed() -> None:  # (also when the stream never started: its own finally never runs)
            turn.abandon()
            reply.drop_unstored()

        return sse_response(_stream(request, reply), on_close=closed)
    reply.register()
    try:
        events = await turn.collect(request)
        parser = reply.parser
        for ev in events:
            if ev["type"] == "token":
                for delta in parser.push_token(ev["text"]):
                    reply.items.feed(delta)
        for delta in parser.finish():
            reply.items.feed(delta)
        reply.items.ensure_any()
        reply.items.close(parser.answer.calls, cut=turn.finish_reason != "stop")
        obj = reply.finish()
        await reply.store(obj)
    finally:
        reply.unregister()
        reply.drop_unstored()
    return JSONResponse(obj)


@router.get("/v1/responses/{rid}")
async def get_response(request: Request, rid: str) -> dict:
    state = state_of(request)
    try:
        _, obj = await run_in_threadpool(state.daemon.get_response, rid)
    except NotFound:
        running = state.running_responses.get(rid)
        if running is None:
            raise
        return running.obj("in_progress")  # stored once it ends
    return obj


@router.delete("/v1/responses/{rid}")
async def delete_response(request: Request, rid: str) -> dict:
    state = state_of(request)
    if rid in state.running_responses:
        raise Conflict(f"response {rid} is still being generated; delete it once it has ended", param="response_id",
                       retryable=True)
    await run_in_threadpool(state.daemon.delete_response, rid)
    return {"id": rid, "object": "response", "deleted": True}


class _Reply:
    """One response being built: its id, items, and the request fields it echoes."""

    def __init__(self, req: ResponsesRequest, turn: Turn, model: str, sid: str | None, new_session: bool = False):
        self.req, self.turn, self.model, self.sid = req, turn, model, sid
        self.new_session = new_session  # its session was made for it (a new chain, or a branch)
        self.stored = self.dropped = False
        self.id = new_id("resp")
        self.created = int(time.time())
        self.items = OutputItems(sealed_reasoning="reasoning.encrypted_content" in (req.include or ()))
        plan = getattr(turn.handle, "answer", None)
        self.parser = plan.parser(getattr(turn.handle, "call_seed", None)) if plan is not None else AnswerParser()

    def obj(self, status: str) -> dict:
        r, t = self.req, self.turn
        tools = [t_.model_dump(exclude_none=True) for t_ in r.tools or []]
        choice = r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump") else (r.tool_choice or "auto")
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": self.items.items if status != "in_progress" else [],
               "instructions": r.instructions, "previous_response_id": r.previous_response_id,
               "tools": tools, "tool_choice": choice,
               "parallel_tool_calls": DEFAULT_PARALLEL if r.parallel_tool_calls is None else r.parallel_tool_calls,
               "text": {"format": fmt, "verbosity": (r.text.verbosity if r.text else None) or "medium"},
               "temperature": r.temperature, "top_p": r.top_p,
               "max_output_tokens": r.max_output_tokens, "store": r.store, "truncation": "disabled",
               "metadata": (r.model_extra or {}).get("metadata") or {}, "error": None, "incomplete_details": None,
               "usage": None, "completed_at": None, "reasoning": {"effort": None, "summary": None},
               "weave": {**t.weave(), "session": self.sid}}
        return out

    def finish(self) -> dict:
        """The final object (status from how the turn ended; usage)."""
        t = self.turn
        if t.error is not None:
            obj = self.obj("failed")
            obj["error"] = {"code": t.failure().code or "server_error",
                            "message": t.error.get("message", "the turn failed")}
            return obj
        reason = t.finish_reason
        obj = self.obj("completed" if reason == "stop" else "cancelled" if reason == "cancelled" else "incomplete")
        if reason == "stop":
            obj["completed_at"] = int(time.time())
        if reason == "length":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        elif reason not in ("stop", "cancelled"):
            obj["incomplete_details"] = {"reason": reason}
        u = t.usage
        cached = u["prompt_tokens_details"]["cached_tokens"]
        # written to a cache: the prompt rows computed into a stored response's session, which a continuation
        # reads instead of computing them again
        written = u["prompt_tokens"] - cached if self.kept else 0
        obj["usage"] = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                        "total_tokens": u["total_tokens"],
                        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                        "output_tokens_details": {"reasoning_tokens": self.parser.reasoning_tokens}}
        return obj

    @property
    def kept(self) -> bool:
        """Stored once it ends (``store``, in a chain's session)."""
        return bool(self.req.store) and self.sid is not None

    def register(self) -> None:
        """A response that will be stored is visible (in_progress) while it is generated."""
        if self.kept:
            self.turn.state.running_responses[self.id] = self

    def unregister(self) -> None:
        self.turn.state.running_responses.pop(self.id, None)

    async def store(self, obj: dict) -> None:
        if self.kept and obj["status"] in ("completed", "incomplete"):
            await run_in_threadpool(self.turn.state.daemon.store_response, self.sid, self.id, obj)
            self.stored = True

    def drop_unstored(self) -> None:
        """A session made for this response that stores none (it failed, was cancelled, or its client left)
        holds no chain anyone can continue: deleted (off the event loop; cancelling its turn if it runs),
        else it would hold a session slot and its KV for good."""
        if not self.new_session or self.stored or self.sid is None or self.dropped:
            return
        self.dropped = True
        daemon = self.turn.state.daemon

        def drop() -> None:
            with contextlib.suppress(NotFound):
                daemon.delete_session(self.sid)

        asyncio.get_running_loop().run_in_executor(None, drop)


async def _stream(request: Request, reply: _Reply) -> AsyncIterator[bytes]:
    """The typed events: created, in_progress, each item's added / deltas / done, then completed (or
    incomplete / failed), each with its sequence number."""
    turn, seq = reply.turn, 0

    def ev(e: dict) -> bytes:
        nonlocal seq
        e = {**e, "sequence_number": seq}
        seq += 1
        return frame(e, event=e["type"])  # as OpenAI sends them: named events, no [DONE] at the end

    turn.watch(request)
    reply.register()  # (here, not before: a stream that never starts never unregisters)
    try:
        yield ev({"type": "response.created", "response": reply.obj("in_progress")})
        yield ev({"type": "response.in_progress", "response": reply.obj("in_progress")})
        async for e in turn.events(progress=True):
            if e["type"] == "progress":
                yield progress_comment(e)
            elif e["type"] == "token":
                for delta in reply.parser.push_token(e["text"]):
                    for out in reply.items.feed(delta):
                        yield ev(out)
        if turn.error is None:
            for delta in reply.parser.finish():
                for out in reply.items.feed(delta):
                    yield ev(out)
        ended = reply.items.ensure_any() + reply.items.close(reply.parser.answer.calls,
                                                             cut=turn.finish_reason != "stop")
        for out in ended:
            yield ev(out)
        obj = reply.finish()
        await reply.store(obj)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(obj["status"],
                                                                                    "response.incomplete")
        yield ev({"type": kind, "response": obj})
    finally:
        reply.unregister()
        turn.unwatch()
        turn.abandon()
        reply.drop_unstored()
