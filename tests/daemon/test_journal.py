"""Journal: round trip, atomic commits, kill -9 recovery (with and without KV files), concurrency."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import weaved
from tests.kv.test_store import CFG
from weaved.daemon.journal import Journal, JournalError
from weaved.kv.store import KVStore

SLA = {"class": "interactive", "ttft_ms": 500, "ttlt_s": 30}
PLACEMENT = {"prefill": "standard", "decode": "standard", "pool": "cpu-standard", "reasons": ["no GPU"]}
REPO_ROOT = str(Path(weaved.__file__).resolve().parents[1])


def test_round_trip(tmp_path):
    j = Journal(tmp_path / "journal.db")
    j.create_session("s1", SLA, 4096, "You are terse.", PLACEMENT)
    assert j.add_message("s1", "user", "hi", [1, 2, 3]) == 0
    j.commit_tokens("s1", [1, 2, 3], 3)
    j.commit_tokens("s1", [70000, -1], 5)  # any int32
    assert j.finish_message("s1", "assistant", "hello") == 1
    j.set_status("s1", "paused")
    j.set_sla("s1", {**SLA, "class": "background"})
    j.set_placement("s1", None)
    j.close()

    j = Journal(tmp_path / "journal.db")
    r = j.get("s1")
    assert r is not None
    assert (r.id, r.max_context, r.system) == ("s1", 4096, "You are terse.")
    assert (r.status, r.placement) == ("paused", None)
    assert r.sla["class"] == "background" and r.sla["ttft_ms"] == 500
    assert r.tokens == [1, 2, 3, 70000, -1] and r.kv_length == 5
    assert [(m["role"], m["content"], m["token_ids"], m["kv_at"]) for m in r.messages] == [
        ("user", "hi", [1, 2, 3], 0), ("assistant", "hello", None, 5),
    ]
    assert r.created <= r.updated
    assert j.get("nope") is None
    with pytest.raises(KeyError):
        j.set_status("nope", "x")
    with pytest.raises(KeyError):
        j.commit_tokens("nope", [1], 1)
    with pytest.raises(ValueError, match="already exists"):
        j.create_session("s1", SLA, 1, None, None)


def test_commit_is_atomic_and_checked(tmp_path):
    j = Journal(tmp_path / "j.db")
    j.create_session("s", SLA, 100, None, PLACEMENT)
    j.commit_tokens("s", [5, 6], 2)
    with pytest.raises(ValueError, match="cannot reach 4"):
        j.commit_tokens("s", [7], 4)  # caller and journal disagree: nothing changes
    r = j.get("s")
    assert r.tokens == [5, 6] and r.kv_length == 2
    j.commit_tokens("s", [], 2)  # an empty commit is a no-op
    # A failure inside the transaction (after the token row is inserted) rolls back both writes.
    j._db.execute(
        "CREATE TRIGGER boom BEFORE UPDATE OF kv_length ON sessions BEGIN SELECT RAISE(ABORT, 'x'); END"
    )
    with pytest.raises(sqlite3.IntegrityError):
        j.commit_tokens("s", [7, 8], 4)
    j._db.execute("DROP TRIGGER boom")
    r = j.get("s")
    assert r.tokens == [5, 6] and r.kv_length == 2
    j.commit_tokens("s", [7, 8], 4)
    assert j.get("s").tokens == [5, 6, 7, 8]


def test_truncate(tmp_path):
    j = Journal(tmp_path / "j.db")
    j.create_session("s", SLA, 100, None, None)
    for start in range(0, 12, 3):
        j.commit_tokens("s", list(range(start, start + 3)), start + 3)
    j.truncate("s", 7)  # inside the row starting at 6
    r = j.get("s")
    assert r.tokens == list(range(7)) and r.kv_length == 7
    j.commit_tokens("s", [100, 101], 9)
    assert j.get("s").tokens == [*range(7), 100, 101]
    j.truncate("s", 6)  # on a row boundary
    assert j.get("s").tokens == list(range(6))
    with pytest.raises(ValueError):
        j.truncate("s", 7)
    j.truncate("s", 0)
    assert j.get("s").tokens == [] and j.get("s").kv_length == 0


def test_delete_and_list(tmp_path):
    j = Journal(tmp_path / "j.db")
    for i in range(3):
        j.create_session(f"s{i}", SLA, 100, None, None)
        j.add_message(f"s{i}", "user", "x", [1])
        j.commit_tokens(f"s{i}", [1, 2], 2)
    j.delete("s1")
    j.delete("s1")  # idempotent
    assert [r.id for r in j.list()] == ["s0", "s2"]
    assert j.get("s1") is None
    assert j._db.execute("SELECT COUNT(*) FROM tokens WHERE session='s1'").fetchone()[0] == 0
    assert j._db.execute("SELECT COUNT(*) FROM messages WHERE session='s1'").fetchone()[0] == 0
    light = j.list(with_tokens=False)
    assert [(r.kv_length, r.tokens) for r in light] == [(2, []), (2, [])]
    j.create_session("s1", SLA, 100, None, None)  # the id can be reused, empty
    assert j.get("s1").tokens == [] and j.get("s1").messages == []


def test_refuses_newer_schema(tmp_path):
    path = tmp_path / "j.db"
    Journal(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(JournalError, match="schema version 99"):
        Journal(path)


def test_answers_keep_their_finish_reason_and_old_journals_are_upgraded(tmp_path):
    path = tmp_path / "j.db"
    j = Journal(path)
    j.create_session("s1", SLA, 64, None, None)
    j.add_message("s1", "user", "hi", [1])
    j.finish_message("s1", "assistant", "cut", [2], finish_reason="interrupted")
    j.close()
    assert [m["finish_reason"] for m in Journal(path).get("s1").messages] == [None, "interrupted"]

    old = tmp_path / "v1.db"  # a journal written before answers had a finish reason
    db = sqlite3.connect(old)
    db.executescript("""
        CREATE TABLE sessions (id TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL, sla TEXT NOT NULL,
            max_context INTEGER NOT NULL, system TEXT, placement TEXT, status TEXT NOT NULL,
            kv_length INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE messages (session TEXT NOT NULL, seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
            token_ids BLOB, kv_at INTEGER NOT NULL, created REAL NOT NULL, PRIMARY KEY (session, seq)) WITHOUT ROWID;
        CREATE TABLE tokens (session TEXT NOT NULL, start INTEGER NOT NULL, ids BLOB NOT NULL,
            PRIMARY KEY (session, start)) WITHOUT ROWID;
        INSERT INTO sessions VALUES ('s0', 1, 1, '{"class": "batch"}', 64, NULL, NULL, 'active', 0);
        INSERT INTO messages VALUES ('s0', 0, 'user', 'hello', NULL, 0, 1);
        PRAGMA user_version=1;
    """)
    db.close()
    j = Journal(old)
    assert [(m["content"], m["finish_reason"]) for m in j.get("s0").messages] == [("hello", None)]
    j.finish_message("s0", "assistant", "hi", None, "stop")
    assert j.get("s0").messages[-1]["finish_reason"] == "stop"
    j.close()


def test_concurrent_reads_during_writes(tmp_path):
    path = tmp_path / "j.db"
    j = Journal(path)
    j.create_session("s", SLA, 100000, None, None)
    other = Journal(path)  # a second connection, as another process would have
    n_commits, errors = 300, []

    def writer():
        for i in range(n_commits):
            j.commit_tokens("s", [2 * i, 2 * i + 1], 2 * i + 2)

    def reader(journal: Journal):
        try:
            for _ in range(100):
                r = journal.get("s")
                assert r.kv_length == len(r.tokens) and r.tokens == list(range(r.kv_length))
        except Exception as e:  # reported on the main thread
            errors.append(e)

    readers = [threading.Thread(target=reader, args=(x,)) for x in (j, j, other)]
    threads = [threading.Thread(target=writer), *readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert other.get("s").kv_length == 2 * n_commits


WRITER = """
import sys
from pathlib import Path
from weaved.daemon.journal import Journal

journal = Journal(Path(sys.argv[1]))
sessions = [f"s{i}" for i in range(3)]
for s in sessions:
    journal.create_session(s, {"class": "batch"}, 10**6, "sys", None)
length = dict.fromkeys(sessions, 0)
for turn in range(2000):  # bounded, in case the kill never comes
    for k, s in enumerate(sessions):
        journal.add_message(s, "user", f"turn {turn}", [turn, k])
        for _ in range(4):
            ids = [length[s] * 3 + k + i * 3 for i in range(3)]  # token at position p is 3p + k
            journal.commit_tokens(s, ids, length[s] + 3)
            length[s] += 3
        journal.finish_message(s, "assistant", f"reply {turn}")
    print(turn, flush=True)
"""


def run_until_killed(script: str, args: list[str], turns: int) -> None:
    """Start a writer, let it finish ``turns`` turns, then SIGKILL it mid-way through the next ones."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        for line in proc.stdout:
            if int(line) >= turns:
                break
        time.sleep(0.05)  # let it run on so the kill lands at an arbitrary point of a turn
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the writer ended before it was killed"


def test_kill_9_recovers_every_session(tmp_path):
    path = tmp_path / "j.db"
    run_until_killed(WRITER, [str(path)], turns=30)
    wal = Path(str(path) + "-wal")
    assert wal.exists() and wal.stat().st_size > 0  # killed before any clean close: commits are in the WAL

    j = Journal(path)
    records = j.list()
    assert [r.id for r in records] == ["s0", "s1", "s2"]
    for k, r in enumerate(records):
        assert r.kv_length == len(r.tokens) and r.kv_length % 3 == 0
        assert r.tokens == [3 * p + k for p in range(r.kv_length)]
        roles = [m["role"] for m in r.messages]
        n_turns = (len(roles) + 1) // 2
        assert n_turns >= 30
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)
        for m in r.messages:
            turn = m["seq"] // 2
            assert m["content"] == (f"turn {turn}" if m["role"] == "user" else f"reply {turn}")
            if m["role"] == "user":
                assert m["token_ids"] == [turn, k] and m["kv_at"] == 12 * turn
        # Finished turns committed all their 12 tokens; an unfinished one somewhere between 0 and 12.
        finished = len(roles) // 2
        assert 12 * finished <= r.kv_length <= 12 * n_turns
    j.create_session("after", SLA, 10, None, None)  # the recovered journal is writable


