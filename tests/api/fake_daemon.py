"""A test double of ``weaved.daemon.core.Daemon`` for the API's tests: same interface, canned token streams.

Tokens are bytes (token id = byte value, 256 = end of turn), so text and ids map trivially.  Each turn
streams ``reply`` one byte per token from its own thread, as the real engine does, and honours
``max_tokens``, ``stop``, cancellation and shutdown.  ``hold`` keeps turns from producing tokens until
``release()`` (or a cancel), so tests can catch a turn in flight; ``fail`` makes every turn fail with
that message after its first token, as the engine does when the KV cap is reached.  Every call is
recorded in ``calls``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from weaved.daemon.events import EventBus, Subscription
from weaved.errors import Conflict, ContextTooLong, InvalidRequest, NotFound, Overloaded
from weaved.routing.types import SLA, SLAClass

EOT = 256


class ByteTokenizer:
    vocab_size = 257
    eog_ids = frozenset({EOT})

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return b"<|eot|>" if token == EOT else bytes([token])

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def _placement(sla: SLA) -> dict:
    prio = {"interactive": 2, "background": 1, "batch": 0}[sla.cls.value]
    return {"prefill_strategy": "standard", "decode_strategy": "standard", "prefill_pool": "cpu",
            "decode_pool": "cpu", "priority": prio, "reasons": [f"{sla.cls.value}: the only pool"]}


@dataclass
class _Session:
    id: str
    sla: SLA
    max_context: int
    system: str | None
    ephemeral: bool
    placement: dict
    tokens: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    busy: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class FakeHandle:
    session_id: str
    prompt_tokens: int
    cached_tokens: int
    _daemon: FakeDaemon

    def cancel(self) -> None:
        self._daemon.cancel_turn(self.session_id)


class FakeDaemon:
    def __init__(self, reply: str = "Hello from Weave!", *, context_length: int = 512, max_sessions: int = 4,
                 hold: bool = False, fail: str | None = None, fail_status: int | None = None,
                 prefill_chunk: int | None = None):
        self.reply = reply
        self.deleted_created: dict[str, float] = {}  # as the daemon keeps it: paging past a deleted session
        self.prefill_chunk = prefill_chunk  # set: a prompt longer than this says its progress, as the engine's
        self.fail = fail
        self.fail_status = fail_status  # the error event's status (None: the engine's default, 500)
        self.config = SimpleNamespace(context_length=context_length, arch="fake")
        self.profile = SimpleNamespace(host=SimpleNamespace(default_context=32768))
        self.model_name = "fake-model"
        self.tokenizer = ByteTokenizer()
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        self.calls: list[tuple[str, dict]] = []
        self.cancelled: list[str] = []
        self.started = time.time()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self._threads: list[threading.Thread] = []
        self.events = EventBus()  # the daemon's own (its ids, backlog, lagged notices)
        self.shut_down = False
        self.stopping = False  # (stop_turns ran: turns end as "shutdown", none starts)
        self.cut_detached: list[tuple[str, dict, int]] = []  # (session, request, transcript length) to run again
        self.responses: dict[str, tuple[str, dict]] = {}  # stored /v1/responses: id -> (session, body)

    # ---- life cycle ------------------------------------------------------------------------------
    def load(self, progress=None) -> None:
        pass

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.events.attach_loop(loop)

    def release(self) -> None:
        self._go.set()

    def stop_turns(self) -> None:
        self.stopping = True
        with self._lock:
            for s in self.sessions.values():
                s.cancel.set()
        self._go.set()

    def shutdown(self) -> None:
        self.shut_down = True
        self.stop_turns()
        for t in list(self._threads):
            t.join(5)

    # ---- sessions --------------------------------------------------------------------------------
    def create_session(self, sla: SLA, max_context: int | None = None, system: str | None = None, *,
                       ephemeral: bool = False) -> dict:
        self.calls.append(("create_session", {"sla": sla, "max_context": max_context, "system": system}))
        limit = self.config.context_length
        if max_context is not None and not 1 <= max_context <= limit:
            raise ContextTooLong(f"max_context must be between 1 and {limit}", param="max_context")
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise Overloaded(f"too many sessions ({self.max_sessions})")
            sid = ("tmp-" if ephemeral else "s-") + str(next(self._ids))
            self.sessions[sid] = _Session(sid, sla, max_context or limit, system, ephemeral, _placement(sla))
        self.publish("placement", {"session": sid, "placement": self.sessions[sid].placement})
        return self.get_session(sid)

    def _get(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise NotFound(f"no session {sid!r}", param="session")
        return s

    def get_session(self, sid: str, messages: bool = True) -> dict:
        with self._lock:
            s = self._get(sid)
            return {"id": s.id, "sla": {"class": s.sla.cls.value, "ttft_ms": s.sla.ttft_ms, "ttlt_s": s.sla.ttlt_s},
                    "max_context": s.max_context, "system": s.system, "placement": s.placement,
                    "status": "busy" if s.busy else "idle", "context_tokens": len(s.tokens),
                    "messages": list(s.messages) if messages else None, "created": s.created}

    def list_sessions(self, messages: bool = True) -> list[dict]:
        with self._lock:
            return [self.get_session(sid, messages) for sid, s in self.sessions.items() if not s.ephemeral]

    def delete_session(self, sid: str) -> None:
        with self._lock:
            s = self._get(sid)
            s.cancel.set()
            del self.sessions[sid]
            self.deleted_created[sid] = s.created

    # ---- stored responses (a closed journal refuses them, as the daemon's does) ---------------------
    def store_response(self, sid: str, rid: str, body: dict) -> None:
        if self.shut_down:
            raise RuntimeError("Cannot operate on a closed database.")
        self.responses[rid] = (sid, body)

    def get_response(self, rid: str) -> tuple[str, dict]:
        if rid not in self.responses:
            raise NotFound(f"no stored response {rid!r}")
        return self.responses[rid]

    def latest_response(self, sid: str) -> str | None:
        return next((r for r, (s, _) in reversed(self.responses.items()) if s == sid), None)

    def response_end(self, rid: str) -> int | None:
        return None

    def cut_detached_turns(self) -> list:
        return list(self.cut_detached)

    def forget_detached_turn(self, sid: str) -> None:
        self.calls.append(("forget_detached_turn", {"session_id": sid}))

    # ---- turns -----------------------------------------------------------------------------------
    def start_turn(self, *, session_id, messages=None, prompt=None, params, sla=None, echo=False, emit,
                   answer=None, continues=None, detached=None, system=None, replaces_system=False):
        self.calls.append(("start_turn", {"session_id": session_id, "messages": messages, "prompt": prompt,
                                          "params": params, "sla": sla, "echo": echo, "answer": answer,
                                          "detached": detached, "system": system,
                                          "replaces_system": replaces_system}))
        if self.stopping:
            raise Overloaded("shutting down")
        if (messages is None) == (prompt is None):
            raise InvalidRequest("a turn needs either messages or a prompt")
        if messages is not None and not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if session_id is None:
            session_id = self.create_session(sla or SLA(SLAClass.INTERACTIVE), ephemeral=True)["id"]
        with self._lock:
            s = self._get(session_id)
            if s.busy:
                raise Conflict(f"session {session_id} is already generating a turn", param="session", retryable=True)
            if messages is not None:
                text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
                new = self.tokenizer.encode(text)
            else:
                new = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
            total = len(s.tokens) + len(new)
            if params.fit_context:
                params = replace(params, max_tokens=max(1, s.max_context - total), fit_context=False)
            try:
                if total >= s.max_context:
                    raise ContextTooLong(f"the prompt needs {total} tokens but the session holds {s.max_context}")
                if total + params.max_tokens > s.max_context:
                    raise ContextTooLong(f"max_tokens {params.max_tokens} exceeds the context", param="max_tokens")
            except ContextTooLong:
                if s.ephemeral:
                    del self.sessions[s.id]
                raise
            cached = len(s.tokens)
            s.tokens += new
            s.messages += [dict(m) for m in messages or []]
            if sla is not None:
                s.sla = sla
            if replaces_system:
                s.system = system
            s.busy = True
            s.cancel.clear()
        t = threading.Thread(target=self._generate, args=(s, new, params, echo, emit), daemon=True)
        self._threads.append(t)
        t.start()
        return FakeHandle(s.id, total, cached, self)

    def _generate(self, s: _Session, new: list[int], params, echo: bool, emit) -> None:
        n_top = params.logprobs or 0
        if echo:
            emit({"type": "prompt_logprobs",
                  "items": [(t, None if i == 0 else -1.0, [] if i == 0 else [(t, -1.0)] * n_top)
                            for i, t in enumerate(new)]})
        step = self.prefill_chunk
        for fed in range(step, len(new), step) if step else ():
            emit({"type": "progress", "prefilled": fed, "prompt": len(new)})
        out = self.reply
        reason = "stop"
        cut = min((out.find(x) for x in params.stop if x in out), default=-1)
        if cut >= 0:
            out = out[:cut]
        data = out.encode()
        if len(data) > params.max_tokens:
            data, reason = data[: params.max_tokens], "length"
        generated = []
        while not self._go.wait(0.01):
            if s.cancel.is_set():
                break
        for at, b in enumerate(data):
            if s.cancel.is_set():
                break
            ev = {"type": "token", "token": b, "text": bytes([b]).decode("latin-1"), "at": at}
            if params.logprobs is not None:
                ev["logprob"], ev["top_logprobs"] = -0.5, [(b, -0.5)] * n_top
            generated.append(b)
            emit(ev)
            if self.fail is not None:
                with self._lock:
                    s.busy = False
                emit({"type": "error", "message": self.fail,
                      **({"status": self.fail_status} if self.fail_status else {})})
                return
        if s.cancel.is_set():
            reason = "shutdown" if self.stopping else "cancelled"
            with self._lock:
                self.cancelled.append(s.id)
        with self._lock:
            s.tokens += generated
            if generated and reason in ("stop", "length"):
                s.messages.append({"role": "assistant", "content": bytes(generated).decode()})
            s.busy = False
            if s.ephemeral:
                self.sessions.pop(s.id, None)
        emit({"type": "done", "finish_reason": reason,
              "usage": {"prompt_tokens": len(s.tokens) - len(generated), "completion_tokens": len(generated)}})

    def cancel_turn(self, sid: str) -> None:
        with self._lock:
            s = self.sessions.get(sid)
            if s is not None and s.busy:
                s.cancel.set()

    # ---- SLA changes, status, events -------------------------------------------------------------
    def promote(self, sid: str) -> dict:
        return self._change(sid, SLA(SLAClass.INTERACTIVE, 500.0), "promotion")

    def demote(self, sid: str) -> dict:
        return self._change(sid, SLA(SLAClass.BACKGROUND), "demotion")

    def _change(self, sid: str, sla: SLA, kind: str) -> dict:
        with self._lock:
            s = self._get(sid)
            s.sla, s.placement = sla, _placement(sla)
        self.publish(kind, {"session": sid, "placement": s.placement})
        return self.get_session(sid)

    def status(self) -> dict:
        with self._lock:
            sessions = [{"id": s.id, "class": s.sla.cls.value, "pool": "cpu", "ephemeral": s.ephemeral,
                         "state": "running" if s.busy else "idle"} for s in self.sessions.values()]
            busy = sum(1 for s in self.sessions.values() if s.busy)
        return {"model": {"name": self.model_name, "context_length": self.config.context_length},
                "pools": [{"name": "cpu", "batch_depth": busy, "queue_depth": 0}], "sessions": sessions,
                "kv": {"file_bytes": 8192, "ram_bytes": 4096, "reserved_bytes": 16384, "cap_bytes": 1 << 20}}

    def publish(self, kind: str, data: dict) -> None:
        self.events.publish(kind, data)

    def subscribe(self, backlog: int = 0, after: str | None = None) -> Subscription:
        return self.events.subscribe(backlog, after)

    def unsubscribe(self, sub: Subscription) -> None:
        self.events.unsubscribe(sub)
