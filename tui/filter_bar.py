"""The filter bar ``/`` opens: sessions whose fields contain the text stay in the table."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input


class FilterBar(Input):
    BINDINGS = [Binding("escape", "clear_and_close", "Clear filter", show=False)]

    def __init__(self, **kw) -> None:
        hint = ("filter sessions: words in id, class, pool, backend, state, or key:value (state:running); "
                "Enter keeps, Esc clears")
        super().__init__(placeholder=hint, **kw)

    def open(self) -> None:
        self.add_class("-open")
        self.focus()

    def close(self) -> None:
        self.remove_class("-open")

    def action_clear_and_close(self) -> None:
        self.value = ""
        self.close()
        self.post_message(self.Submitted(self, ""))
