"""``weave ps``, ``show``, ``rm``, ``fork``, ``rewind``, ``promote``, ``demote``: the daemon's sessions."""

from __future__ import annotations

import shutil
import sys
import time
from enum import StrEnum
from typing import Annotated

import typer
from weaved.cli import fmt
from weaved.cli.client import sla_body
from weaved.cli.common import (
    ApiKeyOpt,
    JsonOpt,
    SLAClass,
    SocketOpt,
    connect,
    echo,
    not_blank,
    print_json,
    remove_each,
    sla_class,
)

IdArg = Annotated[str, typer.Argument(metavar="ID", help="A session id (as `weave ps` lists them).",
                                      show_default=False, callback=not_blank)]


def _terminal_width() -> int | None:
    """Cut long lines only for a person at a terminal; a pipe gets everything."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def ps_table(sessions: list[dict], width: int | None = None) -> str:
    headers = ("ID", "CLASS", "POOL", "BACKEND", "CONTEXT", "STATE", "TOK/S", "REASON")
    rows = [(s["id"], s.get("class"), s.get("pool"), s.get("backend"), s.get("context_tokens"),
             fmt.state_of(s), None if s.get("tokens_per_s") is None else fmt.rate(s["tokens_per_s"]),
             s.get("reason") or None) for s in sessions]
    return fmt.table(headers, rows, width=width, right=(4, 6))


class TurnState(StrEnum):
    running = "running"
    waiting = "waiting"
    prefill = "prefill"  # waiting, its long prompt being fed (``prefill:DONE/TOTAL``)
    paused = "paused"
    idle = "idle"


def ps(socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False,
       all: Annotated[bool, typer.Option("--all", "-a", help="Include one-off OpenAI calls' sessions.")]
       = False,
       state: Annotated[TurnState | None, typer.Option("--state", show_default=False,
                                                       help="Only sessions in this state.")] = None,
       cls: Annotated[SLAClass | None, typer.Option("--class", show_default=False,
                                                    help="Only sessions of this SLA class.")] = None,
       pool: Annotated[str | None, typer.Option("--pool", metavar="NAME", show_default=False,
                                                help="Only sessions on this pool.")] = None,
       last: Annotated[int | None, typer.Option("--last", min=1, show_default=False,
                                                help="Only the N newest of those.")] = None) -> None:
    """List sessions: id, SLA class, pool, backend, context length, state, tokens/s, and why the router
    placed them where they are (with the load it saw then), oldest first."""
    with connect(socket, api_key) as client:
        st = client.status()
    sessions = every = [s for s in st["sessions"] if all or not s.get("ephemeral")]
    if state is TurnState.prefill:
        sessions = [s for s in sessions if (s.get("prefill") or {}).get("total")]
    elif state is not None:
        sessions = [s for s in sessions if s.get("state") == state.value]
    if cls is not None:
        sessions = [s for s in sessions if s.get("class") == sla_class(cls)]
    if pool is not None:
        sessions = [s for s in sessions if s.get("pool") == pool]
    if last is not None:
        sessions = sessions[-last:]
    if json:
        print_json(sessions)
        return
    echo(ps_table(sessions, _terminal_width()) if sessions else "no sessions")
    if len(sessions) < len(every):
        echo(f"{len(sessions)} of {len(every)} sessions", err=True)
    if unrecovered := st.get("unrecovered"):  # in the data directory, but not served by this daemon
        echo(f"{len(unrecovered)} more in the data directory not recovered (another model's, ...): "
             f"`weave status` says why, `weave rm ID` deletes one", err=True)


def show_text(s: dict) -> str:
    created = s.get("created")
    lines = [
        f"session   {s['id']}",
        f"sla       {fmt.sla_summary(s.get('sla'))}",
        f"placement {fmt.placement_summary(s.get('placement'))}",
        f"backend   {s.get('backend') or fmt.DASH}",
        f"context   {s.get('context_tokens', 0)} of {s.get('max_context', '?')} tokens",
        f"status    {s.get('status', fmt.DASH)}"
        + (f" ({s['state']})" if s.get("status") == "busy" and s.get("state") else ""),
    ]
    if created:
        lines.append(f"created   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(created))}")
    if s.get("forked_from"):
        lines.append(f"forked    from {s['forked_from']}")
    if s.get("system"):
        lines.append(f"system    {s['system']}")
    messages = s.get("messages") or []
    lines.append("")
    if not messages:
        lines.append("(no messages yet)")
    for m in messages:
        lines += message_lines(m)
    return "\n".join(lines)


def message_lines(m: dict) -> list[str]:
    """A transcript entry as ``show`` (and a resumed chat) prints it: its thinking, text, calls, the call
    a tool result answers, and why an answer ended early."""
    lines = []
    if m.get("reasoning_content"):
        lines.append(f"{m.get('role', '?')} (thinking): {_indented(m['reasoning_content'])}")
    if m.get("content") or not m.get("tool_calls"):
        lines.append(f"{m.get('role', '?')}: {_indented(m.get('content') or '')}")
    for c in m.get("tool_calls") or ():
        fn = c.get("function") or {}
        call = f"{fn.get('name', '?')}({fn.get('arguments', '')})"
        lines.append(f"{m.get('role', '?')}: -> {call}  [{c.get('id', '')}]")
    if m.get("role") == "tool" and m.get("tool_call_id"):
        lines[-1] += f"  [answers {m['tool_call_id']}]"
    why = m.get("finish_reason")
    if why in ENDED_EARLY:
        lines.append(f"  [{ENDED_EARLY[why]}]")
    return lines


def _indented(text: str) -> str:
    """A message's later lines indented, so that none reads as another entry (``assistant: ...``)."""
    return text.replace("\n", "\n  ")


