"""``weave chat``: an interactive conversation with one session, answers streamed as they are written.

Ctrl-C while an answer is being written stops that answer (closing the stream makes the daemon cancel
the generation) and returns to the prompt; at the prompt it only reminds how to leave.  Ctrl-D while an
answer is being written stops it and leaves; other text typed meanwhile is not sent as the next prompt
(it was typed before the answer could be read), and the chat says so.

Fed from a pipe (a script), it reads a message a line, draws no prompt, writes only the answers to
stdout (its own lines go to stderr), and exits 1 at the end if the daemon refused or cut any turn.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from weaved.cli import fmt
from weaved.cli.client import Client, sla_body
from weaved.cli.common import (
    ApiKeyOpt,
    SLAClass,
    SocketOpt,
    connect,
    echo,
    fail,
    not_blank,
    sla_class,
    utf8_problem,
)
from weaved.cli.errors import ApiError
from weaved.cli.run import CUT, MaxTokensOpt, SeedOpt, SystemOpt, TemperatureOpt, length_note
from weaved.cli.sessions import message_lines
from weaved.cli.stream_out import write_stream

PROMPT = ">>> "
COMMANDS = """\
/promote   make this session interactive (re-placed for latency, runs first)
/demote    make it background work (re-placed for throughput)
/session   show the session: id, SLA, placement, context
/reset     forget the conversation: start a new session with the same options (the old one is
           deleted if this chat made it, else kept)
