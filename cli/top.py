"""``weave top``: the live view of a running daemon (textual, imported only when the command runs)."""

from __future__ import annotations

from typing import Annotated

import typer
from weaved.cli.client import resolve_address
from weaved.cli.common import ApiKeyOpt, SocketOpt


def top(socket: SocketOpt = None, api_key: ApiKeyOpt = None,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between status polls.")]
        = 1.0) -> None:
    """Watch the daemon: host and GPU load, pools, sessions, peers, throughput and events.

    Keys: p promote, d demote, x delete, / filter, s sort, q quit.
    """
    from weaved.tui.app import WeaveTop

    WeaveTop(resolve_address(socket), api_key=api_key, poll_interval_s=interval).run()


def register(app: typer.Typer) -> None:
    app.command()(top)
