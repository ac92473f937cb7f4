"""The server on real sockets (daemon test double): socket rules, TCP auth, the openai SDK as a client,
disconnects, the event stream and shutdown."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.conftest import WAIT_S, serving, uds_client
from tests.api.fake_daemon import FakeDaemon
from weaved.api.server import Server
from weaved.api.sockets import ServerError, parse_listen

USER = [{"role": "user", "content": "hi"}]


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_socket_is_private_and_removed_after(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path):
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
        assert stat.S_IMODE(os.lstat(sock_path).st_mode) == 0o600
        with uds_client(sock_path) as c:
            assert c.get("/health").json()["status"] == "ok"
    assert not sock_path.exists()
    assert fake.shut_down


def test_refuses_a_live_socket_and_replaces_a_stale_one(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path):
        with pytest.raises(ServerError, match="already|another daemon"), serving(FakeDaemon(), sock_path):
            pass
        assert sock_path.exists()  # the running daemon's socket was left alone
        with uds_client(sock_path) as c:
            assert c.get("/health").status_code == 200
    # a stale socket: bound by a process that is gone (nobody listens)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))
    stale.close()
    assert sock_path.exists()
    with serving(FakeDaemon(), sock_path), uds_client(sock_path) as c:
        assert c.get("/health").status_code == 200


def test_refuses_a_path_that_is_not_a_socket(sock_path):
    sock_path.parent.mkdir(parents=True)
    sock_path.write_text("precious")
    with pytest.raises(ServerError, match="not a socket"), serving(FakeDaemon(), sock_path):
        pass
    assert sock_path.read_text() == "precious"


def test_listen_needs_a_key_and_a_valid_address(sock_path):
    with pytest.raises(ServerError, match="API key"):
        Server(FakeDaemon(), sock_path, listen="127.0.0.1:0")
    for bad in ("8080", "host:", "host:port", "h:99999"):
        with pytest.raises(ServerError, match="HOST:PORT"):
            parse_listen(bad)
    assert parse_listen("[::1]:80") == ("::1", 80)


def test_tcp_needs_the_key_unix_socket_does_not(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path, listen="127.0.0.1:0", api_key="sekrit") as server:
        host, port = server.tcp_address
        base = f"http://{host}:{port}"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekrit"}):
            r = httpx.get(f"{base}/v1/models", headers=headers, timeout=WAIT_S)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"].startswith("req_")
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER}, timeout=WAIT_S)
        assert r.status_code == 401 and not [c for n, c in fake.calls if n == "start_turn"]
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sekrit"}, timeout=WAIT_S)
        assert r.status_code == 200
        with uds_client(sock_path) as c:
            assert c.get("/v1/models").status_code == 200


def test_openai_sdk_over_the_unix_socket(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path), httpx.Client(transport=httpx.HTTPTransport(uds=str(sock_path))) as http:
        client = openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list()] == ["fake-model"]
        out = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=64,
                                             extra_body={"sla": {"class": "background", "ttlt_s": 60}})
        assert out.choices[0].message.content == "Hello from Weave!"
        assert out.model_extra["weave"]["placement"]["decode_pool"] == "cpu"
        assert out._request_id.startswith("req_")  # each request its own id, for logs and support
        sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
        assert (sla.cls.value, sla.ttlt_s) == ("background", 60.0)
        stream = client.chat.completions.create(model="fake-model", messages=USER, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
        assert chunks[-1].usage.completion_tokens == 5
        comp = client.completions.create(model="fake-model", prompt="ab", max_tokens=2, echo=True, logprobs=1)
        assert comp.choices[0].text == "abHe" and comp.choices[0].logprobs.token_logprobs[0] is None
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="fake-model", messages=[], max_tokens=2)
        assert e.value.body["param"] == "messages"
        assert e.value.request_id.startswith("req_") and e.value.request_id != out._request_id


def test_openai_sdk_over_tcp_with_the_key(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path, listen="127.0.0.1:0", api_key="sekrit") as server:
        host, port = server.tcp_address
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="sekrit", max_retries=0)
        out = client.chat.completions.create(model="default", messages=USER, max_tokens=5,
                                             extra_body={"sla": {"class": "interactive", "ttft_ms": 500}})
        assert out.choices[0].message.content == "Hello"
        stream = client.chat.completions.create(model="default", messages=USER, max_tokens=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hel"
        bad = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_disconnect_mid_stream_cancels_the_turn(sock_path):
    fake = FakeDaemon(hold=True, context_length=4096)
    with serving(fake, sock_path), uds_client(sock_path) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        with c.stream("POST", f"/v1/sessions/{sid}/turns",
                      json={"messages": USER, "max_tokens": 100, "stream": True}) as r:
            first = next(r.iter_lines())  # the role chunk: the turn is running
            assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
        # the client hung up while the turn waited for its first token
        wait_for(lambda: sid in fake.cancelled, "the turn to be cancelled")
        wait_for(lambda: c.get(f"/v1/sessions/{sid}").json()["status"] == "idle", "the session to be idle")
        fake.release()
        assert c.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 2}).status_code == 200
        # the abandoned turn still counts in the metrics
        assert 'weave_turns_total{finish_reason="cancelled",sla_class="interactive"} 1.0' in c.get("/metrics").text


def test_disconnect_while_waiting_for_a_whole_answer_cancels(sock_path):
    fake = FakeDaemon(hold=True, context_length=4096)
    with serving(fake, sock_path), uds_client(sock_path) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]

        def ask() -> None:
            with uds_client(sock_path) as c2, pytest.raises(httpx.ReadTimeout):
                c2.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 9}, timeout=0.5)

        t = threading.Thread(target=ask)
        t.start()
        t.join(WAIT_S)
        wait_for(lambda: sid in fake.cancelled, "the turn to be cancelled")


def test_event_stream(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path), uds_client(sock_path) as c:
        with c.stream("GET", "/v1/events") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert next(lines).startswith(":")  # subscribed
            sid = c.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"]
            c.post(f"/v1/sessions/{sid}/promote")
            seen = []
            for line in lines:
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if len(seen) == 2:
                    break
        assert [(e["type"], e["session"]) for e in seen] == [("placement", sid), ("promotion", sid)]
        assert seen[1]["placement"]["priority"] == 2
        wait_for(lambda: not fake.events._subscribers, "the subscriber to leave")


def test_a_client_reconnecting_with_the_last_event_id_gets_what_it_missed(fake: FakeDaemon, sock_path):
    with serving(fake, sock_path), uds_client(sock_path) as c:
        sids = [c.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"] for _ in range(3)]
        with c.stream("GET", "/v1/events", params={"backlog": 3}) as r:
            ids, seen = [], []
            for line in r.iter_lines():
                if line.startswith("id: "):
                    ids.append(line[4:])
                elif line.startswith("data: "):
                    seen.append(json.loads(line[6:])["session"])
                if len(seen) == 1:
                    break
        assert seen == sids[:1] and len(ids) == 1
        c.post(f"/v1/sessions/{sids[0]}/promote")  # while the client was away
        with c.stream("GET", "/v1/events", params={"backlog": 3}, headers={"Last-Event-ID": ids[0]}) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                if len(got) == 3:
                    break
        assert [(e["type"], e["session"]) for e in got] == [("placement", sids[1]), ("placement", sids[2]),
                                                           ("promotion", sids[0])]
        r = c.get("/v1/events", headers={"Last-Event-ID": "not-an-id"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_shutdown_ends_streams_and_turns(sock_path):
    fake = FakeDaemon(hold=True, context_length=4096)
    results: dict = {}
    with serving(fake, sock_path) as server, uds_client(sock_path) as c:
        with c.stream("GET", "/v1/events") as events, c.stream(
                "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 5, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # the turn is running
            server.stop()
            results["turn"] = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            results["events"] = list(events.iter_lines())  # ends instead of waiting forever
    assert results["turn"][-1]["choices"][0]["finish_reason"] == "shutdown"
    assert not sock_path.exists()


def test_a_response_streaming_at_shutdown_is_stored_before_the_daemon_closes(sock_path):
    fake = FakeDaemon(hold=True, context_length=4096)
    with serving(fake, sock_path) as server, uds_client(sock_path) as c:
        with c.stream("POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 5, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # the turn is running
            server.stop()
            datas = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    last = datas[-1]
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"]["reason"] == "shutdown"
    assert fake.responses[last["response"]["id"]][1]["status"] == "incomplete"
    assert fake.shut_down


def test_keep_alive_survives_bad_requests(fake: FakeDaemon, sock_path):
    """Every malformed body is answered 400 on a connection that stays usable: one raw socket, several
    requests in a row on it."""
    bad = [b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
           b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"prompt": [-1]}', b"{"]
    good = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    with serving(fake, sock_path), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(WAIT_S)
        s.connect(str(sock_path))
        reader = s.makefile("rb")
        for body in [*bad, good]:
            path = b"/v1/completions" if b"prompt" in body else b"/v1/chat/completions"
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: weave\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            status = reader.readline().split()[1]
            headers = {}
            while (line := reader.readline().strip()):
                k, v = line.decode().split(":", 1)
                headers[k.lower()] = v.strip()
            payload = json.loads(reader.read(int(headers["content-length"])))
            assert headers.get("connection") != "close"
            if body is good:
                assert status == b"200" and payload["choices"][0]["message"]["content"] == "He"
            else:
                assert status == b"400" and payload["error"]["type"] == "invalid_request_error", payload


def test_idle_connections_outlive_the_clients_keep_alive(fake: FakeDaemon):
    """The server keeps an idle connection open longer than httpx lets one sit in its pool (5 s): the
    client always closes first, so it never sends a request on a connection the server is closing."""
    server = Server(fake, Path("/nonexistent/weave.sock"))
    assert server._uvicorn(server.app).config.timeout_keep_alive > httpx.Limits().keepalive_expiry


def test_a_turns_weave_field_gives_the_placement_it_has_now():
    """A promotion moves a running turn: the finishing chunk's ``weave.placement`` is read then, not kept
    from the turn's start."""
    import asyncio
    from types import SimpleNamespace

    from weaved.api.turn import Turn

    now = {"priority": 0}
    handle = SimpleNamespace(placement={"priority": 0}, placement_now=lambda: dict(now), reprefilled=0)
    spec = SimpleNamespace(session_id="s-1")
    turn = Turn(None, handle, asyncio.Queue(), spec, "batch", {"priority": 0}, 0.0)
    assert turn.weave()["placement"] == {"priority": 0}
    now["priority"] = 2
    assert turn.weave() == {"session": "s-1", "placement": {"priority": 2}}
