"""Shared by the ``weave top`` tests: a fixed host probe, bounded waits, and the screenshot scene."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from textual.pilot import Pilot
from weaved.tui.app import WeaveTop
from weaved.tui.host_probe import GpuSample, HostSample

from tests.cli.fake_server import FakeDaemon, seed_sessions

SIZE = (130, 40)  # columns, rows: the snapshot's and the README screenshot's terminal
SCENE_SOCKET = Path("/tmp/weave-top-scene/weave.sock")  # fixed: the address is drawn on screen
SCENE_POLLS = 24  # status polls before the screenshot: the sparkline's length


class FixedProbe:
    """A host that never changes: two cores, 24 GiB, and the GPUs given (none by default)."""

    def __init__(self, cores: tuple[float, ...] = (63.0, 41.5), gpus: tuple[GpuSample, ...] = ()):
        self.cores, self.gpus = cores, gpus

    def sample(self) -> HostSample:
        note = None if self.gpus else "no GPU"
        return HostSample(self.cores, 6_442_450_944, 25_769_803_776, self.gpus, note)


async def until(pilot: Pilot, cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Let the app run until ``cond()`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await pilot.pause(0.02)


def run(coro) -> None:
    asyncio.run(coro)


def utc() -> None:
    """Event times are drawn in local time: pin it, so screenshots do not depend on the machine."""
    os.environ["TZ"] = "UTC"
    time.tzset()


def scene_app(fake: FakeDaemon) -> WeaveTop:
    """``weave top`` on the seeded fake daemon, polled by hand (see ``settle``): every run draws the same."""
    seed_sessions(fake)
    return WeaveTop(str(fake.socket_path), poll_interval_s=3600.0, probe=FixedProbe())


async def settle(pilot: Pilot) -> None:
    """Bring the scene to its fixed state: SCENE_POLLS polls done, the seeded events logged."""
    app = pilot.app
    assert isinstance(app, WeaveTop)
    await until(pilot, lambda: app.polls >= 1, what="the first poll")
    while app.polls < SCENE_POLLS:
        await app.refresh_status()
    await until(pilot, lambda: len(app.query_one("#events").entries) >= 4, what="the seeded events")
    await pilot.pause(0.1)
