"""The answer parser: reasoning, content and calls come out the same however the text is chunked; an
answer cut mid-call keeps the call (incomplete) and never turns the call syntax into content."""

from __future__ import annotations

import json

import pytest

from weaved.agent.formats import GENERIC, HERMES, LLAMA3, MISTRAL
from weaved.agent.stream import AnswerParser


def parse(fmt, text: str, step: int, **kw):
    p = AnswerParser(fmt, **kw)
    deltas = []
    for i in range(0, len(text), step):
        deltas += p.push(text[i:i + step])
    deltas += p.finish()
    return p.answer, deltas


def assembled(deltas: list[dict]) -> tuple[str, str, list[tuple[str, str]]]:
    """What an OpenAI client assembles from the deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            slot = calls.setdefault(c["index"], ["", ""])
            slot[0] += c["function"].get("name", "")
            slot[1] += c["function"].get("arguments", "")
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]


CASES = [
    (HERMES, 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}{\\" x"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris \\"}{\\" x"}'), ("noop", "{}")]),
    (HERMES, "No call here, only <tool text.", "No call here, only <tool text.", []),
    (LLAMA3, '{"name": "f", "parameters": {"a": [1, {"b": 2}]}}', "", [("f", '{"a": [1, {"b": 2}]}')]),
    (LLAMA3, "Plain {text} answer.", "Plain {text} answer.", []),
    (MISTRAL, 'x[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "x",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"a": "]"}}]}', "", [("f", '{"a": "]"}')]),
    (GENERIC, '{"response": "caf\\u00e9 \\"q\\"\\n\\ud83d\\ude00"}', 'café "q"\n😀', []),
    # a lone surrogate half (JSON allows the escape; no text holds it): the replacement character
    (GENERIC, '{"response": "a\\ud83dabcd"}', "a\ufffdabcd", []),
    (GENERIC, '{"response": "a\\ud83d ab"}', "a\ufffd ab", []),
    (GENERIC, '{"response": "\\udc00x\\ud83d\\u0041"}', "\ufffdx\ufffdA", []),
    # llama3: a call only when the answer starts with "{" itself (" {" is free text, as its grammar says)
    (LLAMA3, ' {"name": "get", "parameters": {"x": 1}}', ' {"name": "get", "parameters": {"x": 1}}', []),
    (LLAMA3, "<", "<", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_calls_parse_whatever_the_chunking(fmt, text, content, calls, step):
    ans, deltas = parse(fmt, text, step)
    assert ans.content == content
    assert [(c.name, c.arguments) for c in ans.calls] == calls
    for c in ans.calls:
        json.loads(c.arguments)
        assert c.id.startswith("call_") if fmt is not MISTRAL else len(c.id) == 9
    assert assembled(deltas) == (content, "", calls)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_is_kept_apart(step):
    text = "<think>\nThe user wants a greeting.\n</think>\n\nHello <b>there</b>."
    ans, deltas = parse(None, text, step, thinking=True)
    assert ans.reasoning.strip() == "The user wants a greeting."
    assert ans.content == "Hello <b>there</b>."
    assert assembled(deltas)[:2] == (ans.content, ans.reasoning)


def test_a_prompt_that_opened_the_reasoning():
    ans, _ = parse(HERMES, 'thinking...</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 4,
                   thinking=True, in_reasoning=True)
    assert ans.reasoning == "thinking..."
    assert [(c.name, c.arguments) for c in ans.calls] == [("f", "{}")]


def test_without_thinking_a_think_tag_is_content():
    ans, _ = parse(None, "<think>x</think>y", 2)
    assert ans.content == "<think>x</think>y" and ans.reasoning == ""


@pytest.mark.parametrize("fmt, text, content, call", [
    (HERMES, 'Cut<tool_call>\n{"name": "get_weather", "arguments": {"ci', "Cut", ("get_weather", '{"ci')),
    (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"a": 1', "", ("f", '{"a": 1')),
    (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu', "", ("g", "")),
    (GENERIC, '{"tool_calls": [{"na', "", None),
    (GENERIC, '{"tool_c', "", None),
    (MISTRAL, '[TOOL_CALLS][{"na', "", None),
    (LLAMA3, '{"name": "f", "parameters": {"a": ', "", ("f", '{"a": ')),
])
def test_an_answer_cut_mid_call_keeps_the_call_incomplete_and_no_syntax_as_content(fmt, text, content, call):
    """As OpenAI answers a call cut by max_tokens: the call with its arguments so far; the envelope is
    never content, and the streamed deltas assemble to what the whole answer says."""
    for step in (1, 3, len(text)):
        ans, deltas = parse(fmt, text, step)
        assert ans.content == content
        complete = [(c.name, c.arguments) for c in ans.calls if c.complete]
        cut = [(c.name, c.arguments) for c in ans.calls if not c.complete]
        assert cut == ([call] if call else [])
        if text.startswith('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}'):
            assert complete == [("f", '{"a": 1}')]
        else:
            assert complete == []
        got_content, _, got_calls = assembled(deltas)
        assert got_content == content
        assert got_calls == [(c.name, c.arguments) for c in ans.calls]


@pytest.mark.parametrize(("fmt", "text"), [
    (LLAMA3, '{"name": "Bob", "age": 3}'),  # content that starts as a call does, then is not one
    (LLAMA3, '{"name": "Bob"}'),
    (HERMES, 'I would write <tool_call>\n{"name": "f", then stop.'),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_text_that_only_starts_like_a_call_never_streams_a_call(fmt, text, step):
    """A call's first delta (its id and name) is said only once the syntax after the name holds: a
    client never receives a call that the answer then turns out not to make."""
    ans, deltas = parse(fmt, text, step)
    assert ans.calls == [] and ans.content == text
    assert not any("tool_calls" in d for d in deltas)
    assert assembled(deltas) == (text, "", [])


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_answer_in_a_response_format_is_never_taken_for_the_envelope(step):
    """With a response format the generic format's answer is the format's JSON itself: one whose first
    key is "response" is that JSON, not an envelope around its string."""
    for text in ('{"response": "hello", "score": 3}', '{"response": "The answer is 4"}'):
        ans, deltas = parse(GENERIC, text, step, envelope=False)
        assert ans.content == text and ans.calls == [] and assembled(deltas) == (text, "", [])
    calls = '{"tool_calls": [{"name": "f", "arguments": {}}]}'
    ans, deltas = parse(GENERIC, calls, step, envelope=False)
    assert [(c.name, c.arguments) for c in ans.calls] == [("f", "{}")] and ans.content == ""


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_text_that_breaks_the_syntax_after_a_complete_call_is_content_once(step):
    """The call's arguments closed, then the text leaves the syntax (an unconstrained answer): the call is
    kept, and only what came after its arguments is content - not the call's text a second time."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}} and then some words'
    ans, deltas = parse(HERMES, text, step)
    assert [(c.name, c.arguments) for c in ans.calls] == [("f", '{"a": 1}')]
    assert ans.content == "} and then some words"
    assert assembled(deltas) == (ans.content, "", [("f", '{"a": 1}')])


