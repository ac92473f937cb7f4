"""A data directory whose disk is full: the journal's writes and the KV files' fail as 507
(``insufficient_storage``), and a request that fails so changes nothing - no half-made session, no
message left in a transcript the journal does not hold - while the daemon goes on serving."""

from __future__ import annotations

import dataclasses
import os
import sqlite3

import pytest

from tests.daemon.support import GREEDY, run_turn
from weaved.daemon.journal import Journal, JournalFull
from weaved.errors import InsufficientStorage
from weaved.kv.errors import DiskFull
from weaved.routing.types import SLA, SLAClass


def fill_journal(j: Journal) -> None:
    """SQLite's own cap on the file's pages: the next page a write needs is refused as SQLITE_FULL,
    as a full disk refuses it."""
    with j._lock:
        j._db.execute("CREATE TABLE IF NOT EXISTS ballast (b BLOB)")
        (pages,) = j._db.execute("PRAGMA page_count").fetchone()
        j._db.execute(f"PRAGMA max_page_count={pages}")
        for size in (512, 64, 8, 0):  # the pages' own free room goes too
            try:
                for _ in range(100_000):
                    j._db.execute("INSERT INTO ballast VALUES (zeroblob(?))", (size,))
            except sqlite3.OperationalError:
                pass


def journal_full(*args, **kw):
    """What a journal write meets on a full disk."""
    raise JournalFull("the journal could not be written: its disk is full")


def stop_with_an_unrecorded_answer(tiny_llama, data, monkeypatch) -> tuple[str, str]:
    """A daemon on ``data`` whose second turn's answer the journal could not record, stopped with it still
    unrecorded (its disk full to the end); (the session, the answer's text as it was shown)."""
    from tests.daemon.support import make_daemon

    d = make_daemon(tiny_llama, data)
    try:
        sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        run_turn(d, sid, "Hello")
        monkeypatch.setattr(d.journal, "finish_message", journal_full)
        run_turn(d, sid, "And then?")
        return sid, d.get_session(sid)["messages"][-1]["content"]
    finally:
        d.shutdown()


def free_journal(j: Journal) -> None:
    with j._lock:
        j._db.execute("PRAGMA max_page_count=1073741823")


def test_a_full_journal_is_a_storage_error_and_keeps_nothing(tmp_path):
    j = Journal(tmp_path / "journal.db")
    j.create_session("s", {"class": "interactive"}, 512, None, None)
    fill_journal(j)
    big = "x" * 5000  # more than a page holds
    with pytest.raises(JournalFull, match="disk is full") as e:
        j.add_turn_input("s", [("user", "a", None, None), ("user", big, [1, 2], None)],
                         detached=({"detach": True}, 0))
    assert isinstance(e.value, InsufficientStorage) and e.value.status == 507
    assert j.get("s").messages == [] and j.detached() == []  # one transaction: nothing of it
    free_journal(j)
    j.add_turn_input("s", [("user", big, [1, 2], None)])
    assert [m["content"] for m in j.get("s").messages] == [big]


def test_a_turn_refused_by_a_full_journal_leaves_the_transcript_as_it_was(daemon):
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    before = daemon.get_session(sid)
    fill_journal(daemon.journal)
    try:
        with pytest.raises(JournalFull):
            run_turn(daemon, sid, "My secret word is PINEAPPLE. " * 150)
        with pytest.raises(JournalFull):  # nor can a session be made: none is left half-made
            daemon.create_session(SLA(SLAClass.INTERACTIVE), system="Be brief. " * 600)
    finally:
        free_journal(daemon.journal)
    after = daemon.get_session(sid)
    assert after["messages"] == before["messages"] and after["context_tokens"] == before["context_tokens"]
    assert [s["id"] for s in daemon.list_sessions()] == [sid]
    assert sorted(p.name for p in daemon.store.dir.glob("s-*.kv")) == [f"{sid}.kv"]
    events, _ = run_turn(daemon, sid, "Say B.")  # with room again, the session goes on
    assert events[-1]["type"] == "done"
    assert [m["role"] for m in daemon.get_session(sid)["messages"]] == ["user", "assistant"] * 2


def test_a_session_whose_kv_file_cannot_be_made_is_not_left_behind(daemon, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: full(fd, 0, n))
    with pytest.raises(DiskFull) as e:
        daemon.create_session(SLA(SLAClass.INTERACTIVE), max_context=256)
    assert e.value.status == 507 and e.value.to_dict()["error"]["code"] == "insufficient_storage"
    monkeypatch.undo()
    assert daemon.list_sessions() == [] and daemon.journal.list(with_tokens=False) == []


