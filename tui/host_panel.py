"""The host panel: CPU load per core and memory."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static
from weaved.cli.fmt import size
from weaved.tui.bars import bar, level, style_for
from weaved.tui.host_probe import HostSample

BAR_CORES = 4  # up to this many cores get a bar each; more are drawn as one character each
STRIP_WIDTH = 32  # cores per line when drawn as characters


class HostPanel(Static):
    """Per-core CPU bars (or level blocks on a many-core host) and a memory bar."""

    last: HostSample | None = None

    def on_mount(self) -> None:
        self.border_title = self.border_title or "host"

    def on_resize(self) -> None:
        if self.last is not None:
            self.show(self.last)

    def show(self, s: HostSample) -> None:
        self.last = s
        width = max(self.content_size.width - 16, 8)
        t = Text()
        cores = s.cpu_percent
        if len(cores) <= BAR_CORES:
            for i, p in enumerate(cores):
                t.append(f"cpu{i:<3d}")
                t.append(bar(p, width), style=style_for(p))
                t.append(f" {p:5.1f}%\n")
        else:
            for start in range(0, len(cores), STRIP_WIDTH):
                chunk = cores[start:start + STRIP_WIDTH]
                t.append(f"cpu{start:<3d}")
                for p in chunk:
                    t.append(level(p), style=style_for(p))
                t.append("\n")
            avg = sum(cores) / len(cores)
            t.append(f"avg   {avg:5.1f}% over {len(cores)} cores\n")
        mem = 100.0 * s.memory_used / s.memory_total if s.memory_total else 0.0
        t.append("mem   ")
        t.append(bar(mem, width), style=style_for(mem))
        t.append(f" {mem:5.1f}%\n      {size(s.memory_used)} of {size(s.memory_total)}")
        self.update(t)
