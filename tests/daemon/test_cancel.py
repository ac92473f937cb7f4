"""Cancelled and deleted turns: the stream ends, the file goes, the transcript keeps an answer, and the
next turn waits for the cancel instead of a conflict."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from tests.daemon.support import GREEDY, LONG, Stream, run_turn
from weaved.errors import NotFound
from weaved.routing.types import SLA, SLAClass


def test_deleting_a_session_mid_turn_ends_its_stream_and_its_file(daemon):
    for round_ in range(4):  # the race was intermittent: several times, each ending cleanly
        sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
        stream = Stream(hold=True)
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count to a thousand"}],
                          params=LONG, emit=stream)
        assert stream.first.wait(60)
        # the engine thread waits in the stream's next token until the session and its journal record
        # are gone, so the cancel lands after them (the order that used to leave streams open)
        daemon.delete_session(sid)
        stream.go.set()
        assert stream.done.wait(60), f"round {round_}: the stream never ended"
        end = stream.events[-1]
        assert end["type"] == "done" and end["finish_reason"] == "cancelled"
        assert sum(ev["type"] in ("done", "error") for ev in stream.events) == 1
        with pytest.raises(NotFound):
            daemon.get_session(sid)
        assert sid not in [r.id for r in daemon.journal.list(with_tokens=False)]
        maps = Path("/proc/self/maps").read_text()
        assert f"{sid}.kv" not in maps  # the file's mapping went with the session, not at collection


def test_a_delete_that_reaches_the_engine_before_the_turn_still_cancels_it(daemon):
    """The turn is registered under the lock, sent to its engine after it: a delete in between sends its
    cancel first, and the engine takes that cancel before the sequence arrives."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    engine = daemon.engines[daemon.sessions[sid].pool]
    submit = engine.submit

    def late(seq):
        daemon.delete_session(sid)
        deadline = time.monotonic() + 30
        while engine.has_work() and time.monotonic() < deadline:  # the engine thread takes the cancel
            time.sleep(0.001)
        submit(seq)

    engine.submit = late
    try:
        stream = Stream()
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count"}], params=LONG, emit=stream)
        assert stream.done.wait(60), "the stream never ended"
    finally:
        engine.submit = submit
    assert [ev["type"] for ev in stream.events] == ["done"] and stream.events[-1]["finish_reason"] == "cancelled"


def test_a_turn_cancelled_before_its_first_token_still_leaves_an_answer(daemon):
    """Cancelled in its prefill: an empty answer marked cancelled, so the transcript's roles keep
    alternating (a template like Gemma's refuses two user turns in a row) and the next turn runs."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    engine = daemon.engines[daemon.sessions[sid].pool]
    submit = engine.submit

    def cancelled_first(seq):
        daemon.cancel_turn(sid)
        submit(seq)

    engine.submit = cancelled_first
    try:
        stream = Stream()
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count"}], params=LONG, emit=stream)
        assert stream.done.wait(60)
    finally:
        engine.submit = submit
    assert stream.events[-1]["finish_reason"] == "cancelled" and stream.events[-1]["usage"]["completion_tokens"] == 0
    msgs = daemon.get_session(sid)["messages"]
    assert [(m["role"], m["content"], m.get("finish_reason")) for m in msgs] == [
        ("user", "Count", None), ("assistant", "", "cancelled")]
    ev, _ = run_turn(daemon, sid, "Again")
    assert ev[-1]["type"] == "done"
    assert [m["role"] for m in daemon.get_session(sid)["messages"]] == ["user", "assistant", "user", "assistant"]


def test_a_turn_right_after_a_cancel_waits_for_it_instead_of_conflict(daemon):
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE, 500, None))["id"]
    stream = Stream()
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count to a thousand"}],
                      params=LONG, emit=stream)
    assert stream.first.wait(60)
    daemon.cancel_turn(sid)  # the client hung up ...
    events, _ = run_turn(daemon, sid, "Just say hi")  # ... and came straight back: accepted
    assert stream.events[-1]["finish_reason"] == "cancelled"
    assert events[-1]["type"] == "done" and events[-1]["finish_reason"] != "cancelled"
    roles = [m["role"] for m in daemon.get_session(sid)["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]  # the cut answer, then the new turn's


def test_a_turn_still_generating_is_not_interrupted_by_a_second(daemon):
    from weaved.errors import Conflict

    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    stream = Stream()
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count to a thousand"}],
                      params=LONG, emit=stream)
    assert stream.first.wait(60)
    with pytest.raises(Conflict) as e:
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "hi"}], params=GREEDY,
                          emit=lambda ev: None)
    assert e.value.retryable  # (it ends by itself: the answer advises a retry)
    daemon.cancel_turn(sid)
    assert stream.done.wait(60)


def test_a_turn_promoted_while_it_runs_reports_the_placement_it_ends_under(daemon):
    """The API's finishing chunk reads the turn's placement as it is then: a promotion moves a running
    turn at the next step, so its answer must not claim the class it started with."""
    sid = daemon.create_session(SLA(SLAClass.BATCH))["id"]
    stream = Stream(hold=True)
    handle = daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count to a thousand"}],
                               params=LONG, emit=stream)
    assert stream.first.wait(60)
    started = handle.placement
    promoted = daemon.promote(sid)["placement"]
    assert handle.placement_now() == promoted and promoted["priority"] > started["priority"]
    assert handle.placement == started  # (the turn's start, as the first chunk said)
    daemon.cancel_turn(sid)
    stream.go.set()
    assert stream.done.wait(60)


def test_a_cancel_that_lands_as_its_turn_ends_does_not_cancel_the_next(daemon):
    """The client hangs up during the step that ends its turn, and its session's next turn reaches the
    engine before that step is over: the cancel was for the turn that ended, so the next one runs."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    engine = daemon.engines[daemon.sessions[sid].pool]
    step, submitted, armed = engine.step, threading.Event(), []

    def slow_step():
        step()
        if armed:  # the rest of a busy step: the next turn arrives meanwhile
            armed.clear()
            submitted.wait(30)

    engine.step = slow_step
    first = Stream(hold=True)
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "hi"}], emit=first,
                      params=dataclasses.replace(GREEDY, max_tokens=1))
    assert first.first.wait(60)
    armed.append(True)
    daemon.cancel_turn(sid)
    first.go.set()
    assert first.done.wait(60)
    second = Stream()
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "again"}], params=GREEDY, emit=second)
    submitted.set()
    assert second.done.wait(60)
    assert second.events[-1]["finish_reason"] == "length" and second.events[-1]["usage"]["completion_tokens"] == 12


def test_a_turns_own_cancel_never_reaches_the_sessions_next_turn(daemon):
    """A handle's cancel is for its turn: once that turn has ended and the session runs another, it
    does nothing (a client that hung up late must not cancel the turn of the one that came back)."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    _, old = run_turn(daemon, sid, "hi")
    stream = Stream(hold=True)
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "again"}], params=GREEDY, emit=stream)
    assert stream.first.wait(60)
    old.cancel()
    stream.go.set()
    assert stream.done.wait(60)
    assert stream.events[-1]["finish_reason"] == "length"
