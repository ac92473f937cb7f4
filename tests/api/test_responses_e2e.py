"""``/v1/responses`` end to end with the official openai SDK: function calls and their outputs, a chain
continued by ``previous_response_id`` without prefilling it again - also after a daemon restart - typed
stream events, structured text, stored responses, and the refusals."""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"]}}]
INSTRUCTIONS = "You are a helpful assistant."


def _sdk(socket) -> openai.OpenAI:
    h = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=120.0)
    return openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)


def test_a_chain_with_tools_survives_a_restart(tmp_path, smollm2_q4_0):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:
        sdk = _sdk(proc.socket)
        first = sdk.responses.create(model="default", input="What is the weather in Paris?", instructions=INSTRUCTIONS,
                                     tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=60, temperature=0)
        assert first.status == "completed"
        calls = [o for o in first.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["parameters"])
        second = sdk.responses.create(model="default", previous_response_id=first.id, instructions=INSTRUCTIONS,
                                      input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                              "output": '{"temperature": 18}'}],
                                      tools=TOOLS, tool_choice="none", max_output_tokens=20, temperature=0)
        assert second.output_text and not [o for o in second.output if o.type == "function_call"]
        # the chain's context was not prefilled again: all of the first turn came from the session's KV
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1
        assert sdk.responses.retrieve(second.id).output_text == second.output_text
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:  # the same data directory
        sdk = _sdk(proc.socket)
        third = sdk.responses.create(model="default", previous_response_id=second.id, instructions=INSTRUCTIONS,
                                     input="And in Rome?", tools=TOOLS, max_output_tokens=12, temperature=0)
        assert third.status in ("completed", "incomplete")
        # after the restart, each response's input is read back from the chain's transcript
        given = sdk.responses.input_items.list(second.id).data
        assert [(i.type, i.call_id, i.output) for i in given] == [
            ("function_call_output", calls[0].call_id, '{"temperature": 18}')]
        assert third.usage.input_tokens_details.cached_tokens >= second.usage.total_tokens - 1
        # an earlier response of the chain continues as a branch, its context shared after the restart too
        branch = sdk.responses.create(model="default", previous_response_id=second.id, instructions=INSTRUCTIONS,
                                      input="And in Oslo?", tools=TOOLS, max_output_tokens=4, temperature=0)
        assert branch.usage.input_tokens_details.cached_tokens >= second.usage.total_tokens - 1
        assert [i.content[0].text for i in sdk.responses.input_items.list(branch.id).data] == ["And in Oslo?"]
        # unknown ids are 404; store false cannot continue
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model="default", previous_response_id="resp_nope", input="x")
        with pytest.raises(openai.BadRequestError):
            sdk.responses.create(model="default", previous_response_id=third.id, input="x", store=False)


def test_a_response_streaming_at_a_stop_ends_incomplete_and_its_chain_goes_on(tmp_path, smollm2_q4_0):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:
        sdk = _sdk(proc.socket)
        first = sdk.responses.create(model="default", input="Hi", max_output_tokens=8, temperature=0)
        names, last = [], None
        stream = sdk.responses.create(model="default", previous_response_id=first.id, temperature=0,
                                      input="Write the numbers from 1 to 1000, separated by commas.",
                                      max_output_tokens=3000, stream=True)
        for ev in stream:
            names.append(ev.type)
            if ev.type == "response.output_text.delta" and names.count(ev.type) == 1:
                proc.proc.send_signal(signal.SIGTERM)  # the daemon stops with the answer under way
            last = ev
        assert last.type == "response.incomplete", names[-3:]
        assert last.response.incomplete_details.reason == "shutdown"
        assert proc.proc.wait(60) == 0, proc.output
        assert "Traceback" not in proc.output  # (the response was stored before the journal closed)
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0)) as proc:  # stored, and it continues the chain
        sdk = _sdk(proc.socket)
        cut = sdk.responses.retrieve(last.response.id)
        assert cut.status == "incomplete" and cut.output_text == last.response.output_text
        nxt = sdk.responses.create(model="default", previous_response_id=cut.id, input="Thanks.",
                                   max_output_tokens=4, temperature=0)
        assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens
        # a chain continued from a response it has gone past branches there, its context shared
        branch = sdk.responses.create(model="default", previous_response_id=first.id, input="Hello again.",
                                      max_output_tokens=4, temperature=0)
        assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        assert [i.content[0].text for i in sdk.responses.input_items.list(branch.id).data] == ["Hello again."]
        on = sdk.responses.create(model="default", previous_response_id=branch.id, input="Bye.",
                                  max_output_tokens=4, temperature=0)
        assert on.usage.input_tokens_details.cached_tokens >= branch.usage.total_tokens - 1
        sdk.responses.delete(nxt.id)  # the chain's latest gone: its earlier responses still branch
        again = sdk.responses.create(model="default", previous_response_id=cut.id, input="Thanks.",
                                     max_output_tokens=4, temperature=0)
        assert again.output_text == nxt.output_text  # the same context and input, greedy: the same answer
        assert sdk.responses.retrieve(first.id).output_text == first.output_text  # the first chain is as it was


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_q4_0):
    with weave_serve(tmp_path_factory.mktemp("resp"), "--model", str(smollm2_q4_0)) as proc:
        yield proc


