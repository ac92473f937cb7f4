"""Server-sent events as the daemon sends them: ``data: <json>`` frames, ``data: [DONE]``, comments."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from weaved.cli.errors import ClientError, api_error

DONE = object()  # SSEDecoder.feed's answer to ``data: [DONE]``


@dataclass(frozen=True)
class Progress:
    """SSEDecoder.feed's answer to a ``: prefill 2048/8192`` comment: a long prompt's tokens fed so far,
    of those to feed."""

    done: int
    total: int


class SSEDecoder:
    """Server-sent events, one line at a time (without its line ending).

    An event is the ``data:`` lines before a blank line, joined by newlines; comments (``: keep-alive``)
    and other fields (``event:``) are skipped, but for a prompt's progress (``: prefill N/M``) and the
    events' ids: ``last_id`` is the last id given (what a reconnection sends as ``Last-Event-ID``).
    ``feed`` returns the event's JSON payload when a line completes one, ``DONE`` for ``data: [DONE]``,
    a ``Progress`` for a progress comment, else None.  A payload that is an error body
    raises ApiError: that is how the daemon reports a failure after a stream began.
    """

    def __init__(self, last_id: str | None = None) -> None:
        self._data: list[str] = []
        self.last_id = last_id
        self._id: str | None = None  # the id of the event being read: ``last_id`` once it is complete

    def feed(self, line: str) -> Any:
        if line == "":
            if self._id is not None:
                self.last_id, self._id = self._id, None
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
            return _progress(line)
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:  # (as the SSE standard has it: an id with NUL is ignored)
            self._id = value
        return None


def _progress(comment: str) -> Progress | None:
    words = comment[1:].split()
    if len(words) == 2 and words[0] == "prefill":
        done, _, total = words[1].partition("/")
        if done.isdigit() and total.isdigit():
            return Progress(int(done), int(total))
    return None


def parse_sse(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON payload of each event, until ``data: [DONE]`` or the end of ``lines``."""
    decoder = SSEDecoder()
    for line in lines:
        obj = decoder.feed(line)
        if obj is DONE:
            return
        if obj is not None and not isinstance(obj, Progress):
            yield obj
