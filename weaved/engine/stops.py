"""Incremental stop detection for streamed text.

Tokens arrive one decoded piece at a time, and a stop string may span several pieces ("</s" then
">").  ``StopChecker`` therefore holds back the longest tail of the text that could still grow into a
stop string, emits everything before it, and when a stop string completes returns the text up to
(not including) it.  A stop token id ends generation without emitting that token's text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopStep:
    """What one ``feed`` produced.

    ``text`` is safe to emit now (when ``stopped``, it is the last text of the output).  ``matched``
    is the stop string or stop token id that ended generation, or None.
    """

    text: str
    stopped: bool = False
    matched: str | int | None = None


class StopChecker:
    """Watches one sequence's output for stop strings and stop token ids.

    Contract: the concatenation of every ``feed(...).text`` plus ``flush()`` is the output up to the
    first stop (excluded), or all of it when nothing stopped it.  Feeding after a stop raises
    ``RuntimeError``.
    """

    def __init__(self, stop_strings: Iterable[str] = (), stop_ids: Iterable[int] = (), until: str | None = None,
                 reasoning: tuple[str, str] | None = None, in_reasoning: bool = False):
        self.stop_strings = tuple(s for s in stop_strings)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self._held = ""  # a tail that may be the start of a stop string; not emitted yet
        self._max_hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.stopped = False
        self.matched: str | int | None = None
        # ``until``: once this text is written (a tool call's start), stop strings no longer apply - the
        # rest is the grammar's to end; stop ids still do
        self._until = until if until and self.stop_strings else None
        self._tail = ""  # the output's last len(until) - 1 characters, for an ``until`` split over pieces
        # ``reasoning`` (open, close): the answer may start with a reasoning block (``in_reasoning``: the
        # prompt opened it), where stop strings do not apply - they end the visible answer after it, as
        # the client sees it apart from the reasoning; stop ids still apply everywhere
        self._gate: _ReasoningGate | None = None
        if reasoning is not None and self.stop_strings:
            self._gate = _ReasoningGate(*reasoning, inside=in_reasoning)

    def feed(self, piece: str, token_id: int | None = None) -> StopStep:
        """Take the decoded text of the next token (and its id, to check stop ids)."""
        if self.stopped:
            raise RuntimeError("generation already stopped")
        if token_id is not None and token_id in self.stop_ids:
            # The stop token's own text is not part of the output; what was held back is.
            text, self._held = self._held, ""
            return self._stop(text, token_id)
        if self._gate is not None:
            passed, piece = self._gate.feed(piece)
            if not self._gate.open:  # its end is written: the rest is the visible answer
                self._gate = None
            if self._gate is not None or not piece:
                return StopStep(passed)
            step = self._visible(piece)
            return StopStep(passed + step.text, step.stopped, step.matched)
        return self._visible(piece)

    def _visible(self, piece: str) -> StopStep:
        buf = self._held + piece
        if self._until is not None:
            buf_at = self._until_in(piece, len(self._held))
            if buf_at is not None:  # stop strings apply to the text before it, then no more
                cut, which = self._first_match(buf[:buf_at])
                self._held, self._until, self.stop_strings = "", None, ()
                return self._stop(buf[:cut], which) if which is not None else StopStep(buf)
        cut, which = self._first_match(buf)
        if which is not None:
            self._held = ""
            return self._stop(buf[:cut], which)
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold :]
        return StopStep(buf[: len(buf) - hold])

    def _until_in(self, piece: str, held: int) -> int | None:
        """Where ``until`` starts in the text held plus ``piece`` (0 if it started before the held text), or
        None while it has not been written; keeps the tail it may still complete."""
        window = self._tail + piece
        at = window.find(self._until)
        keep = len(self._until) - 1
        self._tail = window[-keep:] if keep else ""
        if at < 0:
            return None
        return max(0, at - len(window) + len(piece) + held)

    def flush(self) -> str:
        """End of output for another reason (length, end of sequence): release the held text."""
        text, self._held = self._held, ""
        if self._gate is not None:
            text, self._gate = self._gate.flush() + text, None
        return text

    def _stop(self, text: str, matched: str | int) -> StopStep:
        self.stopped = True
        self.matched = matched
        return StopStep(text, stopped=True, matched=matched)

    def _first_match(self, buf: str) -> tuple[int, str | None]:
        """Earliest start of any stop string in ``buf`` (the longest string wins a tie)."""
        best, which = len(buf) + 1, None
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0 and (i < best or (i == best and which is not None and len(s) > len(which))):
                best, which = i, s
        return best, which

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[len(buf) - n :]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0


class _ReasoningGate:
    """Where an answer's reasoning block is, in its streamed text: ``feed`` returns (text to pass on as
    it is, text after the block's end, "" while it lasts).  The block opens only at the answer's start
    (after blank space), as the answer's parser reads it; until the text there can no longer become
    ``open_``, it is held."""

    def __init__(self, open_: str, close: str, inside: bool):
        self.open_, self.close = open_, close
        self.state = "in" if inside else "maybe"
        self._buf = ""  # "maybe": the text so far; "in": the last len(close) - 1 characters seen

    @property
    def open(self) -> bool:
        return self.state != "out"

    def feed(self, piece: str) -> tuple[str, str]:
        if self.state == "maybe":
            buf, self._buf = self._buf + piece, ""
            s = buf.lstrip()
            if s.startswith(self.open_):
                self.state = "in"
                head = len(buf) - len(s) + len(self.open_)
                passed, rest = self.feed(buf[head:])
                return buf[:head] + passed, rest
            if self.open_.startswith(s):  # blank, or the start of the marker: not decided yet
                self._buf = buf
                return "", ""
            self.state = "out"  # no reasoning block: all of it is the visible answer
            return "", buf
        if self.state == "in":
            window = self._buf + piece
            at = window.find(self.close)
            if at < 0:
                keep = len(self.close) - 1
                self._buf = window[-keep:] if keep else ""
                return piece, ""
            end = at + len(self.close) - len(self._buf)  # where the block ends in ``piece``
            self.state, self._buf = "out", ""
            return piece[:end], piece[end:]
        return "", piece

    def flush(self) -> str:
        text = self._buf if self.state == "maybe" else ""
        self._buf = ""
        return text