def test_a_fork_that_cannot_be_recorded_is_not_left_behind(daemon):
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "My secret word is PINEAPPLE. " * 150)
    fill_journal(daemon.journal)
    try:
        with pytest.raises(InsufficientStorage):
            daemon.fork_session(sid)
    finally:
        free_journal(daemon.journal)
    assert [s["id"] for s in daemon.list_sessions()] == [sid]
    assert [r.id for r in daemon.journal.list(with_tokens=False)] == [sid]
    child = daemon.fork_session(sid)["id"]  # with room again
    assert daemon.get_session(child)["context_tokens"] == daemon.get_session(sid)["context_tokens"]


def test_a_turn_the_disk_fails_before_its_first_token_is_taken_back(daemon, monkeypatch):
    """No room for its KV: the client gets the error, and the session is as if the turn was never asked
    - a retry sends it once (the same prompt as a session that never failed)."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    twin = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    for s in (sid, twin):
        run_turn(daemon, s, "Hello")
    before = daemon.get_session(sid)
    real = daemon.store.reserve

    def full(kv, n):
        if kv is daemon.sessions[sid].kv and n > before["context_tokens"] + 8:
            raise DiskFull(f"session {sid}: allocating positions: No space left on device")
        real(kv, n)

    monkeypatch.setattr(daemon.store, "reserve", full)
    events, _ = run_turn(daemon, sid, "Tell me everything about the sea. " * 20)
    assert events[-1]["type"] == "error" and events[-1]["status"] == 507
    monkeypatch.undo()
    after = daemon.get_session(sid)
    assert after["messages"] == before["messages"]
    assert [m["content"] for m in daemon.journal.get(sid).messages] == [m["content"] for m in before["messages"]]
    _, h = run_turn(daemon, sid, "And the sky?")
    _, h_twin = run_turn(daemon, twin, "And the sky?")
    assert h.prompt_tokens == h_twin.prompt_tokens


def test_a_journal_that_fills_mid_turn_fails_that_turn_only(daemon, monkeypatch):
    """The journal's disk fills while two turns decode in one step: the turn whose tokens could not be
    recorded fails (507), its session's KV, transcript and journal agreeing again; the other turn ends
    as it would have, and the failed session's next turn runs."""
    from tests.daemon.support import LONG, Stream

    a = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    b = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    real, calls = daemon.journal.commit_tokens, {"a": 0}

    def commit(sid, ids, new_length):
        if sid == a:
            calls["a"] += 1
            if calls["a"] > 3:
                raise JournalFull(f"session {sid}: the data directory's disk is full")
        return real(sid, ids, new_length)

    monkeypatch.setattr(daemon.journal, "commit_tokens", commit)
    sa, sb = Stream(), Stream()
    params = dataclasses.replace(LONG, max_tokens=40)
    daemon.start_turn(session_id=b, messages=[{"role": "user", "content": "Count."}], params=params, emit=sb)
    daemon.start_turn(session_id=a, messages=[{"role": "user", "content": "Count too."}], params=params, emit=sa)
    assert sa.done.wait(120) and sb.done.wait(120)
    assert sa.events[-1]["type"] == "error" and sa.events[-1].get("status") == 507
    assert sb.events[-1]["type"] == "done"
    assert sum(e["type"] == "token" for e in sb.events) == 40
    monkeypatch.setattr(daemon.journal, "commit_tokens", real)
    s = daemon.sessions[a]
    assert s.kv.length == len(s.committed) == daemon.journal.get(a).kv_length
    events, _ = run_turn(daemon, a, "Again.")
    assert events[-1]["type"] == "done"


def agree(daemon, sid: str) -> None:
    """The session's KV, its tokens in memory and the journal's agree (else every later commit fails)."""
    s = daemon.sessions[sid]
    assert s.kv.length == len(s.committed) == daemon.journal.get(sid).kv_length


