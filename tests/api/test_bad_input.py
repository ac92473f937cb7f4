"""Bad input gets a 4xx (503 when overloaded) in OpenAI's error shape, changes nothing, and the daemon
keeps serving.  Against the daemon's test double; ``test_real_daemon`` repeats the daemon's own checks."""

from __future__ import annotations

import pytest

from tests.api.fake_daemon import FakeDaemon

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def assert_error(r, status: int, param: str | None = "*", type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "*":
        assert err["param"] == param
    if type_ is not None:
        assert err["type"] == type_
    return err


@pytest.fixture
def bystander(client):
    """A session with a finished turn, to check that a bad request leaves it alone."""
    sid = client.post("/v1/sessions", json={"sla": {"class": "background"}}).json()["id"]
    client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 4})
    before = client.get(f"/v1/sessions/{sid}").json()
    yield sid
    assert client.get(f"/v1/sessions/{sid}").json() == before  # unchanged
    ok = client.post(CHAT, json={"messages": USER, "max_tokens": 2})  # and the daemon still serves
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "He"


RAW_BODIES = [
    pytest.param(b'{"messages": [', "not valid JSON", id="malformed-json"),
    pytest.param(b'{"messages": "\xff\xfe"}', "UTF-8", id="bad-utf8"),
    pytest.param(b"[1, 2]", "JSON object", id="not-an-object"),
    pytest.param(b"", "empty", id="empty-body"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN", id="nan"),
    pytest.param(b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "levels deep", id="nested-5000"),
    pytest.param(b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}", "levels deep", id="nested-70"),
    pytest.param(b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "surrogate", id="lone-surrogate"),
    pytest.param(b'{"messages": [{"role": "user", "\\udc00": "hi"}]}', "surrogate", id="surrogate-key"),
]


@pytest.mark.parametrize(("raw", "words"), RAW_BODIES)
def test_unreadable_bodies(client, bystander, raw: bytes, words: str):
    for path in (CHAT, "/v1/completions", f"/v1/sessions/{bystander}/turns"):
        err = assert_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400,
                           type_="invalid_request_error")
        assert words in err["message"]


