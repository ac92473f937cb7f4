"""The tables' columns take their widths with their rows, so no frame shows them at their headers' widths."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from rich.text import Text
from textual.app import App
from textual.pilot import Pilot
from weaved.tui.fitted_table import FittedTable

from tests.tui.harness import run

LONG_ID = "s-3f9c2a1b7d4e8f60"


class OneTable(App):
    CSS = "FittedTable { height: 6; }"  # a fixed height, as in weave top: drawn before the table has measured rows

    def compose(self):
        yield FittedTable()

    def on_mount(self) -> None:
        table = self.query_one(FittedTable)
        table.add_column("id", key="id")
        table.add_column("n", key="n")


def with_table(check: Callable[[Pilot, FittedTable], Awaitable[None]]) -> None:
    """Run ``check`` on a mounted two-column table."""
    async def scenario():
        app = OneTable()
        async with app.run_test(size=(60, 8)) as pilot:
            await pilot.pause()
            await check(pilot, app.query_one(FittedTable))

    run(scenario())


def test_a_frame_drawn_right_after_fill_shows_whole_cells():
    async def check(pilot: Pilot, table: FittedTable) -> None:
        table.fill([(LONG_ID, [Text(LONG_ID), 12345]), ("s-1", ["[b]x[/b]", 7])])
        # no pause: the table has not gone idle, which is when a DataTable measures its columns
        assert [c.width for c in table.ordered_columns] == [len(LONG_ID), 5]
        assert LONG_ID in pilot.app.export_screenshot()
        await pilot.pause()
        assert str(table.get_row("s-1")[0]) == "[b]x[/b]"  # shown as written, not parsed as markup
        table.fill([("s-1", ["x", 7])])  # fewer, narrower rows: the columns narrow with them
        assert [c.width for c in table.ordered_columns] == [2, 1]

    with_table(check)


def test_a_row_of_the_wrong_length_is_refused_before_anything_changes():
    async def check(pilot: Pilot, table: FittedTable) -> None:
        table.fill([("a", ["x", 1])])
        with pytest.raises(ValueError, match="has 1 cells for 2 columns"):
            table.fill([("b", ["only one"])])
        assert table.row_count == 1 and str(table.get_row("a")[0]) == "x"

    with_table(check)
