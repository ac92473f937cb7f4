"""The agent protocol end to end: ``weave serve`` on the real default model, spoken to by the official
openai SDK over the Unix socket.  Tool round trips, every tool choice enforced, parallel calls, a
streamed call assembled by the SDK, JSON-schema output validated, reasoning kept apart, and each sampling
field that used to be ignored changing the answer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _sdk(socket: Path) -> openai.OpenAI:
    h = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=120.0)
    return openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)


@pytest.fixture(scope="module")
def generic(tmp_path_factory, smollm2_q4_0):
    """SmolLM2's own template has no tool branch: the generic JSON envelope."""
    with weave_serve(tmp_path_factory.mktemp("generic"), "--model", str(smollm2_q4_0)) as proc:
        yield proc


@pytest.fixture(scope="module")
def hermes(tmp_path_factory, smollm2_q4_0):
    with weave_serve(tmp_path_factory.mktemp("hermes"), "--model", str(smollm2_q4_0),
                     "--chat-template", str(TEMPLATES / "hermes-tools.jinja")) as proc:
        yield proc


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, smollm2_q4_0):
    with weave_serve(tmp_path_factory.mktemp("think"), "--model", str(smollm2_q4_0),
                     "--chat-template", str(TEMPLATES / "think-open.jinja")) as proc:
        yield proc


def _validate(calls, tools=TOOLS) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def _complete(choice) -> list:
    """The calls an answer finished: all of them, but the last when the token limit cut it."""
    calls = list(choice.message.tool_calls or [])
    cut = choice.finish_reason == "length"
    assert calls[: len(calls) - cut], "no complete call"
    return calls[: len(calls) - cut]


@pytest.mark.parametrize("server", ["generic", "hermes"])
def test_a_full_tool_round_trip(request, server):
    sdk = _sdk(request.getfixturevalue(server).socket)
    first = sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _validate(choice.message.tool_calls)
    with uds_client(request.getfixturevalue(server).socket) as http:  # the metrics count it as the client saw it
        assert 'weave_turns_total{finish_reason="tool_calls",sla_class="interactive"}' in http.get("/metrics").text
    call = choice.message.tool_calls[0]
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    second = sdk.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=30, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("server", ["generic", "hermes"])
def test_named_and_parallel_choices(request, server):
    sdk = _sdk(request.getfixturevalue(server).socket)
    named = sdk.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    _validate(_complete(named.choices[0]))
    many = sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0, parallel_tool_calls=True)
    _validate(_complete(many.choices[0]))
    ids = [c.id for c in many.choices[0].message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_none_makes_no_call(generic):
    sdk = _sdk(generic.socket)
    out = sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="none",
                                      max_tokens=20, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize("server", ["generic", "hermes"])
def test_a_streamed_call_is_assembled_by_the_sdk(request, server):
    sdk = _sdk(request.getfixturevalue(server).socket)
    kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
              parallel_tool_calls=False)
    whole = sdk.chat.completions.create(**kw)
    with sdk.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got, want = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in want]
    assert final.choices[0].finish_reason == "tool_calls"
    _validate(got)
    # as OpenAI's: the role comes with the first call, content null - streamed and not alike
    assert final.choices[0].message.content is None and whole.choices[0].message.content is None
    first = next(iter(sdk.chat.completions.create(**kw, stream=True))).choices[0].delta
    assert first.role == "assistant" and first.content is None and first.tool_calls[0].function.name
    # with log-probabilities the call syntax's first token comes alone (no text, its entry): still null
    with sdk.chat.completions.stream(**kw, logprobs=True) as stream:
        for _ in stream:
            pass
        assert stream.get_final_completion().choices[0].message.content is None


@pytest.mark.parametrize("server", ["generic", "hermes"])
def test_a_call_cut_by_the_token_limit_stays_an_incomplete_call(request, server):
    """The limit falls inside the arguments: the call is given (name, arguments so far) under
    ``length``, streamed and not alike, the envelope is never content, and the Responses API marks the
    call incomplete."""
    socket = request.getfixturevalue(server).socket
    sdk = _sdk(socket)
    kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=20, temperature=0,
              parallel_tool_calls=False)
    whole = sdk.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.content, choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    content, calls, reasons = "", {}, []
    for chunk in sdk.chat.completions.create(**kw, stream=True):  # (the SDK's stream helper refuses length)
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            slot = calls.setdefault(c.index, ["", ""])
            slot[0] += c.function.name or ""
            slot[1] += c.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "length" and content == ""
    assert [tuple(v) for v in calls.values()] == [(call.function.name, call.function.arguments)]
    with uds_client(socket, timeout=120.0) as c:
        r = c.post("/v1/responses", json={"input": ASK[0]["content"], "tools": [t["function"] | {"type": "function"}
                                                                                 for t in TOOLS],
                                          "tool_choice": "required", "max_output_tokens": 20, "temperature": 0,
                                          "parallel_tool_calls": False, "store": False}).json()
    assert r["status"] == "incomplete"
    assert [(i["type"], i["status"], i["name"]) for i in r["output"]] == \
        [("function_call", "incomplete", call.function.name)]


