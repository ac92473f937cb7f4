"""Chat turns, answered as OpenAI's chat completions: one JSON body, or SSE chunks ending ``[DONE]``.

Used by ``POST /v1/chat/completions`` (a plain OpenAI call, or a turn of the session its ``session``
field or ``X-Weave-Session`` header names) and ``POST /v1/sessions/{id}/turns``.  With a session,
``messages`` are the turn's new messages only: the session holds the conversation so far, and
``detach: true`` answers 202 at once while the turn runs to its end (its answer lands in the transcript).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weaved.agent.stream import Answer, AnswerParser
from weaved.agent.tool_results import check_tool_results
from weaved.api.agent_models import answer_spec
from weaved.api.choices import collect_all, merged, start_choices, total_usage, watch
from weaved.api.logprobs import AnswerEntries, chat_entry
from weaved.api.models import ChatRequest
from weaved.api.params import chat_params, check_model, check_vocab
from weaved.api.sse import DONE, frame, progress_comment, sse_response, stream_chunk
from weaved.api.state import ApiState, state_of
from weaved.api.turn import Turn, TurnSpec, abandon_all, resolve, start_turn
from weaved.errors import InvalidRequest
from weaved.routing.types import SLA


def chat_spec(state: ApiState, req: ChatRequest, session_id: str | None, sla: SLA | None,
              continues: int | None = None) -> TurnSpec:
    """The turn ``req`` asks for (a detached one journals ``req`` itself, to run again if a stop cuts
    it); InvalidRequest for what no turn can answer."""
    check_model(state, req.model)
    params = chat_params(req)
    check_vocab(state.daemon.tokenizer, params)
    answer = answer_spec(req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format,
                         req.chat_template_kwargs)
    if req.detach and (session_id is None or req.stream):
        raise InvalidRequest("detach needs a session and no stream: the answer goes to the session's "
                             "transcript", param="detach")
    if req.detach and req.n > 1:
        raise InvalidRequest("detach answers one choice into the session's transcript; n must be 1", param="n")
    messages = [m.to_dict() for m in req.messages]
    if session_id is None:  # (a session's turn: the daemon checks against its last answer's calls)
        check_tool_results(messages, set())
    detached = req.model_dump(mode="json", exclude_unset=True, by_alias=True) if req.detach else None
    limit = "max_completion_tokens" if req.max_tokens is None and req.max_completion_tokens else "max_tokens"
    return TurnSpec(session_id, params, sla, messages=messages, answer=answer, continues=continues,
                    detached=detached, limit_field=limit)


def journaled_sla(detached: dict | None, sla: SLA | None) -> dict | None:
    """A detached request as it is journaled, its SLA tags the resolved ones: targets given as headers
    (``X-Weave-TTLT-S``, ...) hold for the turn run again after a restart, which has no headers."""
    if detached is None or sla is None:
        return detached
    tags = {k: v for k, v in sla.to_dict().items() if v is not None}
    return {**detached, "sla": tags}


async def answer_chat(request: Request, req: ChatRequest, session_id: str | None) -> Response:
    state = state_of(request)
    spec = chat_spec(state, req, session_id, None)  # a bad request is refused before the session is looked up
    info, sla = await resolve(state, session_id, req.sla, request.headers)
    spec = dataclasses.replace(spec, sla=sla, detached=journaled_sla(spec.detached, sla))
    meta = _Meta(state.daemon.model_name, req.logprobs)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.n > 1:
        turns = await start_choices(state, spec, req.n)
        if req.stream:
            return sse_response(_stream(request, turns, meta, usage), on_close=lambda: abandon_all(turns))
        return JSONResponse(_body(turns, meta, await collect_all(request, turns), state.daemon.tokenizer))
    turn = await start_turn(state, spec, info)
    if req.detach:
        turn.detach()
        return JSONResponse({"id": session_id, "object": "session.turn", "status": "running",
                             "placement": turn.placement, "weave": turn.weave()}, status_code=202)
    if req.stream:
        return sse_response(_stream(request, [turn], meta, usage), on_close=turn.abandon)
    events = await turn.collect(request)
    return JSONResponse(_body([turn], meta, [events], state.daemon.tokenizer))


class _Meta:
    def __init__(self, model: str, logprobs: bool):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs


def _parser(turn: Turn) -> AnswerParser:
    plan = getattr(turn.handle, "answer", None)
    return plan.parser(getattr(turn.handle, "call_seed", None)) if plan is not None else AnswerParser()


def assistant_message(ans: Answer) -> dict:
    """The answer as OpenAI's assistant message: content (null when only calls), reasoning, calls."""
    msg: dict = {"role": "assistant", "content": ans.content if (ans.content or not ans.calls) else None}
    if ans.reasoning:
        msg["reasoning_content"] = ans.reasoning
    if ans.calls:
        msg["tool_calls"] = [c.to_openai() for c in ans.calls]
    return msg


def finish_reason(turn: Turn, ans: Answer) -> str | None:
    """``tool_calls`` when the answer ended by itself with complete calls (a call cut by the token limit
    is still given, with what came of its arguments, under ``length``)."""
    done = ans.calls and all(c.complete for c in ans.calls)
    return "tool_calls" if done and turn.finish_reason == "stop" else turn.finish_reason


