"""OpenAI's list pages: ``after`` an item's id starts the page past it, ``limit`` bounds it, and the answer
says ``first_id``, ``last_id`` and ``has_more``."""

from __future__ import annotations

from collections.abc import Callable

from weaved.errors import InvalidRequest


def page(items: list[dict], after: str | None, limit: int | None, missing: str,
         gone: Callable[[str], Callable[[dict], bool] | None] = lambda after: None) -> dict:
    """The page of ``items`` (in list order) after the item whose id is ``after``, at most ``limit`` long
    (None: all of the rest); an ``after`` no item has is a 400 saying ``missing`` - unless ``gone(after)``
    knows where it stood (an item deleted since the client read it): a test of the items that came after
    it."""
    if after is not None:
        ids = [it["id"] for it in items]
        if after in ids:
            items = items[ids.index(after) + 1:]
        elif (later := gone(after)) is not None:
            items = [it for it in items if later(it)]
        else:
            raise InvalidRequest(f"after: {missing}", param="after")
    data = items if limit is None else items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > len(data)}
