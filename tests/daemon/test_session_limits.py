"""A session's limits: the cap on kept sessions (stateless requests are not counted; at the cap the
least recently active idle Responses chain is evicted, sessions made by /v1/sessions never are;
deleting a chain's last stored response deletes its session), its context, its answer budget."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.daemon.support import recent_events, run_turn
from weaved.config.load import load_profile
from weaved.daemon.core import Daemon
from weaved.errors import NotFound, Overloaded
from weaved.routing.types import SLA, SLAClass

CAP = 3
BG = SLA(SLAClass.BACKGROUND)


@pytest.fixture
def daemon(tiny_llama, tmp_path):
    prof = load_profile("cpu-only")
    prof = replace(prof, host=replace(prof.host, max_sessions=CAP))
    d = Daemon(prof, tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    yield d
    d.shutdown()


def _chain(d: Daemon, rid: str) -> str:
    """A session holding a stored response, as ``/v1/responses`` makes one."""
    sid = d.create_session(BG)["id"]
    d.store_response(sid, rid, {"id": rid, "object": "response"})
    return sid


def test_stateless_requests_run_when_the_kept_sessions_are_at_the_cap(daemon):
    kept = [daemon.create_session(BG)["id"] for _ in range(CAP)]
    with pytest.raises(Overloaded, match="delete some"):
        daemon.create_session(BG)
    events, _ = run_turn(daemon, None, "Hello")
    assert events[-1]["type"] == "done"
    assert sorted(s["id"] for s in daemon.list_sessions()) == sorted(kept)


def test_at_the_cap_the_least_recently_used_idle_chain_is_evicted(daemon):
    mine = daemon.create_session(BG)["id"]
    old, new = _chain(daemon, "resp_old"), _chain(daemon, "resp_new")
    run_turn(daemon, old, "Touch the old chain last")  # now the most recently active chain
    fresh = daemon.create_session(BG)["id"]
    ids = {s["id"] for s in daemon.list_sessions()}
    assert ids == {mine, old, fresh}  # the chain used least recently went, the plain session stayed
    with pytest.raises(NotFound):
        daemon.get_response("resp_new")
    assert daemon.get_response("resp_old")[0] == old
    recent = recent_events(daemon, 50)
    assert any(ev.get("type") == "eviction" and ev.get("session") == new for ev in recent)


def test_without_an_idle_chain_the_cap_refuses_and_says_how_to_make_room(daemon):
    for _ in range(CAP):
        daemon.create_session(BG)
    with pytest.raises(Overloaded, match="none of them an idle Responses chain"):
        daemon.create_session(BG)


def test_deleting_a_chains_last_stored_response_deletes_its_session(daemon):
    sid = _chain(daemon, "resp_a")
    daemon.store_response(sid, "resp_b", {"id": "resp_b", "object": "response"})
    daemon.delete_response("resp_b")
    # the earlier response stays (a continuation from it branches); the chain's latest is still the deleted one
    assert daemon.get_response("resp_a")[0] == sid
    assert daemon.latest_response(sid) == "resp_b"
    with pytest.raises(NotFound):
        daemon.get_response("resp_b")
    daemon.delete_response("resp_a")
    with pytest.raises(NotFound):
        daemon.get_session(sid)
    assert daemon.journal.chain_sessions() == set()


def test_a_turn_is_held_to_the_sessions_max_context_not_its_page_rounded_file(daemon):
    from weaved.engine.sampling import SamplingParams
    from weaved.errors import ContextTooLong

    sid = daemon.create_session(BG, max_context=100)["id"]  # its KV file holds 128 positions
    with pytest.raises(ContextTooLong, match="context of 100 tokens"):
        run_turn(daemon, sid, "Hello", SamplingParams(max_tokens=90, temperature=0))


def test_promotion_and_demotion_keep_the_sessions_own_answer_budget(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND, None, 120.0))["id"]
    assert daemon.promote(sid)["sla"] == {"class": "interactive", "ttft_ms": 500.0, "ttlt_s": 120.0}
    assert daemon.demote(sid)["sla"] == {"class": "background", "ttft_ms": None, "ttlt_s": 120.0}


def test_demoting_a_batch_session_never_raises_its_class_or_priority(daemon):
    sid = daemon.create_session(SLA(SLAClass.BATCH, None, 600.0))["id"]
    before = daemon.get_session(sid)
    after = daemon.demote(sid)
    assert after["sla"] == {"class": "batch", "ttft_ms": None, "ttlt_s": 600.0}
    assert after["placement"]["priority"] == before["placement"]["priority"]


def test_a_fork_keeps_its_parent_and_its_answers_finish_reasons_and_calls_across_a_restart(tiny_llama, tmp_path):
    from tests.daemon.support import make_daemon
    from weaved.engine.sampling import SamplingParams

    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(BG)["id"]
    run_turn(d, sid, "Count to a hundred", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    run_turn(d, sid, "Again", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    whole = d.fork_session(sid)["id"]
    first = d.fork_session(sid, turn=1)["id"]
    want = {c: [(m["role"], m.get("finish_reason")) for m in d.get_session(c)["messages"]] for c in (whole, first)}
    assert want[whole][1] == ("assistant", "length") and len(want[first]) == 2
    context = {c: d.get_session(c)["context_tokens"] for c in (sid, whole, first)}
    assert context[whole] == context[sid]  # the parent's unfed last token too
    d.shutdown()
    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert {c: d.get_session(c)["context_tokens"] for c in (sid, whole, first)} == context
        for c in (whole, first):
            assert [(m["role"], m.get("finish_reason")) for m in d.get_session(c)["messages"]] == want[c]
            assert d.get_session(c)["forked_from"] == sid  # the lineage is kept, also past the parent's end
        d.delete_session(sid)
        assert d.get_session(whole)["forked_from"] == sid and d.get_session(first)["forked_from"] == sid
        assert d.get_session(d.create_session(BG)["id"])["forked_from"] is None
    finally:
        d.shutdown()


@pytest.mark.parametrize("ephemeral, where", [(False, "the session's context"), (True, "this request's context")])
def test_a_prompt_that_fills_the_context_says_no_room_is_left(ephemeral, where):
    """A prompt of exactly the context's size leaves nothing for the answer: the error says so (not that it
    needs what the context holds), and speaks of a stateless request's context as its own."""
    from types import SimpleNamespace

    from weaved.daemon.turns import check_fits
    from weaved.errors import ContextTooLong

    s = SimpleNamespace(id="s-1", kv=SimpleNamespace(capacity=128), max_context=100, ephemeral=ephemeral)
    with pytest.raises(ContextTooLong, match=f"the prompt's 100 tokens fill {where} of 100 tokens: no room"):
        check_fits(s, 40, [1] * 60, 1)
    with pytest.raises(ContextTooLong, match=f"the prompt needs 101 tokens of context but {where} holds 100"):
        check_fits(s, 40, [1] * 61, 1)
    with pytest.raises(ContextTooLong, match=f"max_tokens 2 with a 99-token prompt exceeds {where} of 100") as e:
        check_fits(s, 40, [1] * 59, 2)
    assert e.value.param == "max_tokens"
    check_fits(s, 40, [1] * 59, 1)
    # below the model's context, the error names it and the way to more
    way = "POST /v1/sessions {\"max_context\": N}" if ephemeral else "POST /v1/sessions/s-1/fork {\"max_context\": N}"
    with pytest.raises(ContextTooLong) as e:
        check_fits(s, 40, [1] * 61, 1, model_context=8192)
    assert "the model takes 8192" in e.value.message and way in e.value.message
    with pytest.raises(ContextTooLong) as e:  # (the model's own context is the limit: nothing more to say)
        check_fits(s, 40, [1] * 61, 1, model_context=100)
    assert "the model takes" not in e.value.message