WRONG = [
    pytest.param({"messages": USER, "max_tokens": "5"}, "max_tokens", id="max-tokens-string"),
    pytest.param({"messages": USER, "stream": "yes"}, "stream", id="stream-string"),
    pytest.param({"messages": "hi"}, "messages", id="messages-string"),
    pytest.param({"messages": [{"role": "user"}]}, "messages.0", id="message-no-content"),
    pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", id="bad-role"),
    pytest.param({"messages": USER, "temperature": "hot"}, "temperature", id="temperature-string"),
    pytest.param({"messages": USER, "temperature": -1}, "temperature", id="temperature-negative"),
    pytest.param({"messages": USER, "top_p": -0.1}, "top_p", id="top-p-negative"),
    pytest.param({"messages": USER, "stop": [""]}, "stop", id="empty-stop"),
    pytest.param({"messages": USER, "seed": -(2**63) - 1}, "seed", id="seed-below-int64"),
    pytest.param({"messages": USER, "temperature": 2.5}, "temperature", id="temperature-above-2"),
    pytest.param({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options",
                 id="stream-options-without-stream"),
    pytest.param({"messages": USER, "stream": True, "stream_options": {"foo": 1}}, "stream_options.foo",
                 id="stream-options-unknown-key"),
    pytest.param({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters", id="tool-not-object"),
    pytest.param({}, "messages", id="no-messages"),
    pytest.param({"messages": []}, "messages", id="empty-messages"),
    pytest.param({"messages": USER, "max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
    pytest.param({"messages": USER, "max_tokens": -5}, "max_tokens", id="max-tokens-negative"),
    pytest.param({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", id="mct-zero"),
    pytest.param({"messages": USER, "n": 17}, "n", id="n-17"),
    pytest.param({"messages": USER, "n": 2, "session": "s-1"}, "n", id="n-2-with-session"),
    pytest.param({"messages": USER, "top_logprobs": 2}, "top_logprobs", id="top-logprobs-alone"),
    pytest.param({"messages": USER, "logprobs": True, "top_logprobs": 99}, "top_logprobs", id="top-logprobs-99"),
    pytest.param({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function", id="tool-no-function"),
    pytest.param({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", id="presence-penalty-range"),
    pytest.param({"messages": USER, "functions": [{"name": "f"}]}, "functions", id="functions-deprecated"),
    pytest.param({"messages": USER, "web_search_options": {}}, "web_search_options", id="unknown-field"),
    pytest.param({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", id="too-many-stops"),
    pytest.param({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias", id="logit-bias-key"),
    pytest.param({"messages": USER, "logit_bias": {"²": 1}}, "logit_bias", id="logit-bias-superscript"),
    pytest.param({"messages": USER, "logit_bias": {"٣": 1}}, "logit_bias", id="logit-bias-arabic-digit"),
    pytest.param({"messages": USER, "logit_bias": {"0012": 1}}, "logit_bias", id="logit-bias-leading-zeros"),
    pytest.param({"messages": USER, "logit_bias": {"1": 101}}, "logit_bias", id="logit-bias-range"),
    pytest.param({"messages": USER, "user": 5}, "user", id="user-not-a-string"),
    pytest.param({"messages": USER, "store": "yes"}, "store", id="store-not-a-boolean"),
    pytest.param({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", id="tool-without-call-id"),
    pytest.param({"messages": [{"role": "user", "content": None}]}, "messages.0", id="null-user-content"),
    pytest.param({"messages": USER, "sla": {"class": "urgent"}}, "sla.class", id="sla-class"),
    pytest.param({"messages": USER, "sla": {"ttft_ms": -1}}, "sla.ttft_ms", id="sla-ttft-negative"),
    pytest.param({"messages": USER, "sla": {"ttlt_s": 0}}, "sla.ttlt_s", id="sla-ttlt-zero"),
    pytest.param({"messages": USER, "sla": {"ttft_ms": "fast"}}, "sla.ttft_ms", id="sla-ttft-string"),
    pytest.param({"messages": USER, "sla": {"klass": "batch"}}, "sla.klass", id="sla-unknown-key"),
    pytest.param({"messages": USER, "sla": "interactive"}, "sla", id="sla-string"),
    pytest.param({"messages": USER, "session": ""}, "session", id="session-empty"),
    pytest.param({"messages": USER, "store": True}, "store", id="store-true-keeps-nothing"),
    pytest.param({"messages": USER, "metadata": {"k": 1}}, "metadata", id="metadata-not-a-string"),
    pytest.param({"messages": USER, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", id="metadata-17"),
    pytest.param({"messages": USER, "response_format": {"type": "json_object", "json_schema": {
        "name": "x", "schema": {"type": "string"}}}}, "response_format", id="json-object-with-a-schema"),
    pytest.param({"messages": USER, "response_format": {"type": "text", "json_schema": {
        "name": "x", "schema": {"type": "string"}}}}, "response_format", id="text-with-a-schema"),
    pytest.param({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "x-guidance": {"lenient": True}}}}}, "response_format",
        id="schema-x-guidance"),
    pytest.param({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "x-guidance": {"lenient": True}}}}]},
        "tools[0].function.parameters", id="tool-x-guidance"),
    pytest.param({"messages": USER, "stream": True, "stream_options": {"include_obfuscation": True}},
                 "stream_options.include_obfuscation", id="obfuscation-padding"),
    pytest.param({"messages": USER, "modalities": ["text", "audio"]}, "modalities", id="modalities-audio"),
    pytest.param({"messages": [*USER, {"role": "assistant", "content": "x", "audio": {"id": "a1"}}]}, "messages.1",
                 id="assistant-audio"),
    pytest.param({"messages": [*USER, {"role": "assistant", "content": None, "function_call": {
        "name": "f", "arguments": "{}"}}]}, "messages.1", id="assistant-function-call"),
    pytest.param({"messages": [*USER, {"role": "assistant", "content": "x", "annotations": [{"type": "url"}]}]},
                 "messages.1", id="assistant-annotations"),
    pytest.param({"messages": USER, "service_tier": "bogus"}, "service_tier", id="service-tier-not-openais"),
    pytest.param({"messages": USER, "parallel_tool_calls": True}, "parallel_tool_calls", id="parallel-without-tools"),
    pytest.param({"messages": USER, "reasoning_effort": "low"}, "reasoning_effort", id="reasoning-effort"),
]


@pytest.mark.parametrize(("body", "param"), WRONG)
def test_wrong_fields(client, fake: FakeDaemon, bystander, body: dict, param: str):
    starts = sum(1 for n, _ in fake.calls if n == "start_turn")
    assert_error(client.post(CHAT, json=body), 400, param, "invalid_request_error")
    assert sum(1 for n, _ in fake.calls if n == "start_turn") == starts  # refused before any work


@pytest.mark.parametrize(("headers", "param"), [
    ({"X-Weave-SLA-Class": "urgent"}, "x-weave-sla-class"),
    ({"X-Weave-TTFT-Ms": "soon"}, "x-weave-ttft-ms"),
    ({"X-Weave-TTFT-Ms": "-5"}, "x-weave-ttft-ms"),
    ({"X-Weave-TTLT-S": "inf"}, "x-weave-ttlt-s"),
])
def test_invalid_sla_headers(client, bystander, headers: dict, param: str):
    assert_error(client.post(CHAT, json={"messages": USER}, headers=headers), 400, param)
    assert_error(client.post("/v1/sessions", json={}, headers=headers), 400, param)


@pytest.mark.parametrize("body", [
    {"prompt": 5}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [1, -2]},
    {"prompt": [1, 999999]}, {"prompt": "x", "logprobs": 21}, {"prompt": "x", "echo": 1},
    {"prompt": "x", "best_of": 3}, {"prompt": "x", "max_tokens": 0}, {"prompt": [1.5]}, {"prompt": [True]},
    {"prompt": [[1, -1]]}, {"prompt": {"text": "x"}}, {"prompt": [1, "a"]}, {"prompt": "x", "echo": True, "n": 2},
], ids=["int", "empty", "empty-list", "batch", "negative-id", "id-beyond-vocab", "logprobs-21", "echo-int",
        "best-of", "max-tokens-zero", "float-id", "bool-id", "nested-negative-id", "object", "mixed", "echo-n"])
def test_bad_completions(client, bystander, body: dict):
    err = assert_error(client.post("/v1/completions", json=body), 400, type_="invalid_request_error")
    if err["param"] == "prompt":  # a message that says what was wanted, not a union's "Input should be"
        assert "Input should be" not in err["message"]


def test_token_id_prompts(client, bystander):
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_bad_session_bodies(client, bystander):
    assert_error(client.post("/v1/sessions", json={"max_context": 0}), 400, "max_context")
    assert_error(client.post("/v1/sessions", json={"max_context": "big"}), 400, "max_context")
    assert_error(client.post("/v1/sessions", json={"sla": {"class": "now"}}), 400, "sla.class")
    assert_error(client.post("/v1/sessions", json={"colour": "red"}), 400, "colour")
    assert_error(client.post("/v1/sessions", json={"max_context": 10**6}), 400, "max_context")  # the daemon's
    assert_error(client.post(f"/v1/sessions/{bystander}/turns",
                             json={"messages": USER, "session": "s-other"}), 400, "session")


def test_unknown_session(client, bystander):
    for method, path, body in [
        ("post", CHAT, {"messages": USER, "session": "s-nope"}),
        ("post", "/v1/completions", {"prompt": "x", "session": "s-nope"}),
        ("post", "/v1/sessions/s-nope/turns", {"messages": USER}),
        ("get", "/v1/sessions/s-nope", None),
        ("delete", "/v1/sessions/s-nope", None),
        ("post", "/v1/sessions/s-nope/promote", None),
        ("post", "/v1/sessions/s-nope/demote", None),
    ]:
        r = client.request(method.upper(), path, json=body)
        assert_error(r, 404, "session", "not_found_error")
    assert_error(client.post(CHAT, json={"messages": USER}, headers={"X-Weave-Session": "s-nope"}), 404)


def test_context_limits(client, fake: FakeDaemon, bystander):
    long = [{"role": "user", "content": "x" * 5000}]  # the double's context is 4096 tokens
    err = assert_error(client.post(CHAT, json={"messages": long, "max_tokens": 1}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    # each endpoint names its own field for what the turn feeds
    err = assert_error(client.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(client.post("/v1/responses", json={"input": "x" * 5000, "max_output_tokens": 1}), 400, "input")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(client.post(CHAT, json={"messages": USER, "max_tokens": 5000}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    # the error names the field the request gave the limit by
    err = assert_error(client.post(CHAT, json={"messages": USER, "max_completion_tokens": 5000}), 400,
                       "max_completion_tokens")
    assert err["code"] == "context_length_exceeded" and err["message"].startswith("max_completion_tokens 5000")
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5000}), 400,
                       "max_output_tokens")
    assert err["message"].startswith("max_output_tokens 5000")
    assert all(not s.ephemeral for s in fake.sessions.values())  # refused turns leave no session behind


def test_too_many_sessions(client, fake: FakeDaemon, bystander):
    for _ in range(fake.max_sessions - 1):
        assert client.post("/v1/sessions", json={}).status_code == 200
    r = client.post("/v1/sessions", json={})
    assert_error(r, 503, type_="overloaded_error")
    assert r.headers["retry-after"] == "1"
    assert_error(client.post(CHAT, json={"messages": USER, "max_tokens": 2}), 503)  # no room for one more
    for s in client.get("/v1/sessions").json()["data"]:
        if s["id"] != bystander:
            client.delete(f"/v1/sessions/{s['id']}")


def test_busy_session_conflict(fake: FakeDaemon, bystander, client):
    sid = client.post("/v1/sessions", json={}).json()["id"]
    fake.sessions[sid].busy = True  # as if a turn were in flight
    assert_error(client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER}), 409, "session")
    fake.sessions[sid].busy = False


def test_unknown_routes_and_methods(client, bystander):
    assert "no such endpoint" in assert_error(client.get("/v1/nothing"), 404, type_="not_found_error")["message"]
    # a path with an empty id is an unknown endpoint in OpenAI's shape, not a bare redirect to another
    assert "no such endpoint" in assert_error(client.get("/v1/sessions/"), 404, type_="not_found_error")["message"]
    assert_error(client.delete("/v1/sessions/"), 404)
    assert_error(client.get("/v1/models/"), 404)  # no model of that (empty) name, as OpenAI says it
    assert_error(client.get(CHAT), 405)
    assert_error(client.put("/v1/sessions", json={}), 405)
    # HEAD wherever GET answers: the same status and headers, no body
    for path in ("/health", "/v1/models", "/v1/sessions", "/v1/status"):
        got, head = client.get(path), client.head(path)
        assert head.status_code == got.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"]
    assert client.head("/v1/nothing").status_code == 404 and client.head(CHAT).status_code == 405
    assert client.head("/v1/events").status_code == 405  # a stream that never ends by itself: GET only


def test_oversized_body(client, bystander, monkeypatch):
    from weaved.api import body

    monkeypatch.setattr(body, "MAX_BODY_BYTES", 1000)
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    assert "larger than" in assert_error(client.post(CHAT, json=big), 413, type_="invalid_request_error")["message"]

    def chunks():
        for _ in range(10):
            yield b" " * 200  # no content-length: refused while streaming in

    assert_error(client.post(CHAT, content=chunks()), 413)


def test_event_backlog_is_bounded(client, bystander):
    assert_error(client.get("/v1/events", params={"backlog": 201}), 400, "backlog")
    assert_error(client.get("/v1/events", params={"backlog": -1}), 400, "backlog")


def test_an_orphan_tool_result_is_a_400_before_anything_runs(client, fake):
    orphan = {"role": "tool", "tool_call_id": "call_x", "content": "18C"}
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}, orphan]})
    err = assert_error(r, 400, param="messages", type_="invalid_request_error")
    assert "call_x" in err["message"]
    assert not [c for c in fake.calls if c[0] == "start_turn"]


def test_unknown_fields_are_named_alike_everywhere_and_images_are_said_to_be_unsupported(client, fake):
    for path, body in ((CHAT, {"messages": USER, "foo": 1}), ("/v1/sessions", {"foo": 1})):
        err = assert_error(client.post(path, json=body), 400, param="foo")
        assert err["message"] == "unknown or unsupported field 'foo'"  # (its name once)
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    err = assert_error(client.post(CHAT, json={"messages": image}), 400)
    assert "image_url content parts are not supported" in err["message"] and "Input should be" not in err["message"]
    picture = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                            {"type": "input_image", "image_url": "data:,"}]}]
    err = assert_error(client.post("/v1/responses", json={"input": picture}), 400, param="input")
    assert "input[0]: content parts of type 'input_image' are not supported" in err["message"]
    assert "Input should be" not in err["message"]


@pytest.mark.parametrize(("item", "words"), [
    ({"role": "user"}, "input.0.content: Field required"),  # (a message item's own field, not every shape's)
    ({"content": "hi"}, "input.0.role: Field required"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "garbage"}, "encrypted_content"),
    ({"type": "function_call", "call_id": "c1", "name": "f"}, "input.0.arguments: Field required"),
], ids=["message-without-content", "message-without-role", "foreign-encrypted-content", "call-without-arguments"])
def test_a_bad_responses_input_item_is_refused_in_its_own_shapes_words(client, item: dict, words: str):
    err = assert_error(client.post("/v1/responses", json={"input": [item]}), 400)
    assert words in err["message"] and "more problem" not in err["message"], err["message"]



def test_bookkeeping_fields_with_their_openai_shape_are_accepted_and_empty_input_is_named(client, fake):
    r = client.post(CHAT, json={"messages": USER, "store": False, "metadata": {"run": "42"}, "user": "u-1",
                                "service_tier": "auto"})
    assert r.status_code == 200, r.text
    assert_error(client.post("/v1/responses", json={"input": "hi", "metadata": {"k": 1}}), 400, "metadata",
                 "invalid_request_error")
    for empty in ("", []):
        r = client.post("/v1/responses", json={"input": empty})
        assert_error(r, 400, "input", "invalid_request_error")
        assert r.json()["error"]["message"] == "input: must not be empty: a string, or a list of at least one item"
    r = client.post("/v1/responses", json={"input": "hi", "metadata": {"k": "v"}, "max_output_tokens": 4})
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"}



def test_an_answer_sent_back_as_the_sdks_model_dump_is_accepted(client, fake):
    """``messages.append(answer.model_dump())``: the SDK's message carries null audio, function_call,
    refusal and annotations."""
    dumped = {"role": "assistant", "content": "hello", "audio": None, "function_call": None, "refusal": None,
              "annotations": None, "tool_calls": None}
    for sent in (dumped, {**dumped, "annotations": []}):
        r = client.post(CHAT, json={"messages": [*USER, sent, {"role": "user", "content": "more"}], "max_tokens": 2})
        assert r.status_code == 200, r.text



def test_an_answer_from_the_sdks_parse_helpers_sent_back_is_accepted(client, fake):
    """``client.chat.completions.parse(...)``'s message, appended as it is: the SDK sends its own
    readings of the content and of a call's arguments (``parsed``, ``parsed_arguments``) back too."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}}}
    sent = {"role": "assistant", "content": '{"x": 1}', "parsed": {"x": 1}, "refusal": None, "tool_calls": [call]}
    messages = [*USER, sent, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    turn = fake.calls[-1][1]["messages"][1]
    assert turn["content"] == '{"x": 1}' and turn["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert "parsed" not in turn  # (nothing of the SDK's readings is kept in the transcript)


def test_a_streamed_answer_assembled_by_the_sdks_stream_helper_sent_back_is_accepted(client, fake):
    """``client.chat.completions.stream(...).get_final_completion()``'s message: its calls keep the stream's
    ``index``; accepted, and not kept in the transcript."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    r = client.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert fake.calls[-1][1]["messages"][1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}
    bad = {**call, "index": -1}
    assert_error(client.post(CHAT, json={"messages": [*USER, {**messages[1], "tool_calls": [bad]}, messages[2]]}),
                 400)


def test_query_parameters_a_route_does_not_take_are_refused(client, fake):
    """FastAPI drops them: a stored response asked for as a stream, or a list paged by ``before``, would
    answer something else than asked."""
    for path, params in (("/v1/responses/resp_x", {"stream": "true"}), ("/v1/responses/resp_x", {"include[]": "x"}),
                         ("/v1/responses/resp_x/input_items", {"before": "x"}), ("/v1/models", {"x": "1"}),
                         ("/v1/sessions", {"before": "x"})):
        err = assert_error(client.get(path, params=params), 400, param=next(iter(params)))
        assert "unknown query parameter" in err["message"]
    assert client.get("/v1/sessions", params={"order": "desc", "limit": 2}).status_code == 200


@pytest.mark.parametrize(("tool", "words"), [
    ({"type": "function", "name": "my tool", "parameters": {"type": "object"}}, "function names"),
    ({"type": "function", "name": "f", "parameters": {"type": "string"}}, "type object"),
])
def test_a_bad_responses_tool_is_a_400_naming_it(client, tool, words):
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "tools": [tool]}), 400, "*",
                       "invalid_request_error")
    assert words in err["message"] and err["param"].startswith("tools.0.")


