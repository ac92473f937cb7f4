"""``weave chat``: turns kept in one session, the slash commands, resuming, and Ctrl-C during an answer."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner
from weaved.cli.app import app
from weaved.cli.chat import ChatRepl
from weaved.cli.client import Client

from tests.cli.fake_server import FakeDaemon, seed_sessions, short_socket_dir

runner = CliRunner()
IDLE = "s-e24b7f0d9c1a6358"


@pytest.fixture
def fake():
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as f:
        seed_sessions(f)
        yield f


def chat(fake: FakeDaemon, *args: str, input: str, code: int = 0):
    """What a chat fed from a pipe says: its answers (stdout), then its own lines (stderr)."""
    res = runner.invoke(app, ["chat", *args], input=input, env={"WEAVE_SOCKET": str(fake.socket_path)})
    assert res.exit_code == code, (res.stdout, res.stderr)
    return res.stdout + res.stderr


def new_ids(fake: FakeDaemon, before: set[str]) -> list[str]:
    return [s for s in fake.sessions if s not in before]


def test_turns_stream_into_one_session(fake):
    before = set(fake.sessions)
    out = chat(fake, "--system", "be brief", input="hello\nand again\n/exit\n")
    [sid] = new_ids(fake, before)
    assert f"session {sid}: pool cpu" in out
    assert out.startswith("You said: hello.\nYou said: and again.\n")  # (from a pipe: answers alone, no prompt)
    assert f"session {sid} kept; resume with `weave chat --session {sid}`" in out
    s = fake.sessions[sid]
    assert s.system == "be brief" and s.cls == "interactive"
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    turns = [r for r in fake.requests if r.path == f"/v1/sessions/{sid}/turns"]
    assert [t.body["messages"] for t in turns] == [[{"role": "user", "content": "hello"}],
                                                   [{"role": "user", "content": "and again"}]]


def test_an_unused_session_is_removed_on_exit(fake):
    before = set(fake.sessions)
    out = chat(fake, "--sla", "background", input="")  # Ctrl-D straight away
    assert new_ids(fake, before) == [] and "kept" not in out
    assert fake.requests[0].body == {"sla": {"class": "background"}}


def test_promote_demote_and_session_commands(fake):
    out = chat(fake, "--sla", "batch", input="/session\n/promote\n/demote\n/help\n/nonsense\n/exit\n")
    sid = out.split()[1].rstrip(":")
    assert f"session {sid}: batch; 0 of 8192 tokens; pool cpu" in out
    assert "interactive, TTFT 500ms -> pool cpu" in out and "background -> pool cpu" in out
    assert "/reset     forget the conversation" in out
    assert "unknown command /nonsense; /help lists them" in out
    assert [p.rsplit("/", 1)[1] for p in fake.paths("POST") if p.endswith("mote")] == ["promote", "demote"]
    assert fake.paths("DELETE") == [f"/v1/sessions/{sid}"]  # never used for a turn: not left behind


def test_reset_replaces_the_session_it_made(fake):
    before = set(fake.sessions)
    chat(fake, input="one\n/reset\ntwo\n/exit\n")
    [sid] = new_ids(fake, before)
    assert [m["content"] for m in fake.sessions[sid].messages] == ["two", "You said: two."]
    assert len(fake.paths("DELETE")) == 1


def test_resume_keeps_the_session_and_reset_does_not_delete_it(fake):
    out = chat(fake, "--session", IDLE, input="more\n/reset\n/exit\n")
    assert out.startswith("You said: more.\n")
    out = out.removeprefix("You said: more.\n")
    assert out.startswith(f"resumed session {IDLE} (background, 2 message(s), 14 tokens of context)\n"
                          "user: Write the changelog\nassistant: Done: 12 entries.\n")
    assert f"(session {IDLE} is kept; `weave rm {IDLE}` deletes it)" in out
    assert IDLE in fake.sessions and fake.sessions[IDLE].messages[-1]["content"] == "You said: more."
    assert IDLE not in "".join(fake.paths("DELETE"))  # only the fresh, unused session went on exit


def test_resuming_an_unknown_session_fails_cleanly(fake):
    env = {"WEAVE_SOCKET": str(fake.socket_path)}
    res = runner.invoke(app, ["chat", "--session", "s-nope"], input="", env=env)
    assert res.exit_code == 1 and res.stderr == "weave: error: no session 's-nope'\n"


def test_a_refused_turn_reports_and_the_chat_goes_on(fake):
    fake.sessions[IDLE].busy = True  # a turn of it is running elsewhere: the daemon answers 409
    out = chat(fake, "--session", IDLE, input="hi\n/exit\n", code=1)
    assert f"error: session {IDLE} is already generating a turn" in out


def test_a_full_session_says_how_to_go_on(fake):
    fake.sessions[IDLE].full = True
    out = chat(fake, "--session", IDLE, input="hi\n/exit\n", code=1)
    assert "error: the prompt needs 8204 tokens of context" in out
    assert f"/reset starts a new one, or `weave fork {IDLE} --turn N` goes on from an earlier turn" in out


def test_ctrl_c_stops_the_answer_not_the_chat(fake, monkeypatch):
    """Ctrl-C while tokens arrive: the stream is closed (the daemon sees the client go), the chat goes on."""
    fake.token_delay_s = 0.02
    real = Client.stream_turn
    interrupted = []

    def stream_then_interrupt(self, *a, **kw):
        for i, d in enumerate(real(self, *a, **kw)):
            if i == 3 and not interrupted:
                interrupted.append(True)
                raise KeyboardInterrupt  # what the terminal delivers on Ctrl-C
            yield d

    monkeypatch.setattr(Client, "stream_turn", stream_then_interrupt)
    replies = iter(["a long question with very many words in it", "next", "/exit"])
    said: list[str] = []
    repl = ChatRepl(Client(fake.socket_path), session_id=IDLE, sla=None, system=None, sampling={},
                    read=lambda prompt: next(replies), say=said.append)
    repl.run()
    assert "[stopped]" in said
    for _ in range(200):  # bounded: the fake notices the closed connection at its next write
        if fake.disconnects:
            break
        time.sleep(0.01)
    assert fake.disconnects == 1
    # the next turn ran in full
    assert fake.sessions[IDLE].messages[-1]["content"] == "You said: next."


def test_ctrl_c_at_the_prompt_only_reminds_how_to_leave(fake):
    state = iter([KeyboardInterrupt, "/exit"])

    def read(prompt):
        item = next(state)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    said: list[str] = []
    ChatRepl(Client(fake.socket_path), session_id=IDLE, sla=None, system=None, sampling={}, read=read,
             say=said.append).run()
    assert "\n(use /exit or Ctrl-D to leave)" in said


def test_deleting_a_session_is_said(fake):
    out = chat(fake, input="/reset\n/exit\n")
    assert out.count("had no turns: deleted") == 1 and out.count(" deleted") == 2  # /reset, then leaving


def test_typing_during_an_answer_is_not_sent_and_ctrl_d_stops_it_and_leaves(fake):
    fake.token_delay_s = 0.01
    replies = ["first question", "second question", "/exit"]
    asked: list[str] = []
    calls: list[int] = []

    def read(prompt: str) -> str:
        asked.append(replies[len(asked)])
        return asked[-1]

    def typeahead() -> str | None:  # the terminal: a line typed during the first answer, Ctrl-D in the second
        calls.append(len(asked))
        if len(asked) == 1:
            return "text" if calls.count(1) == 2 else None
        return "eof" if calls.count(2) == 3 else None

    said: list[str] = []
    repl = ChatRepl(Client(fake.socket_path), session_id=IDLE, sla=None, system=None, sampling={},
                    read=read, say=said.append, typeahead=typeahead)
    repl.run()
    assert "[what was typed while the answer was written was not sent]" in said
    assert said[-2:] == ["[stopped; leaving]", f"session {IDLE} kept; resume with `weave chat --session {IDLE}`"]
    user = [m["content"] for m in fake.sessions[IDLE].messages if m["role"] == "user"]
    assert user[-2:] == ["first question", "second question"]  # nothing typed ahead was sent; no third turn


def test_new_session_options_with_a_resumed_session_are_refused_not_ignored(fake):
    env = {"WEAVE_SOCKET": str(fake.socket_path), "WEAVE_API_KEY": None, "WEAVE_DEBUG": None}
    res = runner.invoke(app, ["chat", "--session", IDLE, "--system", "Be terse."], input="", env=env)
    assert res.exit_code == 2 and "--system set up a new session; a resumed one keeps its own" in res.stderr
    res = runner.invoke(app, ["chat", "--session", IDLE, "--sla", "batch"], input="", env=env)
    assert res.exit_code == 2 and "--sla set up a new session" in res.stderr


@pytest.mark.parametrize("reason, said", [("shutdown", "the daemon shut down"),
                                          ("cancelled", "the turn was cancelled")])
def test_an_answer_the_daemon_cut_is_said_to_be_cut(fake, reason, said):
    fake.cut_by = reason  # a shutdown while the answer streams, or the session deleted elsewhere
    out = chat(fake, input="hello\n/exit\n", code=1)  # (from a pipe: a cut answer fails the chat)
    assert f"[the answer was cut: {said}" in out


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(fake):
    lines = iter(["caf\udce9 au lait", "hello"])  # a terminal's Latin-1 byte, as Python decodes stdin

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    said: list[str] = []
    before = len(fake.requests)
    ChatRepl(Client(fake.socket_path), session_id=IDLE, sla=None, system=None, sampling={}, read=read,
             say=said.append).run()
    assert "error: that line is not valid UTF-8 (byte 0xe9 at offset 3); nothing was sent" in said
    turns = [r for r in fake.requests[before:] if r.path.endswith("/turns")]
    assert [t.body["messages"] for t in turns] == [[{"role": "user", "content": "hello"}]]


def test_a_model_without_a_chat_template_ends_the_chat_failing_and_leaves_no_session(fake):
    fake.refuse_turns = "the model has no chat template, so it cannot take messages"
    fake.refuse_code = "no_chat_template"
    before = set(fake.sessions)
    res = runner.invoke(app, ["chat"], input="hello\nand again\n", env={"WEAVE_SOCKET": str(fake.socket_path)})
    assert res.exit_code == 1 and "no chat template" in res.stderr
    assert set(fake.sessions) == before  # the session it made had no turns: deleted
    fake.refuse_code = None  # another refusal ends nothing but that turn
    res = runner.invoke(app, ["chat"], input="hello\n", env={"WEAVE_SOCKET": str(fake.socket_path)})
    assert res.exit_code == 1 and "error:" in res.stderr  # (from a pipe: a refused turn fails the chat, at its end)
    assert "the daemon refused or cut 1 turn(s)" in res.stderr


def test_a_command_with_an_argument_does_nothing_and_says_why(fake):
    """``/promote s-other`` would act on this chat's own session, not the one named: refused, not done."""
    out = chat(fake, input=f"/promote {IDLE}\n/exit\n")
    assert "/promote takes no argument (it acts on this chat's session); nothing was done" in out
    assert not [p for p in fake.paths("POST") if p.endswith("mote")]