KV_WRITER = """
import sys
from pathlib import Path
from weaved.daemon.journal import Journal
from weaved.kv.store import KVStore
from weaved.model.config import ModelConfig, RopeSpec, RopeStyle

CFG = ModelConfig("llama", "tiny", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=256,
                  vocab_size=100, context_length=4096, rms_eps=1e-5, rope_style=RopeStyle.NORM, rope=RopeSpec(base=1e4))

data = Path(sys.argv[1])
journal, store = Journal(data / "journal.db"), KVStore(data, CFG, chunk=16)
kvs = {}
for s in ("a", "b"):
    journal.create_session(s, {"class": "batch"}, 4096, None, None)
    kvs[s] = store.create(s, 4096)
for step in range(1500):  # bounded: 2 tokens per step, capacity 4096
    for k, (s, kv) in enumerate(kvs.items()):
        ids = [kv.length * 2 + k, kv.length * 2 + k + 2]  # token at position p is 2p + k
        n = kv.length + 2
        store.reserve(kv, n)
        for i, t in enumerate(ids):
            kv.data[:, :, :, kv.length + i] = t  # the rows a forward pass would write
        kv.length = n
        journal.commit_tokens(s, ids, n)  # only after the rows are written
    print(step, flush=True)
"""


def test_kill_9_keeps_kv_files_and_journal_consistent(tmp_path):
    run_until_killed(KV_WRITER, [str(tmp_path)], turns=100)
    j, store = Journal(tmp_path / "journal.db"), KVStore(tmp_path, CFG, chunk=16)
    for k, r in enumerate(j.list()):
        assert r.kv_length == len(r.tokens) >= 200
        assert r.tokens == [2 * p + k for p in range(r.kv_length)]
        kv = store.open(r.id, r.kv_length)  # resume from the last committed token, nothing recomputed
        rows = kv.data[:, :, :, : r.kv_length]  # [L, 2, Hkv, kv_length, D]
        expected = np.asarray(r.tokens, dtype=np.float16)[None, None, None, :, None]
        assert np.array_equal(rows, np.broadcast_to(expected, rows.shape))


