"""The client library: SSE parsing, error messages, formatting, and the Client against the fake daemon."""

from __future__ import annotations

import io
import socket

import pytest
from weaved.cli import fmt
from weaved.cli.client import Client, Delta, sla_body
from weaved.cli.errors import ApiError, ClientError, DaemonNotRunning, api_error
from weaved.cli.sse import DONE, Progress, SSEDecoder, parse_sse

from tests.cli.fake_server import FakeDaemon, short_socket_dir


@pytest.fixture
def fake():
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as f:
        yield f


# ---- SSE ------------------------------------------------------------------------------------------

def test_parse_sse_joins_data_lines_skips_comments_and_stops_at_done():
    lines = [": keep-alive", "", "event: chunk", "id: 7", 'data: {"a":', "data: 1}", "", 'data:{"b": 2}',
             "", "data: [DONE]", "", 'data: {"after": true}', ""]
    assert list(parse_sse(lines)) == [{"a": 1}, {"b": 2}]


def test_parse_sse_drops_an_event_left_unfinished_at_the_end():
    assert list(parse_sse(['data: {"a": 1}', "", 'data: {"b": 2}'])) == [{"a": 1}]


def test_sse_error_event_raises_api_error_with_its_message():
    d = SSEDecoder()
    d.feed('data: {"error": {"message": "the KV cap is reached", "type": "server_error", "param": null}}')
    with pytest.raises(ApiError, match="the KV cap is reached") as info:
        d.feed("")
    assert info.value.type == "server_error"


def test_sse_decoder_reports_done_and_refuses_non_json():
    d = SSEDecoder()
    assert d.feed("data: [DONE]") is None
    assert d.feed("") is DONE
    d.feed("data: not json")
    with pytest.raises(ClientError, match="not JSON"):
        d.feed("")


def test_a_prefill_progress_comment_is_reported_and_other_comments_are_not():
    d = SSEDecoder()
    assert d.feed(": prefill 2048/8192") == Progress(2048, 8192)
    for line in (": keep-alive", ": prefill", ": prefill a/b", ": prefill 5/", ": prefilled 1/2"):
        assert d.feed(line) is None
    assert list(parse_sse([": prefill 1/2", "", 'data: {"a": 1}', ""])) == [{"a": 1}]  # payloads only
    assert Delta.of_event(Progress(3, 9)) == Delta("", prefill=(3, 9))
    assert Delta.of_event({"choices": [{"delta": {"content": "hi"}}]}).text == "hi"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_shows_on_a_terminal_and_is_cleared_before_the_answer():
    from weaved.cli.stream_out import write_stream

    deltas = [Delta("", prefill=(512, 1536)), Delta("", prefill=(1024, 1536)), Delta("Hi"),
              Delta("", finish_reason="stop")]
    out, err = io.StringIO(), _Terminal()
    write_stream(deltas, out, err=err)
    assert out.getvalue() == "Hi\n"  # the answer alone: a pipe never sees the progress
    assert err.getvalue() == ("\r\x1b[K[prefill 512/1536 prompt tokens]\r\x1b[K[prefill 1024/1536 prompt tokens]"
                              "\r\x1b[K")
    quiet = io.StringIO()  # stderr not a terminal: nothing
    write_stream(deltas, io.StringIO(), err=quiet)
    assert quiet.getvalue() == ""


def test_a_session_row_being_prefilled_shows_how_far_it_came():
    from weaved.cli.sessions import ps_table

    row = {"id": "s1", "state": "waiting", "prefill": {"done": 2048, "total": 8192}}
    assert fmt.state_of(row) == "prefill:2048/8192"
    assert fmt.state_of({"state": "running", "prefill": None}) == "running"
    assert "prefill:2048/8192" in ps_table([row])


# ---- small helpers --------------------------------------------------------------------------------

def test_api_error_reads_the_openai_shape_and_falls_back_to_the_text():
    body = {"error": {"message": "no session 'x'", "type": "not_found_error", "param": "session"}}
    e = api_error(404, body)
    assert (str(e), e.status, e.param) == ("no session 'x'", 404, "session")
    assert str(api_error(502, "Bad\n gateway")) == "the daemon answered HTTP 502: Bad gateway"


def test_delta_of_chunks():
    chunk = {"choices": [{"delta": {"role": "assistant", "content": ""}}], "weave": {"session": "s"}}
    first = Delta.of(chunk)
    assert first == Delta("", None, {"session": "s"}, None)
    assert Delta.of({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}).text == "hi"
    assert Delta.of({"choices": [], "usage": {"total_tokens": 3}}).usage == {"total_tokens": 3}


def test_sla_body_keeps_only_given_tags():
    assert sla_body() is None
    assert sla_body("batch") == {"class": "batch"}
    assert sla_body(None, 200.0, 5.0) == {"ttft_ms": 200.0, "ttlt_s": 5.0}


def test_formatting():
    assert fmt.size(512) == "512 B" and fmt.size(1536) == "1.5 KiB" and fmt.size(3 * 2**30) == "3.0 GiB"
    assert fmt.seconds(0.184) == "184ms" and fmt.seconds(12.5) == "12.5s" and fmt.seconds(200) == "3m20s"
    assert fmt.seconds(7500) == "2h05m" and fmt.seconds(-0.5) == "-500ms" and fmt.seconds(None) == "-"
    sla = {"class": "interactive", "ttft_ms": 500.0, "ttlt_s": None}
    assert fmt.sla_summary(sla) == "interactive, TTFT 500ms"
    assert fmt.placement_summary({"decode_pool": "cpu", "prefill_pool": "gpu", "prefill_strategy": "standard",
                                  "decode_strategy": "standard", "reasons": ["a", "b"]}) == \
        "pool cpu (standard prefill on gpu, standard decode): a; b"
    assert fmt.table(("A", "BB"), [("x", None), ("long", 3)], right=()) == "A     BB\nx     -\nlong  3"
    assert fmt.table(("A", "B"), [("x", "a long reason")], width=12) == "A  B\nx  a long r…"


