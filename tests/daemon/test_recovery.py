"""Restarts: every session comes back from its last committed token, after a clean stop or kill -9,
and a turn cut by the stop is marked so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.daemon.support import GREEDY, make_daemon, prefilled, run_turn, wait_for_commits
from weaved.daemon.core import Daemon
from weaved.errors import Conflict
from weaved.routing.types import SLA, SLAClass


def test_restart_recovers_sessions_and_their_kv(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.INTERACTIVE, 500, None))["id"]
    run_turn(d, sid, "Remember the number seven")
    ctx = d.get_session(sid)["context_tokens"]
    d.shutdown()
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        info = d2.get_session(sid)
        assert info["sla"]["class"] == "interactive" and len(info["messages"]) == 2
        assert info["context_tokens"] == ctx  # the unfed last token of the turn comes back too
        _, h = run_turn(d2, sid, "Which number?")
        assert prefilled(d2) == h.prompt_tokens - h.cached_tokens < 20
    finally:
        d2.shutdown()


def _prompt_turn(d: Daemon, sid: str, ids: list[int]) -> tuple[list[int], object]:
    done = threading.Event()
    toks: list[int] = []

    def emit(ev: dict) -> None:
        if ev["type"] == "token" and ev["token"] is not None:
            toks.append(ev["token"])
        if ev["type"] in ("done", "error"):
            done.set()

    h = d.start_turn(session_id=sid, prompt=ids, params=GREEDY, emit=emit)
    assert done.wait(120), "turn did not finish"
    return toks, h


def test_prompt_session_continues_after_restart_as_without(tiny_llama, tmp_path):
    """A prompt-only session: the next turn after a restart feeds the answer's unfed last token, so it
    sees the context (and gives the tokens) a daemon that never stopped does."""
    first, second = [5, 6, 7, 8, 9], [10, 11, 12]

    def session(d: Daemon) -> str:
        return d.create_session(SLA(SLAClass.BACKGROUND))["id"]

    plain = make_daemon(tiny_llama, tmp_path / "plain")
    try:
        sid = session(plain)
        _prompt_turn(plain, sid, first)
        want, hw = _prompt_turn(plain, sid, second)
        want_ctx = plain.get_session(sid)["context_tokens"]
    finally:
        plain.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "restarted")
    sid = session(d)
    _prompt_turn(d, sid, first)
    ctx = d.get_session(sid)["context_tokens"]
    d.shutdown()
    d2 = make_daemon(tiny_llama, tmp_path / "restarted")
    try:
        assert d2.get_session(sid)["context_tokens"] == ctx
        got, h = _prompt_turn(d2, sid, second)
        assert h.prompt_tokens == hw.prompt_tokens and prefilled(d2) == len(second) + 1
        assert d2.get_session(sid)["context_tokens"] == want_ctx
        assert got == want and got
    finally:
        d2.shutdown()


@pytest.mark.parametrize("cut", ["cancelled", "stopped"])
def test_a_prompt_cut_in_its_prefill_keeps_its_unfed_rest_across_a_restart(tiny_llama, tmp_path, cut):
    """A raw prompt whose prefill was cut after 40 of its 100 tokens (its turn cancelled, or the daemon
    stopped): after a restart the session still counts the whole prompt in its context, and its next
    turn feeds the 60 unfed tokens before its own - they were never fed otherwise."""
    ids, second = [5 + i % 50 for i in range(100)], [10, 11, 12]
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    d.journal.add_message(sid, "user", "", ids)  # the turn's input, recorded before its prefill
    d.journal.commit_tokens(sid, ids[:40], 40)  # its first chunk committed
    if cut == "cancelled":
        d.journal.finish_message(sid, "assistant", "", [], "cancelled")
    d.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert d.get_session(sid)["context_tokens"] == 100
        _, h = _prompt_turn(d, sid, second)
        assert (h.prompt_tokens, h.cached_tokens) == (103, 40)  # 63 fed
        assert d.sessions[sid].committed[:103] == ids + second
    finally:
        d.shutdown()


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from weaved.daemon.core import Daemon
    from weaved.engine.sampling import SamplingParams
    from weaved.config.load import load_profile
    from weaved.routing.types import SLA, SLAClass
    d = Daemon(load_profile("cpu-only"), Path(sys.argv[1]), data_dir=Path(sys.argv[2]), log_fn=lambda m: None)
    d.load()
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    d.start_turn(session_id=sid, messages=[{"role": "user", "content": "Tell me a long story"}],
                 params=SamplingParams(max_tokens=1500, temperature=0, stop_token_ids=()), emit=lambda ev: None)
    print(sid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_kill_9_mid_generation_loses_nothing_committed(tiny_llama, tmp_path):
    data = tmp_path / "data"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_llama), str(data)], stdout=subprocess.PIPE,
                             text=True)
    try:
        sid = child.stdout.readline().strip()
        assert sid.startswith("s-")
        wait_for_commits(data / "journal.sqlite", sid,  # until the answer has some committed tokens
                         lambda rec: rec.messages and rec.kv_length > len(rec.messages[-1]["token_ids"] or []) + 5)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    d = make_daemon(tiny_llama, data)
    try:
        info = d.get_session(sid)
        assert [m["role"] for m in info["messages"]] == ["user", "assistant"]  # the partial answer is kept
        assert info["messages"][1]["finish_reason"] == "interrupted"  # ... and marked as cut by the crash
        assert "finish_reason" not in info["messages"][0]
        kv = d.sessions[sid].kv
        assert kv.length == len(d.sessions[sid].committed) > 5
        _, h = run_turn(d, sid, "Go on")
        assert prefilled(d) == h.prompt_tokens - h.cached_tokens < 20  # nothing stored was recomputed
        assert d.get_session(sid)["messages"][3]["finish_reason"] in ("stop", "length")
    finally:
        d.shutdown()
    d = make_daemon(tiny_llama, data)  # the marks are in the journal: a second restart keeps them
    try:
        reasons = [m.get("finish_reason") for m in d.get_session(sid)["messages"]]
        assert reasons[:2] == [None, "interrupted"] and reasons[3] in ("stop", "length")
    finally:
        d.shutdown()


def test_a_turn_stopped_before_its_first_token_is_marked_interrupted_after_a_restart(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    d.journal.add_message(sid, "user", "Hello", [1, 2, 3])  # a turn's input, recorded before its prefill
    d.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        msgs = d.get_session(sid)["messages"]
        assert [(m["role"], m["content"], m.get("finish_reason")) for m in msgs] == [
            ("user", "Hello", None), ("assistant", "", "interrupted")]
    finally:
        d.shutdown()


@pytest.mark.parametrize("damage", ["deleted", "cut short", "prefix gone"])
def test_a_lost_kv_file_is_rebuilt_from_the_journal(tiny_llama, tmp_path, damage):
    """The journal holds every committed token: a session whose KV file is gone or damaged comes back
    with a new file, and its next turn computes its context again - the answer a daemon that never lost
    the file gives."""
    long = "Remember the number seven. " * 20  # past a 128-token block: its first turn publishes a prefix
    plain = make_daemon(tiny_llama, tmp_path / "plain")
    try:
        sid = plain.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        run_turn(plain, sid, long)
        want, _ = run_turn(plain, sid, "Which number?")
    finally:
        plain.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(d, sid, long)
    ctx = d.get_session(sid)["context_tokens"]
    d.shutdown()
    kv = tmp_path / "data" / "kv" / f"{sid}.kv"
    if damage == "deleted":
        kv.unlink()
    elif damage == "cut short":
        os.truncate(kv, 4096)
    else:
        (prefix,) = (tmp_path / "data" / "kv" / "prefixes").glob("*.kv")
        prefix.unlink()
    logs: list[str] = []
    d2 = make_daemon(tiny_llama, tmp_path / "data", log_fn=logs.append)
    try:
        assert any(f"session {sid}:" in m and "rebuilt from its journal" in m for m in logs)
        assert d2.status()["unrecovered"] == []
        info = d2.get_session(sid)
        assert info["context_tokens"] == ctx and len(info["messages"]) == 2
        got, h = run_turn(d2, sid, "Which number?")
        # the whole context fed again (its first block mapped from a stored prefix where one is left)
        assert h.prompt_tokens > ctx and prefilled(d2) == h.prompt_tokens - h.cached_tokens
        assert [e.get("token") for e in got] == [e.get("token") for e in want]
    finally:
        d2.shutdown()
    d3 = make_daemon(tiny_llama, tmp_path / "data")  # and it stays whole across the next restart
    try:
        assert d3.get_session(sid)["context_tokens"] == d2_ctx(got, h)
    finally:
        d3.shutdown()


def d2_ctx(events, h) -> int:
    """The context after a turn: its prompt and its answer."""
    return h.prompt_tokens + sum(1 for e in events if e["type"] == "token" and e.get("token") is not None)


def test_a_rebuilt_session_stays_to_be_rebuilt_until_its_next_turn(tiny_llama, tmp_path):
    """A session rebuilt at a restart holds a new, empty file until its next turn computes its context:
    a second restart before that turn must rebuild it again, not read the empty file as its context."""
    plain = make_daemon(tiny_llama, tmp_path / "plain")
    try:
        sid = plain.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        run_turn(plain, sid, "Remember the number seven.")
        want, _ = run_turn(plain, sid, "Which number?")
    finally:
        plain.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(d, sid, "Remember the number seven.")
    d.shutdown()
    (tmp_path / "data" / "kv" / f"{sid}.kv").unlink()
    for _ in range(2):  # restarted twice before its next turn
        logs: list[str] = []
        d = make_daemon(tiny_llama, tmp_path / "data", log_fn=logs.append)
        assert any(f"session {sid}:" in m and "rebuilt from its journal" in m for m in logs)
        if _ == 0:
            d.shutdown()
    try:
        with pytest.raises(Conflict, match="rebuilt from its journal"):  # no rows to fork from yet
            d.fork_session(sid, turn=1)
        got, _ = run_turn(d, sid, "Which number?")
        assert [e.get("token") for e in got] == [e.get("token") for e in want]
    finally:
        d.shutdown()


def test_a_kv_file_whose_session_left_the_journal_is_removed_at_start(tiny_llama, tmp_path):
    """A deletion records the session's end first, then frees its files: a stop in between leaves a
    file no session holds, which the next start removes (it would count against the KV cap forever)."""
    from weaved.daemon.journal import Journal

    d = make_daemon(tiny_llama, tmp_path / "data")
    keep = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    gone = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(d, gone, "Hello")
    d.shutdown()
    j = Journal(tmp_path / "data" / "journal.sqlite")
    j.delete(gone)  # the deletion's first half
    j.close()
    logs: list[str] = []
    d = make_daemon(tiny_llama, tmp_path / "data", log_fn=logs.append)
    try:
        assert not (tmp_path / "data" / "kv" / f"{gone}.kv").exists()
        assert (tmp_path / "data" / "kv" / f"{keep}.kv").exists()
        assert any(gone in m and "removed" in m for m in logs)
        assert [s["id"] for s in d.list_sessions()] == [keep]
    finally:
        d.shutdown()


@pytest.mark.parametrize("damage", ["sla is not JSON", "placement of another shape", "an unknown class",
                                    "a message's extra is not JSON"])
def test_a_damaged_journal_record_leaves_that_session_unrecovered_and_the_rest_serving(tiny_llama, tmp_path, damage):
    """One session's record the daemon cannot read (a hand edit, a bug of another version): that session
    is unrecovered (409, its KV file kept for a repaired journal), the others serve - the daemon starts."""
    import sqlite3

    d = make_daemon(tiny_llama, tmp_path / "data")
    keep = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    bad = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    for sid in (keep, bad):
        run_turn(d, sid, "Hello")
    d.shutdown()
    db = sqlite3.connect(tmp_path / "data" / "journal.sqlite")
    sql = {"sla is not JSON": ("UPDATE sessions SET sla='{not json' WHERE id=?", ),
           "placement of another shape": ("UPDATE sessions SET placement='{\"foo\": 1}' WHERE id=?", ),
           "an unknown class": ("UPDATE sessions SET sla='{\"class\": \"bogus\"}' WHERE id=?", ),
           "a message's extra is not JSON": ("UPDATE messages SET extra='{bad' WHERE session=?", )}[damage]
    db.execute(sql[0], (bad,))
    db.commit()
    db.close()
    logs: list[str] = []
    d = make_daemon(tiny_llama, tmp_path / "data", log_fn=logs.append)
    try:
        assert [s["id"] for s in d.list_sessions()] == [keep]
        run_turn(d, keep, "And again")
        with pytest.raises(Conflict):
            d.get_session(bad)
        assert (tmp_path / "data" / "kv" / f"{bad}.kv").exists()
        assert any(bad in m and "not recovered" in m for m in logs)
    finally:
        d.shutdown()


def test_a_damaged_journal_file_is_named_with_what_to_do(tiny_llama, tmp_path):
    from weaved.errors import WeaveError

    d = make_daemon(tiny_llama, tmp_path / "data")
    run_turn(d, d.create_session(SLA(SLAClass.INTERACTIVE))["id"], "Hello")
    d.shutdown()
    path = tmp_path / "data" / "journal.sqlite"
    raw = bytearray(path.read_bytes())
    raw[100:4096] = b"\xff" * (4096 - 100)  # the header's page past the magic: SQLite calls it malformed
    path.write_bytes(bytes(raw))
    with pytest.raises(WeaveError, match=r"journal .*journal\.sqlite is damaged .*move it aside"):
        make_daemon(tiny_llama, tmp_path / "data")


def test_a_kv_file_removed_while_the_daemon_runs_refuses_its_turns_in_words(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        run_turn(d, sid, "Hello")
        (tmp_path / "data" / "kv" / f"{sid}.kv").unlink()
        before = d.get_session(sid)["messages"]
        for text in ("Short", "And a long answer " * 300):  # within the room reserved so far, and past it
            with pytest.raises(Conflict, match="its KV file .* is gone .*delete the session, or restart"):
                run_turn(d, sid, text)  # refused at its start: nothing is kept of it
        assert d.get_session(sid)["messages"] == before
        other = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]  # the rest serve
        assert run_turn(d, other, "Hello")[0][-1]["type"] == "done"
    finally:
        d.shutdown()


def test_kv_files_without_their_journal_are_refused_not_swept(tiny_llama, tmp_path, caplog):
    """The journal removed while the daemon runs is said in the log at its next write; the next start
    finds KV files and no journal and refuses (it would have swept every session as no one's)."""
    from weaved.errors import WeaveError

    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.BATCH))["id"]
        run_turn(d, sid, "Hello")
        for f in (tmp_path / "data").glob("journal.sqlite*"):
            f.unlink()
        with caplog.at_level("ERROR", logger="weave.daemon"):
            run_turn(d, sid, "Again")
            run_turn(d, sid, "And again")
        said = [r.getMessage() for r in caplog.records if "was removed while the daemon runs" in r.getMessage()]
        assert len(said) == 1  # once
    finally:
        d.shutdown()
    with pytest.raises(WeaveError, match=r"holds 1 session KV file\(s\) but no journal .*move .*kv aside"):
        make_daemon(tiny_llama, tmp_path / "data")
    assert (tmp_path / "data" / "kv" / f"{sid}.kv").exists()  # nothing was swept