def test_responses_stream_options_are_honoured_or_refused(client):
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "stream_options": {}}), 400,
                       "stream_options")
    assert "stream: true" in err["message"]
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "stream": True,
                                                          "stream_options": {"include_usage": True}}),
                       400, "stream_options")
    assert "response.completed" in err["message"]


def test_fields_that_ask_for_what_weave_does_anyway_are_accepted(client, fake):
    r = client.post(CHAT, json={"messages": USER, "modalities": ["text"], "stream": True,
                                "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert r.status_code == 200 and "[DONE]" in r.text
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": True,
                                           "stream_options": {"include_obfuscation": False}})
    assert r.status_code == 200 and "event: response.incomplete" in r.text  # (max_output_tokens reached)


def test_a_busy_chain_is_a_conflict_on_previous_response_id(client, fake: FakeDaemon):
    """A Responses client never named a session: the 409 for a chain already being continued speaks of
    the response it continues."""
    first = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    fake.sessions[first.json()["weave"]["session"]].busy = True
    err = assert_error(client.post("/v1/responses", json={"input": "more", "previous_response_id": rid,
                                                           "max_output_tokens": 4}), 409, "previous_response_id")
    assert rid in err["message"] and "session" not in err["message"]


@pytest.mark.parametrize("busy", [False, True])
def test_a_refused_continuation_leaves_the_chains_instructions(client, fake: FakeDaemon, busy):
    """Other instructions come with the continuing turn: a continuation refused (its answer cannot fit,
    or the chain is busy) leaves the chain's system prompt as it was; one that runs changes it."""
    first = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "instructions": "A"})
    rid, sid = first.json()["id"], first.json()["weave"]["session"]
    fake.sessions[sid].busy = busy
    more = {"input": "more", "previous_response_id": rid, "instructions": "B"}
    if busy:
        assert_error(client.post("/v1/responses", json={**more, "max_output_tokens": 4}), 409, "previous_response_id")
    else:
        assert_error(client.post("/v1/responses", json={**more, "max_output_tokens": 10**8}), 400, "max_output_tokens")
    assert fake.sessions[sid].system == "A"
    fake.sessions[sid].busy = False
    assert client.post("/v1/responses", json={**more, "max_output_tokens": 4}).status_code == 200
    assert fake.sessions[sid].system == "B"