def test_an_answer_the_journal_cannot_record_yet_is_recorded_once_it_can(daemon, monkeypatch):
    """The journal's disk fills as a turn ends: its tokens are committed, so the transcript shows the
    answer (the context holds it) and the journal gains it before the session's next turn - refused with
    a 507 that changes nothing while the disk is still full - so the roles keep alternating."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    real = daemon.journal.finish_message

    monkeypatch.setattr(daemon.journal, "finish_message", journal_full)
    events, _ = run_turn(daemon, sid, "And then?")
    assert events[-1]["type"] == "done"  # (the client had its answer streamed)
    shown = daemon.get_session(sid)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"] * 2
    assert [m["role"] for m in daemon.journal.get(sid).messages] == ["user", "assistant", "user"]
    # still full: the next turn, a fork and a rewind are refused, and nothing changes
    with pytest.raises(JournalFull):
        run_turn(daemon, sid, "And the sky?")
    with pytest.raises(JournalFull):
        daemon.fork_session(sid)
    with pytest.raises(JournalFull):
        daemon.rewind_session(sid, 1)
    agree(daemon, sid)
    assert daemon.get_session(sid) == shown
    monkeypatch.setattr(daemon.journal, "finish_message", real)
    events, _ = run_turn(daemon, sid, "And the sky?")
    assert events[-1]["type"] == "done"
    assert [m["role"] for m in daemon.journal.get(sid).messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in daemon.journal.get(sid).messages][:4] == \
        [m["content"] for m in shown["messages"]]
    agree(daemon, sid)


def test_an_answer_left_unrecorded_by_a_stop_comes_back_from_its_tokens(tiny_llama, tmp_path, monkeypatch):
    """A stop while the journal still lacks an answer (its disk full to the end): the next start finds
    the answer's committed tokens past the transcript's end and keeps them as the answer."""
    from tests.daemon.support import make_daemon

    sid, text = stop_with_an_unrecorded_answer(tiny_llama, tmp_path / "data", monkeypatch)
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        messages = d.get_session(sid)["messages"]  # (all but its last token, sampled and not fed: not kept)
        assert [m["role"] for m in messages] == ["user", "assistant"] * 2
        assert messages[-1]["content"] and text.startswith(messages[-1]["content"])
        agree(d, sid)
    finally:
        d.shutdown()


def test_a_start_on_a_full_disk_keeps_a_cut_answer_to_record_later(tiny_llama, tmp_path, monkeypatch):
    """The start records an answer a stop cut; on a full disk it cannot yet: the session shows it all the
    same (its tokens are committed), and the journal gains it before the session's next turn."""
    from tests.daemon.support import make_daemon

    sid, _ = stop_with_an_unrecorded_answer(tiny_llama, tmp_path / "data", monkeypatch)
    monkeypatch.setattr(Journal, "finish_message", journal_full)
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert [m["role"] for m in d.get_session(sid)["messages"]] == ["user", "assistant"] * 2
        assert [m["role"] for m in d.journal.get(sid).messages] == ["user", "assistant", "user"]
        monkeypatch.undo()
        events, _ = run_turn(d, sid, "And the sky?")
        assert events[-1]["type"] == "done"
        assert [(m["role"], m["finish_reason"]) for m in d.journal.get(sid).messages][2:4] == \
            [("user", None), ("assistant", "interrupted")]
        agree(d, sid)
    finally:
        d.shutdown()


