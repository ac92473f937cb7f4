"""``weave top``: the live view of a running daemon (textual, imported only when the command runs)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from weaved.cli.client import resolve_address
from weaved.cli.common import ApiKeyOpt, SocketOpt, check_address, fail


def on_a_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def top(socket: SocketOpt = None, api_key: ApiKeyOpt = None,
        interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between status polls.")]
        = 1.0) -> None:
    """Watch the daemon: host and GPU load, pools, sessions, peers, throughput and events.

    Keys: p promote, d demote, x delete, / filter (words, or key:value such as state:running), s sort,
    arrows move (left/right scroll a wide table), q or Ctrl-C quit.  Needs a terminal.
    """
    check_address(socket)
    if not on_a_terminal():
        raise fail("weave top needs a terminal; 'weave status' (or --json) prints the daemon's state once", 2)
    from weaved.tui.app import WeaveTop

    WeaveTop(resolve_address(socket), api_key=api_key, poll_interval_s=interval).run()


def register(app: typer.Typer) -> None:
    app.command()(top)
