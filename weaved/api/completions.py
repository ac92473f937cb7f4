"""``POST /v1/completions``: a raw prompt (text or token ids) continued, as OpenAI's legacy API.

``echo: true`` puts the prompt in front of the output; with ``logprobs: N`` as well, the prompt's
tokens come with their log-probabilities too (the first one has none: nothing predicts it), as vLLM
does - evaluation harnesses score text this way.  With a ``session`` the prompt is appended to the
session's context.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from weaved.api.choices import collect_all, merged, start_choices, total_usage, watch
from weaved.api.logprobs import CompletionLogprobs, TextGate
from weaved.api.models import CompletionRequest
from weaved.api.params import check_model, check_vocab, completion_params, session_from
from weaved.api.sse import DONE, frame, progress_comment, sse_response, stream_chunk
from weaved.api.state import state_of
from weaved.api.turn import Turn, TurnSpec, abandon_all, resolve, start_turn
from weaved.errors import InvalidRequest


async def answer_completion(request: Request, req: CompletionRequest) -> Response:
    state = state_of(request)
    check_model(state, req.model)
    params = completion_params(req)
    if req.echo and req.n > 1:  # the choices fork one prefill: only the first would have the prompt's rows
        raise InvalidRequest("n > 1 cannot be combined with echo", param="n")
    prompt = req.single_prompt()
    tokenizer = state.daemon.tokenizer
    check_vocab(tokenizer, params)
    if isinstance(prompt, list):
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and max(prompt) >= vocab:
            raise InvalidRequest(f"prompt token id {max(prompt)} is outside the vocabulary (0..{vocab - 1})",
                                 param="prompt")
    session_id = session_from(req, request.headers)
    info, sla = await resolve(state, session_id, req.sla, request.headers)
    prompt_logprobs = req.echo and req.logprobs is not None
    spec = TurnSpec(session_id, params, sla, prompt=prompt, echo=prompt_logprobs, input_field="prompt")
    echo = (prompt if isinstance(prompt, str) else tokenizer.decode(prompt)) if req.echo else ""
    meta = _Meta(state.daemon.model_name, req.logprobs is not None, echo)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.n > 1:
        turns = await start_choices(state, spec, req.n)
        if req.stream:
            return sse_response(_stream_choices(request, turns, meta, usage, tokenizer),
                                on_close=lambda: abandon_all(turns))
        events = await collect_all(request, turns)
        body = _body(turns[0], meta, events[0], tokenizer)
        body["choices"] = [{**_body(t, meta, ev, tokenizer)["choices"][0], "index": i}
                           for i, (t, ev) in enumerate(zip(turns, events, strict=True))]
        body["usage"] = total_usage(turns)
        return JSONResponse(body)
    turn = await start_turn(state, spec, info)
    if req.stream:
        return sse_response(_stream(request, turn, meta, usage, tokenizer), on_close=turn.abandon)
    events = await turn.collect(request)
    return JSONResponse(_body(turn, meta, events, tokenizer))


class _Meta:
    def __init__(self, model: str, logprobs: bool, echo: str):
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.echo = echo


class _Entries:
    """One choice's log-probability entries as its events arrive: the prompt's (echo), then the generated
    tokens' that its text holds (``TextGate``)."""

    def __init__(self, tokenizer, echo: str):
        self.lps = CompletionLogprobs(tokenizer, text_start=len(echo))
        self.echo = echo
        self.gate = TextGate()

    def add(self, ev: dict) -> None:
        """A ``prompt_logprobs`` or ``token`` event.  A BOS the tokenizer put in front of the prompt stays
        an entry (the entries are the model's positions) but is not in the echoed text: it takes no room
        there, so every offset indexes the text."""
        lps = self.lps
        if ev["type"] == "prompt_logprobs":
            bos, bos_text = getattr(lps.tokenizer, "bos_id", None), getattr(lps.tokenizer, "bos_text", "")
            for token_id, lp, top in ev["items"]:
                first_bos = not len(lps) and lp is None and bos is not None and token_id == bos
                lps.add(token_id, lp, top, in_text=not (first_bos and not self.echo.startswith(bos_text)))
        elif ev["type"] == "token":
            entry = (ev["token"], ev["logprob"], ev.get("top_logprobs", ()), ev["at"]) if "logprob" in ev else None
            for token_id, lp, top, at in self.gate.push(ev, entry):
                lps.add_generated(token_id, lp, top, at)

    def take(self) -> dict | None:
        """The entries since the last take (one streamed chunk's worth), or None when there are none."""
        return self.lps.take() if len(self.lps) else None


