"""A small HTTP client for the daemon over its Unix socket (or TCP): one typed method per endpoint.

Imported by every client command, so it must start fast: it speaks HTTP/1.1 with the standard
library's ``http.client`` on an ``AF_UNIX`` socket.  (httpx, with the optional packages it imports
at start - its own CLI's click, rich and pygments, httpcore's trio and anyio - more than doubled the
time ``weave ps`` takes here; ``weave top`` uses httpx's async client, where textual dominates.)

Every failure becomes a ``ClientError`` (``weaved.cli.errors``) whose message is one line a person
can act on; the commands print it as ``weave: error: <message>``.  The address is a socket path, or
an ``http://`` / ``https://`` URL for a daemon's TCP listener (which needs the API key); ``None``
means the default socket (``weaved.cli.socket_path``).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from weaved.cli.errors import ClientError, DaemonNotRunning, DaemonStarting, NotASocket, error_from_bytes
from weaved.cli.socket_path import daemon_starting, default_socket_path
from weaved.cli.sse import DONE, Progress, SSEDecoder

CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 60.0
# a stream (tokens, events) gets at least a keep-alive comment every 15 s from the daemon: this long with
# no byte at all is a daemon stopped or hung, not one that is waiting
STREAM_SILENCE_S = 60.0
START_POLL_S = 0.25  # while a daemon starts (its socket not bound yet), how often to try it again


@dataclass(frozen=True)
class Delta:
    """One streamed chat chunk: new text (answer or reasoning), tool-call pieces, and what rides on the
    first and last chunks."""

    text: str
    finish_reason: str | None = None
    weave: dict | None = None  # {"session", "placement"}: on the first and the finishing chunk
    usage: dict | None = None  # on the usage chunk (stream_options.include_usage)
    reasoning: str = ""  # delta.reasoning_content: the model's thinking
    tool_calls: tuple[dict, ...] = ()  # delta.tool_calls: {"index", "id"?, "function": {"name"?, "arguments"}}
    prefill: tuple[int, int] | None = None  # (fed, of): a long prompt's progress, before any text

    @classmethod
    def of_event(cls, event: Any) -> Delta:
        """The delta of one event of a chat stream: a chunk, or a prompt's ``Progress``."""
        if isinstance(event, Progress):
            return cls("", prefill=(event.done, event.total))
        return cls.of(event)

    @classmethod
    def of(cls, chunk: dict) -> Delta:
        choices = chunk.get("choices") or [{}]
        first = choices[0]
        delta = first.get("delta") or {}
        text = delta.get("content") or first.get("text") or ""  # a chat chunk's delta, a completion's text
        return cls(text, first.get("finish_reason"), chunk.get("weave"),
                   chunk.get("usage"), delta.get("reasoning_content") or "", tuple(delta.get("tool_calls") or ()))


def sla_body(cls: str | None = None, ttft_ms: float | None = None,
             ttlt_s: float | None = None) -> dict | None:
    """Weave's SLA tags as a request's ``sla`` field, or None when none is given."""
    body = {k: v for k, v in (("class", cls), ("ttft_ms", ttft_ms), ("ttlt_s", ttlt_s)) if v is not None}
    return body or None


