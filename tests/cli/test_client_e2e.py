"""The client commands against a real ``weave serve`` started by the test (the default model, CPU)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner
from weaved.cli.app import app

from tests.tui.daemon_process import running_daemon, wait_for

pytestmark = pytest.mark.slow
runner = CliRunner()
FEW = ["--max-tokens", "8", "--temperature", "0"]


@pytest.fixture(scope="module")
def socket():
    with running_daemon() as sock:
        yield str(sock)


def weave(socket: str, *args: str, input: str | None = None) -> str:
    res = runner.invoke(app, list(args), input=input, env={"WEAVE_SOCKET": socket, "WEAVE_API_KEY": None})
    assert res.exit_code == 0, (args, res.stdout, res.stderr)
    return res.stdout


def sessions(socket: str) -> dict[str, dict]:
    return {s["id"]: s for s in json.loads(weave(socket, "ps", "--json"))}


def test_run_answers_one_prompt_and_keeps_no_session(socket):
    before = set(sessions(socket))
    out = weave(socket, "run", "What colour is the sky?", *FEW)
    assert out.strip()
    assert set(sessions(socket)) == before
    data = json.loads(weave(socket, "run", "-", *FEW, "--json", input="Say hello."))
    assert data["object"] == "chat.completion" and data["usage"]["completion_tokens"] >= 1


def test_submit_wait_then_ps_promote_show_rm(socket):
    res = runner.invoke(app, ["submit", "--wait", *FEW, "Name a fruit."], env={"WEAVE_SOCKET": socket})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    sid = res.stderr.split()[1]  # "session   s-..." comes first, on stderr
    assert res.stdout.strip()
    s = sessions(socket)[sid]
    assert (s["class"], s["pool"], s["backend"], s["state"]) == ("background", "cpu", "cpu", "idle")
    assert s["context_tokens"] > 8 and "background" in s["reason"]

    assert weave(socket, "promote", sid).startswith(f"{sid}: interactive")
    assert sessions(socket)[sid]["class"] == "interactive"
    shown = json.loads(weave(socket, "show", sid, "--json"))
    assert shown["sla"]["class"] == "interactive"
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    assert weave(socket, "demote", sid, "--json") and sessions(socket)[sid]["class"] == "background"

    assert weave(socket, "rm", sid) == f"deleted {sid}\n"
    assert sid not in sessions(socket)


def test_submit_returns_at_once_and_the_task_runs_on(socket):
    data = json.loads(weave(socket, "submit", "--json", "--sla", "batch", *FEW, "Count to three."))
    sid = data["id"]
    assert data["status"] == "running" and data["placement"]["decode_pool"] == "cpu"

    def answered() -> bool:
        messages = json.loads(weave(socket, "show", sid, "--json"))["messages"]
        return [m["role"] for m in messages] == ["user", "assistant"]

    wait_for(answered, what="the detached turn's answer")
    assert "Count to three." in weave(socket, "show", sid)
    weave(socket, "rm", sid)


def test_chat_keeps_the_session_across_turns(socket):
    res = runner.invoke(app, ["chat", *FEW], input="Hello.\nAnd again.\n/session\n/exit\n",
                        env={"WEAVE_SOCKET": socket, "WEAVE_API_KEY": None})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    sid = res.stderr.split()[1].rstrip(":")  # (from a pipe, the chat's own lines are on stderr)
    s = json.loads(weave(socket, "show", sid, "--json"))
    assert [m["role"] for m in s["messages"]] == ["user", "assistant", "user", "assistant"]
    weave(socket, "rm", sid)


def test_status(socket):
    out = weave(socket, "status")
    assert "profile   cpu-only" in out and "\ncpu " in out
    data = json.loads(weave(socket, "status", "--json"))
    assert data["pools"][0]["backend"] == "cpu"


def test_fork_shares_a_session_and_outlives_it(socket):
    res = runner.invoke(app, ["submit", "--wait", *FEW, "Name a fruit."], env={"WEAVE_SOCKET": socket})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    sid = res.stderr.split()[1]
    out = weave(socket, "fork", sid, "--sla", "batch")
    child = out.split(":")[0]
    assert f"forked from {sid}" in out and child != sid
    assert sessions(socket)[child]["class"] == "batch"
    data = json.loads(weave(socket, "fork", sid, "--turn", "1", "--max-context", "4000", "--json"))
    assert data["forked_from"] == sid and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["max_context"] == 4000
    weave(socket, "rm", sid)
    shown = json.loads(weave(socket, "show", child, "--json"))
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    weave(socket, "rm", child, data["id"])


def test_rewind_takes_a_session_back_to_a_turn(socket):
    res = runner.invoke(app, ["submit", "--wait", *FEW, "Name a fruit."], env={"WEAVE_SOCKET": socket})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    sid = res.stderr.split()[1]
    assert weave(socket, "rewind", sid, "--turn", "0").startswith(f"{sid}: back to turn 0 (0 messages, 0 tokens")
    assert json.loads(weave(socket, "show", sid, "--json"))["messages"] == []
    bad = runner.invoke(app, ["rewind", sid, "--turn", "3"], env={"WEAVE_SOCKET": socket})
    assert bad.exit_code == 1 and "turn must be between 0 and the session's 0" in bad.stderr
    weave(socket, "rm", sid)
