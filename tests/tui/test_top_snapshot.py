"""``weave top`` as drawn at a fixed terminal size, compared with the stored SVG (pytest-textual-snapshot).

After a deliberate change to the view, regenerate with ``python -m pytest tests/tui --snapshot-update``
and look at the new SVG before keeping it.
"""

from __future__ import annotations

from tests.cli.fake_server import FakeDaemon
from tests.tui.harness import SCENE_SOCKET, SIZE, scene_app, settle, until, utc


def test_weave_top_looks_the_same(snap_compare):
    utc()
    with FakeDaemon(SCENE_SOCKET) as fake:
        assert snap_compare(scene_app(fake), terminal_size=SIZE, run_before=settle)


def test_the_confirmation_and_the_filter_look_the_same(snap_compare):
    utc()

    async def confirm_after_filtering(pilot) -> None:
        await settle(pilot)
        await pilot.press("slash", *"back", "enter", "x")

    with FakeDaemon(SCENE_SOCKET) as fake:
        assert snap_compare(scene_app(fake), terminal_size=SIZE, run_before=confirm_after_filtering)


def test_daemon_not_running_looks_the_same(snap_compare):
    utc()

    async def missed(pilot) -> None:
        await until(pilot, lambda: pilot.app.polls >= 1, what="the first poll")

    fake = FakeDaemon(SCENE_SOCKET)  # never started: nothing listens there
    assert snap_compare(scene_app(fake), terminal_size=SIZE, run_before=missed)