def test_an_answer_keeps_its_parsed_form_across_a_restart(tmp_path):
    from weaved.daemon.turns import message_extra

    j = Journal(tmp_path / "j.db")
    j.create_session("s1", {"class": "interactive"}, 4096, None, None)
    parsed = {"content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "f", "arguments": "{}"}}]}
    j.finish_message("s1", "assistant", '{"tool_calls": [...]}', [1, 2], "stop", extra={"answer": parsed})
    j.close()
    m = Journal(tmp_path / "j.db").get("s1").messages[-1]
    assert m["content"] == '{"tool_calls": [...]}' and message_extra(m) == {"answer": parsed}


def test_a_rewind_drops_later_messages_and_tokens_and_responses_keep_their_end(tmp_path):
    path = tmp_path / "j.db"
    j = Journal(path)
    j.create_session("s", SLA, 100, None, None)
    j.add_message("s", "user", "one", None)
    j.commit_tokens("s", [1, 2, 3], 3)
    j.finish_message("s", "assistant", "a", None, "stop")
    j.add_response("resp_1", "s", {"id": "resp_1"}, messages=2)
    j.add_message("s", "user", "orphan", None)
    j.commit_tokens("s", [4, 5], 5)
    j.finish_message("s", "assistant", "cut", None, "interrupted")
    j.rewind("s", 2, 3)
    j.close()
    j = Journal(path)
    r = j.get("s")
    assert [m["content"] for m in r.messages] == ["one", "a"] and r.tokens == [1, 2, 3] and r.kv_length == 3
    assert j.response_end("resp_1") == 2 and j.response_end("resp_nope") is None


def test_a_version_3_journal_gains_the_responses_end_and_the_forks_parent(tmp_path):
    old = tmp_path / "v3.db"
    j = Journal(old)
    j.create_session("s", SLA, 100, None, None)
    j.close()
    db = sqlite3.connect(old)  # as Weave wrote it before responses recorded their end and forks their parent
    db.executescript("""
        ALTER TABLE sessions DROP COLUMN forked_from;
        DROP TABLE detached;
        DROP TABLE responses;
        CREATE TABLE responses (id TEXT PRIMARY KEY, session TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL);
        INSERT INTO responses VALUES ('resp_old', 's', 1, '{"id": "resp_old"}');
        PRAGMA user_version=3;
    """)
    db.close()
    j = Journal(old)
    assert j.get_response("resp_old") == ("s", {"id": "resp_old"}) and j.response_end("resp_old") is None
    j.add_response("resp_new", "s", {"id": "resp_new"}, messages=0)
    assert j.response_end("resp_new") == 0
    assert j.get("s").forked_from is None
    j.create_session("f", SLA, 100, None, None, forked_from="s")
    assert j.get("f").forked_from == "s"


def test_a_version_4_journal_gains_the_detached_turns(tmp_path):
    old = tmp_path / "v4.db"
    j = Journal(old)
    j.create_session("s", SLA, 100, None, None)
    j.close()
    db = sqlite3.connect(old)  # as Weave wrote it before detached turns were journaled
    db.executescript("DROP TABLE detached; PRAGMA user_version=4;")
    db.close()
    j = Journal(old)
    assert j.detached() == []
    j.set_detached("s", {"messages": [{"role": "user", "content": "go"}], "detach": True}, 2)
    assert j.detached() == [("s", {"messages": [{"role": "user", "content": "go"}], "detach": True}, 2)]


def test_detached_turns_are_kept_until_dropped_and_go_with_their_session(tmp_path):
    j = Journal(tmp_path / "j.db")
    for sid in ("a", "b"):
        j.create_session(sid, SLA, 100, None, None)
    j.set_detached("a", {"n": 1}, 0)
    j.set_detached("b", {"n": 2}, 4)
    j.set_detached("a", {"n": 3}, 2)  # run again: the same session's record replaced
    j.close()
    j = Journal(tmp_path / "j.db")  # (across a restart)
    assert sorted(j.detached()) == [("a", {"n": 3}, 2), ("b", {"n": 2}, 4)]
    j.drop_detached("a")
    j.delete("b")
    assert j.detached() == []
