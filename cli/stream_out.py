"""How a streamed answer is printed: its text, reasoning and tool calls as they arrive, and a long
prompt's progress on the terminal meanwhile (``weave run``, ``weave chat``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TextIO

from weaved.cli import fmt
from weaved.cli.client import Delta

DIM, CALL, PLAIN = "\x1b[2m", "\x1b[36m", "\x1b[0m"


def write_stream(deltas: Iterable[Delta], out: TextIO | None = None,
                 stop: Callable[[], bool] | None = None, err: TextIO | None = None) -> Delta | None:
    """Print each delta as it arrives (then a newline): the answer's text; its reasoning dimmed (on a
    terminal; marked ``[thinking]`` otherwise); each tool call as ``-> name(arguments)``.  A long
    prompt's progress shows on ``err`` (stderr) while it is a terminal, on one line rewritten in place
    and cleared before the answer.  Returns the last delta that carries the finish reason or usage, or
    None.  ``stop()``, asked after each delta, ends the printing early."""
    out = out or sys.stdout
    err = err or sys.stderr
    styled = out.isatty() and not os.environ.get("NO_COLOR")  # (https://no-color.org asks for no styles)
    last, mode, wrote = None, "text", False
    progress = ProgressLine(err)

    def switch(to: str) -> None:
        nonlocal mode
        if to == mode:
            return
        if mode == "reasoning":
            out.write(PLAIN + "\n" if styled else "\n[/thinking]\n")
        elif mode == "call":
            out.write(")" + (PLAIN if styled else "") + "\n")
        if to == "reasoning":
            out.write(DIM if styled else "[thinking]\n")
        mode = to

    for d in deltas:
        if d.prefill is not None:
            progress.show(f"[prefill {d.prefill[0]}/{d.prefill[1]} prompt tokens]")
            continue
        progress.clear()
        if d.reasoning:
            switch("reasoning")
            out.write(fmt.printable(d.reasoning))
        for call in d.tool_calls:
            fn = call.get("function") or {}
            if "id" in call:  # a new call
                switch("text")
                out.write(("\n" if wrote else "") + (CALL if styled else "")
                          + f"-> {fmt.printable(fn.get('name', ''))}(")
                mode = "call"
            out.write(fmt.printable(fn.get("arguments") or ""))
        if d.text:
            switch("text")
            out.write(fmt.printable(d.text))  # a model's text may hold escape sequences
        out.flush()
        wrote = wrote or bool(d.text or d.reasoning or d.tool_calls)
        if d.finish_reason or d.usage:  # (the usage chunk comes after the finish: keep its reason)
            last = replace(d, finish_reason=d.finish_reason or (last.finish_reason if last else None))
        if stop is not None and stop():
            break
    progress.clear()
    switch("text")
    out.write("\n")
    out.flush()
    return last


class ProgressLine:
    """One line of progress on a terminal, rewritten in place (nothing when ``err`` is not a terminal)."""

    def __init__(self, err: TextIO):
        self.err, self.shown = err, False
        self.tty = err.isatty()

    def show(self, text: str) -> None:
        if self.tty:
            self.err.write("\r\x1b[K" + text)
            self.err.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.err.write("\r\x1b[K")
            self.err.flush()
            self.shown = False