def test_a_chat_shaped_tool_choice_sent_to_responses_says_the_responses_shape(client):
    body = {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    err = assert_error(client.post("/v1/responses", json=body), 400, param="tool_choice")
    assert 'names a function as {"type": "function", "name": "f"}' in err["message"]


@pytest.mark.parametrize("choice, says", [
    ({"type": "allowed_tools", "tools": []}, "type 'allowed_tools' is not supported"),
    ({"type": "custom", "custom": {"name": "f"}}, "type 'custom' is not supported"),
    ({"type": "function", "name": "f"}, 'names a function as {"type": "function", "function": {"name": "f"}}'),
    ("any", "'any' is not a tool choice"),
])
def test_a_tool_choice_chat_does_not_take_is_named_with_the_shapes_it_does(client, choice, says):
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    err = assert_error(client.post("/v1/chat/completions", json=body), 400, param="tool_choice")
    assert says in err["message"] and "more problem" not in err["message"]


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice", "allowed_tools"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference items"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0", "custom tools"),
])
def test_shapes_weave_does_not_take_are_named_in_one_message(client, path, body, param, says):
    err = assert_error(client.post(path, json=body), 400, param=param)
    assert says in err["message"] and "more problem" not in err["message"], err["message"]


def test_an_unhandled_error_says_the_connection_closes(client, fake: FakeDaemon, monkeypatch):
    """The server drops the connection after a 500: the response says so, so a keep-alive client opens a
    new one for its next request instead of writing into a closed socket."""
    def broken(*a, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(fake, "list_sessions", broken)
    r = client.get("/v1/sessions")
    assert_error(r, 500, type_="server_error")
    assert r.headers["connection"] == "close"


def test_a_refusal_of_what_the_turn_feeds_names_the_requests_own_field(client, fake, monkeypatch):
    """The daemon speaks of messages; a Responses request sent ``input`` (e.g. a model without a chat
    template), a completion ``prompt``."""
    from weaved.errors import InvalidRequest

    def no_template(**kw):
        raise InvalidRequest("the model has no chat template, so it cannot take messages", param="messages")

    monkeypatch.setattr(fake, "start_turn", no_template)
    assert_error(client.post("/v1/responses", json={"input": "hi"}), 400, param="input")
    assert_error(client.post(CHAT, json={"messages": USER}), 400, param="messages")


def test_responses_refusals_speak_of_the_responses_fields(client, fake):
    """The Responses API has no response_format, messages or tool_calls: its refusals name text.format,
    a tool's parameters, function_call and function_call_output items."""
    def refused(body: dict, param: str) -> str:
        return assert_error(client.post("/v1/responses", json={"input": "hi", **body}), 400, param,
                            "invalid_request_error")["message"]

    schema = {"type": "object"}
    assert "json_schema" in refused({"text": {"format": {"type": "json_object", "schema": schema}}}, "text.format")
    assert "x-guidance" in refused({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        **schema, "x-guidance": {"lenient": True}}}}}, "text.format")
    assert "text.format.schema" in refused({"text": {"format": {"type": "json_schema", "name": "x"}}},
                                           "text.format")
    assert "x-guidance" in refused({"tools": [{"type": "function", "name": "f", "parameters": {
        **schema, "x-guidance": {}}}]}, "tools[0].parameters")
    call = {"type": "function_call", "call_id": "call_a", "name": "f", "arguments": "{}"}
    user = {"type": "message", "role": "user", "content": "hi"}
    orphan = refused({"input": [user, {"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input")
    assert orphan.startswith("the function_call_output for 'nope' must follow the function_call")
    stranger = refused({"input": [user, call, {"type": "function_call_output", "call_id": "nope", "output": "1"}]},
                       "input")
    assert "function_call_output for 'nope'" in stranger and "call_a" in stranger
    missing = refused({"input": [user, call, user]}, "input")
    assert "function_call_output" in missing and "call_a" in missing and "tool" not in missing
    assert not [c for c in fake.calls if c[0] == "start_turn"]


def test_an_sla_given_as_a_word_is_shown_the_object_it_takes(client):
    err = assert_error(client.post(CHAT, json={"messages": USER, "sla": "batch"}), 400, param="sla")
    assert '{"class": "batch"}' in err["message"] and "SLABody" not in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "description": "the age", "schema": {"type": "object"}}}},
     "response_format.json_schema.description"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "p", "description": "the age", "schema": {"type": "object"}}}}, "text.format"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "text", "strict": True}}},
     "text.format"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_object",
                                                                                  "name": "x"}}}, "text.format"),
], ids=["chat-description", "responses-description", "text-strict", "json-object-name"])
def test_a_format_field_the_model_would_never_see_is_refused(client, path, body, param):
    """The schema is enforced by a grammar, not written into the prompt: a description for the model, or
    a field a plain format ignores, is refused by name rather than dropped."""
    assert_error(client.post(path, json=body), 400, param)