@pytest.mark.parametrize("server", ["generic", "hermes"])
def test_a_sessions_transcript_keeps_its_calls_with_the_ids_the_api_gave(request, server):
    """A session's answer with calls is kept as OpenAI's assistant message (calls and their ids, no
    envelope as content); its tool results are accepted by those ids and refused by any other."""
    served = request.getfixturevalue(server)
    with uds_client(served.socket, timeout=120.0) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        turn = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "temperature": 0,
                "parallel_tool_calls": False}
        r = c.post(f"/v1/sessions/{sid}/turns", json=turn).json()
        calls = r["choices"][0]["message"]["tool_calls"]
        kept = c.get(f"/v1/sessions/{sid}").json()["messages"][-1]
        assert kept["role"] == "assistant" and kept["tool_calls"] == calls
        assert not kept["content"] and kept["finish_reason"] == r["choices"][0]["finish_reason"] == "tool_calls"
        with c.stream("GET", "/v1/events", params={"backlog": 50}) as events:  # its turn_end says it too
            ends, comments = [{}], 0
            for line in itertools.islice(events.iter_lines(), 400):  # (the backlog: a keep-alive, then events)
                comments += line.startswith(":")
                if comments > 1:  # the backlog is over: the next keep-alive came
                    break
                if line.startswith("data: ") and json.loads(line[6:])["type"] == "turn_end":
                    ends.append(json.loads(line[6:]))
                    if ends[-1]["session"] == sid:
                        break
        assert ends[-1]["session"] == sid and ends[-1]["finish_reason"] == "tool_calls"
        wrong = {"role": "tool", "tool_call_id": "call_not_made", "content": "18C"}
        refused = c.post(f"/v1/sessions/{sid}/turns", json={**turn, "messages": [wrong], "tool_choice": "auto"})
        assert refused.status_code == 400 and "call_not_made" in refused.json()["error"]["message"]
        assert c.get(f"/v1/sessions/{sid}").json()["messages"][-1] == kept  # nothing changed
        answer = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C and sunny"}
        ok = c.post(f"/v1/sessions/{sid}/turns", json={**turn, "messages": [answer], "tool_choice": "none",
                                                          "max_tokens": 8})
        assert ok.status_code == 200, ok.text
        c.delete(f"/v1/sessions/{sid}")


