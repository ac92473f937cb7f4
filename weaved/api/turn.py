"""One turn in flight as the API sees it: started on the daemon, its events bridged to the event loop.

The daemon calls ``emit`` from an engine thread; the loop's ``Outbox`` moves each event into an asyncio
queue that the request's coroutine reads, waking the loop once for all the events of a step.  A watcher
task waits for the client to hang up and cancels the generation then, so an abandoned request frees its
slot at the engine's next step.  Timing (time to first token, gaps between tokens) and token counts go
to the metrics here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request

from weaved.agent.plan import AnswerSpec
from weaved.api.models import SLABody
from weaved.api.outbox import outbox
from weaved.api.params import sla_from
from weaved.api.state import ApiState
from weaved.engine.sampling import SamplingParams
from weaved.errors import ContextTooLong, NotFound, Overloaded, WeaveError
from weaved.http_errors import REQUEST_ID, status_type
from weaved.routing.types import SLA, SLAClass

_draining: set[asyncio.Task] = set()
log = logging.getLogger("weave.api")


@dataclass(frozen=True)
class TurnSpec:
    session_id: str | None  # None: an ephemeral session, gone after the turn
    params: SamplingParams
    sla: SLA | None = None
    messages: list[dict] | None = None  # chat: this turn's new messages
    prompt: str | list[int] | None = None  # completions: text or token ids
    echo: bool = False  # the prompt tokens' log-probabilities too
    answer: AnswerSpec | None = None  # chat: tools, response format, template arguments
    continues: int | None = None  # a stored response's transcript end the turn follows (Responses chains)
    detached: dict | None = None  # a detached turn's request, journaled until the turn ends
    limit_field: str = "max_tokens"  # the request's name for params.max_tokens (errors name it)
    input_field: str = "messages"  # the request's name for what the turn feeds: prompt, input (errors name it)
    system: str | None = None  # with replaces_system: the session's system prompt from this turn on
    replaces_system: bool = False


class TurnFailed(WeaveError):
    """The engine failed the turn after it started (e.g. the KV cap was reached)."""


class Turn:
    def __init__(self, state: ApiState, handle, queue: asyncio.Queue, spec: TurnSpec, sla_class: str,
                 placement: dict | None, arrived: float):
        self.state, self.handle, self.spec = state, handle, spec
        self._queue = queue
        self.sla_class = sla_class
        self.placement = placement
        self.arrived = arrived  # time.monotonic() when the request came in
        self._drained = False  # its events are read in the background (``detach``)
        self.shares_prompt = False  # a later choice of an n > 1 request: its prompt is choice 0's
        self.session = spec.session_id  # the client's session (None for an ephemeral one)
        self.request_id = REQUEST_ID.get()  # the request that started it (the log links the two)
        self.finish_reason: str | None = None
        self.error: dict | None = None
        self.completion_tokens = 0
        self._usage: dict | None = None
        self.reasoning_tokens = 0  # of the answer, as its parser counted them (usage's reasoning_tokens)
        self._last_token_at: float | None = None
        self.ttft_seen: float | None = None  # seconds from the request to its first token, as the client saw
        self._watcher: asyncio.Task | None = None
        # a turn that may call tools keeps its text: its metrics count an answer of calls as such
        plan = getattr(handle, "answer", None)
        self._text: list[str] | None = [] if plan is not None and plan.offers_tools else None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def usage(self) -> dict:
        prompt = int(self.handle.prompt_tokens)
        done_usage = self._usage or {}
        completion = int(done_usage.get("completion_tokens", self.completion_tokens))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": int(getattr(self.handle, "cached_tokens", 0))}}

    def weave(self) -> dict:
        """The ``weave`` field of every response: the session and its placement as it is now (a
        promotion moves a running turn), and the committed tokens fed again because the chat template
        rewrote history, when it did."""
        now = getattr(self.handle, "placement_now", None)
        if now is not None:  # a promotion or demotion while the turn runs: its finishing chunk says so
            self.placement = now()
        out = {"session": self.session, "placement": self.placement}
        if getattr(self.handle, "reprefilled", 0):
            out["reprefilled_tokens"] = int(self.handle.reprefilled)
        return out

    def cancel(self) -> None:
        if not self.done:
            self.handle.cancel()

    def abandon(self) -> None:
        """Nobody reads this turn any more (finished, or the client left): cancel it if it still runs,
        and read its last events in the background so that its metrics are recorded all the same."""
        if self.done:
            return
        self.cancel()
        self.detach()

    def detach(self) -> None:
        """Let the turn run to its end with nobody listening; its events are read in the background
        (its answer lands in the session's transcript, its timing in the metrics).  Once only: a turn
        let go of by its stream and by its response's end is read by one reader."""
        if self.done or self._drained:
            return
        self._drained = True

        async def drain() -> None:
            async for _ in self.events():
                pass

        task = asyncio.create_task(drain())
        _draining.add(task)  # a reference, so the task is not collected before it ends
        task.add_done_callback(_draining.discard)

    # ---- the client ------------------------------------------------------------------------------
    def watch(self, request: Request) -> None:
        """Cancel the generation when the client disconnects (until ``unwatch``)."""

        async def wait() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.cancel()
                    return

        self._watcher = asyncio.create_task(wait())

    def unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    # ---- events ----------------------------------------------------------------------------------
    async def events(self, progress: bool = False) -> AsyncIterator[dict]:
        """The turn's events, ending with its ``done`` or ``error`` event; with ``progress``, also the
        ``progress`` events of a prompt that takes more than one step (``{"prefilled", "prompt"}``:
        tokens fed so far, of the prompt's tokens not taken from a cached prefix), which a stream
        passes on as comments (``sse.progress_comment``)."""
        while not self.done:
            ev = await self._queue.get()
            if ev.get("type") == "progress" and not progress:
                continue
            self._account(ev)
            yield ev

    async def collect(self, request: Request) -> list[dict]:
        """Every event of the turn (a non-streaming answer); raises TurnFailed if the engine failed it."""
        self.watch(request)
        try:
            events = [ev async for ev in self.events()]
        finally:
            self.unwatch()
            self.abandon()
        if self.error is not None:
            raise self.failure()
        return events

    def failure(self) -> WeaveError:
        assert self.error is not None
        message = self.error.get("message", "the turn failed")
        if self.completion_tokens and self.session is not None:  # (a stream showed them; an answer did not)
            message += (f" (the {self.completion_tokens} token(s) generated before it are kept in session "
                        f"{self.session}'s transcript, ended as \"error\": POST /v1/sessions/{self.session}/rewind "
                        f"takes the turn back)")
        exc = TurnFailed(message)
        exc.status = int(self.error.get("status", 500))
        if exc.status == 507:  # the disk: the code a client tells it by (InsufficientStorage's)
            exc.code = "insufficient_storage"
        # the cause's own type, code and retry advice where the engine passed them on (a full KV cap), else
        # the type its status has (a lost KV file's 409: a conflict)
        exc.type = self.error.get("error_type") or status_type(exc.status)
        exc.code = self.error.get("code", exc.code)
        exc.retry_after_s = self.error.get("retry_after_s", 1.0)
        exc.retryable = self.error.get("retryable", exc.status == 503)  # (a lost KV file's 409: not)
        exc.logged = True  # the engine said it in the log already
        return exc

    def _account(self, ev: dict) -> None:
        kind = ev.get("type")
        m = self.state.metrics
        if kind == "token" and ev.get("token") is not None:
            now = time.monotonic()
            if self._last_token_at is None:
                self.ttft_seen = now - self.arrived
                m.ttft.labels(self.sla_class).observe(self.ttft_seen)
            else:
                m.inter_token.labels(self.sla_class).observe(now - self._last_token_at)
            self._last_token_at = now
            self.completion_tokens += 1
            if self._text is not None:
                self._text.append(ev.get("text", ""))
        elif kind in ("done", "error"):
            self._usage = ev.get("usage")
            if kind == "done":
                self.finish_reason = ev.get("finish_reason") or "stop"
            else:
                self.error = ev
                if int(ev.get("status", 500)) == 500:  # a bug the engine logged by session: name the request
                    log.warning("%s: its turn in session %s failed: %s", self.request_id or "no request id",
                                getattr(self.handle, "session_id", self.session), ev.get("message", "?"))
            u = self.usage
            prompt, cached = (0, 0) if self.shares_prompt else (u["prompt_tokens"],
                                                                 u["prompt_tokens_details"]["cached_tokens"])
            reason = self._metric_reason()
            m.observe_turn(self.sla_class, reason, prompt, cached, u["completion_tokens"],
                           int(getattr(self.handle, "reprefilled", 0)))
            if reason in ("stop", "length", "tool_calls"):  # (a cancelled or failed turn met nothing)
                m.observe_targets(self.sla_class, time.monotonic() - self.arrived, self.ttft_seen, ev)

    def _metric_reason(self) -> str:
        """The finish reason the API gives the client: ``tool_calls`` for an answer that ended by itself
        with complete calls (as ``api.chat.finish_reason`` decides it)."""
        if self.error is not None or self.finish_reason is None:
            return "error"
        if self.finish_reason == "stop" and self._text:
            parser = self.handle.answer.parser(getattr(self.handle, "call_seed", None))
            parser.push("".join(self._text))
            parser.finish()
            calls = parser.answer.calls
            if calls and all(c.complete for c in calls):
                return "tool_calls"
        return self.finish_reason


def emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
    """``emit(ev)`` for an engine thread: ``ev`` reaches ``queue`` on ``loop`` (through the loop's outbox,
    which wakes it once for a step's events)."""
    return partial(outbox(loop).put, queue)


async def resolve(state: ApiState, session_id: str | None, sla_body: SLABody | None,
                  headers: Headers) -> tuple[dict | None, SLA | None]:
    """The session's record (NotFound for an unknown id) and the turn's SLA tags, if it gives any (the
    tags it leaves out are the session's)."""
    info = await run_in_threadpool(state.daemon.get_session, session_id) if session_id is not None else None
    return info, sla_from(sla_body, headers, SLA.from_dict(info["sla"]) if info is not None else None)


def named_limit(e: ContextTooLong, field: str) -> ContextTooLong:
    """``e`` naming the request's own field for the answer's length (``max_completion_tokens``,
    ``max_output_tokens``) where the daemon says ``max_tokens``."""
    if e.param != "max_tokens" or field == "max_tokens":
        return e
    return ContextTooLong(e.message.replace("max_tokens", field, 1), param=field)


def abandon_all(turns: list[Turn]) -> None:
    """``Turn.abandon`` each: a response over, whatever became of its streaming."""
    for t in turns:
        t.abandon()


async def start_turn(state: ApiState, spec: TurnSpec, session_info: dict | None = None) -> Turn:
    """Start ``spec`` on the daemon (WeaveError for a request it refuses; nothing changes then).
    ``session_info`` is the session's record from ``resolve`` when the turn belongs to a session."""
    arrived = time.monotonic()
    if state.closing.is_set():
        raise Overloaded("the daemon is shutting down")
    daemon = state.daemon
    session_id = spec.session_id
    if session_id is None:
        # An ephemeral session, created here so that its placement is known even if the turn is over
        # (and the session gone) before start_turn returns.
        session_info = await run_in_threadpool(
            partial(daemon.create_session, spec.sla or SLA(SLAClass.INTERACTIVE), None, None, ephemeral=True))
        session_id = session_info["id"]
    queue: asyncio.Queue = asyncio.Queue()
    start = partial(daemon.start_turn, session_id=session_id, messages=spec.messages, prompt=spec.prompt,
                    params=spec.params, sla=spec.sla, echo=spec.echo, answer=spec.answer, continues=spec.continues,
                    detached=spec.detached, emit=emitter(asyncio.get_running_loop(), queue),
                    **({"system": spec.system, "replaces_system": True} if spec.replaces_system else {}))
    try:
        handle = await run_in_threadpool(start)
    except BaseException as e:
        if spec.session_id is None:  # the refused turn's ephemeral session goes (if still there)
            with contextlib.suppress(NotFound):
                await run_in_threadpool(daemon.delete_session, session_id)
        if isinstance(e, WeaveError) and e.param == "messages":  # the request's own name for what it feeds
            e.param = spec.input_field  # (prompt, input)
        if isinstance(e, ContextTooLong):
            raise named_limit(e, spec.limit_field) from None
        raise
    placement = getattr(handle, "placement", None) or (session_info or {}).get("placement")
    if spec.sla is not None:
        sla_class = spec.sla.cls.value
    elif session_info is not None:
        sla_class = session_info["sla"]["class"]
    else:
        sla_class = "interactive"
    return Turn(state, handle, queue, spec, sla_class, placement, arrived)