def test_a_rewritten_history_the_journal_cannot_take_back_changes_nothing(daemon, monkeypatch):
    """A turn whose template rewrote the history re-feeds from the first changed token: the journal is
    cut first, so a full disk refuses the turn (507) with the KV, the tokens and the journal agreeing
    - not the KV cut and the journal not, which failed every later commit."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    daemon.sessions[sid].messages[-1]["content"] = "A different answer than the one the KV holds."
    before = daemon.get_session(sid)

    monkeypatch.setattr(daemon.journal, "truncate", journal_full)
    with pytest.raises(JournalFull):
        run_turn(daemon, sid, "And then?")
    monkeypatch.undo()
    agree(daemon, sid)
    assert daemon.get_session(sid) == before
    events, h = run_turn(daemon, sid, "And then?")
    assert events[-1]["type"] == "done" and h.reprefilled > 0
    agree(daemon, sid)


def test_a_continuation_refused_after_its_rewind_keeps_the_rewound_session(daemon, monkeypatch):
    """A turn continuing an earlier point of the transcript (a Responses chain's ``continues``) takes the
    session back first; a full disk then refusing its history rewrite leaves it taken back - memory,
    KV and journal agreeing - not its memory restored over a journal already cut."""
    from tests.daemon.support import run_to_end

    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    run_turn(daemon, sid, "And then?")
    daemon.sessions[sid].messages[1]["content"] = "A different answer than the one the KV holds."

    monkeypatch.setattr(daemon.journal, "truncate", journal_full)
    with pytest.raises(JournalFull):
        run_to_end(daemon, session_id=sid, messages=[{"role": "user", "content": "Again?"}], params=GREEDY,
                   continues=2)
    monkeypatch.undo()
    agree(daemon, sid)
    assert len(daemon.sessions[sid].messages) == len(daemon.journal.get(sid).messages) == 2
    events, _ = run_to_end(daemon, session_id=sid, messages=[{"role": "user", "content": "Again?"}], params=GREEDY)
    assert events[-1]["type"] == "done"
    agree(daemon, sid)
    assert len(daemon.sessions[sid].messages) == len(daemon.journal.get(sid).messages) == 4


def test_a_response_stored_after_an_unrecorded_answer_ends_past_it(daemon, monkeypatch):
    """A Responses answer the journal could not record, then stored once the disk has room: the answer is
    recorded first, so the stored response's end is past it (a continuation keeps it)."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    real = daemon.journal.finish_message

    monkeypatch.setattr(daemon.journal, "finish_message", journal_full)
    run_turn(daemon, sid, "Hello")
    monkeypatch.setattr(daemon.journal, "finish_message", real)
    daemon.store_response(sid, "resp_1", {"id": "resp_1"})
    assert daemon.response_end("resp_1") == 2 == len(daemon.journal.get(sid).messages)
    agree(daemon, sid)


def test_a_first_turn_whose_stored_prefix_cannot_be_recorded_changes_nothing(daemon, monkeypatch):
    """A new session's first turn starting with another's stored prefix: its rows are mapped, then named
    in the journal - which a full disk refuses (507), the rows going again, so the KV, the tokens and the
    journal agree; with room again the turn takes the prefix."""
    prompt = "Here is a long shared system prompt about the sea and the stars. " * 20
    first = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, first, prompt)
    daemon.sessions[first].publishing.wait(60)
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    real = daemon.journal.commit_tokens

    def full(id, *args, **kw):
        if id == sid:
            raise JournalFull("the journal could not be written: its disk is full")
        return real(id, *args, **kw)

    monkeypatch.setattr(daemon.journal, "commit_tokens", full)
    with pytest.raises(JournalFull):
        run_turn(daemon, sid, prompt)
    monkeypatch.undo()
    agree(daemon, sid)
    assert daemon.sessions[sid].kv.length == 0 and daemon.get_session(sid)["messages"] == []
    events, h = run_turn(daemon, sid, prompt)
    assert events[-1]["type"] == "done" and h.cached_tokens > 0
    agree(daemon, sid)


def test_a_promotion_the_journal_cannot_record_changes_nothing(daemon, monkeypatch):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    before = daemon.get_session(sid)

    def full(*args, **kw):
        raise DiskFull("the journal: No space left on device")

    monkeypatch.setattr(daemon.journal, "set_sla", full)
    with pytest.raises(DiskFull):
        daemon.promote(sid)
    monkeypatch.undo()
    assert daemon.get_session(sid) == before


def test_a_rewind_whose_rows_cannot_be_copied_still_leaves_memory_as_the_journal(daemon, monkeypatch):
    """A rewind cuts the journal, then takes the session's rows back from a shared prefix: a full disk
    there fails the rewind (507) with the session in memory cut as its journal is - not left longer,
    which failed every later commit."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    run_turn(daemon, sid, "And then?")

    def full(*args, **kw):
        raise DiskFull("allocating positions: No space left on device")

    monkeypatch.setattr(daemon.store, "unshare", full)
    with pytest.raises(DiskFull):
        daemon.rewind_session(sid, 1)
    monkeypatch.undo()
    agree(daemon, sid)
    assert len(daemon.sessions[sid].messages) == len(daemon.journal.get(sid).messages) == 2
    events, _ = run_turn(daemon, sid, "Again?")
    assert events[-1]["type"] == "done"
    agree(daemon, sid)


def test_a_system_prompt_the_journal_cannot_record_changes_nothing(daemon, monkeypatch):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, "You are a pirate.")["id"]
    monkeypatch.setattr(daemon.journal, "set_system", journal_full)
    with pytest.raises(JournalFull):
        daemon.set_system(sid, "You are a robot.")
    monkeypatch.undo()
    assert daemon.get_session(sid)["system"] == daemon.journal.get(sid).system == "You are a pirate."
