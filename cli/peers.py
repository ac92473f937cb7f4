"""``weave peers ls|add|rm``: the daemons this one federates with, through the daemon's socket.

The shared token of a new peer is read from an environment variable (``--token-env``, default
``WEAVE_PEER_TOKEN``) so that it stays out of shell history and ``ps``; ``--token`` exists for
scripts that hold it already.
"""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer
from weaved.cli import fmt
from weaved.cli.common import ApiKeyOpt, JsonOpt, SocketOpt, connect, echo, fail, not_blank, print_json, remove_each

DEFAULT_TOKEN_ENV = "WEAVE_PEER_TOKEN"

peers_app = typer.Typer(name="peers", no_args_is_help=True,
                        help="The peer daemons this one federates with: list, add, remove.")

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The peer's name (as `weave peers ls` lists it).",
                                        show_default=False, callback=not_blank)]


def _load(p: dict) -> str | None:
    pools = (p.get("load") or {}).get("pools")
    if pools is None:
        return None
    running = sum(q.get("batch_depth", 0) for q in pools)
    queued = sum(q.get("queue_depth", 0) for q in pools)
    return f"{running} running, {queued} queued"


def _layers(p: dict) -> str | None:
    layers = p.get("layers") or {}
    return f"{layers.get('count', 0)}/{layers['of']}" if layers.get("of") else None


def _free_kv(p: dict) -> str | None:
    kv = p.get("kv") or {}
    if kv.get("free_bytes") is None:
        return None
    return f"{fmt.size(kv['free_bytes'])} ({kv.get('free_tokens', '?')} tok)"


def _stale_note(p: dict) -> str | None:
    """A peer that does not answer: its last error, and when it last reported (its figures are that
    report's, so the table leaves them out)."""
    at = p.get("reported_at")
    when = f"last report at {time.strftime('%H:%M:%S', time.localtime(at))}" if at else "never reported"
    return "; ".join(x for x in (p.get("last_error"), when) if x)


def peers_table(peers: list[dict]) -> str:
    headers = ("NAME", "URL", "SOURCE", "STATE", "LATENCY", "LAYERS", "FREE KV", "LOAD", "NOTE")
    rows = []
    for p in peers:
        if p.get("state") == "alive":
            rows.append((p["name"], p.get("url"), p.get("source"), p.get("state"),
                         None if p.get("latency_ms") is None else f"{p['latency_ms']:.1f}ms", _layers(p),
                         _free_kv(p), _load(p), (p.get("layers") or {}).get("reason")))
        else:
            rows.append((p["name"], p.get("url"), p.get("source"), p.get("state"), None, None, None, None,
                         _stale_note(p)))
    return fmt.table(headers, rows, right=(4,))


@peers_app.command("ls")
def ls(socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """List the peers: where they are, whether they answer, what they can hold and how busy they are."""
    with connect(socket, api_key) as client:
        peers = client.peers()
    if json:
        print_json(peers)
    elif not peers:
        echo("no peers")
    else:
        echo(peers_table(peers))


@peers_app.command("add")
def add(ctx: typer.Context, name: NameArg,
        url: Annotated[str, typer.Argument(metavar="URL", help="The peer's control plane, http(s)://host:port.",
                                           show_default=False)],
        token_env: Annotated[str, typer.Option("--token-env", metavar="VAR",
                                               help="Read the shared token from this environment variable.")]
        = DEFAULT_TOKEN_ENV,
        token: Annotated[str | None, typer.Option("--token", show_default=False,
                                                  help="The shared token itself (it lands in shell history: "
                                                       "prefer --token-env).")] = None,
        socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Federate with another daemon; it is health-checked at once and kept across restarts."""
    from weaved.config.profile import PEER_NAME_RE, PEER_NAME_RULE, PeerConfig
    from weaved.config.tables import Invalid

    if not PEER_NAME_RE.fullmatch(name):
        raise fail(f"peer name {name!r}: {PEER_NAME_RULE}", 2)
    try:  # the url's shape (the daemon checks it again)
        PeerConfig(name, url, "token")
    except Invalid as e:
        raise fail(f"{e.field}: {e.reason}", 2) from None
    source = ctx.get_parameter_source("token_env")
    if token is not None and source is not None and source.name == "COMMANDLINE":
        raise fail("give the token once: --token or --token-env, not both", 2)
    if token is None:
        token = os.environ.get(token_env, "")
        if not token:
            raise fail(f"no token for the peer: set {token_env} (or pass --token-env VAR)", 2)
    with connect(socket, api_key) as client:
        peer = client.add_peer(name, url, token)
    if json:
        print_json(peer)
    else:
        echo(f"added peer {peer['name']} at {peer['url']}; it is being checked (see `weave peers ls`)")


@peers_app.command("rm")
def rm(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Peers to remove.", callback=not_blank)],
       socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Stop federating with peers added at run time (profile peers stay until the profile changes)."""
    with connect(socket, api_key) as client:
        remove_each(names, client.delete_peer, lambda n: f"removed peer {n}", json)


def register(app: typer.Typer) -> None:
    app.add_typer(peers_app)
