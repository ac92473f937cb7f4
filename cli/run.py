"""``weave run`` (one prompt, one answer, like ``ollama run``) and ``weave submit`` (a task for an agent)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, TextIO

import typer
from weaved.cli import fmt
from weaved.cli.client import Client, Delta, sla_body
from weaved.cli.common import ApiKeyOpt, JsonOpt, SLAClass, SocketOpt, connect, echo, fail, print_json, sla_class

SystemOpt = Annotated[str | None, typer.Option("--system", help="A system prompt.", show_default=False)]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "--max-tokens", min=1, show_default=False, help="Stop after this many tokens (default: the daemon's).")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", min=0.0, show_default=False,
                                                      help="Sampling temperature (0: greedy).")]
SlaOpt = Annotated[SLAClass, typer.Option("--sla", help="The SLA class.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", min=0, show_default=False, help="Sampling seed.")]

AT_TOKEN_LIMIT = "[stopped at the token limit; --max-tokens raises it]"  # run and chat say it alike


def messages_for(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def write_stream(deltas: Iterable[Delta], out: TextIO | None = None,
                 stop: Callable[[], bool] | None = None) -> Delta | None:
    """Print each delta's text as it arrives (then a newline); the last delta that carries the finish
    reason or usage, or None.  ``stop()``, asked after each delta, ends the printing early."""
    out = out or sys.stdout
    last = None
    for d in deltas:
        if d.text:
            out.write(fmt.printable(d.text))  # a model's text may hold escape sequences
            out.flush()
        last = d if d.finish_reason or d.usage else last
        if stop is not None and stop():
            break
    out.write("\n")
    out.flush()
    return last


def _note_length(last: Delta | None) -> None:
    if last is not None and last.finish_reason == "length":
        echo(AT_TOKEN_LIMIT, err=True)


PromptArg = Annotated[str, typer.Argument(help="The prompt; `-` reads it from stdin.", show_default=False)]


def run(prompt: PromptArg, sla: SlaOpt = SLAClass.interactive, system: SystemOpt = None,
        max_tokens: MaxTokensOpt = None, temperature: TemperatureOpt = None, seed: SeedOpt = None,
        socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False) -> None:
    """Answer one prompt, streaming the answer (no session is kept)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise fail("the prompt is empty", 2)  # bad usage, like every argument error
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    with connect(socket, api_key) as client:
        msgs = messages_for(text, system)
        if json:
            print_json(client.chat(msgs, sla=sla_body(sla_class(sla)), **sampling))
            return
        last = write_stream(client.stream_chat(msgs, sla=sla_body(sla_class(sla)), **sampling))
    _note_length(last)


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


def _turn_result(client: Client, sid: str, msgs: list[dict], sampling: dict) -> dict:
    answer = client.turn(sid, msgs, **sampling)
    choice = (answer.get("choices") or [{}])[0]
    return {"content": (choice.get("message") or {}).get("content", ""),
            "finish_reason": choice.get("finish_reason"), "usage": answer.get("usage")}


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
    wait: Annotated[bool, typer.Option("--wait", help="Stay and stream the answer.")] = False,
    socket: SocketOpt = None, api_key: ApiKeyOpt = None, json: JsonOpt = False,
) -> None:
    """Submit a task as a new session with SLA tags; prints its id and placement at once.

    Without --wait the task runs on in the daemon: follow it with `weave ps`, read it with `weave show ID`.
    """
    text = read_task(task, file)
    if not text.strip():
        raise fail("the task is empty", 2)
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    msgs = [{"role": "user", "content": text}]
    with connect(socket, api_key) as client:
        info = client.create_session(sla_body(sla_class(sla), ttft_ms, ttlt_s), max_context, system)
        record = {"id": info["id"], "placement": info.get("placement")}
        header = f"session   {info['id']}\nplacement {fmt.placement_summary(info.get('placement'))}"
        if not wait:
            client.detach_turn(info["id"], msgs, **sampling)
            print_json({**record, "status": "running"}) if json else echo(header)
            return
        if json:
            print_json({**record, **_turn_result(client, info["id"], msgs, sampling)})
            return
        echo(header, err=True)
        last = write_stream(client.stream_turn(info["id"], msgs, **sampling))
    _note_length(last)


def register(app: typer.Typer) -> None:
    app.command()(run)
    app.command()(submit)