# answers that did not end by themselves, as ``show`` marks them
ENDED_EARLY = {"interrupted": "interrupted: the daemon stopped in the middle of this answer",
               "cancelled": "cancelled", "length": "cut at the token limit", "shutdown": "cut by a shutdown"}


def show(session_id: IdArg, socket: SocketOpt = None, api_key: ApiKeyOpt = None,
         json: JsonOpt = False) -> None:
    """Show a session: its SLA, placement and transcript."""
    with connect(socket, api_key) as client:
        s = client.session(session_id)
    print_json(s) if json else echo(show_text(s))


def rm(session_ids: Annotated[list[str], typer.Argument(metavar="ID...", help="Sessions to delete.",
                                                        callback=not_blank)],
       socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Delete sessions (a running turn is cancelled; the transcript and KV file are removed)."""
    with connect(socket, api_key) as client:
        remove_each(session_ids, client.delete_session, lambda sid: f"deleted {sid}", json)


def _sla_change(session_id: str, socket: str | None, api_key: str | None, json: bool, promote: bool) -> None:
    with connect(socket, api_key) as client:
        s = client.promote(session_id) if promote else client.demote(session_id)
    if json:
        print_json(s)
    else:
        echo(f"{s['id']}: {fmt.sla_summary(s.get('sla'))} -> "
                   f"{fmt.placement_summary(s.get('placement'))}")


def promote(session_id: IdArg, socket: SocketOpt = None, api_key: ApiKeyOpt = None,
            json: JsonOpt = False) -> None:
    """Make a session interactive: it is re-placed for latency and runs first from the next step."""
    _sla_change(session_id, socket, api_key, json, promote=True)


def demote(session_id: IdArg, socket: SocketOpt = None, api_key: ApiKeyOpt = None,
           json: JsonOpt = False) -> None:
    """Make a session background work: it is re-placed for throughput and yields to interactive ones."""
    _sla_change(session_id, socket, api_key, json, promote=False)


def fork(session_id: IdArg,
         turn: Annotated[int | None, typer.Option("--turn", min=1, show_default=False,
                                                  help="Fork after this answered turn (default: where it is now).")]
         = None,
         sla: Annotated[SLAClass | None, typer.Option("--sla", show_default=False,
                                                      help="The fork's SLA class (default: the parent's).")] = None,
         max_context: Annotated[int | None, typer.Option(
             "--max-context", min=1, show_default=False,
             help="The fork's context in tokens (default: the parent's); more goes on past a full parent.")] = None,
         socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Fork a session: a new session with its context, shared, not computed again (sub-agents, retries).

    The fork has its own SLA, placement and context size, and outlives its parent."""
    with connect(socket, api_key) as client:
        s = client.fork(session_id, turn, sla_body(sla_class(sla)) if sla is not None else None, max_context)
    if json:
        print_json(s)
    else:
        echo(f"{s['id']}: forked from {s.get('forked_from')} ({s.get('context_tokens', 0)} tokens of context, "
             f"{s.get('shared_tokens', 0)} shared); {fmt.placement_summary(s.get('placement'))}")


def rewind(session_id: IdArg,
           turn: Annotated[int, typer.Option("--turn", min=0, show_default=False,
                                             help="Keep the transcript through this answered turn (0: none).")],
           socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Take a session back to the end of one of its turns: the later turns go, from its transcript and its
    KV cache (a cancelled turn, or an answer to ask again)."""
    with connect(socket, api_key) as client:
        s = client.rewind(session_id, turn)
    if json:
        print_json(s)
    else:
        echo(f"{s['id']}: back to turn {turn} ({len(s.get('messages') or [])} messages, "
             f"{s.get('context_tokens', 0)} tokens of context)")


def register(app: typer.Typer) -> None:
    app.command()(ps)
    app.command("ls", hidden=True)(ps)  # (what people type first)
    app.command()(show)
    app.command()(rm)
    app.command()(fork)
    app.command()(rewind)
    app.command()(promote)
    app.command()(demote)
