"""A tool result must answer a call: OpenAI's rule, so that an agent loop's bug is a 400, not a turn.

A ``tool`` message (a Responses ``function_call_output``) follows the assistant message whose
``tool_calls`` it answers - directly or after other tool messages - and its ``tool_call_id`` is one of
those calls' ids.  Results at the very start of a request's messages answer the calls of the answer
before it: a session's last answer (``answered_calls`` of its transcript; a Responses chain's
previous ``function_call`` items), or none for a stateless request (``earlier`` None: unknown, accepted).
Every call must have its result before the next message that is not one (or the request's end).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weaved.errors import InvalidRequest


@dataclass(frozen=True)
class Words:
    """An API's errors for tool results, in its own terms (``str.format`` templates): a result before
    any call (``cid``), one answering none of the calls before it (``cid``, ``calls``), calls left
    without results (``ids``); ``param``: the request's field that holds the conversation."""

    orphan: str
    stranger: str
    missing: str
    param: str


CHAT_WORDS = Words(
    orphan="the tool result for {cid!r} must follow the assistant message whose tool_calls it answers; none comes "
           "before it",
    stranger="the tool result for {cid!r} answers no call of the assistant message before it (its calls: {calls})",
    missing="an assistant message with tool_calls must be followed by a tool result for each call; no result for: "
            "{ids}",
    param="messages")
RESPONSES_WORDS = Words(
    orphan="the function_call_output for {cid!r} must follow the function_call it answers; none comes before it",
    stranger="the function_call_output for {cid!r} answers none of the function_call items before it (their "
             "call_ids: {calls})",
    missing="each function_call must be followed by a function_call_output for its call_id before any other "
            "input item; no output for: {ids}",
    param="input")


def answered_calls(transcript: list[dict]) -> set[str] | None:
    """The calls a session's next messages may answer first: those of its transcript's last assistant
    message (before any tool results) - a generated answer's parsed calls (its ``answer``) or calls a
    client sent; None when unknown (an answer recorded without its parsed form)."""
    for m in reversed(transcript):
        role = m.get("role")
        if role == "tool":
            continue
        if role != "assistant":
            return set()
        answer = m.get("answer")
        calls = (answer or {}).get("tool_calls") or m.get("tool_calls")
        if calls:
            return {c.get("id") for c in calls}
        return None if "finish_reason" in m and answer is None else set()
    return set()


def cut_calls(transcript: list[dict]) -> set[str]:
    """The calls of ``answered_calls`` that the token limit cut (their arguments never closed): a result
    may answer one (an agent saying it could not run it), none is required - the conversation may go on
    past an answer that was cut."""
    for m in reversed(transcript):
        if m.get("role") == "tool":
            continue
        if m.get("role") != "assistant" or m.get("finish_reason") != "length":
            return set()
        calls = ((m.get("answer") or {}).get("tool_calls") or m.get("tool_calls") or [])[-1:]
        return {c.get("id") for c in calls if not _closed(c.get("function", {}).get("arguments"))}
    return set()


def _closed(arguments: object) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except (TypeError, ValueError):
        return False


def check_tool_results(messages: list[dict], earlier: set[str] | None, words: Words = CHAT_WORDS,
                       cut: set[str] = frozenset()) -> None:
    """Raise InvalidRequest (400) for a tool result that answers no call, and for calls left without
    their results when the conversation goes on (see the module's doc).  ``cut``: calls of ``earlier``
    the token limit cut, which may be answered and need not be."""
    calls: set[str] | None = earlier  # the ids the next tool message may answer; None: unknown
    optional: set[str] = set(cut)
    answered: set[str] = set()
    leading = True  # no message but tool results so far
    for m in messages:
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            if calls is None and leading:
                continue
            if not calls:
                raise InvalidRequest(words.orphan.format(cid=cid), param=words.param)
            if cid not in calls:
                raise InvalidRequest(words.stranger.format(cid=cid, calls=", ".join(sorted(calls))),
                                     param=words.param)
            answered.add(cid)
            continue
        _all_answered(calls, answered | optional, words)
        leading = False
        calls = {c.get("id") for c in m.get("tool_calls") or ()} if role == "assistant" else set()
        answered, optional = set(), set()
    _all_answered(calls, answered | optional, words)


def _all_answered(calls: set[str] | None, answered: set[str], words: Words) -> None:
    """An assistant message's calls must each have their result before the conversation goes on (or
    ends: the answer asked for follows the results), as OpenAI requires."""
    missing = sorted((calls or set()) - answered)
    if missing:
        raise InvalidRequest(words.missing.format(ids=", ".join(missing)), param=words.param)
