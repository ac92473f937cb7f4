"""The pools table: one row per batch engine, and the KV store's bytes by tier in its subtitle."""

from __future__ import annotations

from rich.text import Text
from weaved.cli.fmt import DASH, printable, rate, size, variant
from weaved.tui.fitted_table import FittedTable

COLUMNS = ("pool", "backend", "device", "strategy", "variant", "batch", "queue", "tok/s", "preempted")


class PoolsTable(FittedTable):
    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="none", zebra_stripes=True, **kw)
        self._last: tuple | None = None

    def on_mount(self) -> None:
        self.border_title = "pools"
        for c in COLUMNS:
            self.add_column(c, key=c)

    def show(self, pools: list[dict], kv: dict, notes: list[str]) -> None:
        if (pools, kv, notes) == self._last:
            return
        self._last = (pools, kv, notes)
        rows = []
        for p in pools:
            # a torch pool on the CPU device stands in for a GPU pool (tests, functional benchmarks)
            device = f"{p.get('device')} (GPU stand-in)" if p.get("stand_in") else (p.get("device") or DASH)
            cells = [p["name"], p.get("backend") or DASH, device, p.get("strategy") or DASH,
                     variant(p.get("variant") or {})]
            rows.append((p["name"], [*(Text(printable(str(c))) for c in cells), p.get("batch_depth", 0),
                                     p.get("queue_depth", 0), rate(p.get("tokens_per_s")), p.get("preemptions", 0)]))
        self.fill(rows)
        ram = size(kv.get("ram_bytes")) if kv.get("ram_measured", True) else "?"
        device = f" · {size(kv['device_bytes'])} GPU" if kv.get("device_bytes") else ""
        sub = (f"KV {size(kv.get('file_bytes'))} disk · {ram} RAM{device} · {size(kv.get('reserved_bytes'))} reserved"
               f" / {size(kv.get('cap_bytes'))} cap") if kv else ""
        if notes:
            sub += f" · {len(notes)} pool note(s)"
        self.border_subtitle = sub
