"""``weave run`` (one prompt, one answer, like ``ollama run``) and ``weave submit`` (a task for an agent)."""

from __future__ import annotations

import json as json_lib
import sys
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from weaved.cli import fmt
from weaved.cli.client import Client, Delta, sla_body
from weaved.cli.common import (
    ApiKeyOpt,
    JsonOpt,
    SLAClass,
    SocketOpt,
    connect,
    echo,
    fail,
    print_json,
    sla_class,
    utf8_text,
)
from weaved.cli.errors import ApiError
from weaved.cli.stream_out import write_stream


def _system_text(value: str | None) -> str | None:
    return None if value is None else utf8_text(value, "--system")


SystemOpt = Annotated[str | None, typer.Option("--system", help="A system prompt.", show_default=False,
                                               callback=_system_text)]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "--max-tokens", min=1, show_default=False, help="Stop after this many tokens (default: the daemon's).")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", min=0.0, max=2.0, show_default=False,
                                                      help="Sampling temperature, 0 to 2 (0: greedy).")]
SlaOpt = Annotated[SLAClass, typer.Option("--sla", help="The SLA class.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", min=-(1 << 63), max=(1 << 64) - 1, show_default=False,
                                             help="Sampling seed (-1: a random one).")]

AT_TOKEN_LIMIT = "[stopped at the token limit; --max-tokens raises it]"  # run and chat say it alike
# without --max-tokens an answer may run to the end of the context: "length" then means it is full
AT_CONTEXT_END = "[stopped: the context is full (the model's, or the session's max_context)]"


def length_note(max_tokens: int | None) -> str:
    """What a ``length`` finish means: the token limit asked for, or (none asked) the context's end."""
    return AT_TOKEN_LIMIT if max_tokens is not None else AT_CONTEXT_END


def messages_for(text: str, system: str | None = None) -> list[dict]:
    """The turn's messages; text that is not UTF-8 (stdin or an argument) is a usage error here, not the
    daemon's refusal of a "lone surrogate" (``--system`` is checked as an option)."""
    utf8_text(text, "the input")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def _note_length(last: Delta | None, max_tokens: int | None) -> None:
    """``_note_finish`` of a streamed answer's last delta (None: the stream ended without one)."""
    _note_finish(last.finish_reason if last is not None else None, max_tokens)


def _note_finish(reason: str | None, max_tokens: int | None) -> None:
    """Say why an answer stopped short: a note for the token limit; an error (exit 1) when the answer
    was cut by the daemon - a shutdown, a cancel (e.g. the session deleted) - or ended without a finish,
    so that a script can tell the answer is incomplete (with --json too, after the answer is printed)."""
    if reason == "length":
        echo(length_note(max_tokens), err=True)
    elif reason in CUT:
        raise fail(f"the answer was cut: {CUT[reason]}")
    elif reason is None:
        raise fail("the answer ended without a finish (the connection to the daemon was lost)")


CUT = {"shutdown": "the daemon shut down", "cancelled": "the turn was cancelled (its session deleted?)",
       "interrupted": "the daemon stopped in the middle of it"}


PromptArg = Annotated[str, typer.Argument(help="The prompt; `-` reads it from stdin.", show_default=False)]


RAW_MAX_TOKENS = 256  # --raw's default answer length (the completions API's own default is 16 tokens)

RawOpt = Annotated[bool, typer.Option(
    "--raw", help="Continue the prompt as plain text, without the chat template (the completions API): "
                  f"for a base model, which has none. --max-tokens defaults to {RAW_MAX_TOKENS} here.")]


def run(prompt: PromptArg, sla: SlaOpt = SLAClass.interactive, system: SystemOpt = None,
        max_tokens: MaxTokensOpt = None, temperature: TemperatureOpt = None, seed: SeedOpt = None,
        raw: RawOpt = False, socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Answer one prompt, streaming the answer (no session is kept)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise fail("the prompt is empty", 2)  # bad usage, like every argument error
    if raw and system is not None:
        raise fail("--system needs the chat template: a --raw prompt is continued as it stands; put any "
                   "instructions in the prompt itself", 2)
    if raw and max_tokens is None:
        max_tokens = RAW_MAX_TOKENS
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "sla": sla_body(sla_class(sla))}
    with connect(socket, api_key) as client:
        if raw:  # the prompt as it stands, through the completions API
            utf8_text(text, "the input")
            answer, stream = partial(client.complete, text), partial(client.stream_completion, text)
        else:
            msgs = messages_for(text, system)
            answer, stream = partial(client.chat, msgs), partial(client.stream_chat, msgs)
        if json:
            result = answer(**sampling)
            print_json(result)
            _note_finish(((result.get("choices") or [{}])[0]).get("finish_reason"), max_tokens)
            return
        last = write_stream(stream(**sampling))
    _note_length(last, max_tokens)