def _body(turn: Turn, meta: _Meta, events: list[dict], tokenizer) -> dict:
    text = meta.echo + "".join(ev["text"] for ev in events if ev["type"] == "token")
    logprobs = None
    if meta.logprobs:
        entries = _Entries(tokenizer, meta.echo)
        for ev in events:
            entries.add(ev)
        logprobs = entries.lps.to_dict()
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": turn.finish_reason}
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [choice], "usage": turn.usage, "weave": turn.weave()}


def _chunk(meta: _Meta, text: str, *, logprobs: dict | None = None, finish: str | None = None,
           usage: bool = False, weave: dict | None = None, index: int = 0) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return stream_chunk(meta, "text_completion", choice, usage=usage, weave=weave)


async def _stream(request: Request, turn: Turn, meta: _Meta, usage: bool, tokenizer) -> AsyncIterator[bytes]:
    """Chunks of text (with logprobs).  An echoed prompt goes out whole, with its log-probabilities,
    in the first chunk - sent when the first token (or the end) arrives, so every prompt entry is in."""
    entries = _Entries(tokenizer, meta.echo)
    echo_pending = bool(meta.echo)
    first = True
    turn.watch(request)
    try:
        async for ev in turn.events(progress=True):
            if ev["type"] == "progress":
                yield progress_comment(ev)
                continue
            if ev["type"] == "prompt_logprobs":
                entries.add(ev)
                continue
            if echo_pending and ev["type"] in ("token", "done"):
                yield frame(_chunk(meta, meta.echo, logprobs=entries.lps.take() if meta.logprobs else None,
                                   usage=usage, weave=turn.weave()))
                echo_pending, first = False, False
            if ev["type"] == "token":
                entries.add(ev)
                lp = entries.take() if meta.logprobs else None
                if ev["text"] or lp is not None:
                    yield frame(_chunk(meta, ev["text"], logprobs=lp, usage=usage,
                                       weave=turn.weave() if first else None))
                    first = False
        if turn.error is not None:
            yield frame(turn.failure().to_dict())
        else:
            yield frame(_chunk(meta, "", finish=turn.finish_reason, usage=usage, weave=turn.weave()))
            if usage:
                yield frame({"id": meta.id, "object": "text_completion", "created": meta.created,
                             "model": meta.model, "choices": [], "usage": turn.usage})
        yield DONE
    finally:
        turn.unwatch()
        turn.abandon()


async def _stream_choices(request: Request, turns: list[Turn], meta: _Meta, usage: bool,
                          tokenizer) -> AsyncIterator[bytes]:
    """n choices' chunks, merged as they come, each with its index (no echo: refused with n > 1)."""
    logs = [_Entries(tokenizer, "") for _ in turns]
    watcher = asyncio.create_task(watch(request, turns))
    try:
        async for i, ev in merged(turns, progress=True):
            t = turns[i]
            if ev["type"] == "progress":
                yield progress_comment(ev)
            elif ev["type"] == "token":
                logs[i].add(ev)
                lp = logs[i].take() if meta.logprobs else None
                if ev["text"] or lp is not None:
                    yield frame(_chunk(meta, ev["text"], logprobs=lp, usage=usage, index=i))
            elif ev["type"] == "done":
                yield frame(_chunk(meta, "", finish=t.finish_reason, usage=usage, weave=t.weave(), index=i))
        failed = next((t for t in turns if t.error is not None), None)
        if failed is not None:
            yield frame(failed.failure().to_dict())
        elif usage:
            yield frame({"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                         "choices": [], "usage": total_usage(turns)})
        yield DONE
    finally:
        watcher.cancel()
        for t in turns:
            t.abandon()
