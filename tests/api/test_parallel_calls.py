"""``parallel_tool_calls``: honoured when given; false when left out, as llama.cpp's server has it."""

from __future__ import annotations

TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def _spec(fake):
    return [c for c in fake.calls if c[0] == "start_turn"][-1][1]["answer"]


def test_one_call_an_answer_unless_the_request_asks_for_more(client, fake):
    for sent, parallel in ((None, False), (True, True), (False, False)):
        body = {"messages": USER, "tools": TOOL, **({} if sent is None else {"parallel_tool_calls": sent})}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert _spec(fake).parallel is parallel
        body = {"input": "Weather in Paris and Rome?", "tools": [{"type": "function", **TOOL[0]["function"]}],
                **({} if sent is None else {"parallel_tool_calls": sent})}
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert _spec(fake).parallel is parallel and r.json()["parallel_tool_calls"] is parallel
