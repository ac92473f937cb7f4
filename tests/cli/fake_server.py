"""A test double of the daemon's HTTP API on a Unix socket, for the client commands and ``weave top``.

It speaks the same shapes as ``weaved.api`` (OpenAI-style chat answers and SSE chunks, the session
API, ``/v1/status`` as ``weaved.daemon.core.Daemon.status`` builds it, ``/v1/events``) but holds its
sessions in a dict and answers every turn with a fixed text derived from the user's message, so tests
can assert exactly what the commands print.  It records every request it gets.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct-Q4_0"
# the pool's tokens/s at successive /v1/status calls (a fixed wave, so a sparkline has a shape)
TPS_WAVE = (212.5, 230.1, 251.0, 244.6, 198.3, 160.2, 141.9, 175.4, 220.8, 262.3, 270.0, 238.7)
EVENT_TIME = 1767225600.0  # 2026-01-01 00:00:00 UTC: fixed, so screenshots do not change


def placement(cls: str, pool: str = "cpu") -> dict:
    reasons = (["interactive: latency-sensitive", f"CPU pool {pool!r} (batch 1/16)"] if cls == "interactive"
               else [f"{cls}: throughput-tolerant", f"decode on CPU pool {pool!r} (batch 1/16)"])
    return {"prefill_strategy": "standard", "decode_strategy": "standard", "prefill_pool": pool,
            "decode_pool": pool, "priority": 3 if cls == "interactive" else 1, "reasons": reasons}


def reply_pieces(text: str) -> list[str]:
    """The fake model's answer to ``text``, as the pieces it streams: ``You said: <text>.`` word by word."""
    words = f"You said: {text.strip()}.".split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


@dataclass
class Seen:
    method: str
    path: str
    body: dict | None
    headers: dict[str, str]


@dataclass
class FakeSession:
    id: str
    sla: dict
    max_context: int = 2048
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    created: float = EVENT_TIME
    # what /v1/status reports while (or after) it runs
    state: str = "idle"
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    deadline_slack_s: float | None = None
    ephemeral: bool = False
    placement: dict = field(default_factory=dict)
    busy: bool = False
    full: bool = False  # its context is full: a turn is refused as the daemon refuses it
    forked_from: str | None = None

    @property
    def cls(self) -> str:
        return self.sla["class"]

    @property
    def context_tokens(self) -> int:
        return sum(len((m["content"] or "").split()) + 4 for m in self.messages)

    def record(self) -> dict:  # GET /v1/sessions/{id}, as Daemon.get_session
        return {"id": self.id, "sla": dict(self.sla), "max_context": self.max_context, "system": self.system,
                "placement": self.placement, "status": "busy" if self.busy or self.state != "idle" else "idle",
                "state": self.state, "context_tokens": self.context_tokens, "messages": list(self.messages),
                "created": self.created, "forked_from": self.forked_from, "pool": self.placement["decode_pool"],
                "backend": "cpu"}

    def status_row(self) -> dict:  # a row of /v1/status "sessions", as status_dict
        return {"id": self.id, "class": self.cls, "pool": self.placement["decode_pool"], "backend": "cpu",
                "context_tokens": self.context_tokens, "state": self.state, "tokens_per_s": self.tokens_per_s,
                "ttft_s": self.ttft_s, "deadline_slack_s": self.deadline_slack_s,
                "reason": "; ".join(self.placement["reasons"]), "ephemeral": self.ephemeral,
                "prefill": getattr(self, "prefill", None)}