def _given(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


# ---- connections ---------------------------------------------------------------------------------

def resolve_address(address: str | Path | None) -> str:
    return str(address) if address else str(default_socket_path())


def is_url(address: str) -> bool:
    return address.startswith(("http://", "https://"))


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=CONNECT_TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connection(address: str) -> http.client.HTTPConnection:
    if not is_url(address):
        return _UnixConnection(address)
    url = urlsplit(address)
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    return cls(url.hostname or "localhost", url.port, timeout=CONNECT_TIMEOUT_S)


def not_running(address: str) -> DaemonNotRunning:
    """Nothing answers at ``address``: no daemon, unless the path is something other than a socket
    (a Unix connect to a plain file is refused just as to a dead socket)."""
    if not is_url(address) and os.path.exists(address) and not stat.S_ISSOCK(os.stat(address).st_mode):
        return NotASocket(address, "a directory" if os.path.isdir(address) else "a file")
    return DaemonNotRunning(address)


class Client:
    """The daemon's API as methods.  Each call opens its own connection (a Unix socket connects in
    microseconds), so a client may be used from one thread at a time and needs no closing."""

    def __init__(self, address: str | Path | None = None, api_key: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S, on_starting: Callable[[str], None] | None = None,
                 stream_silence_s: float = STREAM_SILENCE_S):
        """``on_starting``: given, a request that finds the daemon still starting (loading its model; its
        socket not bound yet) is told once why it waits and waits for it; else that is an error."""
        self.address = resolve_address(address)
        self.timeout_s = timeout_s
        self.stream_silence_s = stream_silence_s
        self.on_starting = on_starting
        self._prefix = urlsplit(self.address).path.rstrip("/") if is_url(self.address) else ""
        self._headers = {"Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    # ---- plumbing --------------------------------------------------------------------------------
    def _open(self, method: str, path: str, body: dict | None,
              read_timeout_s: float | None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request; the connection and the response (status and headers read)."""
        conn = _connection(self.address)
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            try:
                conn.connect()
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if is_url(self.address) or not daemon_starting(self.address):
                    raise not_running(self.address) from e
                self._wait_for_start(conn)
            except PermissionError as e:
                raise ClientError(f"cannot open the daemon's socket {self.address}: permission denied") from e
            except OSError as e:
                raise ClientError(f"cannot connect to the daemon at {self.address}: {e.strerror or e}") from e
            assert conn.sock is not None
            conn.sock.settimeout(read_timeout_s)
            with self._transport_errors():
                conn.request(method, self._prefix + path, body=data, headers=headers)
                return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _wait_for_start(self, conn: http.client.HTTPConnection) -> None:
        """Connect ``conn`` once the starting daemon binds its socket; DaemonStarting without
        ``on_starting``, DaemonNotRunning if it exits first (its lock goes with it)."""
        if self.on_starting is None:
            raise DaemonStarting(self.address)
        self.on_starting(f"the daemon at {self.address} is starting (loading its model); waiting for it "
                         "(Ctrl-C stops waiting)")
        while True:
            time.sleep(START_POLL_S)
            try:
                conn.connect()
                return
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if not daemon_starting(self.address):
                    raise not_running(self.address) from e

    def _transport_errors(self, silence_s: float | None = None) -> _TransportErrors:
        return _TransportErrors(self.address, silence_s)

    def request(self, method: str, path: str, body: dict | None = None, *, generates: bool = False) -> Any:
        """One request; its JSON answer, or ApiError for an error status.  ``generates``: the answer is a
        generation (a whole turn, minutes on a CPU pool), read with no time limit, as a stream is."""
        conn, r = self._open(method, path, body, None if generates else self.timeout_s)
        with closing(conn):
            with self._transport_errors():
                raw = r.read()
        if r.status >= 400:
            raise error_from_bytes(r.status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise ClientError(f"the daemon's answer to {method} {path} is not JSON") from None

    def stream(self, method: str, path: str, body: dict | None = None) -> Iterator[Any]:
        """The events of an SSE answer (JSON payloads, and a ``Progress`` for each prompt progress
        comment).  Closing the iterator early (``break``, Ctrl-C) closes the
        connection, which makes the daemon cancel the generation."""
        # (tokens or events may be minutes apart, but the daemon's keep-alives are not)
        conn, r = self._open(method, path, body, self.stream_silence_s)
        with closing(conn):
            if r.status >= 400:
                with self._transport_errors():
                    raw = r.read()
                raise error_from_bytes(r.status, raw)
            decoder = SSEDecoder()
            while True:
                with self._transport_errors(silence_s=self.stream_silence_s):
                    raw = r.readline()
                if not raw:
                    return
                obj = decoder.feed(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                if obj is DONE:
                    return
                if obj is not None:
                    yield obj

    # ---- daemon ----------------------------------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", "/health")

    def status(self) -> dict:
        """Everything ``weave top`` shows: model, pools, sessions, KV tiers, hardware, peers."""
        return self.request("GET", "/v1/status")

    def models(self) -> list[dict]:
        return self.request("GET", "/v1/models")["data"]

    def events(self) -> Iterator[dict]:
        """``/v1/events``: placements, promotions, demotions, preemptions as they happen (endless)."""
        return self.stream("GET", "/v1/events")

    # ---- sessions --------------------------------------------------------------------------------
    def sessions(self) -> list[dict]:
        return self.request("GET", "/v1/sessions")["data"]

    def session(self, session_id: str) -> dict:
        """The session with its SLA, placement and transcript (``messages``)."""
        return self.request("GET", f"/v1/sessions/{_quote(session_id)}")

    def create_session(self, sla: dict | None = None, max_context: int | None = None,
                       system: str | None = None) -> dict:
        """A new session; the answer carries its ``id`` and ``placement``."""
        return self.request("POST", "/v1/sessions", _given({"sla": sla, "max_context": max_context,
                                                           "system": system}))

    def delete_session(self, session_id: str) -> dict:
        return self.request("DELETE", f"/v1/sessions/{_quote(session_id)}")

    def clear_prefixes(self) -> dict:
        """Every stored prefix no session maps removed: ``{"files", "bytes", "kept_files", "short_blocks"}``."""
        return self.request("DELETE", "/v1/prefixes")

    def fork(self, session_id: str, turn: int | None = None, sla: dict | None = None,
             max_context: int | None = None) -> dict:
        """A new session sharing ``session_id``'s context (all of it, or through answer ``turn``)."""
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/fork",
                            _given({"turn": turn, "sla": sla, "max_context": max_context}))

    def rewind(self, session_id: str, turn: int) -> dict:
        """Take ``session_id`` back to the end of answer ``turn`` (0: before its first turn)."""
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/rewind", {"turn": turn})

    def promote(self, session_id: str) -> dict:
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/promote")

    def demote(self, session_id: str) -> dict:
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/demote")

    # ---- peers -----------------------------------------------------------------------------------
    def peers(self) -> list[dict]:
        """The federation's peers with their state (``weave peers ls``)."""
        return self.request("GET", "/v1/peers")["data"]

    def add_peer(self, name: str, url: str, token: str) -> dict:
        return self.request("POST", "/v1/peers", {"name": name, "url": url, "token": token})

    def delete_peer(self, name: str) -> dict:
        return self.request("DELETE", f"/v1/peers/{_quote(name)}")

    # ---- turns -----------------------------------------------------------------------------------
    def turn(self, session_id: str, messages: list[dict], **sampling: Any) -> dict:
        """A turn of a session, answered as one chat completion."""
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/turns",
                            {"messages": messages, **_given(sampling)}, generates=True)

    def stream_turn(self, session_id: str, messages: list[dict], **sampling: Any) -> Iterator[Delta]:
        body = {"messages": messages, **_given(sampling), "stream": True}
        with closing(self.stream("POST", f"/v1/sessions/{_quote(session_id)}/turns", body)) as chunks:
            for chunk in chunks:
                yield Delta.of_event(chunk)

    def detach_turn(self, session_id: str, messages: list[dict], **sampling: Any) -> dict:
        """Start a turn that runs to its end with nobody listening (its answer lands in the transcript)."""
        return self.request("POST", f"/v1/sessions/{_quote(session_id)}/turns",
                            {"messages": messages, **_given(sampling), "detach": True})

    def chat(self, messages: list[dict], *, sla: dict | None = None, **sampling: Any) -> dict:
        """A one-off chat completion (no session is kept)."""
        body = {"messages": messages, **_given({"sla": sla, **sampling})}
        return self.request("POST", "/v1/chat/completions", body, generates=True)

    def complete(self, prompt: str, *, sla: dict | None = None, **sampling: Any) -> dict:
        """A one-off text completion: the model continues ``prompt`` as it stands (no chat template)."""
        return self.request("POST", "/v1/completions", {"prompt": prompt, **_given({"sla": sla, **sampling})},
                            generates=True)

    def stream_completion(self, prompt: str, *, sla: dict | None = None, **sampling: Any) -> Iterator[Delta]:
        body = {"prompt": prompt, **_given({"sla": sla, **sampling}), "stream": True}
        with closing(self.stream("POST", "/v1/completions", body)) as chunks:
            for chunk in chunks:
                yield Delta.of_event(chunk)

    def stream_chat(self, messages: list[dict], *, sla: dict | None = None,
                    **sampling: Any) -> Iterator[Delta]:
        body = {"messages": messages, **_given({"sla": sla, **sampling}), "stream": True}
        with closing(self.stream("POST", "/v1/chat/completions", body)) as chunks:
            for chunk in chunks:
                yield Delta.of_event(chunk)


def _quote(session_id: str) -> str:
    return quote(session_id, safe="")


class _TransportErrors:
    """Maps a broken exchange (timeout, reset, malformed HTTP) to a one-line ClientError."""

    def __init__(self, address: str, silence_s: float | None = None):
        self.address = address
        self.silence_s = silence_s  # a stream's: its timeout is a silence, not a slow answer

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None:
            return False
        if isinstance(exc, TimeoutError) and self.silence_s is not None:
            raise ClientError(f"no word from the daemon at {self.address} for {self.silence_s:.0f} s (a stream "
                              "gets a keep-alive every 15 s): it may be stopped or hung") from exc
        if isinstance(exc, TimeoutError):
            raise ClientError(f"the daemon at {self.address} did not answer in time") from exc
        if isinstance(exc, http.client.HTTPException | ConnectionError):
            what = str(exc) or type(exc).__name__
            raise ClientError(f"lost the connection to the daemon at {self.address}: {what}") from exc
        return False
