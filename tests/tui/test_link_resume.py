"""``weave top``'s event stream across a lost connection: it resumes after the last event it showed (the
daemon's ``Last-Event-ID``), so nothing is shown twice and nothing that happened meanwhile is missed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from weaved.tui.link import DaemonLink

from tests.api.conftest import serving
from tests.api.fake_daemon import FakeDaemon


def test_a_reconnection_resumes_after_the_last_event_shown(tmp_path: Path):
    fake = FakeDaemon(context_length=4096)
    sock = tmp_path / "run" / "weave.sock"

    async def first_n(link: DaemonLink, n: int) -> list[dict]:
        got: list[dict] = []
        agen = link.events()
        try:
            async for ev in agen:
                got.append(ev)
                if len(got) == n:
                    break
        finally:
            await agen.aclose()  # the connection goes: as when the daemon's socket drops
        return got

    async def main() -> tuple[list[dict], list[dict]]:
        link = DaemonLink(str(sock))
        try:
            shown = await asyncio.wait_for(first_n(link, 2), 30)  # the backlog: two placements
            fake.publish("promotion", {"session": "s-b"})  # while weave top is away
            again = await asyncio.wait_for(first_n(link, 1), 30)
            return shown, again
        finally:
            await link.aclose()

    with serving(fake, sock):
        for sid in ("s-a", "s-b"):
            fake.publish("placement", {"session": sid})
        shown, again = asyncio.run(main())
    assert [(e["type"], e["session"]) for e in shown] == [("placement", "s-a"), ("placement", "s-b")]
    assert [(e["type"], e["session"]) for e in again] == [("promotion", "s-b")]  # not the backlog again
