"""The confirmation asked before ``x`` deletes a session."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label


class ConfirmDelete(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Delete"), Binding("n", "answer(False)", "Keep"),
                Binding("escape", "answer(False)", "Keep", show=False)]

    def __init__(self, session_id: str):
        super().__init__()
        self.session_id = session_id

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(f"Delete session {self.session_id}?", id="confirm-question")
            yield Label("Its transcript and KV cache are removed; a running turn is cancelled.")
            yield Label("[b]y[/b] delete    [b]n[/b] keep", id="confirm-keys")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