def test_a_schema_that_cannot_be_enforced_is_named_beside_tools(generic):
    """With tools offered too, a response_format schema the grammar engine cannot enforce is the
    response_format's error, not the tools'; a tool's own bad schema stays the tools'."""
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}
    with uds_client(generic.socket, timeout=120.0) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "response_format": bad,
                                                 "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": bad_tool, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_stop_and_min_tokens_are_refused_beside_a_grammar_that_ends_the_answer(generic):
    """A stop string would cut the JSON short under finish_reason "stop", and min_tokens would leave the
    sampler nothing once the JSON is complete (it was a 500): both are a 400 naming the field."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    with uds_client(generic.socket, timeout=120.0) as c:
        for extra, param in (({"response_format": fmt, "stop": ["}"]}, "stop"),
                             ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
                             ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 70, "max_tokens": 80},
                              "min_tokens")):
            r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        ok = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, "temperature": 0,
                                                  "response_format": fmt, "stop": []})
        assert ok.status_code == 200, ok.text


def test_a_name_the_template_does_not_render_is_refused_not_dropped(generic):
    with uds_client(generic.socket, timeout=120.0) as c:
        named = [{"role": "user", "content": "Hi", "name": "alice"}]
        r = c.post("/v1/chat/completions", json={"messages": named, "max_tokens": 4})
        assert r.status_code == 400 and "messages[0].name" in r.json()["error"]["message"]
        tool_named = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "12:00"}]
        ok = c.post("/v1/chat/completions", json={"messages": tool_named, "tools": TOOLS, "max_tokens": 4})
        assert ok.status_code == 200, ok.text  # a tool result's name is the tool's (the generic format says it)
        for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                            ("/v1/responses", {"input": "Hi", "store": False})):
            r = c.post(route, json={**body, "chat_template_kwargs": {"enable_thinking": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
            assert "does not read ['enable_thinking']" in r.json()["error"]["message"]


def test_json_schema_output_validates(generic):
    sdk = _sdk(generic.socket)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for prompt in ("Invent a person.", "Who wrote Hamlet?", "Say hello."):
        out = sdk.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          response_format=fmt, max_tokens=60, temperature=0.7, seed=1)
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    obj = sdk.chat.completions.create(model="default", messages=ASK, response_format={"type": "json_object"},
                                      max_tokens=60, temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_reasoning_is_returned_apart_and_a_rewritten_history_is_reprefilled(thinking):
    sdk = _sdk(thinking.socket)
    with uds_client(thinking.socket, timeout=120.0) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        first = http.post(f"/v1/sessions/{sid}/turns", json={
            "messages": [{"role": "user", "content": "Is 7 a prime number?"}], "max_tokens": 24,
            "temperature": 0}).json()
        msg = first["choices"][0]["message"]
        assert msg["reasoning_content"] and "<think>" not in (msg["content"] or "")
        reasoning_tokens = first["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert 0 < reasoning_tokens <= first["usage"]["completion_tokens"]
        assert "reprefilled_tokens" not in first["weave"]
        second = http.post(f"/v1/sessions/{sid}/turns", json={
            "messages": [{"role": "user", "content": "And 9?"}], "max_tokens": 8, "temperature": 0}).json()
        # the template drops the earlier answer's reasoning: the context is fed again from there, and said
        assert second["weave"]["reprefilled_tokens"] > 0
        metrics = http.get("/metrics").text
        assert 'weave_tokens_total{kind="reprefilled",sla_class="interactive"}' in metrics
        resp = http.post("/v1/responses", json={"input": "Is 7 a prime number?", "max_output_tokens": 24,
                                                "temperature": 0, "store": False}).json()
        assert [i["type"] for i in resp["output"]][0] == "reasoning"
        assert 0 < resp["usage"]["output_tokens_details"]["reasoning_tokens"] <= resp["usage"]["output_tokens"]
    # the raw reasoning as OpenAI returns it (content of reasoning_text, not a summary), streamed so
    kw = dict(model="default", input="Is 7 a prime number?", max_output_tokens=24, temperature=0, store=False)
    whole = sdk.responses.create(**kw)
    item = whole.output[0]
    assert item.type == "reasoning" and item.summary == [] and item.content[0].type == "reasoning_text"
    with sdk.responses.stream(**kw) as stream:
        deltas = [ev.delta for ev in stream if ev.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    # sent back as input, either shape is the next message's reasoning
    again = sdk.responses.create(model="default", max_output_tokens=4, temperature=0, store=False,
                                 input=[{"role": "user", "content": "Is 7 a prime number?"},
                                        item.model_dump(exclude_none=True),
                                        {"role": "assistant", "content": "Yes."},
                                        {"role": "user", "content": "And 9?"}])
    assert again.status in ("completed", "incomplete")
    chunks = list(sdk.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0,
                                              stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning
    off = sdk.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None


def test_the_previously_ignored_fields(generic, smollm2_q4_0):
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_q4_0)
    with uds_client(generic.socket, timeout=120.0) as http:
        body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0,
                "logprobs": True}
        r = http.post("/v1/chat/completions", json=body).json()
        text = r["choices"][0]["message"]["content"]
        first = r["choices"][0]["logprobs"]["content"][0]
        ids = tok.encode(bytes(first["bytes"]).decode("utf-8"), add_bos=False)
        assert len(ids) == 1, ids
        first_id = ids[0]
        # logit_bias: banning the first token changes the answer; a large bias on another forces it
        banned = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(first_id): -100}}).json()
        assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first["token"]
        other = tok.encode(" purple", add_bos=False)[0]
        forced = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(other): 100}}).json()
        assert forced["choices"][0]["logprobs"]["content"][0]["bytes"] == list(tok.token_bytes(other))
        # stop_token_ids: the first token ends the turn at once
        stopped = http.post("/v1/chat/completions", json={**body, "stop_token_ids": [first_id]}).json()
        assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["message"]["content"] == ""
        # min_tokens: an answer that would end early goes on
        brief = {**body, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 200}
        short = http.post("/v1/chat/completions", json=brief).json()
        n = short["usage"]["completion_tokens"]
        assert short["choices"][0]["finish_reason"] == "stop" and n < 200
        longer = http.post("/v1/chat/completions", json={**brief, "min_tokens": n + 5}).json()
        assert longer["usage"]["completion_tokens"] >= n + 5
        # frequency and presence penalties change a repetitive answer
        rep = {"messages": [{"role": "user", "content": "Repeat the word 'yes' twenty times."}], "max_tokens": 24,
               "temperature": 0}
        a = http.post("/v1/chat/completions", json=rep).json()["choices"][0]["message"]["content"]
        b = http.post("/v1/chat/completions", json={**rep, "frequency_penalty": 2.0}).json()
        c = http.post("/v1/chat/completions", json={**rep, "presence_penalty": 2.0}).json()
        assert b["choices"][0]["message"]["content"] != a and c["choices"][0]["message"]["content"] != a
        # out-of-vocabulary ids are refused by name
        bad = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(tok.vocab_size): 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
        # no max_tokens: allowed up to the context (no refusal because a default did not fit)
        sid = http.post("/v1/sessions", json={"max_context": 64}).json()["id"]
        r = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "temperature": 0})
        assert r.status_code == 200, r.text
        # an unknown model is OpenAI's 404 model_not_found; the served name and "default" are fine
        miss = http.post("/v1/chat/completions", json={**body, "model": "gpt-4o"})
        assert miss.status_code == 404 and miss.json()["error"]["code"] == "model_not_found"
        served = http.get("/v1/models").json()["data"][0]["id"]
        assert http.post("/v1/chat/completions", json={**body, "model": served}).status_code == 200
        assert text


def test_a_stop_string_ends_the_text_of_an_auto_answer_never_its_call(hermes):
    """Tools with tool_choice auto in a format whose calls start with a marker: the answer is text until
    then, and a stop string (an agent framework's "Observation:") ends that text; a call it appears in is
    written whole, and parses."""
    sdk = _sdk(hermes.socket)
    quote = [{"role": "user", "content": "Get the weather in the city called 'Paris'."}]
    called = sdk.chat.completions.create(model="default", messages=quote, tools=TOOLS, tool_choice="auto",
                                         parallel_tool_calls=False, max_tokens=80, temperature=0,
                                         stop=["Paris", "city"])
    choice = called.choices[0]  # (greedy: this model calls here) its arguments hold "Paris", not cut there
    assert choice.finish_reason == "tool_calls" and "Paris" in choice.message.tool_calls[0].function.arguments
    _validate(choice.message.tool_calls)
    text = sdk.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hello."}],
                                       tools=TOOLS, tool_choice="auto", max_tokens=40, temperature=0, stop=["l"])
    t = text.choices[0]  # (greedy: this model answers in text here) it stops at the string
    assert not t.message.tool_calls and t.finish_reason == "stop" and t.message.content == "He"


def test_stop_strings_and_log_probabilities_are_the_answers_not_its_reasoning(thinking):
    """A thinking template: a stop string written in the reasoning does not end the answer (it ends the
    visible answer after the reasoning), and ``logprobs.content`` holds the content's tokens alone."""
    sdk = _sdk(thinking.socket)
    ask = [{"role": "user", "content": "Is 7 a prime number?"}]
    whole = sdk.chat.completions.create(model="default", messages=ask, max_tokens=24, temperature=0, logprobs=True)
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert "e" in reasoning
    content = msg.content or ""
    assert "".join(e.token for e in whole.choices[0].logprobs.content) == content
    stopped = sdk.chat.completions.create(model="default", messages=ask, max_tokens=24, temperature=0, stop=["e"])
    got = stopped.choices[0].message
    assert got.model_extra["reasoning_content"] == reasoning  # (greedy: the same reasoning, whole)
    assert stopped.choices[0].finish_reason == whole.choices[0].finish_reason
    assert "e" not in (got.content or "") and (got.content or "") == content.split("e")[0].strip()


def test_a_text_answer_in_the_generic_envelope_lists_its_texts_tokens_not_the_envelopes(generic):
    """Tools offered on a model whose answers are the generic envelope, a text answer: its entries are
    those of the string's tokens (joined and JSON-decoded, the content), not of ``{"response": "`` and
    ``"}`` - streamed and not alike."""
    import json

    sdk = _sdk(generic.socket)
    kw = dict(model="default", messages=[{"role": "user", "content": "Write two short lines about rain."}],
              tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0, logprobs=True)
    whole = sdk.chat.completions.create(**kw)
    c = whole.choices[0]
    tokens = [e.token for e in c.logprobs.content]
    assert not tokens[0].lstrip().startswith("{") and c.message.content
    text = "".join(tokens)
    if c.finish_reason == "stop":  # (the whole string, closing quote left out)
        assert json.loads('"' + text + '"') == c.message.content
    else:  # cut by max_tokens: as far as it came (an escape may be cut)
        assert c.message.content.startswith(json.loads('"' + text.rstrip("\\") + '"')[:-2])
    streamed = []
    with sdk.chat.completions.stream(**kw) as stream:
        for ev in stream:
            if ev.type == "logprobs.content.delta":
                streamed += [e.token for e in ev.content]
    assert streamed == tokens