class FakeDaemon:
    """The API on ``socket_path``; ``token_delay_s`` paces streamed pieces (to test Ctrl-C and
    disconnects).  Use ``with FakeDaemon(path) as d:``."""

    def __init__(self, socket_path: Path, *, token_delay_s: float = 0.0):
        self.socket_path = Path(socket_path)
        self.token_delay_s = token_delay_s
        self.sessions: dict[str, FakeSession] = {}
        self.requests: list[Seen] = []
        self.events: list[dict] = []  # what was published (the backlog a subscriber may ask for)
        self.disconnects = 0  # streams the client closed before the end
        self.cut_by: str | None = None  # when set, answers end with this finish reason (e.g. "shutdown")
        self.answer_delay_s = 0.0  # a whole (non-streamed) answer takes this long to come (a long generation)
        self.status_delay_s = 0.0  # /v1/status takes this long to answer
        self.refuse_turns: str | None = None  # when set, every turn is refused (400) with this message
        self.refuse_code: str | None = None  # ... and this code
        self.unrecovered: list[dict] = []  # /v1/status "unrecovered": {"id", "reason"}
        self.api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"
        self._subscribers: list[queue.Queue] = []
        self._lock = threading.Lock()
        self._counter = 0
        self.status_calls = 0
        self._server: _Server | None = None
        self.stopping = threading.Event()

    # ---- test helpers ----------------------------------------------------------------------------
    def add_session(self, sid: str, cls: str = "background", messages: list[dict] | None = None,
                    **live) -> FakeSession:
        s = FakeSession(sid, {"class": cls, "ttft_ms": None, "ttlt_s": None}, messages=list(messages or []),
                        placement=placement(cls), **live)
        self.sessions[sid] = s
        return s

    def publish(self, kind: str, **data) -> None:
        ev = {"type": kind, "time": EVENT_TIME + len(self.events), **data}
        with self._lock:
            self.events.append(ev)
            for q in self._subscribers:
                q.put(ev)

    def paths(self, method: str | None = None) -> list[str]:
        return [r.path for r in self.requests if method is None or r.method == method]

    def status(self) -> dict:
        sessions = [s.status_row() for s in self.sessions.values()]
        running = sum(1 for s in sessions if s["state"] == "running")
        waiting = sum(1 for s in sessions if s["state"] == "waiting")
        tps = TPS_WAVE[self.status_calls % len(TPS_WAVE)]
        self.status_calls += 1
        return {
            "model": {"name": MODEL, "path": f"/models/{MODEL}.gguf", "arch": "llama",
                      "context_length": 8192},
            "profile": "cpu-only", "profile_file": None, "durability": "page-cache", "data_dir": "/srv/weave",
            "uptime_s": 3725.0,
            "pools": [{"name": "cpu", "backend": "cpu", "device": "cpu", "strategy": "standard",
                       "variant": {"speculative": False, "max_batch": 16, "prefill_chunk": 256,
                                   "token_budget": 272},
                       "batch_depth": running, "queue_depth": waiting, "tokens_per_s": tps, "steps": 9120,
                       "tokens_generated": 48211, "tokens_prefilled": 90210, "preemptions": 3}],
            "pool_notes": [], "sessions": sessions, "unrecovered": list(self.unrecovered),
            "kv": {"file_bytes": 188_743_680, "ram_bytes": 96_468_992, "ram_measured": True,
                   "reserved_bytes": 201_326_592, "cap_bytes": 12_884_901_888, "sessions": len(sessions)},
            "hardware": {"cpu_percent": [63.0, 58.5], "memory_total": 25_769_803_776,
                         "memory_used": 6_442_450_944, "rss": 412_090_368, "gpus": []},
            "peers": [],
        }

    # ---- life ------------------------------------------------------------------------------------
    def start(self) -> FakeDaemon:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        self.stopping.clear()
        self._server = _Server(str(self.socket_path), _Handler)
        self._server.fake = self
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.socket_path.exists():
            self.socket_path.unlink()

    def __enter__(self) -> FakeDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- routes (called on the server's threads) -------------------------------------------------
    def new_id(self, prefix: str = "s-") -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}{self._counter:016x}"

    def subscribe(self, backlog: int = 0) -> queue.Queue:
        """Events from now on, after the last ``backlog`` published before (as the daemon's
        ``/v1/events?backlog=N``)."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            for ev in self.events[-backlog:] if backlog > 0 else []:
                q.put(ev)
            self._subscribers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subscribers.remove(q)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    fake: FakeDaemon


def _error(status: int, message: str, type: str, param: str | None = None,
           code: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # quiet
        pass

    def address_string(self) -> str:
        return "unix"

    @property
    def fake(self) -> FakeDaemon:
        return self.server.fake

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # ---- plumbing --------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = self.path.split("?")[0]
        self.fake.requests.append(Seen(method, path, body, {k.lower(): v for k, v in self.headers.items()}))
        if self.fake.api_key and self.headers.get("Authorization") != f"Bearer {self.fake.api_key}":
            self._json(*_error(401, "missing or wrong API key", "authentication_error"))
            return
        for pattern, verb, handler in ROUTES:
            m = re.fullmatch(pattern, path)
            if m and verb == method:
                handler(self, body or {}, *m.groups())
                return
        self._json(*_error(404, f"no such endpoint: {method} {path}", "not_found_error"))

    def _json(self, status: int, data: object) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def _send(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _session(self, sid: str) -> FakeSession | None:
        s = self.fake.sessions.get(sid)
        if s is None:
            self._json(*_error(404, f"no session {sid!r}", "not_found_error", "session"))
        return s

    # ---- endpoints -------------------------------------------------------------------------------
    def health(self, body: dict) -> None:
        self._json(200, {"status": "ok", "model": MODEL})

    def status(self, body: dict) -> None:
        time.sleep(self.fake.status_delay_s)
        self._json(200, self.fake.status())

    def models(self, body: dict) -> None:
        model = {"id": MODEL, "object": "model", "created": int(EVENT_TIME), "owned_by": "weave",
                 "context_length": 8192}
        self._json(200, {"object": "list", "data": [model]})

    def list_sessions(self, body: dict) -> None:
        data = [s.record() for s in self.fake.sessions.values() if not s.ephemeral]
        self._json(200, {"object": "list", "data": data})

    def create_session(self, body: dict) -> None:
        sla = {"class": "interactive", "ttft_ms": None, "ttlt_s": None, **(body.get("sla") or {})}
        if sla["class"] not in ("interactive", "background", "batch"):
            self._json(*_error(400, "sla.class: Input should be 'interactive', 'background' or 'batch'",
                               "invalid_request_error", "sla.class"))
            return
        s = FakeSession(self.fake.new_id(), sla, body.get("max_context") or 8192, body.get("system"),
                        placement=placement(sla["class"]))
        self.fake.sessions[s.id] = s
        self.fake.publish("placement", session=s.id, placement=s.placement)
        self._json(200, s.record())

    def get_session(self, body: dict, sid: str) -> None:
        if (s := self._session(sid)) is not None:
            self._json(200, s.record())

    def delete_session(self, body: dict, sid: str) -> None:
        if self._session(sid) is not None:
            del self.fake.sessions[sid]
            self._json(200, {"id": sid, "object": "session.deleted", "deleted": True})

    def change_sla(self, body: dict, sid: str, kind: str) -> None:
        if (s := self._session(sid)) is None:
            return
        cls = "interactive" if kind == "promote" else "background"
        s.sla = {"class": cls, "ttft_ms": 500.0 if cls == "interactive" else None, "ttlt_s": None}
        s.placement = placement(cls)
        kind = "promotion" if kind == "promote" else "demotion"
        self.fake.publish(kind, session=sid, placement=s.placement)
        self._json(200, s.record())

    def turn(self, body: dict, sid: str) -> None:
        if (s := self._session(sid)) is None:
            return
        if s.busy:
            self._json(*_error(409, f"session {sid} is already generating a turn", "conflict_error",
                               "session"))
            return
        if s.full:
            status, err = _error(400, "the prompt needs 8204 tokens of context but the session's context holds 8192",
                                 "invalid_request_error", "messages")
            err["error"]["code"] = "context_length_exceeded"
            self._json(status, err)
            return
        self._answer(s, body)

    def chat_completions(self, body: dict) -> None:
        sla = {"class": "interactive", "ttft_ms": None, "ttlt_s": None, **(body.get("sla") or {})}
        s = FakeSession(self.fake.new_id("tmp-"), sla, placement=placement(sla["class"]), ephemeral=True)
        self.fake.sessions[s.id] = s
        try:
            self._answer(s, body, session_field=None)
        finally:
            self.fake.sessions.pop(s.id, None)

    def completions(self, body: dict) -> None:
        """A text completion: the fake model continues the prompt with ``reply_pieces`` of it."""
        pieces = reply_pieces(str(body.get("prompt", "")))
        finish = "stop"
        if body.get("max_tokens") is not None and body["max_tokens"] < len(pieces):
            pieces, finish = pieces[: body["max_tokens"]], "length"
        meta = {"id": "cmpl-fake", "object": "text_completion", "created": int(EVENT_TIME), "model": MODEL}
        if not body.get("stream"):
            self._json(200, {**meta, "choices": [{"index": 0, "text": "".join(pieces), "logprobs": None,
                                                  "finish_reason": finish}]})
            return
        self._start_sse()
        for text, reason in [*((p, None) for p in pieces), ("", finish)]:
            out = {**meta, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
            self._send(b"data: " + json.dumps(out).encode() + b"\n\n")
        self._send(b"data: [DONE]\n\n")

    def _answer(self, s: FakeSession, body: dict, session_field: str | None = "") -> None:
        messages = body.get("messages") or []
        if self.fake.refuse_turns is not None:
            self._json(*_error(400, self.fake.refuse_turns, "invalid_request_error", "messages",
                               self.fake.refuse_code))
            return
        if not messages:
            self._json(*_error(400, "messages: List should have at least 1 item", "invalid_request_error",
                               "messages"))
            return
        if not s.messages and s.placement:  # as the daemon does: placed again once the prompt is known
            words = sum(len(m["content"].split()) for m in messages)
            s.placement = {**s.placement, "reasons": [f"placed again at its first turn ({words} prompt tokens to "
                                                      f"compute)", *s.placement["reasons"]]}
        s.messages.extend({"role": m["role"], "content": m["content"]} for m in messages)
        pieces = reply_pieces(messages[-1]["content"])
        limit = body.get("max_tokens")
        finish = "stop"
        if limit is not None and limit < len(pieces):
            pieces, finish = pieces[:limit], "length"
        if self.fake.cut_by is not None:
            pieces, finish = pieces[:1], self.fake.cut_by
        weave = {"session": s.id if session_field is not None else None, "placement": s.placement}
        usage = {"prompt_tokens": s.context_tokens, "completion_tokens": len(pieces),
                 "total_tokens": s.context_tokens + len(pieces),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        meta = {"id": "chatcmpl-fake", "created": int(EVENT_TIME), "model": MODEL}
        if body.get("detach"):
            s.messages.append({"role": "assistant", "content": "".join(pieces)})
            self._json(202, {"id": s.id, "object": "session.turn", "status": "running",
                             "placement": s.placement})
            return
        if not body.get("stream"):
            time.sleep(self.fake.answer_delay_s)
            text = "".join(pieces)
            s.messages.append({"role": "assistant", "content": text})
            self._json(200, {**meta, "object": "chat.completion", "usage": usage, "weave": weave,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "logprobs": None, "finish_reason": finish}]})
            return
        s.busy, s.state = True, "running"
        sent: list[str] = []
        finished = False
        try:
            self._start_sse()

            def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
                out = {**meta, "object": "chat.completion.chunk", **extra,
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
                return b"data: " + json.dumps(out).encode() + b"\n\n"

            frames = [chunk({"role": "assistant", "content": ""}, weave=weave)]
            frames += [chunk({"content": p}) for p in pieces]
            frames.append(chunk({}, finish, weave=weave))
            for i, f in enumerate(frames):
                if not self._send(f):
                    self.fake.disconnects += 1
                    return
                if 0 < i <= len(pieces):
                    sent.append(pieces[i - 1])
                if self.fake.token_delay_s:
                    time.sleep(self.fake.token_delay_s)
            # as the daemon does: the answer is in the transcript before the client hears the end
            s.messages.append({"role": "assistant", "content": "".join(sent)})
            s.busy, s.state, finished = False, "idle", True
            self._send(b"data: [DONE]\n\n")
        finally:
            if not finished:  # the client left: keep what was sent, as a cancelled turn does
                s.messages.append({"role": "assistant", "content": "".join(sent)})
                s.busy, s.state = False, "idle"

    def follow_events(self, body: dict) -> None:
        query = dict(part.partition("=")[::2] for part in self.path.partition("?")[2].split("&") if part)
        q = self.fake.subscribe(int(query.get("backlog", "0")))
        try:
            self._start_sse()
            if not self._send(b": keep-alive\n\n"):
                return
            while not self.fake.stopping.is_set():
                try:
                    ev = q.get(timeout=0.05)
                except queue.Empty:
                    if not self._send(b": keep-alive\n\n"):
                        return
                    continue
                if not self._send(b"data: " + json.dumps(ev).encode() + b"\n\n"):
                    return
        finally:
            self.fake.unsubscribe(q)


SID = r"([^/]+)"
ROUTES = [
    (r"/health", "GET", _Handler.health),
    (r"/v1/status", "GET", _Handler.status),
    (r"/v1/models", "GET", _Handler.models),
    (r"/v1/events", "GET", _Handler.follow_events),
    (r"/v1/sessions", "GET", _Handler.list_sessions),
    (r"/v1/sessions", "POST", _Handler.create_session),
    (rf"/v1/sessions/{SID}", "GET", _Handler.get_session),
    (rf"/v1/sessions/{SID}", "DELETE", _Handler.delete_session),
    (rf"/v1/sessions/{SID}/turns", "POST", _Handler.turn),
    (rf"/v1/sessions/{SID}/(promote|demote)", "POST", _Handler.change_sla),
    (r"/v1/chat/completions", "POST", _Handler.chat_completions),
    (r"/v1/completions", "POST", _Handler.completions),
    (r"/v1/prefixes", "DELETE", lambda h, body: h._json(200, {"object": "prefixes.cleared", "files": 3,
                                                               "bytes": 5 * 2**20, "kept_files": 1,
                                                               "short_blocks": 2})),
]


@contextmanager
def short_socket_dir() -> Iterator[Path]:
    """A fresh directory with a short path: a Unix socket's path must fit in 107 bytes, and pytest's
    temporary directories can be longer than that."""
    d = Path(tempfile.mkdtemp(prefix="wv", dir="/tmp"))
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        os.rmdir(d)


def seed_sessions(fake: FakeDaemon) -> None:
    """Three sessions of each class, as a busy daemon would hold them (used by the TUI tests and the
    README's screenshot)."""
    fake.add_session("s-3f9c2a1b7d4e8f60", "interactive",
                     [{"role": "user", "content": "Summarise the failing test output for me"}],
                     state="running", tokens_per_s=38.2, ttft_s=0.184, deadline_slack_s=0.42)
    fake.add_session("s-a71e04c9b2d35f18", "background",
                     [{"role": "user", "content": "Refactor the parser module " * 20}],
                     state="running", tokens_per_s=21.7, ttft_s=1.92, deadline_slack_s=41.0)
    fake.add_session("s-0c5d86e2f1a94b37", "batch",
                     [{"role": "user", "content": "Label these 400 tickets " * 40}],
                     state="waiting")
    fake.add_session("s-e24b7f0d9c1a6358", "background",
                     [{"role": "user", "content": "Write the changelog"},
                      {"role": "assistant", "content": "Done: 12 entries."}])
    fake.publish("placement", session="s-3f9c2a1b7d4e8f60", placement=placement("interactive"))
    fake.publish("placement", session="s-a71e04c9b2d35f18", placement=placement("background"))
    fake.publish("preemption", session="s-0c5d86e2f1a94b37", pool="cpu")
    fake.publish("promotion", session="s-3f9c2a1b7d4e8f60", placement=placement("interactive"))