def test_a_new_data_directory_and_its_journal_are_the_users_alone(tiny_llama, tmp_path):
    old = os.umask(0o022)
    try:
        d = make_daemon(tiny_llama, tmp_path / "data")
        d.shutdown()
    finally:
        os.umask(old)
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "data" / "journal.sqlite").stat().st_mode & 0o777 == 0o600


def test_a_fork_cut_by_a_crash_before_it_was_complete_is_gone_at_the_next_start(tiny_llama, tmp_path):
    """A fork is recorded as being made until its context is copied: a daemon killed in between (the
    client never had its id) leaves no empty session claiming to be a fork - the next start removes its
    record and its file; the parent and a completed fork stay."""
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(d, sid, "Remember the number seven")
    done = d.fork_session(sid)["id"]

    class Killed(BaseException):
        pass

    def killed(*a, **k):  # the daemon dies while copying: nothing after it runs (no clean-up either)
        raise Killed

    d.delete_session = lambda cid: None
    d._fill_fork = killed
    with pytest.raises(Killed):
        d.fork_session(sid)
    cut = next(c for c in d.sessions if c not in (sid, done))
    assert d.journal.get(cut).status == "forking" and d.journal.get(done).status == "active"
    d.shutdown()
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert sorted(s["id"] for s in d2.list_sessions()) == sorted([sid, done])
        assert d2.journal.get(cut) is None and cut not in d2.store.session_ids()
        assert d2.get_session(done)["messages"] == d2.get_session(sid)["messages"]
    finally:
        d2.shutdown()
