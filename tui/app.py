"""``weave top``: a live view of a running daemon.

Two workers keep it current: one polls ``/v1/status`` (pools, sessions, KV, peers), one follows
``/v1/events`` (placements, promotions, preemptions ...).  Both survive the daemon going away: the
view says "daemon not running" and picks up again when it is back.  The host panel samples the
machine itself (psutil, pynvml), since the daemon is on this host (it speaks over a Unix socket).

Keys: ``p`` promote, ``d`` demote, ``x`` delete (after a confirmation), ``/`` filter, ``s`` sort,
``q`` quit; the arrow keys choose the session.
"""

from __future__ import annotations

import asyncio
import signal

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Header, Input
from weaved.cli.client import is_url
from weaved.cli.errors import ClientError, DaemonNotRunning
from weaved.cli.fmt import printable
from weaved.tui.confirm_delete import ConfirmDelete
from weaved.tui.connection_bar import ConnectionBar
from weaved.tui.event_log import EventLog
from weaved.tui.filter_bar import FilterBar
from weaved.tui.gpu_panel import GpuPanel
from weaved.tui.host_panel import HostPanel
from weaved.tui.host_probe import HostProbe
from weaved.tui.link import DaemonLink
from weaved.tui.peers_panel import PeersPanel
from weaved.tui.pools_table import PoolsTable
from weaved.tui.sessions_table import SessionsTable
from weaved.tui.throughput_panel import ThroughputPanel

DONE_WORDS = {"promote": "promoted", "demote": "demoted", "delete": "deleted"}


COMPACT_BELOW_ROWS = 34  # terminal rows under which the panels take their compact heights (.tcss)
TINY_BELOW_ROWS = 22  # rows under which the gauges and the bottom row are hidden (.tcss)


