"""The throughput panel: tokens per second over the daemon's pools, as a sparkline of recent polls."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

HISTORY = 120  # polls kept (two minutes at the default interval)


class ThroughputPanel(Vertical):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.history: deque[float] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Label("waiting for the daemon", id="tps-now")
        yield Sparkline([], summary_function=max, id="tps-spark")

    def on_mount(self) -> None:
        self.border_title = "throughput"

    def add(self, tokens_per_s: float) -> None:
        self.history.append(tokens_per_s)
        peak = max(self.history)
        self.query_one("#tps-now", Label).update(f"{tokens_per_s:,.1f} tok/s   peak {peak:,.1f}")
        self.query_one("#tps-spark", Sparkline).data = list(self.history)

    def clear(self) -> None:
        self.query_one("#tps-now", Label).update("no daemon")
