"""Stored Responses chains in the daemon: a continuation starts from its response's end, so a turn no
stored response holds (cut by a crash, cancelled, or posted to the session directly) is not in its
context - and the rewind outlives a restart.  A chain (or session) of another model is named as such."""

from __future__ import annotations

import threading

import pytest

from tests.daemon.support import GREEDY, LONG, Stream, make_daemon, recent_events, run_turn
from weaved.daemon.core import Daemon
from weaved.errors import Conflict, NotFound
from weaved.routing.types import SLA, SLAClass


def _continue(d: Daemon, sid: str, text: str, continues: int) -> list[dict]:
    done, events = threading.Event(), []

    def emit(ev: dict) -> None:
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    d.start_turn(session_id=sid, messages=[{"role": "user", "content": text}], params=GREEDY, emit=emit,
                 continues=continues)
    assert done.wait(120), "turn did not finish"
    return events


def _answer(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "token")


def test_a_continuation_drops_the_turns_past_its_response(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        chain = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        plain = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        for sid in (chain, plain):
            run_turn(d, sid, "Name a colour.")
        d.store_response(chain, "resp_1", {"id": "resp_1"})
        end = d.response_end("resp_1")
        assert end == 2
        run_turn(d, chain, "A turn the client never saw.")  # e.g. its response was lost to a crash
        assert len(d.get_session(chain)["messages"]) == 4
        answer = _answer(_continue(d, chain, "And another?", end))
        expected = _answer(run_turn(d, plain, "And another?")[0])
        assert answer == expected  # the context held the chain only: the same bits as a session without it
        got = d.get_session(chain)
        assert [m["content"] for m in got["messages"][:3]] == ["Name a colour.",
                                                                d.get_session(plain)["messages"][1]["content"],
                                                                "And another?"]
        assert got["context_tokens"] == d.get_session(plain)["context_tokens"]
        seen = recent_events(d, 50)
        assert [ev["messages"] for ev in seen if ev.get("type") == "rewind"] == [2]
        # a continuation at the session's end drops nothing
        before = d.get_session(chain)["messages"]
        d.store_response(chain, "resp_2", {"id": "resp_2"})
        _continue(d, chain, "Thanks.", d.response_end("resp_2"))
        assert d.get_session(chain)["messages"][:len(before)] == before
    finally:
        d.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")  # the rewind was journalled
    try:
        msgs = d.get_session(chain)["messages"]
        assert [m["content"] for m in msgs][2:] == ["And another?", msgs[3]["content"], "Thanks.", msgs[5]["content"]]
        assert "A turn the client never saw." not in [m["content"] for m in msgs]
    finally:
        d.shutdown()


def test_a_session_of_another_model_is_named_not_denied(tiny_llama, tiny_qwen2, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.BATCH))["id"]
        d.store_response(sid, "resp_1", {"id": "resp_1"})
    finally:
        d.shutdown()
    other = make_daemon(tiny_qwen2, tmp_path / "data")  # the same data directory, another model
    try:
        for call in (lambda: other.get_session(sid), lambda: other.get_response("resp_1")):
            with pytest.raises(Conflict, match="this daemon did not recover.*made for model"):
                call()
        with pytest.raises(NotFound):
            other.get_session("s-nope")
        assert other.list_sessions() == []
    finally:
        other.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")  # and back: nothing was lost
    try:
        assert d.get_response("resp_1")[0] == sid
    finally:
        d.shutdown()


def test_a_session_of_another_model_goes_when_deleted_by_its_id(tiny_llama, tiny_qwen2, tmp_path):
    """Named in the status, and deleted when asked by its id: its journal records and files go."""
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.BATCH))["id"]
        d.store_response(sid, "resp_1", {"id": "resp_1"})
    finally:
        d.shutdown()
    other = make_daemon(tiny_qwen2, tmp_path / "data")
    try:
        (u,) = other.status()["unrecovered"]
        assert u["id"] == sid and "made for model" in u["reason"]
        assert sid not in u["reason"] and "{" not in u["reason"]  # said once, no Python dict
        assert u["reason"].endswith("serve that model again to bring it back")
        other.delete_session(sid)
        assert other.status()["unrecovered"] == [] and not list((tmp_path / "data").rglob(f"{sid}*"))
        with pytest.raises(NotFound):
            other.get_session(sid)
    finally:
        other.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert d.list_sessions() == []
        with pytest.raises(NotFound):
            d.get_response("resp_1")
    finally:
        d.shutdown()


def test_a_session_rewound_to_a_turn_answers_the_next_as_it_did_then(tiny_llama, tmp_path):
    """Rewinding drops the later turns from the transcript, the journal and the KV: asked again, the next
    turn answers what it answered the first time (the context is exactly the first turn's), and a restart
    finds the rewound session.  Turn 0 empties it; a turn out of range or a running turn is refused."""
    from weaved.errors import InvalidRequest

    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BATCH))["id"]
    run_turn(d, sid, "Hello")
    after_first = d.get_session(sid)
    second, _ = run_turn(d, sid, "Tell me more")
    run_turn(d, sid, "And more")
    with pytest.raises(InvalidRequest, match="between 0 and the session's 3"):
        d.rewind_session(sid, 4)
    back = d.rewind_session(sid, 1)
    assert back["messages"] == after_first["messages"] and back["context_tokens"] == after_first["context_tokens"]
    again, _ = run_turn(d, sid, "Tell me more")
    assert [e.get("token") for e in again if e["type"] == "token"] == [
        e.get("token") for e in second if e["type"] == "token"]
    assert any(e["type"] == "rewind" and e["session"] == sid for e in recent_events(d))
    d.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert len(d.get_session(sid)["messages"]) == 4  # the first turn and the one asked again
        assert d.rewind_session(sid, 0)["messages"] == [] and d.get_session(sid)["context_tokens"] == 0
        run_turn(d, sid, "Hello")
        stream = Stream(hold=True)
        d.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count"}], params=LONG, emit=stream)
        assert stream.first.wait(60)
        with pytest.raises(Conflict, match="rewind it once the turn has ended") as e:
            d.rewind_session(sid, 0)
        assert e.value.retryable
        d.cancel_turn(sid)
        stream.go.set()
        assert stream.done.wait(60)
    finally:
        d.shutdown()


def test_a_raw_prompt_session_is_rewound_by_its_journal_and_a_chain_is_refused(tiny_llama, tmp_path):
    """A raw prompt's input is in the journal only (the live transcript holds its answers): the rewind
    keeps the journal's first turn and the next prompt is answered as the second was; a session holding
    stored responses is refused (their ends would point past it)."""
    from tests.daemon.support import run_to_end

    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(SLA(SLAClass.BATCH))["id"]

        def prompt(ids: list[int]) -> list[int]:
            events, _ = run_to_end(d, session_id=sid, prompt=ids, params=GREEDY)
            return [e["token"] for e in events if e["type"] == "token" and e.get("token") is not None]

        prompt([5, 6, 7, 8])
        second = prompt([9, 10, 11])
        prompt([12, 13])
        back = d.rewind_session(sid, 1)
        assert [m["role"] for m in back["messages"]] == ["prompt", "assistant"]
        assert prompt([9, 10, 11]) == second
        chain = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        run_turn(d, chain, "Name a colour.")
        d.store_response(chain, "resp_1", {"id": "resp_1"})
        with pytest.raises(Conflict, match="holds stored responses") as e:
            d.rewind_session(chain, 0)
        assert not e.value.retryable  # (waiting does not change it: the SDKs are told not to retry)
    finally:
        d.shutdown()
