"""``weave top`` driven by textual's pilot against the fake daemon: every key binding, the live data,
and losing and finding the daemon again."""

from __future__ import annotations

import time

import pytest
from weaved.tui.app import WeaveTop
from weaved.tui.confirm_delete import ConfirmDelete
from weaved.tui.filter_bar import FilterBar
from weaved.tui.host_probe import GpuSample

from tests.cli.fake_server import EVENT_TIME, FakeDaemon, seed_sessions, short_socket_dir
from tests.tui.harness import FixedProbe, run, until

SIZE = (130, 40)
INTERACTIVE, BACKGROUND, IDLE, BATCH = ("s-3f9c2a1b7d4e8f60", "s-a71e04c9b2d35f18", "s-e24b7f0d9c1a6358",
                                        "s-0c5d86e2f1a94b37")
PROMOTE, DEMOTE = f"/v1/sessions/{BACKGROUND}/promote", f"/v1/sessions/{BACKGROUND}/demote"


@pytest.fixture
def fake():
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as f:
        seed_sessions(f)
        yield f


def top(fake: FakeDaemon, poll_interval_s: float = 0.5, **kw) -> WeaveTop:
    """The app on ``fake``.  Not polling too often keeps the pilot's key presses quick: each waits until
    the app is idle."""
    probe = kw.pop("probe", FixedProbe())
    return WeaveTop(str(fake.socket_path), poll_interval_s=poll_interval_s, probe=probe, **kw)


async def loaded(pilot, app: WeaveTop) -> None:
    """The sessions shown, both tables measured (on their next idle), then laid out with those sizes."""
    await until(pilot, lambda: len(app.sessions.shown_ids) == 4, what="the sessions")
    tables = (app.sessions, app.pools)
    await until(pilot, lambda: all(t.virtual_size.height == 1 + t.row_count for t in tables), what="the tables")
    await pilot.pause()  # a layout pass after the tables' sizes changed


