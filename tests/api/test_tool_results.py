"""A tool result must answer a call of the assistant message before it (OpenAI's rule): otherwise a 400
naming the call, before anything runs."""

from __future__ import annotations

import pytest

from tests.api.test_bad_input import CHAT, assert_error
from weaved.api.tool_results import check_tool_results
from weaved.errors import InvalidRequest

USER = {"role": "user", "content": "Weather in Paris?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
    {"id": "call_b", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}


def tool(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "18C"}


@pytest.mark.parametrize("messages, earlier", [
    ([USER, CALLS, tool("call_a"), tool("call_b")], set()),
    ([USER, CALLS, tool("call_b"), USER], set()),  # (not every call needs its result)
    ([tool("call_x"), USER], None),  # a session's turn: the results of its last answer's calls
    ([tool("call_x"), tool("call_y")], {"call_x", "call_y"}),  # a Responses chain's previous calls
])
def test_results_that_answer_a_call_pass(messages, earlier):
    check_tool_results(messages, earlier)


@pytest.mark.parametrize("messages, earlier, says", [
    ([USER, tool("call_x")], set(), "none comes before it"),
    ([tool("call_x"), USER], set(), "none comes before it"),  # a stateless request has no answer before it
    ([USER, CALLS, tool("call_c")], set(), "answers no call"),
    ([USER, CALLS, USER, tool("call_a")], set(), "none comes before it"),  # a user message ended the calls
    ([tool("call_x"), USER, CALLS, tool("call_x")], None, "answers no call"),  # later ones are known
    ([tool("call_z")], {"call_x"}, "answers no call"),
])
def test_results_that_answer_no_call_are_refused(messages, earlier, says):
    with pytest.raises(InvalidRequest, match=says):
        check_tool_results(messages, earlier)


def test_an_orphan_tool_result_is_a_400_before_anything_runs(client, fake):
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}, tool("call_x")]})
    err = assert_error(r, 400, param="messages", type_="invalid_request_error")
    assert "call_x" in err["message"]
    assert not [c for c in fake.calls if c[0] == "start_turn"]
