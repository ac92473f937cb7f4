"""OpenAI types a request's optional fields ``X | null``: an explicit null is the field's default, as
clients that write every field send it - never a 400."""

from __future__ import annotations

import pytest

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "n": None, "logprobs": None, "stream": None,
                              "stream_options": None, "top_logprobs": None, "temperature": None, "seed": None}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None, "logprobs": None, "n": None,
                         "stream": None}),
], ids=["chat", "completions"])
def test_null_is_the_default(client, path: str, body: dict):
    plain = client.post(path, json={k: v for k, v in body.items() if v is not None})
    nulls = client.post(path, json=body)
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert len(nulls.json()["choices"]) == 1 and nulls.json()["choices"][0].get("logprobs") is None


def test_null_stays_a_refusal_where_a_value_is_required(client):
    r = client.post("/v1/chat/completions", json={"messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_null_is_the_default_in_the_responses_api(client):
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": None, "stream": None,
                                           "temperature": None, "instructions": None})
    assert r.status_code == 200, r.text
    assert r.json()["store"] is True and r.json()["status"] in ("completed", "incomplete")


@pytest.mark.parametrize("reasoning", [None, {"effort": None, "summary": None}])
def test_a_responses_reasoning_echoed_back_is_taken(client, reasoning):
    """A response carries ``reasoning: {"effort": null, "summary": null}``; a client that sends it back is
    answered, and an effort the model cannot honour is refused by name."""
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "reasoning": reasoning})
    assert r.status_code == 200, r.text
    refused = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                 "reasoning": {"effort": "high"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning", refused.text
    assert "reasoning.effort" in refused.json()["error"]["message"]


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/chat/completions", {"audio": None, "prediction": None, "reasoning_effort": None,
                              "web_search_options": None, "functions": None, "best_of": None, "modalities": None}),
    ("/v1/completions", {"suffix": None, "best_of": None}),
    ("/v1/responses", {"background": None, "top_logprobs": None, "max_tool_calls": None}),
    ("/v1/responses", {"background": False}),
], ids=["chat", "completions", "responses", "responses-background-false"])
def test_a_null_for_a_field_not_offered_is_its_default(client, path: str, extra: dict):
    """A field Weave does not offer, sent as null (its default: an SDK that writes every field does),
    is no request for it: answered as without it.  A value is still refused by name."""
    base = {"messages": USER, "max_tokens": 2} if path == "/v1/chat/completions" else (
        {"prompt": "hi", "max_tokens": 2} if path == "/v1/completions" else {"input": "hi", "max_output_tokens": 2})
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 200, r.text
    name = sorted(extra)[0]
    refused = client.post(path, json={**base, name: True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text