def test_a_fork_of_a_fork_at_an_earlier_turn_starts_where_the_original_did(tiny_llama, tmp_path):
    """A fork's journal keeps where each of its messages was recorded, as its parent's did: forking the
    fork at an earlier turn takes the context back to that turn (it took the whole context, so the next
    turn added no tokens and was refused)."""
    from tests.daemon.support import GREEDY, make_daemon
    from weaved.engine.sampling import SamplingParams

    d = make_daemon(tiny_llama, tmp_path / "data")
    try:
        sid = d.create_session(BG)["id"]
        for text in ("Count to ten", "Again", "Once more"):
            run_turn(d, sid, text, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        direct = d.fork_session(sid, turn=1)["id"]
        via = d.fork_session(d.fork_session(sid)["id"], turn=1)["id"]
        assert d.get_session(via)["context_tokens"] == d.get_session(direct)["context_tokens"]
        assert d.get_session(via)["messages"] == d.get_session(direct)["messages"]
        answers = [run_turn(d, c, "And now?", GREEDY)[1].prompt_tokens for c in (direct, via)]
        assert answers[0] == answers[1]
    finally:
        d.shutdown()


def test_forking_a_chain_at_the_cap_never_evicts_the_chain_being_forked(daemon):
    """At the cap, a fork of the least recently used chain makes room by evicting another chain - or
    is refused - but never evicts its own parent (which the fork then could not copy)."""
    parent = _chain(daemon, "resp_parent")
    run_turn(daemon, parent, "Hello")
    other = _chain(daemon, "resp_other")
    run_turn(daemon, other, "Hi")  # the parent is now the least recently used chain
    daemon.create_session(BG)
    fork = daemon.fork_session(parent)["id"]
    ids = {s["id"] for s in daemon.list_sessions()}
    assert parent in ids and fork in ids and other not in ids
    assert daemon.get_response("resp_parent")[0] == parent


def test_a_parent_that_changed_while_it_was_forked_is_a_conflict(daemon, monkeypatch):
    """A turn that started and ended on the parent between the fork point and the copy (here: taken
    back to an earlier turn) would give the fork rows its tokens do not name: a 409, nothing made."""
    from weaved.errors import Conflict

    sid = daemon.create_session(BG)["id"]
    run_turn(daemon, sid, "Hello")
    run_turn(daemon, sid, "And then?")
    create = daemon.create_session

    def meanwhile(*args, **kw):  # the parent is taken back to its first answer before the copy
        info = create(*args, **kw)
        with daemon._lock:
            daemon._rewind(daemon.sessions[sid], 2, "a test")
        return info

    monkeypatch.setattr(daemon, "create_session", meanwhile)
    with pytest.raises(Conflict, match="changed while it was being forked"):
        daemon.fork_session(sid)
    assert [s["id"] for s in daemon.list_sessions()] == [sid]


def test_a_full_session_goes_on_in_a_fork_with_a_larger_context(daemon):
    """A session whose context is full cannot grow; a fork with a larger max_context takes its whole
    context (shared, not computed again) and goes on.  A max_context below the fork's context is refused."""
    from tests.daemon.support import prefilled
    from weaved.errors import ContextTooLong

    sid = daemon.create_session(BG, max_context=64)["id"]
    run_turn(daemon, sid, "Hello there")
    with pytest.raises(ContextTooLong) as e:
        run_turn(daemon, sid, "Tell me a long story about the sea and the sky and the stars. " * 3)
    assert f"/v1/sessions/{sid}/fork" in e.value.message
    held = daemon.get_session(sid)["context_tokens"]
    with pytest.raises(ContextTooLong) as e:
        daemon.fork_session(sid, max_context=held)
    assert e.value.param == "max_context"
    fork = daemon.fork_session(sid, max_context=512)
    assert fork["max_context"] == 512 and fork["context_tokens"] == held
    assert fork["messages"] == daemon.get_session(sid)["messages"]
    before = prefilled(daemon)
    events, h = run_turn(daemon, fork["id"], "Tell me a long story about the sea and the sky and the stars. " * 3)
    assert events[-1]["type"] == "done"
    # only the new message was computed (and the parent's last sampled token, never fed)
    assert h.cached_tokens == held - 1 and prefilled(daemon) - before == h.prompt_tokens - h.cached_tokens


def test_clearing_the_stored_prefixes_removes_what_a_deleted_session_left(daemon):
    """A session's first prompt is stored as a shared prefix and stays after the session is deleted (a
    cache); clearing the prefixes takes it off the disk - but not a file a live session maps."""
    prompt = "Here is a long shared system prompt about the sea and the stars. " * 20
    gone = daemon.create_session(BG)["id"]
    run_turn(daemon, gone, prompt)
    daemon.sessions[gone].publishing.wait(60)
    assert daemon.store.prefixes.paths()
    daemon.delete_session(gone)
    left = daemon.store.prefixes.paths()
    assert left and all(p.exists() for p in left)
    out = daemon.clear_prefixes()
    assert out["files"] == len(left) and out["bytes"] > 0 and out["kept_files"] == 0
    assert not any(p.exists() for p in left) and daemon.store.prefixes.paths() == []
    kept = daemon.create_session(BG)["id"]
    run_turn(daemon, kept, prompt)
    daemon.sessions[kept].publishing.wait(60)
    mapped = daemon.store.prefixes.paths()
    out = daemon.clear_prefixes()
    assert out["files"] == 0 and out["kept_files"] == len(mapped) and all(p.exists() for p in mapped)
    events, _ = run_turn(daemon, kept, "And then?")  # (its rows still read right)
    assert events[-1]["type"] == "done"
