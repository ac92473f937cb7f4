"""What every client command shares: the connection options, one-line errors, JSON output.

Exit codes: 0 done, 1 the daemon refused or failed the request, 2 bad usage (click's), 3 no daemon
is running at the address.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Annotated, Any

import typer
from weaved.cli.client import Client, is_url
from weaved.cli.errors import ApiError, ClientError, DaemonNotRunning
from weaved.cli.fmt import printable

EXIT_FAILED = 1
EXIT_NO_DAEMON = 3

SocketOpt = Annotated[str | None, typer.Option(
    "--socket", envvar="WEAVE_SOCKET", show_default=False, metavar="PATH|URL",
    help="The daemon's socket (default: $XDG_RUNTIME_DIR/weave/weave.sock, else ~/.weave/weave.sock), "
         "or http://HOST:PORT for its TCP listener.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar="WEAVE_API_KEY", show_default=False,
    help="API key, sent as a bearer token (needed on the daemon's TCP listener).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text (for scripts and agents).")]


class SLAClass(StrEnum):
    interactive = "interactive"
    background = "background"
    batch = "batch"


_UNESCAPED = re.compile("[\\x7f-\\x9f\\u202a-\\u202e\\u2066-\\u2069]")  # json.dumps escapes the C0 ones


def debug() -> bool:
    return os.environ.get("WEAVE_DEBUG") == "1"


def not_blank(value):
    """A typer callback for ids and names: an empty or blank one is a usage error (exit 2), not a
    request for the daemon's ``/v1/sessions/``."""
    if value is not None and any(not v.strip() for v in (value if isinstance(value, list) else [value])):
        raise typer.BadParameter("must not be empty")
    return value


def utf8_problem(text: str, where: str) -> str | None:
    """Why ``text`` (an argument or stdin, which Python decodes with surrogate escapes for bytes that are
    not UTF-8) cannot be sent as it is, naming the first such byte and its offset; None if it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        offset = len(text[:e.start].encode("utf-8", "surrogateescape"))
        if 0xDC80 <= c <= 0xDCFF:  # an escaped byte
            return f"{where} is not valid UTF-8 (byte 0x{c - 0xDC00:02x} at offset {offset})"
        return f"{where} holds a lone surrogate (U+{c:04X} at offset {offset}), which is not text"
    return None


def utf8_text(text: str, where: str) -> str:
    """``text`` if it is valid UTF-8, else a usage error (exit 2) saying where it is not."""
    if (problem := utf8_problem(text, where)) is not None:
        raise fail(problem, 2)
    return text


def fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    """Print ``weave: error: <message>`` to stderr; raise the returned Exit."""
    echo(f"weave: error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def reporting() -> Iterator[None]:
    """Turn a ClientError raised inside into a one-line message and an exit code (a traceback only
    with WEAVE_DEBUG=1)."""
    try:
        yield
    except ClientError as e:
        if debug():
            raise
        raise fail(str(e), EXIT_NO_DAEMON if isinstance(e, DaemonNotRunning) else EXIT_FAILED) from None


def check_address(socket: str | None) -> None:
    """Bad usage (exit 2) for an address that is a URL the client cannot speak (``ftp://``)."""
    if socket is not None and "://" in socket and not is_url(socket):
        raise fail(f"the daemon's address {socket!r} (--socket or WEAVE_SOCKET): a URL must be http://HOST:PORT "
                   f"(its TCP listener); a Unix socket is given by its path", 2)


@contextmanager
def connect(socket: str | None, api_key: str | None) -> Iterator[Client]:
    """A client for the daemon at ``socket`` (None: the default address), with ``reporting``."""
    check_address(socket)
    with reporting(), Client(socket, api_key, on_starting=lambda m: echo(f"weave: {m}", err=True)) as client:
        yield client


def echo(text: str = "", err: bool = False) -> None:
    """``typer.echo`` of ``text`` with its control characters escaped (``fmt.printable``): every line a
    command prints may hold what a model wrote or a client sent."""
    typer.echo(printable(text), err=err)


def print_json(data: Any) -> None:
    """``data`` as indented JSON; the control characters JSON leaves raw (DEL, C1, bidi overrides) are
    written as ``\\u`` escapes, so the output is still the same JSON."""
    text = json.dumps(data, indent=2, ensure_ascii=False)
    typer.echo(_UNESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", text))


def remove_each(items: list[str], remove: Callable[[str], Any], said: Callable[[str], str], json: bool) -> None:
    """Remove each item through the daemon (``remove(item)`` answers its record), saying ``said(item)``
    as each goes, or printing every record as JSON at the end.  An item the daemon refuses (unknown, ...)
    does not stop the others: each refusal is reported, and the command then fails (exit 1)."""
    done, refused = [], []
    for item in items:
        try:
            done.append(remove(item))
        except ApiError as e:  # (a lost daemon, DaemonNotRunning, ends it at once)
            refused.append(str(e) if item in str(e) else f"{item}: {e}")  # (named once)
            continue
        if not json:
            echo(said(item))
    if json:
        print_json(done)
    if refused:
        raise ClientError("; ".join(refused))


def sla_class(value: SLAClass | str | None) -> str | None:
    if value is None:
        return None
    return value.value if isinstance(value, SLAClass) else str(value)