def test_typed_stream_events_assemble_the_same_response(served):
    sdk = _sdk(served.socket)
    kw = dict(model="default", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", max_output_tokens=60,
              temperature=0, parallel_tool_calls=False)
    whole = sdk.responses.create(**kw)
    types = []
    with sdk.responses.stream(**kw) as stream:
        for ev in stream:
            types.append(ev.type)
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in types and "response.output_item.done" in types
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    text, last = [], None
    for ev in sdk.responses.create(model="default", input="Say hello.", max_output_tokens=10, temperature=0,
                                   stream=True):
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        last = ev
    # cut by max_output_tokens: OpenAI's last event for that is response.incomplete
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert "".join(text) == last.response.output_text and last.response.output_text
    msg = [o for o in last.response.output if o.type == "message"][0]
    assert msg.status == "incomplete"  # the item the limit cut, as OpenAI marks it
    # on the wire as OpenAI sends it: each event named by an "event:" line, and no [DONE] after the last
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), timeout=120.0) as h, \
            h.stream("POST", "http://weave/v1/responses", json={"input": "Hi", "max_output_tokens": 3,
                                                                "stream": True, "store": False}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and names[-1] == "response.incomplete"
    assert not any("[DONE]" in line for line in lines)


def test_a_response_being_generated_is_shown_in_progress(served):
    """A stored response is visible while it streams: in_progress, neither deletable nor continued until it
    ends (409), then the stored object."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), base_url="http://weave",
                      timeout=120.0) as h:
        with h.stream("POST", "/v1/responses", json={"input": "Count to fifty.", "max_output_tokens": 40,
                                                     "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            created = next(json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: "))
            rid = created["response"]["id"]
            seen = h.get(f"/v1/responses/{rid}")
            assert seen.status_code == 200 and seen.json()["status"] == "in_progress", seen.text
            refused = h.delete(f"/v1/responses/{rid}")
            assert refused.status_code == 409 and refused.json()["error"]["param"] == "response_id"
            assert refused.headers.get("Retry-After") == "1"  # (it ends by itself: the SDKs' retry helps)
            given = h.get(f"/v1/responses/{rid}/input_items")
            assert given.status_code == 200, given.text
            items = given.json()["data"]
            for path in ("/v1/responses", "/v1/responses/input_tokens"):  # not continued before it ends
                early = h.post(path, json={"input": "Go on.", "previous_response_id": rid})
                assert early.status_code == 409, early.text
                assert early.json()["error"]["param"] == "previous_response_id"
                assert early.headers.get("Retry-After") == "1"
            for _ in lines:
                pass
        done = h.get(f"/v1/responses/{rid}").json()
        assert done["status"] == "incomplete" and done["output"]
        assert h.get(f"/v1/responses/{rid}/input_items").json()["data"] == items  # the same once stored
        assert [i["content"][0]["text"] for i in items] == ["Count to fifty."]
        assert h.delete(f"/v1/responses/{rid}").json()["deleted"] is True


def test_structured_text_and_stored_objects(served):
    sdk = _sdk(served.socket)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    r = sdk.responses.create(model="default", input="Name a big city.", max_output_tokens=60, temperature=0,
                             text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                              "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert sdk.responses.retrieve(r.id).id == r.id
    sdk.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(r.id)
    eph = sdk.responses.create(model="default", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(eph.id)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model="default", input="Hi", truncation="auto")
    assert "truncation" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # a schema the grammar cannot enforce: its own field named
        sdk.responses.create(model="default", input="Hi", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert e.value.body["param"] == "text.format" and "response_format" not in e.value.body["message"]


def test_a_responses_input_items_are_what_its_request_added(served):
    sdk = _sdk(served.socket)
    first = sdk.responses.create(model="default", input="Name a colour.", max_output_tokens=4, temperature=0)
    second = sdk.responses.create(model="default", previous_response_id=first.id, max_output_tokens=4,
                                  temperature=0, input=[{"role": "user", "content": "Another."},
                                                        {"role": "user", "content": "And a third."}])
    items = sdk.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Another."), ("message", "user", "And a third.")]
    newest = sdk.responses.input_items.list(second.id, limit=1)  # newest first, as OpenAI lists them
    assert [i.content[0].text for i in newest.data] == ["And a third."] and newest.has_more
    rest = sdk.responses.input_items.list(second.id, after=newest.data[0].id)
    assert [i.content[0].text for i in rest.data] == ["Another."] and not rest.has_more
    assert [i.content[0].text for i in sdk.responses.input_items.list(first.id).data] == ["Name a colour."]
    third = sdk.responses.create(model="default", previous_response_id=second.id, max_output_tokens=4, temperature=0,
                                 input=[{"role": "developer", "content": "Be brief."},
                                        {"role": "user", "content": "A fourth?"}])
    assert [(i.role, i.content[0].text) for i in sdk.responses.input_items.list(third.id, order="asc").data] == [
        ("developer", "Be brief."), ("user", "A fourth?")]  # as sent (the template reads it as a system turn)


def test_an_input_token_count_is_the_usage_its_response_reports(served):
    """``responses.input_tokens.count`` with a request's input fields gives the ``input_tokens`` that
    request's response reports: a new chain with tools and a format, its continuation with new
    instructions, and a branch from a response its chain has gone past; nothing is created by counting."""
    sdk = _sdk(served.socket)
    gen = dict(model="default", max_output_tokens=6, temperature=0)
    sessions = len(sdk.get("/sessions", cast_to=object)["data"])
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    shapes = [dict(input="Hi there."), dict(input="Weather in Oslo?", instructions=INSTRUCTIONS, tools=TOOLS),
              dict(input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "A city?"}],
                   text=fmt)]
    counts = [sdk.responses.input_tokens.count(model="default", **kw) for kw in shapes]
    assert len(sdk.get("/sessions", cast_to=object)["data"]) == sessions  # counting stored nothing
    assert len(set(c.input_tokens for c in counts)) == 3 and all(c.object == "response.input_tokens" for c in counts)
    made = [sdk.responses.create(**gen, **kw) for kw in shapes]
    assert [c.input_tokens for c in counts] == [r.usage.input_tokens for r in made]
    first = made[1]
    follow = dict(previous_response_id=first.id, instructions="Answer in French.", input="And in Rome?", tools=TOOLS)
    n = sdk.responses.input_tokens.count(model="default", **follow).input_tokens
    second = sdk.responses.create(**gen, **follow)
    assert n == second.usage.input_tokens > first.usage.total_tokens
    branch = dict(previous_response_id=first.id, instructions="Answer in French.", input="And in Oslo?", tools=TOOLS)
    n = sdk.responses.input_tokens.count(model="default", **branch).input_tokens
    assert n == sdk.responses.create(**gen, **branch).usage.input_tokens
    # refusals: a generation field named, an unknown chain (404), a tool result answering no call of it
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.input_tokens.count(model="default", input="Hi", extra_body={"max_output_tokens": 5})
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.input_tokens.count(model="default", input="Hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        sdk.responses.input_tokens.count(model="default", previous_response_id=second.id, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "18"}])