@pytest.mark.parametrize(("path", "limit"), [("/v1/chat/completions", "max_completion_tokens"),
                                             ("/v1/chat/completions", "max_tokens")])
def test_min_tokens_past_the_limit_names_both_as_the_request_did(client, path, limit):
    err = assert_error(client.post(path, json={"messages": [{"role": "user", "content": "hi"}], limit: 2,
                                               "min_tokens": 3}), 400, "min_tokens")
    assert f"must not exceed {limit} (2)" in err["message"]


def test_a_response_validates_against_the_sdks_own_types(client, fake):
    """Strictly, as code that re-validates a stored or proxied response does (required fields included)."""
    from openai.types.responses import Response

    for store in (True, False):
        r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": store})
        assert r.status_code == 200, r.text
        usage = Response.model_validate(r.json()).usage
        assert r.json()["text"]["verbosity"] == "medium"  # what it was served with, asked for or not
        cached = usage.input_tokens_details.cached_tokens
        assert usage.input_tokens_details.cache_write_tokens == (usage.input_tokens - cached if store else 0)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"reasoning_effort": "high"}, "reasoning_effort", "chat_template_kwargs"),
    ({"service_tier": "flex"}, None, None),  # one of OpenAI's: accepted (bookkeeping)
    ({"verbosity": "medium"}, None, None),  # the default, as clients send it: honoured (it is what the model does)
    ({"verbosity": "low"}, "verbosity", "only 'medium'"),
])
def test_a_field_not_offered_says_what_to_do_instead(client, body: dict, param: str | None, words: str | None):
    r = client.post(CHAT, json={"messages": USER, "max_tokens": 2, **body})
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert words in assert_error(r, 400, param)["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"max_tool_calls": 2}, "max_tool_calls", "parallel_tool_calls"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "only 'medium'"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools are given"),
    ({"service_tier": "bogus"}, "service_tier", "auto, default, flex, scale, priority"),
])
def test_a_responses_field_not_offered_says_why(client, body: dict, param: str, words: str):
    err = assert_error(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, **body}), 400, param)
    assert words in err["message"], err
