"""``GET /v1/responses/{id}/input_items``: the items a stored response answered - what its request
added to the chain, read back from the session's transcript in the Responses API's item shapes."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from weaved.api.paging import page
from weaved.api.state import state_of

router = APIRouter()


def as_items(rid: str, messages: list[dict]) -> list[dict]:
    """Transcript messages as input items: messages with text parts, calls sent back as ``function_call``
    items, tool results as ``function_call_output``; each with an id stable for this response."""
    items: list[dict] = []
    for i, m in enumerate(messages):
        key = f"{rid.removeprefix('resp_')}_{i}"
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "id": f"fco_{key}", "call_id": m.get("tool_call_id"),
                          "output": m.get("content") or "", "status": "completed"})
            continue
        if m.get("content"):
            kind = "output_text" if m["role"] == "assistant" else "input_text"
            items.append({"type": "message", "id": f"msg_{key}", "role": m.get("sent_as") or m["role"],
                          "status": "completed",
                          "content": [{"type": kind, "text": m["content"]}]})
        for j, call in enumerate(m.get("tool_calls") or ()):
            items.append({"type": "function_call", "id": f"fc_{key}_{j}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
    return items


@router.get("/v1/responses/{rid}/input_items")
async def input_items(request: Request, rid: str, order: Literal["asc", "desc"] = "desc",
                      limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
    """OpenAI's list: newest first unless ``order=asc``, ``limit`` a page, ``after`` an item id."""
    state = state_of(request)
    running = state.running_responses.get(rid)  # being generated: its input is its request's
    if running is not None:
        messages = running.req.messages()
    else:
        messages = await run_in_threadpool(state.daemon.response_input, rid)
    items = as_items(rid, messages)
    if order == "desc":
        items.reverse()
    return page(items, after, limit, f"no input item {after!r} in response {rid}")
