"""The GPU panel: utilisation and memory per NVIDIA GPU, or why there is none."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static
from weaved.cli.fmt import size
from weaved.tui.bars import bar, style_for
from weaved.tui.host_probe import HostSample


class GpuPanel(Static):
    def on_mount(self) -> None:
        self.border_title = self.border_title or "gpu"

    def show(self, s: HostSample) -> None:
        if not s.gpus:
            self.update(Text(s.gpu_note or "no GPU", style="dim"))
            return
        width = max(self.content_size.width - 12, 6)
        t = Text()
        for i, g in enumerate(s.gpus):
            mem = 100.0 * g.memory_used / g.memory_total if g.memory_total else 0.0
            t.append(f"{i} {g.name}\n", style="bold")
            t.append("util ")
            t.append(bar(g.utilization, width), style=style_for(g.utilization))
            t.append(f" {g.utilization:3.0f}%\nmem  ")
            t.append(bar(mem, width), style=style_for(mem))
            t.append(f" {mem:3.0f}%\n     {size(g.memory_used)} of {size(g.memory_total)}\n")
        self.update(t)
