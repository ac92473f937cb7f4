"""Detached turns in the journal: kept while they run, dropped when they end, returned after a stop
that cut one, and dropped as stale when the transcript no longer ends with the cut turn."""

from __future__ import annotations

import threading

import pytest

from tests.daemon.support import LONG, make_daemon, run_to_end, run_turn
from weaved.engine.sampling import SamplingParams
from weaved.errors import Overloaded
from weaved.routing.types import SLA, SLAClass

TASK = [{"role": "user", "content": "Count to a thousand"}]
BODY = {"messages": TASK, "detach": True}


def _detached_turn(d, sid: str, params, on_event=None) -> threading.Event:
    done = threading.Event()

    def emit(ev: dict) -> None:
        if on_event is not None:
            on_event(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    d.start_turn(session_id=sid, messages=TASK, params=params, emit=emit, detached=BODY)
    return done


def _cut_by_a_stop(model, data) -> str:
    """A session with one turn, then a detached one that a stop cuts after its first token: its id."""
    d = make_daemon(model, data)
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    run_turn(d, sid, "Hello")
    first_token = threading.Event()
    _detached_turn(d, sid, LONG, lambda ev: ev["type"] == "token" and first_token.set())
    assert first_token.wait(120)
    d.shutdown()
    return sid


def test_a_detached_turn_that_ends_leaves_no_record(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
        assert _detached_turn(d, sid, SamplingParams(max_tokens=4, temperature=0)).wait(120)
        assert d.journal.detached() == [] and d.cut_detached_turns() == []
    finally:
        d.shutdown()


def test_a_detached_turn_cut_by_a_stop_is_returned_after_the_restart(tiny_llama, tmp_path):
    logs: list[str] = []
    d = make_daemon(tiny_llama, tmp_path / "data", log_fn=logs.append)
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    run_turn(d, sid, "Hello")  # a turn before it: the record says where the transcript stood
    first_token = threading.Event()
    done = _detached_turn(d, sid, LONG, lambda ev: ev["type"] == "token" and first_token.set())
    assert first_token.wait(120)
    d.shutdown()  # the turn ends "shutdown": cut, so its record stays
    assert done.is_set()
    said = f"stopped: 1 session turn(s) ended as 'shutdown' ({sid}); the 1 detached one(s) run again at the next start"
    assert said in logs  # said at the stop
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert d2.get_session(sid)["messages"][-1]["finish_reason"] == "shutdown"
        assert d2.cut_detached_turns() == [(sid, BODY, 2)]
    finally:
        d2.shutdown()


def test_a_record_that_no_longer_matches_the_transcript_is_dropped(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    run_turn(d, sid, "Hello")  # ended normally: a record for it would take this turn back
    d.journal.set_detached(sid, BODY, 0)
    d.shutdown()
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert d2.cut_detached_turns() == [] and d2.journal.detached() == []
        assert len(d2.get_session(sid)["messages"]) == 2
    finally:
        d2.shutdown()


def test_a_session_taken_back_before_its_turn_ran_again_still_runs_it(tiny_llama, tmp_path):
    """A crash after the rewind and before the turn started again: the record still holds."""
    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
    run_turn(d, sid, "Hello")
    d.journal.set_detached(sid, BODY, 2)  # where the transcript stands: before the turn
    d.shutdown()
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert d2.cut_detached_turns() == [(sid, BODY, 2)]
    finally:
        d2.shutdown()


def test_a_cut_detached_turn_runs_again_on_a_session_whose_kv_file_was_lost(tiny_llama, tmp_path):
    """Its session is rebuilt from the journal; the turn's cut answer is taken back (from the tokens
    only: nothing is in its new KV yet) and the turn runs again over the rebuilt context."""
    sid = _cut_by_a_stop(tiny_llama, tmp_path / "data")
    (tmp_path / "data" / "kv" / f"{sid}.kv").unlink()
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        ((cut_sid, body, n),) = d2.cut_detached_turns()
        assert cut_sid == sid and n == 2
        events, _ = run_to_end(d2, session_id=sid, messages=TASK, params=SamplingParams(max_tokens=4, temperature=0),
                               continues=n, detached=body)
        assert events[-1]["type"] == "done"
        info = d2.get_session(sid)
        assert [m["role"] for m in info["messages"]] == ["user", "assistant"] * 2
        assert info["messages"][-1]["finish_reason"] == "length"
    finally:
        d2.shutdown()


def test_a_cut_detached_turn_refused_when_it_runs_again_keeps_its_partial_answer(tiny_llama, tmp_path):
    """Running a cut turn again takes its session back to before it - only once the turn is accepted: a
    refusal (a full pool) leaves the transcript, its journal and the cut answer as they were."""
    sid = _cut_by_a_stop(tiny_llama, tmp_path / "data")
    d2 = make_daemon(tiny_llama, tmp_path / "data")
    try:
        ((_, body, n),) = d2.cut_detached_turns()
        before, tokens = d2.get_session(sid)["messages"], list(d2.sessions[sid].committed)

        def full(*args, **kw):
            raise Overloaded("the pool is full", retry_after_s=5.0)

        d2._admit = full
        with pytest.raises(Overloaded):
            d2.start_turn(session_id=sid, messages=TASK, params=LONG, emit=lambda ev: None, continues=n, detached=body)
        assert d2.get_session(sid)["messages"] == before and before[-1]["finish_reason"] == "shutdown"
        assert d2.sessions[sid].committed == tokens and d2.sessions[sid].kv.length == len(tokens)
        assert len(d2.journal.get(sid).messages) == len(before)
        del d2._admit  # room again: it runs from before the cut turn
        events, _ = run_to_end(d2, session_id=sid, messages=TASK, params=SamplingParams(max_tokens=4, temperature=0),
                               continues=n, detached=body)
        assert events[-1]["type"] == "done" and len(d2.get_session(sid)["messages"]) == n + len(TASK) + 1
    finally:
        d2.shutdown()
