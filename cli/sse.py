"""Server-sent events as the daemon sends them: ``data: <json>`` frames, ``data: [DONE]``, comments."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from weaved.cli.errors import ClientError, api_error

DONE = object()  # SSEDecoder.feed's answer to ``data: [DONE]``


class SSEDecoder:
    """Server-sent events, one line at a time (without its line ending).

    An event is the ``data:`` lines before a blank line, joined by newlines; comments (``: keep-alive``)
    and other fields (``event:``, ``id:``) are skipped.  ``feed`` returns the event's JSON payload when a
    line completes one, ``DONE`` for ``data: [DONE]``, else None.  A payload that is an error body
    raises ApiError: that is how the daemon reports a failure after a stream began.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Any:
        if line == "":
            if not self._data:
                return None
            payload, self._data = "\n".join(self._data), []
            if payload.strip() == "[DONE]":
                return DONE
            try:
                obj = json.loads(payload)
            except ValueError:
                raise ClientError(f"the daemon sent an event that is not JSON: {payload[:80]!r}") from None
            if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
                raise api_error(int(obj["error"].get("status") or 500), obj)
            return obj
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def parse_sse(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON payload of each event, until ``data: [DONE]`` or the end of ``lines``."""
    decoder = SSEDecoder()
    for line in lines:
        obj = decoder.feed(line)
        if obj is DONE:
            return
        if obj is not None:
            yield obj