def test_shows_pools_sessions_events_and_the_connection(fake):
    async def scenario():
        app = top(fake, poll_interval_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            # sorted by class: interactive, background (by id), batch
            assert app.sessions.shown_ids == [INTERACTIVE, BACKGROUND, IDLE, BATCH]
            row = app.sessions.get_row(INTERACTIVE)
            assert [str(c) for c in row[:9]] == [INTERACTIVE, "interactive", "cpu", "cpu", "11", "running",
                                                 "38.2", "184ms", "420ms"]
            assert str(row[9]).startswith("interactive: latency-sensitive")
            pools = app.query_one("#pools")
            assert [str(c) for c in pools.get_row("cpu")][:4] == ["cpu", "cpu", "cpu", "standard"]
            assert pools.border_subtitle.startswith("KV 180.0 MiB disk · 92.0 MiB RAM")
            bar = app.query_one("#connection")
            assert bar.up
            assert "SmolLM2-135M-Instruct-Q4_0 · profile cpu-only · up 1h02m · 4 session(s)" in bar.text
            await until(pilot, lambda: len(app.query_one("#events").entries) >= 4, what="the events")
            fake.publish("migration", session=BATCH, pool="cpu")
            log = app.query_one("#events")
            await until(pilot, lambda: any("migration" in e for e in log.entries), what="a live event")
            when = time.strftime("%H:%M:%S", time.localtime(EVENT_TIME + 2))
            assert log.entries[2] == f"{when} preemption s-0c5d86e2f1a94b37 pool=cpu"
            spark = app.query_one("#tps-spark")
            await until(pilot, lambda: len(spark.data) >= 3, what="throughput samples")
            assert list(spark.data[:3]) == [212.5, 230.1, 251.0]

    run(scenario())


def test_p_promotes_and_d_demotes_the_selected_session(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press("down")  # the background session
            assert app.sessions.selected_id() == BACKGROUND
            await pilot.press("p")
            await until(pilot, lambda: PROMOTE in fake.paths("POST"), what="promote")
            await until(pilot, lambda: str(app.sessions.get_row(BACKGROUND)[1]) == "interactive", what="its class")
            assert app.sessions.selected_id() == BACKGROUND  # the cursor follows the session, not the row
            await pilot.press("d")
            await until(pilot, lambda: DEMOTE in fake.paths("POST"), what="demote")
            assert fake.sessions[BACKGROUND].cls == "background"

    run(scenario())


def test_x_deletes_only_after_confirmation(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press("x")
            await until(pilot, lambda: isinstance(app.screen, ConfirmDelete), what="the question")
            assert app.screen.session_id == INTERACTIVE
            await pilot.press("n")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmDelete), what="the answer")
            assert fake.paths("DELETE") == [] and INTERACTIVE in fake.sessions
            await pilot.press("x")
            await until(pilot, lambda: isinstance(app.screen, ConfirmDelete), what="the question again")
            await pilot.press("y")
            await until(pilot, lambda: INTERACTIVE not in app.sessions.shown_ids, what="the row to go")
            assert fake.paths("DELETE") == [f"/v1/sessions/{INTERACTIVE}"]
            assert INTERACTIVE not in fake.sessions

    run(scenario())


def test_slash_filters_the_sessions(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press("slash")
            bar = app.query_one(FilterBar)
            assert bar.has_class("-open") and bar.has_focus
            await pilot.press(*"background")
            assert app.sessions.shown_ids == [BACKGROUND, IDLE]
            await pilot.press("enter")  # keep the filter, back to the table
            assert not bar.has_class("-open") and app.sessions.has_focus
            await pilot.pause(0.6)  # polls keep coming: the filter stays
            assert app.sessions.shown_ids == [BACKGROUND, IDLE]
            assert "filter 'background'" in app.sessions.border_title
            await pilot.press("p")  # keys act on the filtered rows
            await until(pilot, lambda: PROMOTE in fake.paths("POST"), what="promote")
            await pilot.press("slash", "escape")  # clears it
            assert len(app.sessions.shown_ids) == 4 and not bar.has_class("-open")

    run(scenario())


def test_s_cycles_the_sort_column(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            by_id = [BATCH, INTERACTIVE, BACKGROUND, IDLE]
            unknown_last = [INTERACTIVE, BACKGROUND, BATCH, IDLE]  # known values first, then by id
            expected = [
                ("id", by_id), ("pool", by_id),  # one pool: ties go by id
                ("context_tokens", [BATCH, BACKGROUND, IDLE, INTERACTIVE]),  # longest first
                ("state", [IDLE, INTERACTIVE, BACKGROUND, BATCH]),
                ("tokens_per_s", unknown_last),  # fastest first
                ("ttft_s", unknown_last), ("deadline_slack_s", unknown_last),  # shortest first
                ("class", [INTERACTIVE, BACKGROUND, IDLE, BATCH]),  # and round again
            ]
            for key, order in expected:
                await pilot.press("s")
                assert (app.sessions.sort_key, app.sessions.shown_ids) == (key, order)
            assert app.sessions.border_title == "sessions (4) · sorted by class"

    run(scenario())


@pytest.mark.parametrize("key", ["q", "ctrl+c"])  # Ctrl-C as in top and htop
def test_q_and_ctrl_c_quit(fake, key):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            await pilot.press(key)
            await until(pilot, lambda: not app.is_running, what="the exit")

    run(scenario())


@pytest.mark.parametrize("size", [(40, 12), (60, 20)])
def test_a_short_terminal_keeps_the_sessions_and_the_connections_state_on_screen(fake, size):
    """Below 22 rows the gauges and the bottom row give way: nothing runs past the screen's end."""
    def fits(app: WeaveTop) -> bool:
        screen = app.screen.region
        return app.screen.virtual_size.height <= screen.height and screen.contains_region(app.connection.region)

    async def scenario():
        app = top(fake, poll_interval_s=0.05)
        async with app.run_test(size=size) as pilot:
            await loaded(pilot, app)
            assert fits(app) and app.sessions.region.height >= 5  # borders, header, two rows at least
            assert not app.query_one("#gauges").display and not app.query_one("#bottom").display
        with short_socket_dir() as d:  # and with no daemon, that is what the screen says
            app = WeaveTop(str(d / "w.sock"), poll_interval_s=0.05, probe=FixedProbe())
            async with app.run_test(size=size) as pilot:
                await until(pilot, lambda: app.connection.up is False, what="the daemon to be missed")
                assert fits(app) and "daemon not running" in app.connection.text

    run(scenario())


def test_says_daemon_not_running_and_reconnects_by_itself():
    async def scenario():
        with short_socket_dir() as d:
            path = d / "w.sock"
            app = WeaveTop(str(path), poll_interval_s=0.05, probe=FixedProbe())
            async with app.run_test(size=SIZE) as pilot:
                bar = app.query_one("#connection")
                await until(pilot, lambda: bar.up is False, what="the daemon to be missed")
                assert bar.text == f"daemon not running at {path}: start one with `weave serve` (retrying)"
                assert app.sessions.shown_ids == []
                fake = FakeDaemon(path)
                seed_sessions(fake)
                with fake:
                    await until(pilot, lambda: bar.up is True, what="the reconnection")
                    await until(pilot, lambda: len(app.sessions.shown_ids) == 4, what="the sessions")
                    log = app.query_one("#events")
                    await until(pilot, lambda: len(log.entries) >= 4, what="the event stream")
                await until(pilot, lambda: bar.up is False, what="the daemon to go")
                assert "-- the daemon went away" in log.entries and app.sessions.shown_ids == []
                with fake:
                    await until(pilot, lambda: bar.up is True, what="the second reconnection")
                assert "-- the daemon is back" in log.entries

    run(scenario())


def test_host_panels_many_cores_and_gpus(fake):
    gpu = GpuSample("NVIDIA L40S", 87.0, 30 * 2**30, 48 * 2**30)
    probe = FixedProbe(cores=tuple(float(i * 3 % 100) for i in range(40)), gpus=(gpu,))

    async def scenario():
        app = top(fake, probe=probe)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            host = str(app.query_one("#host").render())
            assert "cpu0  " in host and "cpu32 " in host and "avg    43.5% over 40 cores" in host
            gpu_text = str(app.query_one("#gpu").render())
            assert "0 NVIDIA L40S" in gpu_text and " 87%" in gpu_text and "30.0 GiB of 48.0 GiB" in gpu_text

    run(scenario())


def test_no_gpu_is_said(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            assert str(app.query_one("#gpu").render()) == "no GPU"
            assert "cpu1" in str(app.query_one("#host").render())

    run(scenario())


def test_weave_top_command_opens_the_view_on_the_socket(monkeypatch, tmp_path):
    from typer.testing import CliRunner
    from weaved.cli import top as top_cmd
    from weaved.cli.app import app as cli

    opened = []
    monkeypatch.setattr(WeaveTop, "run", lambda self: opened.append((self.address, self.poll_interval_s)))
    env = {"WEAVE_SOCKET": str(tmp_path / "w.sock")}
    res = CliRunner().invoke(cli, ["top", "--interval", "2"], env=env)  # (the runner's output is no terminal)
    assert res.exit_code == 2 and "needs a terminal" in res.output and opened == []
    monkeypatch.setattr(top_cmd, "on_a_terminal", lambda: True)
    res = CliRunner().invoke(cli, ["top", "--interval", "2"], env=env)
    assert res.exit_code == 0, res.output
    assert opened == [(str(tmp_path / "w.sock"), 2.0)]


def test_sigterm_and_sighup_end_the_app_so_the_terminal_is_restored(fake):
    import asyncio
    import signal

    async def scenario(sig):
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            handler = asyncio.get_running_loop()._signal_handlers[sig]  # what the signal would run
            handler._run()
            await until(pilot, lambda: not app.is_running, what="the exit")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        run(scenario(sig))


def test_a_gpu_stand_in_pool_and_device_kv_are_shown(fake, monkeypatch):
    real = fake.status

    def status() -> dict:
        st = real()
        st["pools"].append({**st["pools"][0], "name": "gpu", "backend": "torch", "device": "cpu",
                            "device_kind": "gpu", "stand_in": True})
        st["kv"]["device_bytes"] = 3 * 2**20
        return st

    monkeypatch.setattr(fake, "status", status)

    async def scenario():
        app = top(fake, poll_interval_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(pilot, app)
            pools = app.query_one("#pools")
            await until(pilot, lambda: pools.row_count == 2, what="both pools")
            assert [str(c) for c in pools.get_row("gpu")][:3] == ["gpu", "torch", "cpu (GPU stand-in)"]
            assert "92.0 MiB RAM · 3.0 MiB GPU ·" in pools.border_subtitle

    run(scenario())


def test_the_daemons_text_is_shown_as_it_is_never_as_markup_or_terminal_codes(fake):
    hostile = fake.add_session("s-00000000000000bb", "batch")
    hostile.placement = {**hostile.placement, "reasons": ["[bold red]loud[/]", "[/unclosed", "\x1b[2Jcleared"]}
    fake.publish("placement", session="s-00000000000000bb", placement=hostile.placement)
    status = fake.status
    fake.status = lambda: {**status(), "model": {**status()["model"], "name": "m [/x] \x1b[2J"}}

    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "s-00000000000000bb" in app.sessions.shown_ids, what="the session")
            reason = str(app.sessions.get_row("s-00000000000000bb")[9])
            assert reason == "[bold red]loud[/]; [/unclosed; \\x1b[2Jcleared"
            await until(pilot, lambda: any("s-00000000000000bb" in e for e in app.events.entries), what="event")
            assert not any("\x1b" in e for e in app.events.entries)
            bar = app.query_one("#connection")  # (as markup, "[/x]" froze the view: its poll died)
            assert bar.up and "m [/x] \\x1b[2J" in str(bar.render())
            polled = fake.status_calls
            await until(pilot, lambda: fake.status_calls > polled + 1, what="the polls going on")

    run(scenario())


def test_the_filter_matches_columns_not_the_placement_reason(fake):
    from weaved.tui.sessions_table import SessionsTable

    table = SessionsTable()
    rows = [{"id": "s-aa01", "class": "background", "pool": "cpu", "backend": "cpu", "state": "idle",
             "reason": "background: running on the CPU pool"},
            {"id": "s-bb02", "class": "interactive", "pool": "gpu", "backend": "torch", "state": "running",
             "reason": "interactive: idle GPU pool"}]

    def shown(text: str) -> list[str]:
        table.filter_text = text
        return [r["id"] for r in rows if table._matches(r)]

    assert shown("running") == ["s-bb02"]  # the state, not the first session's reason
    assert shown("idle") == ["s-aa01"]
    assert shown("state:running") == ["s-bb02"] and shown("state:run") == []  # a column: exact
    assert shown("class:background pool:cpu") == ["s-aa01"] and shown("class:background pool:gpu") == []
    assert shown("id:s-bb") == ["s-bb02"]  # ids by prefix
    assert shown("torch") == ["s-bb02"] and shown("") == ["s-aa01", "s-bb02"]


def test_the_events_panel_starts_with_what_happened_before(fake):
    for i in range(3):
        fake.publish("placement", session=f"s-00000000000000e{i}", placement={"decode_pool": "cpu", "reasons": []})

    async def scenario():
        app = top(fake)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: sum("s-00000000000000e" in e for e in app.events.entries) == 3,
                        what="the backlog")

    run(scenario())


def test_a_short_terminal_keeps_every_session_the_filter_and_the_newest_events_on_screen(fake):
    async def scenario():
        app = top(fake)
        async with app.run_test(size=(80, 24)) as pilot:
            await loaded(pilot, app)
            assert app.screen.has_class("-compact")
            table = app.sessions
            # the border, the header row and all four sessions fit inside the table's own height
            assert table.region.height >= 2 + 1 + 4 and table.region.bottom <= app.screen.region.bottom
            # ... no horizontal scrollbar takes a row from them: left and right scroll the wide columns
            assert table.scrollable_content_region.height >= 1 + 4
            assert app.pools.scrollable_content_region.height == app.pools.virtual_size.height
            table.focus()
            await pilot.press("right", "right")
            assert table.scroll_x > 0
            await until(pilot, lambda: len(app.events.entries) >= 4, what="the events")
            for k in range(6):
                fake.publish("migration", session=BATCH, pool=f"p{k}")
            await until(pilot, lambda: any("pool=p5" in e for e in app.events.entries), what="the new events")
            await pilot.pause(0.1)
            assert app.events.scroll_y == app.events.max_scroll_y  # the newest, not the oldest
            await pilot.press("slash")
            bar = app.query_one(FilterBar)
            assert bar.region.height > 0 and bar.region.bottom <= app.screen.region.bottom  # typed text shows
            await pilot.press(*"back")
            assert bar.value == "back"
        async with top(fake).run_test(size=SIZE) as pilot:
            assert not pilot.app.screen.has_class("-compact")

    run(scenario())


def test_a_daemon_over_tcp_gets_gauges_labelled_as_this_machines():
    """Over TCP the host and GPU gauges still sample the machine ``weave top`` runs on: they say so."""
    async def scenario():
        app = WeaveTop("http://127.0.0.1:9", api_key="k", poll_interval_s=0.05, probe=FixedProbe())
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            assert app.host.border_title == "this machine (not the daemon's)"
            assert app.gpu.border_title == "this machine's gpu"

    run(scenario())