# ---- the client -----------------------------------------------------------------------------------

def test_no_daemon_is_one_clear_message(tmp_path):
    path = tmp_path / "nothing.sock"
    with pytest.raises(DaemonNotRunning) as info:
        Client(path).status()
    assert str(info.value) == f"no daemon running at {path}; start one with `weave serve`"


def test_stale_socket_file_counts_as_no_daemon():

    with short_socket_dir() as d:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / "stale.sock"))
        s.close()  # the file stays, nobody listens
        with pytest.raises(DaemonNotRunning):
            Client(d / "stale.sock").health()


def test_requests_and_error_statuses(fake):
    c = Client(fake.socket_path)
    assert c.health()["status"] == "ok"
    assert c.models()[0]["id"].startswith("SmolLM2")
    info = c.create_session({"class": "batch"}, 1024, "be brief")
    assert info["placement"]["decode_pool"] == "cpu" and info["max_context"] == 1024
    assert fake.requests[-1].body == {"sla": {"class": "batch"}, "max_context": 1024, "system": "be brief"}
    assert [s["id"] for s in c.sessions()] == [info["id"]]
    with pytest.raises(ApiError) as err:
        c.session("s-missing")
    assert err.value.status == 404 and str(err.value) == "no session 's-missing'"


def test_stream_turn_yields_text_then_the_finish(fake):
    c = Client(fake.socket_path)
    sid = c.create_session()["id"]
    deltas = list(c.stream_turn(sid, [{"role": "user", "content": "hello"}], max_tokens=None))
    assert "".join(d.text for d in deltas) == "You said: hello."
    assert deltas[0].weave["session"] == sid and deltas[-1].finish_reason == "stop"
    assert fake.requests[-1].body == {"messages": [{"role": "user", "content": "hello"}], "stream": True}


def test_closing_a_stream_early_closes_the_connection(fake):
    fake.token_delay_s = 0.02
    c = Client(fake.socket_path)
    sid = c.create_session()["id"]
    stream = c.stream_turn(sid, [{"role": "user", "content": "one two three four five six seven eight"}])
    next(stream)
    next(stream)
    stream.close()
    for _ in range(200):  # the fake notices at its next write (bounded wait)
        if fake.disconnects:
            break
        import time

        time.sleep(0.01)
    assert fake.disconnects == 1


def test_api_key_is_sent_as_a_bearer_token(fake):
    fake.api_key = "k3y"
    with pytest.raises(ApiError) as err:
        Client(fake.socket_path).status()
    assert err.value.status == 401
    assert Client(fake.socket_path, api_key="k3y").status()["profile"] == "cpu-only"
    assert fake.requests[-1].headers["authorization"] == "Bearer k3y"


def test_session_ids_are_quoted_into_the_path(fake):
    with pytest.raises(ApiError):
        Client(fake.socket_path).session("a/b")
    assert fake.requests[-1].path == "/v1/sessions/a%2Fb"


def test_a_path_that_is_not_a_socket_is_named_as_such(tmp_path):
    plain = tmp_path / "weave.sock"
    plain.write_text("")
    with pytest.raises(DaemonNotRunning) as info:  # (still "no daemon": the commands' exit code 3)
        Client(plain).status()
    assert str(info.value).startswith(f"{plain} is a file, not a socket: point --socket")
    with pytest.raises(DaemonNotRunning, match="is a directory, not a socket"):
        Client(tmp_path).status()


def test_the_decoder_keeps_the_last_complete_events_id():
    """What a reconnection sends as Last-Event-ID: the id of the last event read whole (an event cut
    before its blank line was not seen)."""
    d = SSEDecoder("r-1")
    for line in ("id: r-2", 'data: {"a": 1}', ""):
        d.feed(line)
    assert d.last_id == "r-2"
    d.feed(": keep-alive")
    d.feed("")
    assert d.last_id == "r-2"  # (a comment has no id)
    for line in ("id: r-3", 'data: {"b": 2}'):  # cut here
        d.feed(line)
    assert d.last_id == "r-2"


def test_no_color_leaves_a_terminals_stream_unstyled(monkeypatch):
    """Reasoning and calls are styled on a terminal - unless NO_COLOR is set: then marked as on a pipe."""
    from weaved.cli.stream_out import write_stream

    deltas = [Delta("", reasoning="hmm"), Delta("Hi"), Delta("", finish_reason="stop")]
    styled = _Terminal()
    write_stream(deltas, styled, err=io.StringIO())
    assert "\x1b[" in styled.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _Terminal()
    write_stream(deltas, plain, err=io.StringIO())
    assert "\x1b[" not in plain.getvalue() and "[thinking]\nhmm" in plain.getvalue()


def test_a_stream_with_no_word_for_too_long_is_a_daemon_stopped_or_hung(tmp_path):
    """The daemon sends a keep-alive at least every 15 s on a stream: silence past the client's limit is an
    error that says so, not a wait without end."""
    import threading

    path = tmp_path / "w.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    done = threading.Event()

    def stall() -> None:  # the headers of a stream, then nothing (a daemon stopped with SIGSTOP)
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n: keep-alive\n\n")
            done.wait(10)

    t = threading.Thread(target=stall, daemon=True)
    t.start()
    try:
        c = Client(str(path), stream_silence_s=0.3)
        with pytest.raises(ClientError, match="no word from the daemon .* it may be stopped or hung"):
            list(c.stream("GET", "/v1/events"))
    finally:
        done.set()
        t.join(5)
        server.close()
