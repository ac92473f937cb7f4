"""The event log: placements, promotions, demotions, migrations and preemptions as the daemon reports them."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import RichLog
from weaved.cli.fmt import placement_summary, printable

STYLES = {"placement": "cyan", "promotion": "green", "demotion": "yellow", "preemption": "magenta",
          "migration": "blue", "error": "red"}
MAX_LINES = 1000


def event_text(ev: dict) -> str:
    """``12:00:03 promotion  s-3f9c2a1b7d4e8f60 -> pool cpu (...): reasons``."""
    when = time.strftime("%H:%M:%S", time.localtime(ev.get("time") or time.time()))
    kind = str(ev.get("type", "event"))
    session = ev.get("session")
    rest = {k: v for k, v in ev.items() if k not in ("type", "time", "session", "placement")}
    parts = [when, f"{kind:<10s}"]
    if session:
        parts.append(str(session))
    if ev.get("placement"):
        parts.append("-> " + placement_summary(ev["placement"]))
    parts += [f"{k}={v}" for k, v in rest.items()]
    return " ".join(parts)


class EventLog(RichLog):
    def __init__(self, **kw) -> None:
        super().__init__(max_lines=MAX_LINES, wrap=False, markup=False, **kw)
        self.entries: list[str] = []  # the plain lines, newest last (bounded like the view)

    def on_mount(self) -> None:
        self.border_title = "events"

    def add(self, ev: dict) -> None:
        line = printable(event_text(ev))
        self.entries.append(line)
        del self.entries[:-MAX_LINES]
        self.write(Text(line, style=STYLES.get(str(ev.get("type")), "")))

    def note(self, line: str) -> None:
        """A line of the viewer's own (connection changes)."""
        self.entries.append(line)
        del self.entries[:-MAX_LINES]
        self.write(Text(line, style="dim"))
