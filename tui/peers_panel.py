"""The peers panel: the federation's other nodes and their state."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static
from weaved.cli.fmt import peer_text, printable


class PeersPanel(Static):
    def on_mount(self) -> None:
        self.border_title = "peers"

    def show(self, peers: list[dict]) -> None:
        if not peers:
            self.update(Text("no peers", style="dim"))
            return
        t = Text()
        for p in peers:
            alive = p.get("state") in ("alive", "up", "ready") or p.get("alive") is True
            t.append("● ", style="green" if alive else "red")
            t.append(printable(peer_text(p)) + "\n")
        self.update(t)
