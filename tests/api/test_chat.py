"""Chat completions and session turns, against the daemon's test double."""

from __future__ import annotations

import json

import pytest

from tests.api.fake_daemon import FakeDaemon

USER = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_completion_shape(client, fake: FakeDaemon):
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": USER, "max_tokens": 64})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello from Weave!"}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == len("Hello from Weave!")
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["weave"]["session"] is None  # a plain OpenAI call: an ephemeral session
    assert body["weave"]["placement"]["decode_pool"] == "cpu"
    assert fake.sessions == {}  # the ephemeral session is gone after its turn


def test_sampling_fields_reach_the_daemon(client, fake: FakeDaemon):
    body = {"messages": USER, "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7, "stop": "x"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    params = [c for name, c in fake.calls if name == "start_turn"][-1]["params"]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (5, 0.5, 0.9, 40)
    assert (params.min_p, params.repetition_penalty, params.seed, params.stop) == (0.05, 1.1, 7, ("x",))
    assert params.logprobs is None
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("seed, reaches", [(-1, None), (-2, 2**64 - 2), (0, 0)])
def test_seed_minus_one_is_llama_cpps_no_seed(client, fake: FakeDaemon, seed, reaches):
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "seed": seed})
    assert r.status_code == 200, r.text
    assert [c for name, c in fake.calls if name == "start_turn"][-1]["params"].seed == reaches


def test_stop_string_ends_the_text(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "stop": [" from", "zz"], "max_tokens": 64})
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs(client):
    r = client.post("/v1/chat/completions",
                    json={"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e", "l"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [ord("H")]
    assert content[0]["top_logprobs"] == [{"token": "H", "logprob": -0.5, "bytes": [72]}] * 2


def test_streaming_with_usage(client):
    body = {"messages": USER, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["weave"]["placement"]["decode_pool"] == "cpu"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_streaming_without_usage_has_no_usage_field(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert all("usage" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)


def test_sla_body_and_headers(client, fake: FakeDaemon):
    client.post("/v1/chat/completions",
                json={"messages": USER, "max_tokens": 2, "sla": {"class": "batch", "ttlt_s": 30}})
    sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
    assert (sla.cls.value, sla.ttft_ms, sla.ttlt_s) == ("batch", None, 30.0)
    headers = {"X-Weave-SLA-Class": "background", "X-Weave-TTFT-Ms": "2500", "X-Weave-TTLT-S": "60"}
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=headers)
    sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
    assert (sla.cls.value, sla.ttft_ms, sla.ttlt_s) == ("background", 2500.0, 60.0)
    # the body wins over a header of the same meaning
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "sla": {"class": "batch"}},
                headers=headers)
    sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
    assert (sla.cls.value, sla.ttft_ms) == ("batch", 2500.0)


def test_session_by_field_and_header(client, fake: FakeDaemon):
    sid = client.post("/v1/sessions", json={"sla": {"class": "background"}}).json()["id"]
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "session": sid})
    assert r.json()["weave"]["session"] == sid
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "again"}],
                                                  "max_tokens": 4}, headers={"X-Weave-Session": sid})
    assert r.json()["weave"]["session"] == sid
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first turn stays in the KV
    msgs = client.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]


def test_session_turn_keeps_its_class_when_sla_has_none(client, fake: FakeDaemon):
    sid = client.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"]
    client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 2},
                headers={"X-Weave-TTFT-Ms": "900"})
    sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
    assert (sla.cls.value, sla.ttft_ms) == ("batch", 900.0)


def test_turns_answer_like_chat_completions(client):
    sid = client.post("/v1/sessions", json={}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 5})
    body = r.json()
    assert body["object"] == "chat.completion" and body["weave"]["session"] == sid
    assert body["choices"][0]["message"]["content"] == "Hello"
    r = client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 5, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1]) == "Hello"