def _choice(turn: Turn, index: int, meta: _Meta, events: list[dict], tokenizer) -> dict:
    parser = _parser(turn)
    entries, content = AnswerEntries(parser), []
    for ev in events:
        if ev["type"] == "token":
            parser.push_token(ev["text"])
            if meta.logprobs:  # the answer's tokens (not the reasoning's, nor an envelope's around its text)
                content += entries.push(ev, _entry(tokenizer, ev))
    parser.finish()
    content += entries.finish()
    turn.reasoning_tokens = parser.reasoning_tokens
    ans = parser.answer
    logprobs = {"content": content} if meta.logprobs else None
    return {"index": index, "message": assistant_message(ans), "logprobs": logprobs,
            "finish_reason": finish_reason(turn, ans)}


def _entry(tokenizer, ev: dict) -> dict | None:
    """A token event's ``logprobs.content`` item (None for an event without one)."""
    if "logprob" not in ev:
        return None
    return chat_entry(tokenizer, ev["token"], ev["logprob"], ev.get("top_logprobs", ()))


def _body(turns: list[Turn], meta: _Meta, events: list[list[dict]], tokenizer) -> dict:
    choices = [_choice(t, i, meta, ev, tokenizer) for i, (t, ev) in enumerate(zip(turns, events, strict=True))]
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": total_usage(turns), "weave": turns[0].weave()}


def _chunk(meta: _Meta, delta: dict, *, index: int = 0, finish: str | None = None, logprobs: dict | None = None,
           usage: bool = False, weave: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return stream_chunk(meta, "chat.completion.chunk", choice, usage=usage, weave=weave)


async def _stream(request: Request, turns: list[Turn], meta: _Meta, usage: bool) -> AsyncIterator[bytes]:
    """The chunks: per choice the role first, then reasoning, content and tool-call deltas (with
    logprobs), its finish reason; then usage and [DONE].  The ``weave`` field rides on the first and the
    finishing chunks."""
    tokenizer = turns[0].state.daemon.tokenizer
    parsers = [_parser(t) for t in turns]
    gates = [AnswerEntries(p) for p in parsers]  # each choice's log-probabilities go out with their text
    # The role chunk goes first; where the answer may be calls it waits for the answer's first piece, so
    # that a call's says "content": null, as OpenAI's does (an answer of text gets "" as always).
    waiting = [getattr(getattr(t.handle, "answer", None), "offers_tools", False) is True for t in turns]

    def role(i: int, delta: dict | None = None, lp: dict | None = None) -> bytes:
        """Choice ``i``'s first chunk: the role, with the answer's first piece (``delta``) when that is no
        text (its first call, its reasoning, or ``{}``: a token that only has log-probabilities): "content"
        is then null, as the answer's is unstreamed when it only calls."""
        waiting[i] = False
        first = {"role": "assistant", "content": "" if delta is None else None, **(delta or {})}
        return frame(_chunk(meta, first, index=i, logprobs=lp, usage=usage, weave=turns[i].weave()))

    def opened(i: int, delta: dict, lp: dict | None = None) -> list[bytes]:
        out = []
        if waiting[i]:
            if "content" not in delta:
                return [role(i, delta, lp)]
            out.append(role(i))
        return [*out, frame(_chunk(meta, delta, index=i, logprobs=lp, usage=usage))]

    def pieces(i: int, deltas: list[dict], released: list) -> Iterator[bytes]:
        """The chunks of a choice's deltas, its released log-probabilities on the first (alone in an empty
        delta when the text that released them is held back)."""
        lp = {"content": released} if released else None
        if not deltas and lp is not None:
            deltas = [{}]
        for j, delta in enumerate(deltas):
            yield from opened(i, delta, lp if j == 0 else None)

    watcher = asyncio.create_task(watch(request, turns))
    try:
        for i in range(len(turns)):
            if not waiting[i]:
                yield role(i)
        async for i, ev in merged(turns, progress=True):
            t, parser = turns[i], parsers[i]
            if ev["type"] == "progress":
                yield progress_comment(ev)
            elif ev["type"] == "token":
                deltas = parser.push_token(ev["text"])
                t.reasoning_tokens = parser.reasoning_tokens
                for chunk in pieces(i, deltas, gates[i].push(ev, _entry(tokenizer, ev)) if meta.logprobs else []):
                    yield chunk
            elif ev["type"] in ("done", "error") and t.error is None:
                tail = parser.finish()
                for chunk in pieces(i, tail, gates[i].finish() if meta.logprobs else []):
                    yield chunk
                if waiting[i]:  # an answer with nothing in it: its role chunk still comes first
                    yield role(i)
                yield frame(_chunk(meta, {}, index=i, finish=finish_reason(t, parser.answer), usage=usage,
                                   weave=t.weave()))
        failed = next((t for t in turns if t.error is not None), None)
        if failed is not None:
            yield frame(failed.failure().to_dict())
        elif usage:
            yield frame({"id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
                         "model": meta.model, "choices": [], "usage": total_usage(turns)})
        yield DONE
    finally:
        watcher.cancel()
        for t in turns:
            t.abandon()
