"""Reasoning handed to a client that keeps its own chain (``store: false``): with
``include: ["reasoning.encrypted_content"]`` a reasoning item carries its text sealed, and the item sent
back gives the next request that reasoning, as the raw content would."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from weaved.api.response_items import OutputItems, seal_reasoning
from weaved.api.responses_models import ResponsesRequest


def answered(sealed: bool) -> list[dict]:
    items = OutputItems(sealed_reasoning=sealed)
    items.feed({"reasoning_content": "The user greets; answer briefly. ünï"})
    items.feed({"content": "Hello!"})
    items.close()
    return items.items


def test_reasoning_is_sealed_only_when_asked_and_comes_back_as_the_next_answers_reasoning():
    assert "encrypted_content" not in answered(False)[0]
    reasoning, message = answered(True)
    assert reasoning["encrypted_content"].startswith("weave1:")
    sent_back = {"type": "reasoning", "id": reasoning["id"], "summary": [],
                 "encrypted_content": reasoning["encrypted_content"]}  # what a client that keeps items sends
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "hi"}, sent_back,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "more"}], "store": False, "include": ["reasoning.encrypted_content"]})
    assert req.unsupported() is None
    assert req.messages()[1] == {"role": "assistant", "content": "Hello!",
                                 "reasoning_content": "The user greets; answer briefly. ünï"}


@pytest.mark.parametrize("blob", ["gAAAAABoOpenAIsOwn", seal_reasoning("x")[:-2] + "!!"])
def test_encrypted_content_weave_did_not_write_is_refused(blob):
    with pytest.raises(ValidationError, match="encrypted_content"):
        ResponsesRequest.model_validate({"input": [{"type": "reasoning", "summary": [], "encrypted_content": blob},
                                                   {"role": "user", "content": "hi"}]})


def test_other_include_values_are_refused_by_name():
    req = ResponsesRequest.model_validate({"input": "hi", "include": ["reasoning.encrypted_content",
                                                                      "message.output_text.logprobs"]})
    assert req.unsupported()[0] == "include" and "message.output_text.logprobs" in req.unsupported()[1]


def test_text_then_a_call_sent_back_is_one_assistant_message():
    """A client that keeps its own items (``store: false``) sends back an answer's message item and the
    call items that followed it: one answer, so one assistant message with its text and its calls."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    req = ResponsesRequest.model_validate({"store": False, "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a"},
        {"type": "function_call_output", "call_id": "call_2", "output": "b"}]})
    msgs = req.messages()
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert msgs[1]["content"] == "Let me look." and [c["id"] for c in msgs[1]["tool_calls"]] == ["call_1", "call_2"]
