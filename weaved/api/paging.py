"""OpenAI's list pages: ``after`` an item's id starts the page past it, ``limit`` bounds it, and the answer
says ``first_id``, ``last_id`` and ``has_more``."""

from __future__ import annotations

from weaved.errors import InvalidRequest


def page(items: list[dict], after: str | None, limit: int | None, missing: str) -> dict:
    """The page of ``items`` (in list order) after the item whose id is ``after``, at most ``limit`` long
    (None: all of the rest); an ``after`` no item has is a 400 saying ``missing``."""
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise InvalidRequest(f"after: {missing}", param="after")
        items = items[ids.index(after) + 1:]
    data = items if limit is None else items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > len(data)}