class WeaveTop(App):
    CSS_PATH = "weave_top.tcss"
    TITLE = "weave top"
    BINDINGS = [
        Binding("p", "promote", "Promote"),
        Binding("d", "demote", "Demote"),
        Binding("x", "delete", "Delete"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("s", "sort", "Sort"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # as in top and htop
    ]

    def __init__(self, address: str, *, api_key: str | None = None, poll_interval_s: float = 1.0,
                 probe: HostProbe | None = None):
        """``address``: the daemon's socket path (or TCP URL).  ``probe`` samples the host (a HostProbe
        when not given)."""
        super().__init__()
        self.address = address
        self.link = DaemonLink(address, api_key)
        self.poll_interval_s = poll_interval_s
        self.probe = probe
        self.status: dict | None = None  # the last status the daemon sent (None while it is away)
        self.polls = 0  # status polls done, answered or not
        self.up: bool | None = None

        # the main screen's widgets, held directly: ``query_one`` searches the active screen, which is
        # the confirmation while it is open, and the workers keep updating these meanwhile
        self.host, self.gpu = HostPanel(id="host"), GpuPanel(id="gpu")
        self.throughput = ThroughputPanel(id="throughput")
        self.pools, self.sessions = PoolsTable(id="pools"), SessionsTable(id="sessions")
        self.peers, self.events = PeersPanel(id="peers"), EventLog(id="events")
        self.filter_bar, self.connection = FilterBar(id="filter"), ConnectionBar(address, id="connection")

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="≋")
        with Horizontal(id="gauges"):
            yield from (self.host, self.gpu, self.throughput)
        yield self.pools
        yield self.sessions
        with Horizontal(id="bottom"):
            yield from (self.peers, self.events)
        yield self.filter_bar
        yield self.connection
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.address
        if is_url(self.address):  # a daemon over TCP: the gauges sample this machine, not the daemon's
            self.host.border_title, self.gpu.border_title = "this machine (not the daemon's)", "this machine's gpu"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # leave the terminal as it was found, whoever stops us
            loop.add_signal_handler(sig, self.exit)
        if self.probe is None:
            self.probe = HostProbe()
        self.sample_host()
        self.set_interval(self.poll_interval_s, self.sample_host)
        self.run_worker(self._poll_status(), group="status", exit_on_error=False)
        self.run_worker(self._follow_events(), group="events", exit_on_error=False)
        self.sessions.focus()

    def on_resize(self, event) -> None:
        # a short terminal (e.g. 80x24) cannot give every panel its full height: the gauges, the pools
        # and the bottom row shrink so the sessions keep their rows and the filter bar stays on screen
        self.screen.set_class(event.size.height < COMPACT_BELOW_ROWS, "-compact")
        # shorter still, only the pools, the sessions and the connection's state fit
        self.screen.set_class(event.size.height < TINY_BELOW_ROWS, "-tiny")
        self.events.scroll_end(animate=False)  # the newest events, whatever the old height showed

    async def on_unmount(self) -> None:
        await self.link.aclose()
        if isinstance(self.probe, HostProbe):
            self.probe.close()

    # ---- host ------------------------------------------------------------------------------------
    def sample_host(self) -> None:
        if self.probe is None or not self.host.is_mounted:
            return
        s = self.probe.sample()
        self.host.show(s)
        self.gpu.show(s)

    # ---- the daemon ------------------------------------------------------------------------------
    async def _poll_status(self) -> None:
        while True:
            await self.refresh_status()
            await asyncio.sleep(self.poll_interval_s)

    async def refresh_status(self) -> None:
        try:
            st = await self.link.status()
        except ClientError as e:
            self._went_down(e)
        else:
            self._show(st)
        self.polls += 1

    def _show(self, st: dict) -> None:
        if self.up is False:  # back after an absence (the first connection needs no note)
            self.events.note("-- the daemon is back")
        self.up, self.status = True, st
        self.connection.connected(st)
        self.pools.show(st.get("pools") or [], st.get("kv") or {}, st.get("pool_notes") or [])
        self.sessions.show(st.get("sessions") or [])
        self.peers.show(st.get("peers") or [])
        self.throughput.add(sum(p.get("tokens_per_s") or 0.0 for p in st.get("pools") or ()))

    def _went_down(self, e: ClientError) -> None:
        if isinstance(e, DaemonNotRunning):
            text = f"daemon not running at {self.address}: start one with `weave serve` (retrying)"
        else:
            text = f"daemon error: {e} (retrying)"
        if self.up is True:
            self.events.note("-- the daemon went away")
        self.up, self.status = False, None
        self.connection.down(text)
        self.pools.show([], {}, [])
        self.sessions.show([])
        self.peers.show([])
        self.throughput.clear()

    async def _follow_events(self) -> None:
        while True:
            try:
                async for ev in self.link.events():
                    self.events.add(ev)
            except ClientError:
                pass  # the status poll says what is wrong; try again shortly
            await asyncio.sleep(self.poll_interval_s)

    # ---- keys ------------------------------------------------------------------------------------
    def _selected(self) -> str | None:
        sid = self.sessions.selected_id()
        if sid is None:
            self.notify("no session selected", severity="warning")
        return sid

    def action_promote(self) -> None:
        if (sid := self._selected()) is not None:
            self.run_worker(self._change("promote", sid), group="actions")

    def action_demote(self) -> None:
        if (sid := self._selected()) is not None:
            self.run_worker(self._change("demote", sid), group="actions")

    def action_delete(self) -> None:
        if (sid := self._selected()) is None:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._change("delete", sid), group="actions")

        self.push_screen(ConfirmDelete(sid), answered)

    async def _change(self, kind: str, sid: str) -> None:
        call = {"promote": self.link.promote, "demote": self.link.demote, "delete": self.link.delete}[kind]
        try:
            await call(sid)
        except ClientError as e:
            self.notify(printable(f"{kind} {sid}: {e}"), severity="error", markup=False)
            return
        self.notify(f"{DONE_WORDS[kind]} {sid}")
        await self.refresh_status()

    def action_filter(self) -> None:
        self.filter_bar.open()

    def on_input_changed(self, event: Input.Changed) -> None:
        if isinstance(event.input, FilterBar):
            self.sessions.set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if isinstance(event.input, FilterBar):
            event.input.close()
            self.sessions.set_filter(event.value)
            self.sessions.focus()

    def action_sort(self) -> None:
        self.sessions.cycle_sort()