def test_a_message_that_starts_with_a_slash_is_sent_doubled(fake):
    before = set(fake.sessions)
    chat(fake, input="//etc/hosts is a file\n/exit\n")
    [sid] = new_ids(fake, before)
    turns = [r for r in fake.requests if r.path == f"/v1/sessions/{sid}/turns"]
    assert turns[0].body["messages"] == [{"role": "user", "content": "/etc/hosts is a file"}]


def test_ctrl_c_during_a_command_stops_it_not_the_chat(fake, monkeypatch):
    said: list[str] = []
    lines = iter(["/session", "/exit"])
    repl = ChatRepl(Client(fake.socket_path), session_id=IDLE, sla=None, system=None, sampling={},
                    read=lambda prompt: next(lines), say=said.append)

    real, calls = repl.client.session, []

    def session(sid):  # the resume reads the session; then /session is interrupted while it waits
        calls.append(sid)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(sid)

    monkeypatch.setattr(repl.client, "session", session)
    repl.run()
    assert "\n[stopped]" in said and any("kept; resume with" in s for s in said)


def test_resuming_after_a_call_shows_the_call_not_none(fake):
    fake.add_session("s-00000000000000c1", "background", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}])
    out = chat(fake, "--session", "s-00000000000000c1", input="/exit\n")
    assert 'assistant: -> get_weather({"city": "Oslo"})  [call_1]' in out and "None" not in out


def test_a_chat_fed_from_a_pipe_draws_no_prompt_and_fails_if_a_turn_was_refused(fake):
    """A script pipes lines in: stdout holds the answers alone (no prompt, no notes), the chat's own lines
    go to stderr, and a refused turn - here a first message longer than the context, which no reset or
    fork helps - makes the chat exit 1 once its input ends."""
    env = {"WEAVE_SOCKET": str(fake.socket_path)}
    res = runner.invoke(app, ["chat"], input="hello\n", env=env)
    assert res.exit_code == 0 and res.stdout == "You said: hello.\n" and ">>>" not in res.stderr
    fake.sessions[IDLE].full = True
    res = runner.invoke(app, ["chat", "--session", IDLE], input="hi\n", env=env)
    assert res.exit_code == 1 and res.stdout == ""
    assert "error: the prompt needs 8204 tokens" in res.stderr and "/reset starts a new one" in res.stderr
