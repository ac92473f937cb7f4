"""Every client command, as text and as --json, against the fake daemon; and the no-daemon message."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner
from weaved.cli.app import app

from tests.cli.fake_server import FakeDaemon, seed_sessions, short_socket_dir

runner = CliRunner()
IDLE = "s-e24b7f0d9c1a6358"


@pytest.fixture
def fake():
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as f:
        seed_sessions(f)
        yield f


def weave(fake: FakeDaemon | None, *args: str, input: str | None = None, socket: str | None = None):
    env = {"WEAVE_SOCKET": socket or str(fake.socket_path), "WEAVE_API_KEY": None, "WEAVE_DEBUG": None}
    return runner.invoke(app, list(args), input=input, env=env)


def ok(res) -> str:
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return res.stdout


# ---- sessions -------------------------------------------------------------------------------------

def test_ps_lists_sessions_with_class_pool_backend_context_state_speed_and_reason(fake):
    out = ok(weave(fake, "ps")).splitlines()
    assert out[0].split() == ["ID", "CLASS", "POOL", "BACKEND", "CONTEXT", "STATE", "TOK/S", "REASON"]
    assert len(out) == 5
    first = out[1].split()
    assert first[:7] == ["s-3f9c2a1b7d4e8f60", "interactive", "cpu", "cpu", "11", "running", "38.2"]
    assert out[1].endswith("interactive: latency-sensitive; CPU pool 'cpu' (batch 1/16)")
    assert out[3].split()[5:7] == ["waiting", "-"]


def test_ps_says_how_many_sessions_of_the_data_directory_it_does_not_list(fake):
    assert "not recovered" not in weave(fake, "ps").stderr
    fake.unrecovered = [{"id": "s-0ther", "reason": "its KV file is another model's"}]
    res = weave(fake, "ps")
    assert res.exit_code == 0 and "s-0ther" not in res.stdout
    assert "1 more in the data directory not recovered" in res.stderr and "weave status" in res.stderr


def test_ps_json_is_the_status_sessions(fake):
    rows = json.loads(ok(weave(fake, "ps", "--json")))
    assert [r["id"] for r in rows] == list(fake.sessions)
    assert rows[0]["ttft_s"] == 0.184 and rows[1]["class"] == "background"


def test_ps_hides_one_off_sessions_unless_all(fake):
    fake.add_session("tmp-0000000000000001", "interactive", ephemeral=True)
    assert "tmp-" not in ok(weave(fake, "ps"))
    assert "tmp-0000000000000001" in ok(weave(fake, "ps", "--all"))


def test_ps_filters_by_state_class_and_pool_and_keeps_the_newest(fake):
    every = json.loads(ok(weave(fake, "ps", "--json")))
    res = weave(fake, "ps", "--state", "waiting")
    assert res.exit_code == 0 and [ln.split()[5] for ln in res.stdout.splitlines()[1:]] == ["waiting"]
    assert res.stderr == f"1 of {len(every)} sessions\n"
    background = json.loads(ok(weave(fake, "ps", "--class", "background", "--json")))
    assert background and {r["class"] for r in background} == {"background"}
    assert json.loads(ok(weave(fake, "ps", "--pool", "nowhere", "--json"))) == []
    newest = json.loads(ok(weave(fake, "ps", "--last", "2", "--json")))
    assert [r["id"] for r in newest] == [r["id"] for r in every[-2:]]
    assert weave(fake, "ps", "--state", "sleeping").exit_code == 2


def test_ps_with_no_sessions(fake):
    fake.sessions.clear()
    assert ok(weave(fake, "ps")) == "no sessions\n"
    assert ok(weave(fake, "ls")) == "no sessions\n"  # the name people type first
    assert json.loads(ok(weave(fake, "ps", "--json"))) == []


def test_show_prints_sla_placement_and_transcript(fake):
    out = ok(weave(fake, "show", IDLE))
    assert out.splitlines()[0] == f"session   {IDLE}"
    assert "sla       background\n" in out
    assert "placement pool cpu (standard prefill, standard decode): background: throughput-tolerant" in out
    assert out.endswith("user: Write the changelog\nassistant: Done: 12 entries.\n")
    assert "forked" not in out
    fake.sessions[IDLE].forked_from = "s-parent"
    assert "forked    from s-parent\n" in ok(weave(fake, "show", IDLE))
    assert "status    idle\n" in out
    assert "status    busy (waiting)\n" in ok(weave(fake, "show", "s-0c5d86e2f1a94b37"))  # its turn's state


def test_show_json_and_unknown_session(fake):
    data = json.loads(ok(weave(fake, "show", IDLE, "--json")))
    assert data["id"] == IDLE and len(data["messages"]) == 2
    res = weave(fake, "show", "s-nope")
    assert res.exit_code == 1
    assert res.stderr == "weave: error: no session 's-nope'\n" and res.stdout == ""


def test_rm_deletes_each_session(fake):
    out = ok(weave(fake, "rm", IDLE, "s-0c5d86e2f1a94b37"))
    assert out == f"deleted {IDLE}\ndeleted s-0c5d86e2f1a94b37\n"
    assert IDLE not in fake.sessions and len(fake.sessions) == 2
    data = json.loads(ok(weave(fake, "rm", "s-a71e04c9b2d35f18", "--json")))
    assert data == [{"id": "s-a71e04c9b2d35f18", "object": "session.deleted", "deleted": True}]


def test_a_submitted_task_the_daemon_refuses_leaves_no_empty_session(fake):
    fake.refuse_turns = "the model has no chat template"
    before = set(fake.sessions)
    res = weave(fake, "submit", "label the tickets")
    assert res.exit_code == 1 and "no chat template" in res.stderr
    assert set(fake.sessions) == before


def test_rm_deletes_every_session_it_can_and_reports_the_rest(fake):
    res = weave(fake, "rm", "s-nope", IDLE, "s-gone")
    assert res.exit_code == 1 and res.stdout == f"deleted {IDLE}\n"
    assert res.stderr == "weave: error: no session 's-nope'; no session 's-gone'\n"  # (each id named once)
    assert IDLE not in fake.sessions


def test_promote_and_demote(fake):
    out = ok(weave(fake, "promote", IDLE))
    assert out.startswith(f"{IDLE}: interactive, TTFT 500ms -> pool cpu")
    assert fake.sessions[IDLE].cls == "interactive"
    assert fake.paths("POST")[-1] == f"/v1/sessions/{IDLE}/promote"
    data = json.loads(ok(weave(fake, "demote", IDLE, "--json")))
    assert data["sla"]["class"] == "background" and data["placement"]["priority"] == 1
    assert [e["type"] for e in fake.events[-2:]] == ["promotion", "demotion"]


# ---- status ---------------------------------------------------------------------------------------

def test_status_shows_model_pools_kv_hardware_and_peers(fake):
    out = ok(weave(fake, "status"))
    assert out.startswith("model     SmolLM2-135M-Instruct-Q4_0 (llama, 8192-token context)\n")
    assert "profile   cpu-only, up 1h02m\n" in out  # a shipped profile: its name says which
    assert "data      /srv/weave (durability page-cache)\n" in out
    from weaved.cli.status import status_text

    mine = status_text({"profile": "mine", "profile_file": "/etc/weave/mine.toml", "uptime_s": 5.0})
    assert "profile   mine (/etc/weave/mine.toml), up 5.0s\n" in mine  # the operator's own file: where it is
    assert "sessions  4 (3 generating)\n" in out
    assert ("kv        4 session file(s): 180.0 MiB on disk, 92.0 MiB in RAM, 192.0 MiB reserved of a "
            "12.0 GiB cap\n") in out
    assert "gpu       none\n" in out and "peers     none\n" in out
    pool_lines = out[out.index("POOL"):].splitlines()
    assert pool_lines[1].split() == ["cpu", "cpu", "cpu", "standard", "max", "16,", "chunk", "256", "2", "1",
                                     "212.5", "3"]


def test_status_shows_device_kv_and_moves():
    from weaved.cli.status import status_text

    text = status_text({"kv": {"sessions": 2, "file_bytes": 2**20, "ram_bytes": 2**20, "device_bytes": 3 * 2**20,
                               "device_free_bytes": 2**30, "reserved_bytes": 2**21, "cap_bytes": 2**30},
                        "migrations": {"count": 2, "bytes": 5 * 2**20, "seconds": 0.02,
                                       "by_reason": {"promotion": 1, "demotion": 1}}})
    assert "1.0 MiB in RAM, 3.0 MiB on GPU pools (1.0 GiB free), 2.0 MiB reserved" in text
    assert "moves     2 KV move(s) between backends, 5.0 MiB copied in 20ms (1 demotion, 1 promotion)" in text


def test_status_counts_requests_without_a_session_and_shared_prefix_files():
    """A plain OpenAI client's requests are stateless: they count as running, not as sessions; and the
    shared prefixes' files, which hold disk too, are in the kv line."""
    from weaved.cli.status import status_text

    text = status_text({"sessions": [{"id": "s-1", "state": "idle"}, {"id": "tmp-1", "state": "running",
                                                                        "ephemeral": True}],
                        "kv": {"sessions": 1, "file_bytes": 2**20, "reserved_bytes": 2**20, "cap_bytes": 2**30,
                               "prefixes": {"files": 42, "bytes": 3 * 2**30 // 2, "cap_bytes": 2**31}}})
    assert "sessions  1 (0 generating); 1 request(s) without a session running\n" in text
    assert "cap; 42 shared prefix file(s): 1.5 GiB of their 2.0 GiB cap\n" in text


def test_status_shows_rings_and_groups():
    from weaved.cli.status import status_text

    ring = {"ring": "ring-a-2", "members": ["b"], "sessions": 1, "formed": 2, "lost": 1, "rebuilt_sessions": 1,
            "rebuilt_tokens": 300, "pipeline_prefills": 1}
    text = status_text({"pools": [{"name": "ring", "backend": "qring", "ring": ring}],
                        "groups": [{"group": "ring-c-1", "home": "node-c", "rank": 1, "world": 3,
                                    "state": "serving"}]})
    assert ("ring      ring: ring-a-2 with b, 1 session(s); formed 2x, lost 1x, rebuilt 1 session(s) (300 tokens), "
            "1 pipeline prefill(s)") in text
    assert "member    of ring-c-1 (home node-c), rank 1 of 3, serving" in text


def test_status_json_and_peers(fake):
    data = json.loads(ok(weave(fake, "status", "--json")))
    assert data["pools"][0]["name"] == "cpu" and data["kv"]["cap_bytes"] == 12_884_901_888
    original = fake.status
    peer = {"name": "b", "url": "tcp://10.0.0.2:7070", "state": "alive", "latency_ms": 0.4}
    fake.status = lambda: {**original(), "peers": [peer]}
    assert "peers     b tcp://10.0.0.2:7070 (alive, 0.4ms)\n" in ok(weave(fake, "status"))


# ---- run and submit -------------------------------------------------------------------------------

def test_run_streams_the_answer_without_keeping_a_session(fake):
    assert ok(weave(fake, "run", "hello there")) == "You said: hello there.\n"
    body = fake.requests[-1].body
    assert fake.requests[-1].path == "/v1/chat/completions"
    assert body == {"messages": [{"role": "user", "content": "hello there"}], "sla": {"class": "interactive"},
                    "stream": True}
    # the stand-in drops its ephemeral session after the stream's last byte: wait for it, bounded
    deadline = time.monotonic() + 5
    while any(s.startswith("tmp-") for s in list(fake.sessions)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(s.startswith("tmp-") for s in list(fake.sessions))


def test_run_reads_stdin_with_dash_and_passes_options(fake):
    out = ok(weave(fake, "run", "-", "--sla", "batch", "--system", "terse", "--max-tokens", "2",
                   "--temperature", "0", "--seed", "7", input="from stdin\n"))
    assert out == "You said:\n"
    body = fake.requests[-1].body
    assert body["messages"] == [{"role": "system", "content": "terse"},
                                {"role": "user", "content": "from stdin\n"}]
    assert (body["sla"], body["max_tokens"], body["temperature"], body["seed"]) == \
        ({"class": "batch"}, 2, 0.0, 7)


def test_sampling_options_take_the_apis_ranges(fake):
    ok(weave(fake, "run", "hi", "--seed", "-1", "--temperature", "2"))  # -1: a random seed, as the API says
    assert (fake.requests[-1].body["seed"], fake.requests[-1].body["temperature"]) == (-1, 2.0)
    before = len(fake.requests)
    for bad in (["--temperature", "5"], ["--temperature", "-1"], ["--seed", str(1 << 64)]):
        res = weave(fake, "run", "hi", *bad)
        assert res.exit_code == 2, (bad, res.stderr)  # a usage error, refused before the daemon sees it
    assert len(fake.requests) == before


def test_run_json_prints_the_completion(fake):
    data = json.loads(ok(weave(fake, "run", "hi", "--json")))
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["content"] == "You said: hi."


@pytest.mark.parametrize("reason, says", [("shutdown", "the daemon shut down"), ("cancelled", "cancelled")])
def test_run_fails_when_the_daemon_cuts_the_answer(fake, reason, says):
    fake.cut_by = reason
    res = weave(fake, "run", "hello there")
    assert res.exit_code == 1 and res.stdout == "You\n"
    assert res.stderr.startswith("weave: error: the answer was cut: ") and says in res.stderr


@pytest.mark.parametrize("args", [["run", "--json", "hello there"], ["submit", "--wait", "--json", "hello there"]])
def test_a_cut_answer_fails_with_json_too(fake, args):
    """A script reading --json tells a cut answer by the exit code as one reading the text does: the
    answer is printed, then the error."""
    fake.cut_by = "cancelled"
    res = weave(fake, *args)
    assert res.exit_code == 1 and "the answer was cut" in res.stderr
    assert "cancelled" in res.stdout and json.loads(res.stdout)


def test_ctrl_c_during_submit_wait_json_says_the_sessions_id(fake, monkeypatch):
    import weaved.cli.run as run_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "_turn_result", interrupted)
    res = weave(fake, "submit", "--wait", "--json", "task four")
    assert res.exit_code != 0 and res.stdout == ""
    assert "interrupted: the task was cancelled; its answer so far is kept (weave show s-" in res.stderr


def test_a_length_finish_says_which_limit_stopped_it(fake):
    """With --max-tokens, the token limit; without, an answer runs to the context's end, which "length" then
    means - raising --max-tokens would not help."""
    res = weave(fake, "run", "--max-tokens", "1", "hello there")
    assert res.exit_code == 0 and "--max-tokens raises it" in res.stderr
    fake.cut_by = "length"
    res = weave(fake, "run", "hello there")
    assert res.exit_code == 0 and "the context is full" in res.stderr and "--max-tokens" not in res.stderr


@pytest.mark.parametrize("args", [["show", ""], ["rm", "s-1", " "], ["fork", ""], ["promote", ""], ["demote", ""],
                                  ["chat", "--session", ""], ["peers", "rm", ""], ["peers", "add", " ", "http://h:1"]])
def test_an_empty_id_is_a_usage_error_the_daemon_never_sees(fake, args):
    before = len(fake.requests)
    res = weave(fake, *args)
    assert res.exit_code == 2 and "must not be empty" in res.stderr, (args, res.stderr)
    assert len(fake.requests) == before


@pytest.mark.parametrize("args, where", [(["run", "caf\udce9"], "the input"),
                                         (["run", "hi", "--system", "\udcff"], "--system"),
                                         (["submit", "caf\udce9"], "the task")])
def test_text_that_is_not_utf8_is_a_usage_error_naming_the_byte(fake, args, where):
    before = len(fake.requests)
    res = weave(fake, *args)
    assert res.exit_code == 2 and f"weave: error: {where} is not valid UTF-8 (byte 0x" in res.stderr, res.stderr
    assert len(fake.requests) == before  # nothing sent, no session made


def test_run_refuses_an_empty_prompt(fake):
    res = weave(fake, "run", "-", input="  \n")
    assert res.exit_code == 2 and res.stderr == "weave: error: the prompt is empty\n"


def test_submit_returns_id_and_placement_at_once(fake):
    out = ok(weave(fake, "submit", "label the tickets", "--ttlt-s", "3600", "--max-context", "4096"))
    sid = out.splitlines()[0].split()[1]
    # the placement the task's turn runs with (the session is placed again when its prompt is known)
    assert out.splitlines()[1].startswith("placement pool cpu (standard prefill, standard decode): "
                                          "placed again at its first turn (3 prompt tokens to compute); background")
    create, turn = fake.requests[-2:]
    assert create.body == {"sla": {"class": "background", "ttlt_s": 3600.0}, "max_context": 4096}
    assert turn.path == f"/v1/sessions/{sid}/turns"
    assert turn.body == {"messages": [{"role": "user", "content": "label the tickets"}], "detach": True}


def test_submit_json_reads_a_file(fake, tmp_path):
    task = tmp_path / "task.txt"
    task.write_text("summarise the log", encoding="utf-8")
    data = json.loads(ok(weave(fake, "submit", "--file", str(task), "--sla", "interactive",
                               "--ttft-ms", "250", "--json")))
    assert set(data) == {"id", "placement", "status"} and data["status"] == "running"
    assert data["placement"]["priority"] == 3
    assert fake.sessions[data["id"]].sla == {"class": "interactive", "ttft_ms": 250.0, "ttlt_s": None}
    assert fake.sessions[data["id"]].messages[0]["content"] == "summarise the log"


def test_submit_reads_piped_stdin(fake):
    ok(weave(fake, "submit", input="a task from a pipe"))
    assert fake.requests[-1].body["messages"][0]["content"] == "a task from a pipe"


def test_submit_wait_streams_the_result(fake):
    res = weave(fake, "submit", "--wait", "--sla", "batch", "task two")
    assert ok(res) == "You said: task two.\n"
    assert res.stderr.startswith("session   s-") and "batch: throughput-tolerant" in res.stderr
    assert "placed again at its first turn (2 prompt tokens to compute)" in res.stderr.splitlines()[1]
    assert fake.requests[-1].body["stream"] is True


def test_submit_wait_json_is_one_object_at_the_end(fake):
    data = json.loads(ok(weave(fake, "submit", "--wait", "--json", "--max-tokens", "2", "x y z")))
    assert data["content"] == "You said:" and data["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2 and data["id"].startswith("s-")
    assert data["placement"]["reasons"][0] == "placed again at its first turn (3 prompt tokens to compute)"


def test_submit_refuses_two_sources_and_no_task(fake, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("x")
    res = weave(fake, "submit", "arg", "--file", str(f))
    assert res.exit_code == 2 and "not both" in res.stderr
    res = weave(fake, "submit", "--file", str(tmp_path / "missing.txt"))
    assert res.exit_code == 2 and res.stderr.startswith("weave: error: cannot read")
    res = weave(fake, "submit", input="")
    assert res.exit_code == 2 and res.stderr == "weave: error: the task is empty\n"


def test_invalid_sla_class_is_a_usage_error(fake):
    res = weave(fake, "submit", "--sla", "urgent", "x")
    assert res.exit_code == 2


# ---- no daemon ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["ps"], ["ps", "--json"], ["status"], ["status", "--json"], ["show", "s-1"],
                                  ["rm", "s-1"], ["promote", "s-1"], ["demote", "s-1"], ["run", "hi"],
                                  ["submit", "task"], ["submit", "--wait", "task"], ["chat"]])
def test_every_command_says_no_daemon_and_how_to_start_one(tmp_path, args):
    sock = str(tmp_path / "none.sock")
    res = weave(None, *args, socket=sock, input="")
    assert res.exit_code == 3, (res.stdout, res.stderr)
    assert res.stderr == f"weave: error: no daemon running at {sock}; start one with `weave serve`\n"


def test_socket_option_overrides_the_environment(fake, tmp_path):
    env = {"WEAVE_SOCKET": str(tmp_path / "x")}
    res = runner.invoke(app, ["ps", "--socket", str(fake.socket_path)], env=env)
    assert ok(res).startswith("ID")


def test_api_key_from_the_environment(fake):
    fake.api_key = "s3cret"
    res = runner.invoke(app, ["ps"], env={"WEAVE_SOCKET": str(fake.socket_path), "WEAVE_API_KEY": "s3cret"})
    assert ok(res).startswith("ID")
    res = runner.invoke(app, ["ps"], env={"WEAVE_SOCKET": str(fake.socket_path), "WEAVE_API_KEY": "wrong"})
    assert res.exit_code == 1 and res.stderr == "weave: error: missing or wrong API key\n"


def test_weave_debug_shows_the_traceback(tmp_path):
    res = runner.invoke(app, ["ps"], env={"WEAVE_SOCKET": str(tmp_path / "none.sock"), "WEAVE_DEBUG": "1"})
    assert res.exit_code == 1 and type(res.exception).__name__ == "DaemonNotRunning"


# ---- what reaches the terminal ----------------------------------------------------------------------

HOSTILE = "\x1b]0;owned\x07\x1b[2Jcleared\x9b31m\u202eevil\x00"


def test_control_characters_are_shown_escaped_never_sent_to_the_terminal(fake):
    fake.add_session("s-00000000000000aa", "background",
                     messages=[{"role": "user", "content": HOSTILE}, {"role": "assistant", "content": "ok\tdone\n"}])
    for args in (["show", "s-00000000000000aa"], ["show", "s-00000000000000aa", "--json"], ["ps"],
                 ["run", HOSTILE, "--max-tokens", "8"]):
        out = ok(weave(fake, *args))
        assert not any(c in out for c in "\x1b\x07\x9b\u202e\x00"), (args, out)
    shown = ok(weave(fake, "show", "s-00000000000000aa"))
    assert "\\x1b]0;owned\\x07\\x1b[2Jcleared\\x9b31m\\u202eevil\\x00" in shown and "ok\tdone" in shown
    record = json.loads(ok(weave(fake, "show", "s-00000000000000aa", "--json")))
    assert record["messages"][0]["content"] == HOSTILE  # the JSON still says exactly what is stored
    res = weave(fake, "show", "s-\x1b[2J")  # an error message that repeats what the user typed
    assert res.exit_code != 0 and "\x1b" not in res.stderr


def test_printable_keeps_text_and_escapes_only_controls():
    from weaved.cli.fmt import printable

    assert printable("héllo wörld ✓ 漢字\n\tnext") == "héllo wörld ✓ 漢字\n\tnext"
    assert printable("a\x1bb\rc\x7f\u2066") == "a\\x1bb\\x0dc\\x7f\\u2066"
    assert printable(printable(HOSTILE)) == printable(HOSTILE)


def test_show_marks_answers_that_did_not_end_by_themselves(fake):
    fake.add_session("s-00000000000000cc", "background", messages=[
        {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": "Once upon", "finish_reason": "interrupted"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "Done.", "finish_reason": "stop"}])
    out = ok(weave(fake, "show", "s-00000000000000cc")).splitlines()
    at = out.index("assistant: Once upon")
    assert out[at + 1].strip().startswith("[interrupted")
    assert out[-1] == "assistant: Done."  # an answer that ended by itself carries no mark


def test_a_messages_later_lines_are_indented_so_none_reads_as_another_entry(fake):
    fake.add_session("s-00000000000000dd", "background", messages=[
        {"role": "user", "content": "line one\nassistant: not a real answer"},
        {"role": "assistant", "content": "ok"}])
    out = ok(weave(fake, "show", "s-00000000000000dd")).splitlines()
    assert out[-3:] == ["user: line one", "  assistant: not a real answer", "assistant: ok"]


def test_version_and_a_socket_url_that_is_not_http():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.startswith("weave ")
    res = runner.invoke(app, ["ps", "--socket", "ftp://host:1"], env={"WEAVE_SOCKET": None})
    assert res.exit_code == 2 and "a URL must be http://HOST:PORT" in res.stderr
    res = runner.invoke(app, ["ps"], env={"WEAVE_SOCKET": "ftp://host:1"})
    assert res.exit_code == 2 and "'ftp://host:1' (--socket or WEAVE_SOCKET)" in res.stderr


def test_ps_state_prefill_lists_the_sessions_whose_prompt_is_being_fed(fake):
    waiting = "s-0c5d86e2f1a94b37"
    fake.sessions[waiting].prefill = {"done": 1024, "total": 5015}
    rows = ok(weave(fake, "ps", "--state", "prefill")).splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[0] == waiting and "prefill:1024/5015" in rows[0].split()


def test_clear_prefixes_says_what_went_and_what_stayed(fake):
    out = ok(weave(fake, "clear-prefixes"))
    assert out.startswith("removed 3 stored prefix file(s), 5.0 MiB, and 2 short prefix block(s)")
    assert "1 file(s) kept" in out and fake.requests[-1].method == "DELETE"
    assert json.loads(ok(weave(fake, "clear-prefixes", "--json")))["files"] == 3


def test_help_shows_flags_as_flags():
    for args in (["status", "--help"], ["bench", "--help"], ["ps", "--help"]):
        out = runner.invoke(app, args).stdout
        assert "--help" in out and "<bool>" not in out


def test_submit_sends_a_tools_file_and_a_choice(fake, tmp_path):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(tools), encoding="utf-8")
    ok(weave(fake, "submit", "find it", "--tools", str(f), "--tool-choice", "lookup"))
    body = fake.requests[-1].body
    assert body["tools"] == tools
    assert body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    f.write_text('{"not": "a list"}', encoding="utf-8")
    res = weave(fake, "submit", "x", "--tools", str(f))
    assert res.exit_code == 2 and "list of tool definitions" in res.stderr
    res = weave(fake, "submit", "x", "--tool-choice", "auto")
    assert res.exit_code == 2 and "--tool-choice needs --tools" in res.stderr
    f.write_text(json.dumps(tools), encoding="utf-8")
    sent = len(fake.requests)
    res = weave(fake, "submit", "x", "--tools", str(f), "--tool-choice", "nope")
    assert res.exit_code == 2 and "'nope'" in res.stderr and "lookup" in res.stderr
    assert len(fake.requests) == sent  # refused before anything was sent


def test_streams_show_reasoning_and_tool_calls():
    import io

    from weaved.cli.client import Delta
    from weaved.cli.stream_out import write_stream

    deltas = [Delta("", reasoning="Let me "), Delta("", reasoning="think."), Delta("Calling."),
              Delta("", tool_calls=({"index": 0, "id": "c1", "function": {"name": "lookup", "arguments": ""}},)),
              Delta("", tool_calls=({"index": 0, "function": {"arguments": '{"q": '}},)),
              Delta("", tool_calls=({"index": 0, "function": {"arguments": '"x"}'}},)),
              Delta("", finish_reason="tool_calls")]
    out = io.StringIO()
    last = write_stream(deltas, out)
    assert out.getvalue() == '[thinking]\nLet me think.\n[/thinking]\nCalling.\n-> lookup({"q": "x"})\n\n'
    assert last.finish_reason == "tool_calls"


def test_status_shows_the_rates_in_use_and_their_age():
    from weaved.cli.status import status_text

    cal = {"prefill_tokens_per_s": 1036.9, "decode_tokens_per_s": 302.9, "source": "calibrated", "age_s": 7200.0,
           "fit_error": 0.06}
    assert ("rates     CPU prefill 1036.9 tok/s, decode 302.9 tok/s at a full batch (calibrated 2h00m ago, fit "
            "within 6%)") in status_text({"rates": cal})
    given = {"prefill_tokens_per_s": 123.0, "decode_tokens_per_s": 45.0, "source": "profile"}
    assert "decode 45.0 tok/s at a full batch (given by the profile)" in status_text({"rates": given})


def test_ctrl_c_during_submit_wait_says_the_task_was_cancelled(fake, monkeypatch):
    import weaved.cli.run as run_mod

    def interrupted(deltas):
        next(iter(deltas))
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "write_stream", interrupted)
    res = weave(fake, "submit", "--wait", "task three")
    assert res.exit_code != 0
    sid = res.stderr.splitlines()[0].split()[1]
    assert f"interrupted: the task was cancelled; its answer so far is kept (weave show {sid})" in res.stderr


def test_a_whole_answer_is_waited_for_however_long_it_takes(fake):
    """``weave run --json`` and ``submit --wait --json`` read a whole generation in one answer, which on a
    CPU pool takes minutes: it has no read time limit (other requests keep theirs)."""
    from weaved.cli.client import Client
    from weaved.cli.errors import ClientError

    fake.answer_delay_s = 0.6
    client = Client(fake.socket_path, timeout_s=0.2)
    answer = client.chat([{"role": "user", "content": "hello there"}], max_tokens=4)
    assert answer["choices"][0]["message"]["content"]
    sid = client.create_session({"class": "background"}, None, None)["id"]
    assert client.turn(sid, [{"role": "user", "content": "hi"}])["choices"][0]["finish_reason"]
    fake.status_delay_s = 0.6  # (a request that is not a generation keeps its limit)
    with pytest.raises(ClientError):
        client.status()


@pytest.mark.parametrize("json_out", [False, True])
def test_a_task_refused_while_it_is_waited_for_leaves_no_empty_session(fake, json_out):
    before = set(fake.sessions)
    fake.refuse_turns = "this model has no chat template"
    res = weave(fake, "submit", "--wait", *(["--json"] if json_out else []), "Summarize the report")
    assert res.exit_code == 1 and "no chat template" in res.stderr
    assert set(fake.sessions) == before


@pytest.mark.parametrize("args", [["run", "--temperature", "5", "hi"], ["nosuch"], ["show", " "],
                                  ["run", "--max-tokens", "x", "hi"]])
def test_bad_usage_is_one_line_and_exit_2_however_it_is_found(args, monkeypatch, capsys):
    """The parser's refusals (a value out of range, an unknown command) say it as the commands' own do:
    ``weave: error: ...`` on one line, exit 2 - no usage box."""
    import sys

    from weaved.cli.app import main

    monkeypatch.setattr(sys, "argv", ["weave", *args])
    monkeypatch.setenv("WEAVE_SOCKET", "/nonexistent/w.sock")
    with pytest.raises(SystemExit) as ended:
        main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.startswith("weave: error: ") and err.count("\n") == 1, err
