"""A tool result must answer a call of the assistant message before it (OpenAI's rule): otherwise a 400
naming the call, before anything runs."""

from __future__ import annotations

import pytest

from weaved.agent.tool_results import answered_calls, check_tool_results, cut_calls
from weaved.daemon.session import transcript_entry, transcript_view
from weaved.errors import InvalidRequest

USER = {"role": "user", "content": "Weather in Paris?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "w", "arguments": "{}"}},
    {"id": "call_b", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}


def tool(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "18C"}


@pytest.mark.parametrize("messages, earlier", [
    ([USER, CALLS, tool("call_a"), tool("call_b")], set()),
    ([USER, CALLS, tool("call_b"), tool("call_a"), USER], set()),  # in any order
    ([tool("call_x"), USER], None),  # a session's turn: the results of its last answer's calls
    ([tool("call_x"), tool("call_y")], {"call_x", "call_y"}),  # a Responses chain's previous calls
])
def test_results_that_answer_a_call_pass(messages, earlier):
    check_tool_results(messages, earlier)


@pytest.mark.parametrize("messages, earlier, says", [
    ([USER, tool("call_x")], set(), "none comes before it"),
    ([tool("call_x"), USER], set(), "none comes before it"),  # a stateless request has no answer before it
    ([USER, CALLS, tool("call_c")], set(), "answers no call"),
    ([USER, CALLS, USER, tool("call_a")], set(), "no result for: call_a, call_b"),  # a user message ended them
    ([USER, CALLS, tool("call_b"), USER], set(), "no result for: call_a"),  # every call needs its result
    ([USER, CALLS, tool("call_b")], set(), "no result for: call_a"),  # before the answer asked for, too
    ([USER], {"call_x"}, "no result for: call_x"),  # a session's last answer's calls
    ([tool("call_x"), USER, CALLS, tool("call_x")], None, "answers no call"),  # later ones are known
    ([tool("call_z")], {"call_x"}, "answers no call"),
])
def test_results_that_answer_no_call_are_refused(messages, earlier, says):
    with pytest.raises(InvalidRequest, match=says):
        check_tool_results(messages, earlier)



CALL = {"id": "call_k", "type": "function", "function": {"name": "w", "arguments": "{}"}}


@pytest.mark.parametrize("transcript, calls", [
    ([], set()),
    ([USER], set()),
    ([USER, {"role": "assistant", "content": "raw", "finish_reason": "stop", "answer": {"content": None,
                                                                                          "tool_calls": [CALL]}}],
     {"call_k"}),
    ([USER, {"role": "assistant", "content": "hi", "finish_reason": "stop", "answer": {}}], set()),
    ([USER, {"role": "assistant", "content": "raw", "finish_reason": "stop"}], None),  # recorded unparsed
    ([USER, CALLS, tool("call_a")], {"call_a", "call_b"}),  # a client's calls, one answered already
])
def test_a_sessions_last_answer_says_which_calls_its_next_results_may_answer(transcript, calls):
    assert answered_calls(transcript) == calls


def test_a_transcripts_view_shows_an_answer_parsed_and_keeps_its_raw_text_for_the_template():
    raw = '{"tool_calls": [{"name": "w", "arguments": {}}]}'
    entry = transcript_entry("assistant", raw, "stop", {"content": None, "tool_calls": [CALL]})
    assert entry["content"] == raw  # what the next turn's template renders: the KV's tokens
    assert transcript_view(entry) == {"role": "assistant", "content": None, "tool_calls": [CALL],
                                      "finish_reason": "tool_calls"}  # as the API returned it
    cut = transcript_entry("assistant", raw[:20], "length", {"content": None, "tool_calls": [CALL]})
    assert transcript_view(cut)["finish_reason"] == "length"
    plain = transcript_entry("assistant", "hello", "length", {})
    assert transcript_view(plain) == {"role": "assistant", "content": "hello", "finish_reason": "length"}


def test_a_call_the_token_limit_cut_may_be_answered_and_need_not_be():
    """A session's last answer ended at max_tokens inside its second call: the conversation may go on
    with a user message (no result owed for the cut call, whose arguments never closed), or answer it;
    the complete call before it still needs its result."""
    cut_answer = {"role": "assistant", "content": "", "finish_reason": "length", "answer": {"content": None,
                  "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                                 {"id": "call_b", "type": "function", "function": {"name": "g",
                                                                                   "arguments": '{"q": "par'}}]}}
    transcript = [{"role": "user", "content": "hi"}, cut_answer]
    assert cut_calls(transcript) == {"call_b"}
    earlier = answered_calls(transcript)
    result = {"role": "tool", "tool_call_id": "call_a", "content": "ok"}
    check_tool_results([result, {"role": "user", "content": "go on"}], earlier, cut=cut_calls(transcript))
    check_tool_results([result, {"role": "tool", "tool_call_id": "call_b", "content": "cut"}], earlier,
                       cut=cut_calls(transcript))
    with pytest.raises(InvalidRequest, match="call_a"):
        check_tool_results([{"role": "user", "content": "go on"}], earlier, cut=cut_calls(transcript))
    done = {**cut_answer, "finish_reason": "tool_calls"}  # not cut: every call is owed its result
    assert cut_calls([done]) == set()