def test_developer_role_and_text_parts(client, fake: FakeDaemon):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).status_code == 200
    sent = [c for n, c in fake.calls if n == "start_turn"][-1]["messages"]
    assert sent == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_a_turn_the_engine_fails(caplog):
    """A turn the engine fails (a bug: it logged the traceback by session) is a 500, or a stream's error
    event; the API's log names the request's id beside the session's, so the client's ``x-request-id``
    finds the traceback."""
    from fastapi.testclient import TestClient

    from weaved.api.app import create_app

    fake = FakeDaemon(context_length=4096, fail="the KV cap (1 MiB) is reached")
    with TestClient(create_app(fake)) as client, caplog.at_level("WARNING", logger="weave.api"):
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "the KV cap (1 MiB) is reached"
        assert r.json()["error"]["type"] == "server_error"
        said = [rec.getMessage() for rec in caplog.records if rec.name == "weave.api"]
        assert len(said) == 1 and said[0].startswith(r.headers["x-request-id"] + ": its turn in session ")
        assert "the KV cap (1 MiB) is reached" in said[0]
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5, "stream": True})
        said = [rec.getMessage() for rec in caplog.records if rec.name == "weave.api"]
        assert len(said) == 2 and said[1].startswith(r.headers["x-request-id"] + ": ")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "the KV cap (1 MiB) is reached"
        assert events[1]["choices"][0]["delta"]["content"] == "H"  # what came before the failure
        assert 'weave_turns_total{finish_reason="error",sla_class="interactive"} 2.0' in client.get("/metrics").text


def test_a_session_turn_failing_mid_answer_says_what_it_kept_and_its_status_gives_its_type():
    """An answer that fails after its first token keeps those tokens in the session's transcript: the
    non-streamed error says so (a stream showed them) and how to take the turn back; an engine error with
    a 409 (a session's KV file removed meanwhile) is a conflict, as 409s are."""
    from fastapi.testclient import TestClient

    from weaved.api.app import create_app

    fake = FakeDaemon(context_length=4096, fail="session s-1: its KV file is gone", fail_status=409)
    with TestClient(create_app(fake)) as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        r = client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 5})
        err = r.json()["error"]
        assert r.status_code == 409 and err["type"] == "conflict_error"
        assert f"the 1 token(s) generated before it are kept in session {sid}'s transcript" in err["message"]
        assert f"POST /v1/sessions/{sid}/rewind" in err["message"]
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})  # nothing is kept
        assert r.status_code == 409 and "kept" not in r.json()["error"]["message"]


def test_a_turn_the_disk_fails_is_a_507_said_once(caplog):
    from fastapi.testclient import TestClient

    from weaved.api.app import create_app

    fake = FakeDaemon(context_length=4096, fail="session s-1: allocating positions 256..512 failed: No space left",
                      fail_status=507)
    with TestClient(create_app(fake)) as client, caplog.at_level("WARNING", logger="weave.http"):
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5, "stream": True})
        assert sse_events(r.text)[-2]["error"]["code"] == "insufficient_storage"
        r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5})
        assert r.json()["error"]["code"] == "insufficient_storage"
    assert not caplog.records  # the engine logged it where it failed: not again here


@pytest.mark.parametrize("parameters", [{}, None])
def test_a_function_with_empty_or_no_parameters_takes_no_arguments(client, fake: FakeDaemon, parameters):
    fn = {"name": "now"} if parameters is None else {"name": "now", "parameters": parameters}
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                                                  "tools": [{"type": "function", "function": fn}]})
    assert r.status_code == 200, r.text
    answer = [c for name, c in fake.calls if name == "start_turn"][-1]["answer"]
    assert answer.tools[0].parameters == {"type": "object", "properties": {}}


def test_a_response_says_when_it_completed_and_its_reasoning_settings(client, fake: FakeDaemon):
    done = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 64}).json()
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    assert done["reasoning"] == {"effort": None, "summary": None}  # (no reasoning settings are taken)
    cut = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    assert cut["status"] == "incomplete" and cut["completed_at"] is None