def read_task(task: str | None, file: Path | None) -> str:
    """The task's text: ``--file`` (``-`` is stdin), the argument (``-`` is stdin), or piped stdin."""
    if task is not None and file is not None:
        raise fail("give the task as an argument or with --file, not both", 2)
    if file is not None:
        if str(file) == "-":
            return sys.stdin.read()
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise fail(f"cannot read {file}: {e.strerror if isinstance(e, OSError) else e}", 2) from None
    if task == "-" or (task is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if task is None:
        raise fail("no task: give it as an argument, with --file, or on stdin", 2)
    return task


def read_tools(path: Path | None, choice: str | None) -> dict:
    """The request fields of ``--tools FILE`` and ``--tool-choice``."""
    if path is None:
        if choice is not None:
            raise fail("--tool-choice needs --tools", 2)
        return {}
    try:
        tools = json_lib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise fail(f"cannot read tools from {path}: {getattr(e, 'strerror', None) or e}", 2) from None
    if isinstance(tools, dict) and isinstance(tools.get("tools"), list):
        tools = tools["tools"]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise fail(f"{path} must hold a JSON list of tool definitions", 2)
    out: dict = {"tools": tools}
    if choice is not None:
        names = [(t.get("function") or {}).get("name") for t in tools]
        if choice not in ("auto", "required", "none") and choice not in names:
            raise fail(f"--tool-choice must be auto, required, none or a function of {path} "
                       f"({', '.join(map(str, names)) or 'none there'}), got {choice!r}", 2)
        out["tool_choice"] = choice if choice in ("auto", "required", "none") else \
            {"type": "function", "function": {"name": choice}}
    return out


def _turn_result(client: Client, sid: str, msgs: list[dict], sampling: dict) -> dict:
    answer = client.turn(sid, msgs, **sampling)
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    out = {"content": message.get("content", ""), "finish_reason": choice.get("finish_reason"),
           "usage": answer.get("usage"), "placement": (answer.get("weave") or {}).get("placement")}
    for key in ("reasoning_content", "tool_calls"):
        if message.get(key):
            out[key] = message[key]
    return out


def submit(
    task: Annotated[str | None, typer.Argument(help="The task; `-` (or nothing, with a pipe) reads stdin.",
                                               show_default=False)] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the task from this file.",
                                              show_default=False)] = None,
    sla: SlaOpt = SLAClass.background,
    ttft_ms: Annotated[float | None, typer.Option("--ttft-ms", min=0.001, show_default=False,
                                                  help="Time to first token the task needs, in ms.")] = None,
    ttlt_s: Annotated[float | None, typer.Option(
        "--ttlt-s", min=0.001, show_default=False, help="Time to the last token the task needs, in seconds.")]
    = None,
    max_context: Annotated[int | None, typer.Option(
        "--max-context", min=1, show_default=False, help="The most context the session needs, in tokens.")]
    = None,
    system: SystemOpt = None, max_tokens: MaxTokensOpt = None, temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Stay and stream the answer (Ctrl-C then cancels the task; its answer so far is kept).")]
    = False,
    tools: Annotated[Path | None, typer.Option(
        "--tools", show_default=False,
        help="A JSON file of tool definitions (OpenAI's chat shape: a list of {type: function, function: "
             "{name, description, parameters}}); the answer may call them.")] = None,
    tool_choice: Annotated[str | None, typer.Option(
        "--tool-choice", show_default=False,
        help="auto (default with --tools), required, none, or a function's name.")] = None,
    socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False,
) -> None:
    """Submit a task as a new session with SLA tags; prints its id and placement at once.

    Without --wait the task runs on in the daemon: follow it with `weave ps`, read it with `weave show ID`.
    A stop or a crash of the daemon does not lose it: it runs again when the daemon next starts.
    """
    text = read_task(task, file)
    if not text.strip():
        raise fail("the task is empty", 2)
    utf8_text(text, "the task")
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                **read_tools(tools, tool_choice)}
    msgs = [{"role": "user", "content": text}]
    # The placement printed is the one the task's turn runs with: a session is placed again when its
    # first turn brings the prompt (the one made at creation saw no tokens).
    with connect(socket, api_key) as client:
        info = client.create_session(sla_body(sla_class(sla), ttft_ms, ttlt_s), max_context, system)
        if not wait:
            try:
                started = client.detach_turn(info["id"], msgs, **sampling)
            except ApiError:  # the task was refused (no chat template, too long, ...): no empty session left
                client.delete_session(info["id"])
                raise
            placement = started.get("placement") or info.get("placement")
            if json:
                print_json({"id": info["id"], "placement": placement, "status": "running"})
            else:
                echo(f"session   {info['id']}\nplacement {fmt.placement_summary(placement)}")
            return
        if json:
            try:
                result = _turn_result(client, info["id"], msgs, sampling)
            except ApiError:  # refused: no empty session left
                client.delete_session(info["id"])
                raise
            except KeyboardInterrupt:  # the request closes, and with it the turn: the session's id is said
                echo(f"weave: interrupted: the task was cancelled; its answer so far is kept "
                     f"(weave show {info['id']})", err=True)
                raise
            print_json({"id": info["id"], **result, "placement": result["placement"] or info.get("placement")})
            _note_finish(result["finish_reason"], max_tokens)
            return
        echo(f"session   {info['id']}", err=True)
        started: list[bool] = []
        try:
            last = write_stream(_with_placement(client.stream_turn(info["id"], msgs, **sampling), info, started))
        except ApiError:
            if not started:  # refused before its first chunk: no empty session left
                client.delete_session(info["id"])
            raise
        except KeyboardInterrupt:  # the stream closes, and with it the turn: say so, not just exit
            echo(f"\nweave: interrupted: the task was cancelled; its answer so far is kept "
                 f"(weave show {info['id']})", err=True)
            raise
    _note_length(last, max_tokens)


def _with_placement(deltas: Iterable[Delta], info: dict, started: list[bool] | None = None) -> Iterator[Delta]:
    """``deltas``, after printing (to stderr) the placement the first chunk brings - or the session's
    own when none does (``started`` gets an entry then)."""
    said = False
    for d in deltas:
        if not said:
            said = True
            if started is not None:
                started.append(True)
            echo(f"placement {fmt.placement_summary((d.weave or {}).get('placement') or info.get('placement'))}",
                 err=True)
        yield d


def register(app: typer.Typer) -> None:
    app.command()(run)
    app.command()(submit)
