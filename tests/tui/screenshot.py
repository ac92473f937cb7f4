"""Draw ``docs/weave-top.svg``: ``weave top`` against the fake daemon, exported by textual.

    python -m tests.tui.screenshot [OUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.cli.fake_server import FakeDaemon
from tests.tui.harness import SCENE_SOCKET, SIZE, run, scene_app, settle, utc


def draw(out: Path) -> None:
    utc()

    async def main() -> None:
        with FakeDaemon(SCENE_SOCKET) as fake:
            app = scene_app(fake)
            async with app.run_test(size=SIZE) as pilot:
                await settle(pilot)
                out.write_text(app.export_screenshot(title="weave top"), encoding="utf-8")

    run(main())


if __name__ == "__main__":
    draw(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/weave-top.svg"))
