"""A tool result must answer a call: OpenAI's rule, so that an agent loop's bug is a 400, not a turn.

A ``tool`` message (a Responses ``function_call_output``) follows the assistant message whose
``tool_calls`` it answers - directly or after other tool messages - and its ``tool_call_id`` is one of
those calls' ids.  Results at the very start of a request's messages answer the calls of the answer
before it: the previous response's ``function_call`` items for a Responses chain (``earlier``), or a
session's last answer, whose call ids this check does not know (``earlier`` None: accepted).
"""

from __future__ import annotations

from weaved.errors import InvalidRequest


def check_tool_results(messages: list[dict], earlier: set[str] | None, *, param: str = "messages") -> None:
    """Raise InvalidRequest (400) for a tool result that answers no call (see the module's doc)."""
    calls: set[str] | None = earlier  # the ids the next tool message may answer; None: unknown
    leading = True  # no message but tool results so far
    for m in messages:
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            if calls is None and leading:
                continue
            if not calls:
                raise InvalidRequest(f"the tool result for {cid!r} must follow the assistant message whose "
                                     f"tool_calls it answers; none comes before it", param=param)
            if cid not in calls:
                raise InvalidRequest(f"the tool result for {cid!r} answers no call of the assistant message "
                                     f"before it (its calls: {', '.join(sorted(calls))})", param=param)
            continue
        leading = False
        calls = {c.get("id") for c in m.get("tool_calls") or ()} if role == "assistant" else set()
