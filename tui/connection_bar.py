"""One line saying whether the daemon answers, and what it serves (the daemon's words as text: a model
name or an error holding ``[`` is not markup, nor a control character a terminal's command)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static
from weaved.cli.fmt import printable, seconds


class ConnectionBar(Static):
    def __init__(self, address: str, **kw) -> None:
        super().__init__(f"connecting to {address} ...", **kw)
        self.address = address
        self.text = ""
        self.up: bool | None = None

    def connected(self, status: dict) -> None:
        model = status.get("model") or {}
        sessions = [s for s in status.get("sessions") or () if not s.get("ephemeral")]
        self.text = (f"● {self.address} · {model.get('name', '?')} · profile {status.get('profile', '?')} · "
                     f"up {seconds(status.get('uptime_s'))} · {len(sessions)} session(s)")
        self.up = True
        self.set_class(False, "-down")
        self.update(Text(printable(self.text)))

    def down(self, text: str) -> None:
        self.text = text
        self.up = False
        self.set_class(True, "-down")
        self.update(Text(printable(self.text)))
