"""The ``weave`` typer app: one module per command group, registered here.

Commands that run in-process (``serve``, ``convert``, ``bench``) import the daemon lazily inside
the command, so client commands start without loading numba, torch or the model.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from weaved.cli.fmt import printable


def _flags_without_a_type() -> None:
    """Show a flag as ``--quick``, not ``--quick <bool>`` (this typer labels every option with its type,
    and a flag takes no value: ``--help <bool>`` reads as if it wanted one)."""
    from typer.core import TyperOption

    labelled = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else labelled(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flags_without_a_type()

app = typer.Typer(
    name="weave",
    help="Weave: serve an LLM to many sessions, each with the execution strategy its SLA needs.",
    epilog=("Examples: 'weave serve &' starts the daemon on the default model; 'weave chat' chats in a "
            "session kept across turns; 'weave run \"Why is the sky blue?\"' streams one answer; 'weave submit "
            "--sla background \"Summarise the logs\"' leaves a task running and prints its id; 'weave ps' lists "
            "the sessions and 'weave top' watches the daemon.\n\nEach command's --help says more; the HTTP API "
            "(OpenAI-compatible) is described in docs/api.md."),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if not value:
        return
    from weaved import __version__

    typer.echo(f"weave {__version__}")
    raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print Weave's version and exit.")] = False) -> None:
    pass


def _register() -> None:
    from weaved.cli import bench, calibrate, chat, convert, peers, run, serve, sessions, status, top

    serve.register(app)
    chat.register(app)
    run.register(app)
    sessions.register(app)
    status.register(app)
    peers.register(app)
    top.register(app)
    convert.register(app)
    bench.register(app)
    calibrate.register(app)


_register()


def main() -> None:
    """Console entry point: one-line errors unless WEAVE_DEBUG=1 - bad usage the parser finds too (exit
    2, ``weave: error: ...`` as the commands' own refusals say it, not a usage box)."""
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt as exc:  # (``serve``'s SIGTERM during its load is one too: 128 + 15)
        sys.exit(143 if type(exc).__name__ == "Terminated" else 130)
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        if os.environ.get("WEAVE_DEBUG") == "1":
            raise
        kind = type(exc).__name__
        if kind == "Abort":  # (Ctrl-C or Ctrl-D at a prompt)
            sys.exit(130)
        if kind == "NoArgsIsHelpError":  # ``weave`` alone: its help
            exc.show()
            sys.exit(0)
        if hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int):  # the parser's
            typer.echo(printable(f"weave: error: {exc.format_message()}"), err=True)
            sys.exit(exc.exit_code)
        typer.echo(printable(f"weave: error: {exc}"), err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
