"""A /v1/responses answer as output items, built from the answer parser's deltas - the typed stream
events as they happen, and the response object at the end (the same items, the same ids)."""

from __future__ import annotations

import base64
import binascii
import secrets

SEALED = "weave1:"  # what a reasoning item's encrypted_content starts with: base64 of its text after it


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def seal_reasoning(text: str) -> str:
    """A reasoning item's ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``): the
    reasoning itself, opaque to the client, which sends it back to a chain it keeps (``store: false``).
    Nothing here is secret - the same text is the item's ``content`` - so it is encoded, not encrypted."""
    return SEALED + base64.b64encode(text.encode()).decode()


def unseal_reasoning(blob: str) -> str:
    """The reasoning in an ``encrypted_content`` this daemon wrote; ValueError for anything else."""
    if not blob.startswith(SEALED):
        raise ValueError("a reasoning item's encrypted_content was not written by Weave (it cannot be read)")
    try:
        return base64.b64decode(blob.removeprefix(SEALED), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("a reasoning item's encrypted_content is damaged") from None


class OutputItems:
    """Turns the parser's deltas (``weaved.agent.stream``) into output items: a ``reasoning`` item, a
    ``message`` with one ``output_text`` part, a ``function_call`` per call.  ``feed`` and ``close``
    return the stream events they complete (``type`` set, ``sequence_number`` added by the caller)."""

    def __init__(self, sealed_reasoning: bool = False):
        self.items: list[dict] = []
        self._open: dict | None = None
        self.sealed_reasoning = sealed_reasoning  # reasoning items carry encrypted_content too

    # ---- events ----------------------------------------------------------------------------------
    def feed(self, delta: dict) -> list[dict]:
        ev: list[dict] = []
        if "reasoning_content" in delta:
            item = self._ensure(ev, "reasoning")
            item["content"][0]["text"] += delta["reasoning_content"]
            ev.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": self._index(), "content_index": 0, "delta": delta["reasoning_content"]})
        if "content" in delta and delta["content"]:
            item = self._ensure(ev, "message")
            item["content"][0]["text"] += delta["content"]
            ev.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._index(),
                       "content_index": 0, "delta": delta["content"], "logprobs": []})
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "id" in call:  # a new call
                ev += self._close()
                item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": fn["name"],
                        "arguments": "", "status": "in_progress"}
                self._start(ev, item)
            item = self._open
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                ev.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self._index(), "delta": fn["arguments"]})
        return ev

    def ensure_any(self) -> list[dict]:
        """An answer with no text and no call is still one (empty) message."""
        ev: list[dict] = []
        if not self.items:
            self._ensure(ev, "message")
        return ev

    def close(self, calls: list | None = None, cut: bool = False) -> list[dict]:
        """The end of the answer: the open item is done - ``incomplete`` when the answer was ``cut``
        (token limit, cancel) in it, or when it is a call the parser's ``calls`` (``ToolCall``s) say
        was not complete."""
        unfinished = {c.id for c in calls or () if not c.complete}
        for item in self.items:  # a call cut mid-arguments is never reported complete
            if item["type"] == "function_call" and item["call_id"] in unfinished:
                item["incomplete"] = True
        if cut and self._open is not None:
            self._open["incomplete"] = True
        return self._close()

    # ---- items -----------------------------------------------------------------------------------
    def _index(self) -> int:
        return len(self.items) - 1

    def _ensure(self, ev: list[dict], kind: str) -> dict:
        if self._open is not None and self._open["type"] == kind:
            return self._open
        ev += self._close()
        if kind == "reasoning":
            # the model's own reasoning, as OpenAI returns raw reasoning (content), not a summary
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self._start(ev, item)
        return item

    def _start(self, ev: list[dict], item: dict) -> None:
        self.items.append(item)
        self._open = item
        shown = {**item, "content": []} if item["type"] in ("reasoning", "message") else dict(item)
        ev.append({"type": "response.output_item.added", "output_index": self._index(), "item": shown})
        if item["type"] == "message":
            ev.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": self._index(),
                       "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        elif item["type"] == "reasoning":
            ev.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": self._index(),
                       "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        i = self.items.index(item)
        ev: list[dict] = []
        status = "incomplete" if item.pop("incomplete", False) else "completed"
        if item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            ev += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": i,
                    "content_index": 0, "text": part["text"], "logprobs": []},
                   {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                    "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            item["status"] = status
            part = item["content"][0]
            if self.sealed_reasoning:
                item["encrypted_content"] = seal_reasoning(part["text"])
            ev += [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                    "content_index": 0, "text": part["text"]},
                   {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                    "content_index": 0, "part": part}]
        else:
            item["status"] = status
            ev.append({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i,
                       "arguments": item["arguments"]})
        ev.append({"type": "response.output_item.done", "output_index": i, "item": item})
        return ev
