"""The sessions table: every session's class, pool, backend, context, state, speed, TTFT, deadline slack
and placement reason; filtered by a substring, sorted by a column chosen with ``s``."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from weaved.cli.fmt import DASH, printable, rate, seconds, state_of
from weaved.tui.fitted_table import FittedTable

# (status field, column label)
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "id"), ("class", "class"), ("pool", "pool"), ("backend", "backend"), ("context_tokens", "context"),
    ("state", "state"), ("tokens_per_s", "tok/s"), ("ttft_s", "TTFT"), ("deadline_slack_s", "slack"),
    ("reason", "placement reason"),
)
FILTER_KEYS = ("id", "class", "pool", "backend", "state")  # what the / filter looks at
SORTABLE = ("class", "id", "pool", "context_tokens", "state", "tokens_per_s", "ttft_s", "deadline_slack_s")
CLASS_ORDER = {"interactive": 0, "background": 1, "batch": 2}
STATE_STYLE = {"running": "green", "waiting": "yellow", "paused": "yellow", "idle": "dim"}


def _sort_value(row: dict, key: str) -> tuple[int, Any]:
    v = row.get(key)
    if key == "class":
        v = CLASS_ORDER.get(v, 9)
    if isinstance(v, float | int) and key in ("tokens_per_s", "context_tokens"):
        v = -v  # biggest first
    return (v is None, v if v is not None else 0)


class SessionsTable(FittedTable):
    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.rows_all: list[dict] = []
        self.filter_text = ""
        self.sort_key = SORTABLE[0]
        self.shown_ids: list[str] = []  # the ids in display order (for tests and the cursor)

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)
        self._title()

    # ---- data ------------------------------------------------------------------------------------
    def show(self, sessions: list[dict]) -> None:
        rows = [s for s in sessions if not s.get("ephemeral")]
        if rows == self.rows_all and self.row_count == len(self.shown_ids):
            return  # nothing changed: no redraw (the usual case between two polls of an idle daemon)
        self.rows_all = rows
        self._rebuild()

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip()
        self._rebuild()

    def cycle_sort(self) -> str:
        self.sort_key = SORTABLE[(SORTABLE.index(self.sort_key) + 1) % len(SORTABLE)]
        self._rebuild()
        return dict(COLUMNS)[self.sort_key]

    def selected_id(self) -> str | None:
        if not self.shown_ids or self.cursor_row < 0 or self.cursor_row >= len(self.shown_ids):
            return None
        return self.shown_ids[self.cursor_row]

    # ---- drawing ---------------------------------------------------------------------------------
    def _matches(self, row: dict) -> bool:
        """Every word of the filter matches: ``state:running`` (or ``class:``, ``pool:``, ``backend:``,
        ``id:``) that column exactly - a prefix for ``id``; a plain word any of those columns in part.
        The placement reason is not searched: its words ("idle", "running") name other sessions' states."""
        for word in self.filter_text.lower().split():
            key, sep, value = word.partition(":")
            if sep and key in FILTER_KEYS:
                cell = str(row.get(key) or "").lower()
                if not (cell.startswith(value) if key == "id" else cell == value):
                    return False
            elif not any(word in str(row.get(k) or "").lower() for k in FILTER_KEYS):
                return False
        return True

    def _rebuild(self) -> None:
        keep = self.selected_id()
        rows = sorted((r for r in self.rows_all if self._matches(r)),
                      key=lambda r: (_sort_value(r, self.sort_key), r["id"]))
        self.shown_ids = [r["id"] for r in rows]
        self.fill([(r["id"], self._cells(r)) for r in rows])
        if keep in self.shown_ids:
            self.move_cursor(row=self.shown_ids.index(keep))
        self._title()

    @staticmethod
    def _cells(r: dict) -> list[object]:
        state = r.get("state") or DASH
        shown = state_of(r) or DASH
        return [_plain(r["id"]), _plain(r.get("class")), _plain(r.get("pool")), _plain(r.get("backend")),
                r.get("context_tokens", 0), Text(printable(shown), style=STATE_STYLE.get(state, "")),
                rate(r.get("tokens_per_s")), seconds(r.get("ttft_s")), _slack(r.get("deadline_slack_s")),
                _plain(r.get("reason"))]

    def _title(self) -> None:
        label = dict(COLUMNS)[self.sort_key]
        shown, total = len(self.shown_ids), len(self.rows_all)
        count = f"{shown} of {total}" if self.filter_text else f"{total}"
        title = f"sessions ({count}) · sorted by {label}"
        if self.filter_text:
            title += f" · filter {self.filter_text!r}"
        self.border_title = title


def _plain(value: object) -> Text:
    """A cell of the daemon's text as it is: not parsed as markup (a DataTable parses plain strings), its
    control characters escaped."""
    return Text(DASH if value is None or value == "" else printable(str(value)))


def _slack(s: float | None) -> Text:
    """Time left before the session's deadline: red when it is already late."""
    if s is None:
        return Text(DASH)
    return Text(seconds(s), style="red" if s < 0 else "")