/exit      leave (also /quit, /bye, Ctrl-D); the session stays in the daemon
/help      this list (also /?)
//text     send "/text" as a message (a line that starts with / is a command)
Ctrl-C stops an answer while it is being written."""
BUSY_RETRY_S = 5.0  # after Ctrl-C the daemon needs a moment (its next step) to cancel the turn


class ChatRepl:
    """The REPL's state and commands, independent of the terminal (``read`` and ``say`` are injected)."""

    def __init__(self, client: Client, *, session_id: str | None, sla: str | None, system: str | None,
                 sampling: dict[str, Any], read: Callable[[str], str] = input,
                 say: Callable[[str], None] = echo, typeahead: Callable[[], str | None] = lambda: None):
        self.client, self.sla, self.system, self.sampling = client, sla, system, sampling
        self.read, self.say = read, say
        # what was typed while an answer streamed: "eof" (Ctrl-D), "text", or None; reading it clears it
        self.typeahead = typeahead
        self.leaving = False  # Ctrl-D came during an answer
        self.session_id = session_id
        self.created = False  # this chat made the session (so /reset and an unused exit may delete it)
        self.turns = 0
        self.prior = False  # a resumed session that held a conversation already
        self.refused = 0  # turns the daemon refused or cut (a chat fed from a pipe exits 1 after any)
        self.asking = False  # a turn is being asked (an error now is the turn's, not a command's)
        self.interrupted = False  # the last answer was stopped with Ctrl-C

    # ---- session life ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.session_id is not None:
            s = self.client.session(self.session_id)
            messages = s.get("messages") or []
            self.prior = bool(messages)
            self.say(f"resumed session {s['id']} ({fmt.sla_summary(s.get('sla'))}, "
                     f"{len(messages)} message(s), {s.get('context_tokens', 0)} tokens of context)")
            for m in messages[-2:]:
                for line in message_lines(m):
                    self.say(line)
            return
        self._new_session()
        self.say("/help lists the commands; Ctrl-D or /exit leaves")

    def _new_session(self) -> None:
        info = self.client.create_session(sla_body(self.sla), None, self.system)
        self.session_id, self.created, self.turns, self.prior = info["id"], True, 0, False
        self.say(f"session {info['id']}: {fmt.placement_summary(info.get('placement'))}")

    def finish(self) -> None:
        """Leaving: a session this chat made and never used is deleted; any other is kept."""
        if self.created and self.turns == 0 and self.session_id is not None:
            self.client.delete_session(self.session_id)
            self.say(f"session {self.session_id} had no turns: deleted")
        elif self.session_id is not None:
            self.say(f"session {self.session_id} kept; resume with `weave chat --session {self.session_id}`")

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        while not self.leaving:
            try:
                line = self.read(PROMPT)
            except EOFError:
                self.say("")
                break
            except KeyboardInterrupt:
                self.say("\n(use /exit or Ctrl-D to leave)")
                continue
            self.asking = False
            try:
                if not self.handle(line):
                    break
            except KeyboardInterrupt:  # Ctrl-C during a command (or a retry's wait): that command stops
                self.say("\n[stopped]")
            except ApiError as e:  # a refused turn or command ends nothing but itself
                if e.code == "no_chat_template":  # no turn of this chat can be taken: leave, failing
                    self.finish()
                    raise
                self.refused += self.asking
                self.say(f"error: {e}")
                if e.code != "context_length_exceeded" or e.param not in ("messages", None):
                    continue
                if self.turns or self.prior:
                    self.say(f"(the session's context is full: /reset starts a new one, or `weave fork "
                             f"{self.session_id} --turn N` goes on from an earlier turn)")
                else:
                    self.say("(that message alone is longer than the session's context)")
        self.finish()

    def handle(self, line: str) -> bool:
        """Do one input line; False to leave."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/") or text.startswith("//"):
            if text.startswith("//"):  # a message that starts with "/": written with it doubled
                line = line.replace("//", "/", 1)
            if (problem := utf8_problem(line, "that line")) is not None:  # the chat goes on
                self.say(f"error: {problem}; nothing was sent")
                return True
            self.ask(line)
            return True
        cmd, *args = text.split()
        cmd = cmd.lower()
        if args and cmd in ("/exit", "/quit", "/bye", "/promote", "/demote", "/session", "/reset", "/help", "/?"):
            self.say(f"{cmd} takes no argument (it acts on this chat's session); nothing was done")
            return True
        if cmd in ("/exit", "/quit", "/bye"):
            return False
        if cmd in ("/promote", "/demote"):
            assert self.session_id is not None
            change = self.client.promote if cmd == "/promote" else self.client.demote
            s = change(self.session_id)
            self.say(f"{fmt.sla_summary(s.get('sla'))} -> {fmt.placement_summary(s.get('placement'))}")
        elif cmd == "/session":
            assert self.session_id is not None
            s = self.client.session(self.session_id)
            self.say(f"session {s['id']}: {fmt.sla_summary(s.get('sla'))}; {s.get('context_tokens', 0)} of "
                     f"{s.get('max_context', '?')} tokens; {fmt.placement_summary(s.get('placement'))}")
        elif cmd == "/reset":
            old, delete = self.session_id, self.created
            if delete and old is not None:
                self.client.delete_session(old)
                self.say(f"session {old} deleted")
            self._new_session()
            if not delete:
                self.say(f"(session {old} is kept; `weave rm {old}` deletes it)")
        elif cmd in ("/help", "/?"):
            self.say(COMMANDS)
        else:
            self.say(f"unknown command {cmd}; /help lists them")
        return True

    def ask(self, text: str) -> None:
        assert self.session_id is not None
        self.asking = True
        messages = [{"role": "user", "content": text}]
        deadline = time.monotonic() + (BUSY_RETRY_S if self.interrupted else 0.0)
        self.interrupted = False
        while True:
            stream = self.client.stream_turn(self.session_id, messages, **self.sampling)
            seen: list[str | None] = []

            def ctrl_d(seen: list[str | None] = seen) -> bool:
                seen.append(self.typeahead())
                return "eof" in seen

            try:
                last = write_stream(stream, stop=ctrl_d)
            except ApiError as e:
                # 409: the turn stopped by Ctrl-C has not finished cancelling yet; it will within a step
                if e.status == 409 and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                raise
            except KeyboardInterrupt:
                stream.close()  # closes the connection: the daemon cancels the generation
                self.turns += 1
                self.interrupted = True
                sys.stdout.write("\n")
                self.say("[stopped]")
                return
            seen.append(self.typeahead())
            if "eof" in seen:  # Ctrl-D while the answer streamed: stop it and leave
                stream.close()
                self.turns += 1
                self.leaving = True
                self.say("[stopped; leaving]")
                return
            if "text" in seen:
                self.say("[what was typed while the answer was written was not sent]")
            break
        self.turns += 1
        reason = last.finish_reason if last is not None else None
        if reason == "length":
            self.say(length_note(self.sampling.get("max_tokens")))
        elif reason in CUT:  # the daemon cut it: a shutdown, or the session deleted elsewhere
            self.refused += 1
            self.say(f"[the answer was cut: {CUT[reason]}]")
        elif reason is None:
            self.refused += 1
            self.say("[the answer ended without a finish: the connection to the daemon was lost]")


def chat(
    session: Annotated[str | None, typer.Option("--session", help="Resume this session.", show_default=False,
                                                callback=not_blank)]
    = None,
    sla: Annotated[SLAClass | None, typer.Option("--sla", help="The new session's SLA class (default: interactive).",
                                                 show_default=False)] = None,
    system: SystemOpt = None, max_tokens: MaxTokensOpt = None, temperature: TemperatureOpt = None,
    seed: SeedOpt = None, socket: SocketOpt = None, api_key: ApiKeyOpt = None,
) -> None:
    """Chat with the model in a session kept across turns; /help lists the commands."""
    if session is not None and (system is not None or sla is not None):
        given = " and ".join(f for f, v in (("--system", system), ("--sla", sla)) if v is not None)
        raise fail(f"{given} set up a new session; a resumed one keeps its own (change its class with /promote "
                   f"or /demote)", 2)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    tty = sys.stdin.isatty()
    # fed from a pipe (a script): no prompts drawn, the chat's own lines on stderr - stdout holds only the
    # answers - and exit 1 if the daemon refused or cut any turn
    ahead = _terminal_typeahead if tty else (lambda: None)
    read, say = (input, echo) if tty else ((lambda _prompt: input()), (lambda text: echo(text, err=True)))
    with connect(socket, api_key) as client:
        repl = ChatRepl(client, session_id=session, sla=sla_class(sla or SLAClass.interactive), system=system,
                        sampling=sampling, typeahead=ahead, read=read, say=say)
        repl.run()
    if repl.refused and not tty:
        raise fail(f"the daemon refused or cut {repl.refused} turn(s) (said above)")


def _terminal_typeahead() -> str | None:
    """Read and discard what the terminal holds: "eof" if that includes Ctrl-D, "text" if anything else,
    None if nothing.  Whole lines (and Ctrl-D) are readable in the terminal's line mode; a partial line
    is flushed."""
    import termios

    fd, got = sys.stdin.fileno(), None
    while select.select([fd], [], [], 0)[0]:
        data = os.read(fd, 4096)
        if not data:
            return "eof"
        got = "text"
    termios.tcflush(fd, termios.TCIFLUSH)
    return got


def register(app: typer.Typer) -> None:
    app.command()(chat)
