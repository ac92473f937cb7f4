"""``weave top`` against a real ``weave serve`` started by the test: every key binding acts on the daemon."""

from __future__ import annotations

import pytest
from weaved.cli.client import Client
from weaved.tui.app import WeaveTop
from weaved.tui.confirm_delete import ConfirmDelete

from tests.tui.daemon_process import running_daemon
from tests.tui.harness import FixedProbe, run, until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon():
    with running_daemon() as sock:
        yield Client(sock)


def test_every_key_against_the_daemon(daemon):
    background = daemon.create_session({"class": "background"})["id"]
    batch = daemon.create_session({"class": "batch"})["id"]
    daemon.turn(batch, [{"role": "user", "content": "Hi."}], max_tokens=4, temperature=0)

    async def scenario():
        app = WeaveTop(daemon.address, poll_interval_s=0.5, probe=FixedProbe())
        async with app.run_test(size=(130, 40)) as pilot:
            both = {background, batch}
            await until(pilot, lambda: set(app.sessions.shown_ids) == both, what="the sessions")
            assert app.connection.up and "profile cpu-only" in app.connection.text
            assert str(app.pools.get_row("cpu")[1]) == "cpu"

            # sorted by class: background first; p promotes it, d demotes it again
            assert app.sessions.selected_id() == background
            await pilot.press("p")
            await until(pilot, lambda: daemon.session(background)["sla"]["class"] == "interactive", what="p")
            await until(pilot, lambda: any("promotion" in e for e in app.events.entries), what="the event")
            await pilot.press("d")
            await until(pilot, lambda: daemon.session(background)["sla"]["class"] == "background", what="d")

            await pilot.press("slash", *"batch", "enter")  # / filters
            assert app.sessions.shown_ids == [batch]
            await pilot.press("slash", "escape")
            assert len(app.sessions.shown_ids) == 2

            await pilot.press("s")  # s sorts by id
            assert app.sessions.shown_ids == sorted([background, batch])

            await pilot.press("x")  # x asks, y deletes the selected session
            await until(pilot, lambda: isinstance(app.screen, ConfirmDelete), what="the question")
            doomed = app.screen.session_id
            await pilot.press("y")
            await until(pilot, lambda: doomed not in app.sessions.shown_ids, what="the deletion")
            assert doomed not in {s["id"] for s in daemon.sessions()}

            await pilot.press("q")
            await until(pilot, lambda: not app.is_running, what="the exit")

    run(scenario())
