"""A table whose columns are sized with its rows, not after them.

A ``DataTable`` measures auto-width columns when it next goes idle, so a frame drawn between adding rows and
that moment shows every column at its header's width with the cells cut off; and the lines it drew then stay
in its line cache after the widths are measured (the cache is keyed by the rows, not the widths), so on a
busy machine a table could keep showing cut cells until its rows next changed.  ``fill`` sets each column's
width from the rows it is about to add, so every frame drawn after it has the final widths.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.render import measure
from textual.widgets import DataTable


class FittedTable(DataTable):
    def fill(self, rows: Sequence[tuple[str, Sequence[object]]]) -> None:
        """Replace every row with ``rows`` (key, cells), each column as wide as its widest cell or header.

        A cell that is not a ``Text`` is shown as ``str(cell)``, never parsed as markup."""
        texts = [(key, [c if isinstance(c, Text) else Text(str(c)) for c in cells]) for key, cells in rows]
        columns = self.ordered_columns
        for key, cells in texts:
            if len(cells) != len(columns):
                raise ValueError(f"row {key!r} has {len(cells)} cells for {len(columns)} columns")
        self.clear()
        console = self.app.console
        for i, column in enumerate(columns):
            column.width = max([column.label.cell_len, *(measure(console, cells[i], 1) for _, cells in texts)])
            column.auto_width = False
        for key, cells in texts:
            self.add_row(*cells, key=key)