def test_text_that_breaks_the_call_syntax_is_still_content():
    text = '[TOOL_CALLS] is what I would write'
    ans, deltas = parse(MISTRAL, text, 2)
    assert ans.calls == [] and ans.content == text == assembled(deltas)[0]


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_tokens_are_the_tokens_of_the_reasoning_block(opened):
    """OpenAI's ``reasoning_tokens``: the tokens from the block's opening marker (or the answer's start,
    when the prompt opened it) to its closing one, both counted; none of the content's."""
    tokens = ([] if opened else ["<think>"]) + ["Seven", " is", " prime", ".", "</think>", "\n\n", "Yes", "."]
    p = AnswerParser(thinking=not opened, in_reasoning=opened)
    for t in tokens:
        p.push_token(t)
    p.finish()
    assert p.answer.reasoning.strip() == "Seven is prime." and p.answer.content == "Yes."
    assert p.reasoning_tokens == (5 if opened else 6)
    plain = AnswerParser(thinking=True)
    for t in ("Yes", "."):
        plain.push_token(t)
    assert plain.reasoning_tokens == 0


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_first_lines_indentation_after_the_reasoning_is_the_answers(step):
    """The blank lines after ``</think>`` belong to neither part; the spaces that start the answer's
    first line (code) are the answer's."""
    ans, deltas = parse(HERMES, "<think>\nr\n</think>\n\n    indented code\nmore", step, thinking=True)
    assert ans.content == "    indented code\nmore" and ans.reasoning.strip() == "r"
    assert assembled(deltas)[0] == ans.content


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_blank_space_before_a_call_is_neither_text_nor_call(step):
    """A thinking template's answer ``</think>\n\n <tool_call>``: no content beside the calls (OpenAI's
    null, which an agent's ``if message.content`` relies on), and text before a call loses its trailing
    blank space; the blank space inside the text, or ending an answer without calls, is the text's."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for text, content in (("<think>\nr\n</think>\n\n " + call, ""), ("<think>r</think>\n \n\t" + call, ""),
                          ("Let me check.\n\n" + call, "Let me check."), ("a  b \n c\n" + call, "a  b \n c")):
        ans, deltas = parse(HERMES, text, step, thinking=True)
        assert ans.content == content and [c.name for c in ans.calls] == ["f"], text
        assert assembled(deltas)[0] == content
    for text in ("a  b  \n", "a <tool text \n\n", "  "):
        ans, deltas = parse(HERMES, text, step)
        assert ans.content == text and assembled(deltas)[0] == text


def test_an_answer_cut_right_after_llamas_call_tag_says_nothing():
    ans, deltas = parse(LLAMA3, "<|python_tag|>", 1000)
    assert ans.content == "" and not ans.calls and assembled(deltas) == ("", "", [])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_text_that_breaks_the_envelope_after_its_response_string_is_content_once(step):
    """The generic envelope's response string closed, then the text leaves the syntax (an answer the
    grammar did not hold): the string's text is said once, then what broke it - never the envelope's
    raw text a second time."""
    ans, deltas = parse(GENERIC, '{"response": "hi \\"there\\""x and more', step)
    assert ans.content == 'hi "there"x and more' and ans.calls == []
    assert assembled(deltas) == ('hi "there"x and more', "", [])
