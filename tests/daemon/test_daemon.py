"""The daemon's core in-process: turns reuse KV, bad turns change nothing, placement and SLA changes,
memory and context limits, durability, admission and events."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from tests.daemon.support import (
    GREEDY,
    LONG,
    Stream,
    make_daemon,
    prefilled,
    recent_events,
    run_to_end,
    run_turn,
)
from weaved.config.load import load_profile
from weaved.daemon.core import Daemon
from weaved.daemon.journal import Journal
from weaved.engine.sampling import SamplingParams
from weaved.errors import ContextTooLong, InvalidRequest, NotFound
from weaved.routing.types import SLA, SLAClass


def test_second_turn_feeds_only_new_tokens(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, "Be brief.")["id"]
    ev1, h1 = run_turn(daemon, sid, "Hello there")
    assert ev1[-1]["type"] == "done" and ev1[-1]["usage"]["completion_tokens"] > 0
    before = prefilled(daemon)
    ev2, h2 = run_turn(daemon, sid, "And again")
    fed = prefilled(daemon) - before
    assert h2.cached_tokens > 0 and fed == h2.prompt_tokens - h2.cached_tokens
    assert fed < 20  # the new user message and the template around it, never the stored context
    msgs = daemon.get_session(sid)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]


def test_bad_turns_change_nothing(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), 64, None)["id"]
    with pytest.raises(NotFound):
        run_turn(daemon, "s-nope", "hi")
    with pytest.raises(ContextTooLong):
        run_turn(daemon, sid, "word " * 100)
    with pytest.raises(ContextTooLong):
        run_turn(daemon, sid, "hi", SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequest):
        daemon.start_turn(session_id=sid, messages=[], params=GREEDY, emit=lambda ev: None)
    template, daemon.tokenizer.chat_template = daemon.tokenizer.chat_template, None  # e.g. a base model
    try:
        with pytest.raises(InvalidRequest, match="no chat template.*--chat-template FILE.*/v1/completions") as info:
            run_turn(daemon, sid, "hi")
        assert info.value.code == "no_chat_template"  # (weave chat leaves on it: no turn can be taken)
    finally:
        daemon.tokenizer.chat_template = template
    assert daemon.get_session(sid)["context_tokens"] == 0
    ev, _ = run_turn(daemon, sid, "hi")
    assert ev[-1]["type"] == "done"


def test_promote_and_demote_change_placement(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    p = daemon.promote(sid)["placement"]
    assert p["priority"] == 2 and any("no GPU pool" in r for r in p["reasons"])
    assert any("priority raised to 2" in r for r in p["reasons"])
    assert daemon.demote(sid)["placement"]["priority"] == 1
    # promoting an interactive session keeps the client's first-token target and says nothing was raised
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE, ttft_ms=200.0))["id"]
    again = daemon.promote(sid)
    assert again["sla"]["ttft_ms"] == 200.0
    assert any("priority kept at the highest, 2" in r for r in again["placement"]["reasons"])


def test_a_demotion_for_idleness_skips_a_session_that_was_used_since(daemon):
    """Idle demotion (and making device room) decides from a list taken under the lock and demotes
    afterwards: a session whose turn started or ran in between is left as it is."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    since = daemon.sessions[sid].last_active
    run_turn(daemon, sid, "Hello")
    assert daemon.demote(sid, reason="idle demotion", idle_since=since) is None
    assert daemon.get_session(sid)["sla"]["class"] == "interactive"
    now = daemon.sessions[sid].last_active
    assert daemon.demote(sid, reason="idle demotion", idle_since=now)["sla"]["class"] == "background"


def test_a_deleted_session_is_gone_from_the_journal_before_its_files(daemon, monkeypatch):
    """A stop between the two leaves no record of a session whose file is gone (it would come back
    rebuilt at the restart, deleted as it was)."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    run_turn(daemon, sid, "Hello")
    seen = []
    real = daemon.store.delete
    monkeypatch.setattr(daemon.store, "delete", lambda i, wait=True: (seen.append(daemon.journal.get(i)),
                                                                       real(i, wait=wait)))
    daemon.delete_session(sid)
    assert seen == [None]


def test_cpu_only_daemon_never_imports_torch(tiny_llama, tmp_path):
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from weaved.daemon.core import Daemon
        from weaved.config.load import load_profile
        d = Daemon(load_profile("cpu-only"), Path(sys.argv[1]), data_dir=Path(sys.argv[2]), log_fn=lambda m: None)
        d.load()
        d.shutdown()
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tiny_llama), str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_default_context_is_the_profiles_capped_by_the_models(tmp_path):
    """A session that names no max_context gets the profile's default_context, never more than the
    model's context; one may still ask for up to the model's."""
    import dataclasses

    from tests.tiny_models import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "long.gguf", "llama", context_length=131072)
    prof = load_profile("cpu-only")
    for default, want in ((4096, 4096), (1 << 20, 131072)):
        p = dataclasses.replace(prof, host=dataclasses.replace(prof.host, default_context=default))
        d = Daemon(p, model, data_dir=tmp_path / f"data{default}", log_fn=lambda m: None)
        d.load()
        try:
            s = d.create_session(SLA(SLAClass.BACKGROUND))
            assert s["max_context"] == want
            assert d.sessions[s["id"]].kv.capacity == want
            assert d.create_session(SLA(SLAClass.BACKGROUND), 131072)["max_context"] == 131072
        finally:
            d.shutdown()


def test_a_model_larger_than_ram_is_refused_with_the_numbers(tiny_llama, tmp_path, monkeypatch):
    import psutil

    from weaved.errors import WeaveError

    real = psutil.virtual_memory()
    fake = real._replace(total=tiny_llama.stat().st_size // 2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    d = Daemon(load_profile("cpu-only"), tiny_llama, data_dir=tmp_path, log_fn=lambda m: None)
    with pytest.raises(WeaveError, match=r"needs about .* GiB of memory .* this host has .* GiB of RAM"):
        d.load()
    assert not (tmp_path / "journal.sqlite").exists() and not (tmp_path / "kv").exists()  # nothing made yet
    d.shutdown()


def test_a_kv_cap_too_small_or_a_data_directory_that_is_a_file_is_refused_at_load(tiny_llama, tmp_path):
    import dataclasses

    from weaved.errors import WeaveError

    prof = load_profile("cpu-only")
    tiny = dataclasses.replace(prof, host=dataclasses.replace(prof.host, kv_cap_bytes=1024))
    d = Daemon(tiny, tiny_llama, data_dir=tmp_path / "a", log_fn=lambda m: None)
    with pytest.raises(WeaveError, match=r"kv_cap_bytes \(1,024 bytes\) holds 4 positions .* at least 256: raise it"):
        d.load()
    d.shutdown()
    (tmp_path / "file").write_text("not a directory")
    d = Daemon(prof, tiny_llama, data_dir=tmp_path / "file", log_fn=lambda m: None)
    with pytest.raises(WeaveError, match="is a file, not a directory"):
        d.load()
    d.shutdown()


def test_a_pool_on_a_device_this_host_lacks_is_refused_with_the_way_out(tiny_llama, tmp_path):
    import dataclasses

    from weaved.daemon.pools import PoolError

    pytest.importorskip("torch")
    prof = load_profile("cpu-only")
    gpu = dataclasses.replace(prof.pools[0], name="gpu", backend="torch", device="cuda:7")
    d = Daemon(dataclasses.replace(prof, pools=(*prof.pools, gpu)), tiny_llama, data_dir=tmp_path / "a",
               log_fn=lambda m: None)
    with pytest.raises(PoolError, match=r"pool 'gpu' runs on device 'cuda:7', which is unavailable .* only_if_gpu"):
        d.load()
    d.shutdown()


def test_sessions_recovered_past_a_lowered_kv_cap_are_noted(tiny_llama, tmp_path):
    import dataclasses

    d = make_daemon(tiny_llama, tmp_path / "data")
    sid = d.create_session(SLA(SLAClass.BATCH), max_context=2048)["id"]
    run_turn(d, sid, "Hello there " * 200)  # past the first 256 positions the session reserves
    assert d.store.reserved_bytes() > 300 * d.config.kv_bytes_per_token
    d.shutdown()
    prof = load_profile("cpu-only")
    bpt = d.config.kv_bytes_per_token
    low = dataclasses.replace(prof, host=dataclasses.replace(prof.host, kv_cap_bytes=300 * bpt))
    d = Daemon(low, tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    try:
        assert any("more than the cap" in n and "weave rm" in n for n in d.status()["pool_notes"])
        assert d.get_session(sid)["messages"][0]["content"] == "Hello there " * 200  # it is kept
    finally:
        d.shutdown()


def test_a_turn_that_meets_a_full_kv_cap_says_so_and_whether_to_retry(tiny_llama, tmp_path):
    """A turn the KV cap cannot hold fails with the cap's own error: overloaded, its code, and - the room
    being held by a kept session, which waiting does not free - no retry (the SDKs would retry twice)."""
    import dataclasses

    from weaved.api.turn import Turn

    prof = load_profile("cpu-only")
    d = make_daemon(tiny_llama, tmp_path / "probe")
    bpt = d.config.kv_bytes_per_token
    d.shutdown()
    low = dataclasses.replace(prof, host=dataclasses.replace(prof.host, kv_cap_bytes=600 * bpt))
    d = Daemon(low, tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    try:
        kept = d.create_session(SLA(SLAClass.BATCH), max_context=400)["id"]
        run_turn(d, kept, "Hello there " * 40)  # a whole chunk of 256 positions
        other = d.create_session(SLA(SLAClass.BATCH), max_context=400)["id"]
        # its prompt's first 256-token chunk fits beside kept's; its second does not
        events, _ = run_turn(d, other, "Hello there " * 170)
        assert len(d.journal.get(kept).tokens) < 256 and 330 < len(d.tokenizer.encode("Hello there " * 170)) < 350
        err = events[-1]
        assert err["type"] == "error" and err["status"] == 503 and err["code"] == "kv_cap_exceeded"
        assert err["retryable"] is False and "DELETE /v1/sessions/ID" in err["message"]
        turn = Turn.__new__(Turn)  # the API's reading of the event
        turn.error, turn.completion_tokens, turn.session = err, 0, other
        exc = turn.failure()
        assert (exc.status, exc.type, exc.code, exc.retryable) == (503, "overloaded_error", "kv_cap_exceeded", False)
        # the refused turn was taken back, and the room it had reserved with it: the kept session's alone
        assert d.store.reserved_bytes() == 256 * bpt and d.get_session(other)["messages"] == []
    finally:
        d.shutdown()


def test_a_kv_cap_beyond_the_disk_is_noted(tiny_llama, tmp_path):
    """The KV files live in the data directory: a cap its disk cannot hold is said at start (sessions
    past it would fail on a full disk instead of being refused)."""
    import dataclasses
    import shutil

    prof = load_profile("cpu-only")
    huge = shutil.disk_usage(tmp_path).total * 4
    d = Daemon(dataclasses.replace(prof, host=dataclasses.replace(prof.host, kv_cap_bytes=huge)), tiny_llama,
               data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    try:
        assert any("more than the data directory's disk can hold" in n for n in d.status()["pool_notes"])
    finally:
        d.shutdown()


def test_a_session_created_empty_is_placed_again_by_its_first_turn(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    first = daemon.get_session(sid)["placement"]
    before = first["reasons"]
    assert any("short prompt (0 <" in r for r in before)
    events, h = run_turn(daemon, sid, "Tell me about the sea and the sky")
    after = daemon.get_session(sid)["placement"]
    # the same pools and priority: it stays, and its reasons speak of the real prompt
    assert after["reasons"][0] == f"kept where it was at its first turn ({h.prompt_tokens} prompt tokens to compute)"
    assert {k: v for k, v in after.items() if k != "reasons"} == {k: v for k, v in first.items() if k != "reasons"}
    assert any(f"short prompt ({h.prompt_tokens} <" in r for r in after["reasons"])
    assert h.placement == after  # what the API reports for the turn
    assert daemon.journal.list(with_tokens=False)[-1].placement == after  # and what a restart finds
    run_turn(daemon, sid, "And the stars?")
    assert daemon.get_session(sid)["placement"] == after  # later turns keep it
    # a stateless request's session is placed with its prompt, and is no event (as its turn is none: under
    # load they would crowd the kept sessions' events out of the backlog)
    seen = len(recent_events(daemon))
    _, h = run_turn(daemon, None, "Tell me about the sea and the sky")
    new = recent_events(daemon)[seen:]
    assert not [e for e in new if e.get("session") == h.session_id], new
    assert not any("short prompt (0 <" in r for r in h.placement["reasons"])  # it saw the prompt


@pytest.mark.parametrize("router", ["no room", "another strategy"])
def test_a_first_turn_that_stays_says_why_with_its_prompt(daemon, monkeypatch, router):
    """When the first turn's placement cannot move the session (no placement now, or one whose KV would
    live elsewhere), its reasons still speak of the real prompt, not of the empty one it was created with."""
    import dataclasses

    from weaved.daemon import moves
    from weaved.routing.types import RoutingError

    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    first = daemon.get_session(sid)["placement"]
    real = moves.place

    def place(*a, **k):
        if router == "no room":
            raise RoutingError("no pool has room")
        return dataclasses.replace(real(*a, **k), decode_strategy="qring")

    monkeypatch.setattr(moves, "place", place)
    _, h = run_turn(daemon, sid, "Tell me about the sea and the sky")
    after = daemon.get_session(sid)["placement"]
    assert after["reasons"][0] == f"kept where it was at its first turn ({h.prompt_tokens} prompt tokens to compute)"
    assert "no pool has room" in after["reasons"][1] if router == "no room" else "qring" in after["reasons"][1]
    assert not any("(0 <" in r for r in after["reasons"])
    assert {k: v for k, v in after.items() if k != "reasons"} == {k: v for k, v in first.items() if k != "reasons"}
    assert daemon.journal.list(with_tokens=False)[-1].placement == after


def test_fsync_durability_flushes_each_commit_before_the_journal_records_it(tiny_llama, tmp_path, monkeypatch):
    import dataclasses

    from weaved.kv.store import KVStore

    prof = load_profile("cpu-only")
    prof = dataclasses.replace(prof, host=dataclasses.replace(prof.host, durability="fsync"))
    order: list[str] = []
    real_flush, real_commit = KVStore.flush, Journal.commit_tokens
    monkeypatch.setattr(KVStore, "flush", lambda self, kv: (order.append("flush"), real_flush(self, kv))[1])
    monkeypatch.setattr(Journal, "commit_tokens",
                        lambda self, *a: (order.append("commit"), real_commit(self, *a))[1])
    d = Daemon(prof, tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None)
    d.load()
    try:
        sid = d.create_session(SLA(SLAClass.BACKGROUND))["id"]
        events, _ = run_turn(d, sid, "hello")
        assert events[-1]["type"] == "done"
        assert order and order[0::2] == ["flush"] * (len(order) // 2) and order[1::2] == ["commit"] * (len(order) // 2)
        assert d.journal._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        order.clear()
        run_turn(d, None, "an ephemeral turn is not journalled, so not flushed")
        assert order == []
    finally:
        d.shutdown()


def test_a_turn_the_pool_cannot_take_is_refused_with_when_to_retry_and_changes_nothing(daemon):
    from weaved.engine.admission import Capacity
    from weaved.errors import Overloaded
    from weaved.http_errors import weave_error_response

    pool = daemon.engines["cpu"]
    pool.capacity = Capacity(max_batch=2, prior_tps=2.0, prefill_cost=0.5)  # two slots of a token a second
    streams = []
    for _ in range(2):  # two interactive turns hold both slots
        sid = daemon.create_session(SLA(SLAClass.INTERACTIVE, 500, None))["id"]
        streams.append((sid, Stream()))
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count"}], params=LONG,
                          emit=streams[-1][1])
    third = daemon.create_session(SLA(SLAClass.INTERACTIVE, 500, None))["id"]
    events, published = [], []
    real_publish = daemon.publish
    daemon.publish = lambda kind, data: (published.append((kind, data)), real_publish(kind, data))
    with pytest.raises(Overloaded) as refused:
        daemon.start_turn(session_id=third, messages=[{"role": "user", "content": "hi"}], params=GREEDY,
                          emit=events.append)
    assert "batch slots" in refused.value.message and refused.value.retry_after_s >= 1
    assert weave_error_response(refused.value).headers["retry-after"] == str(round(refused.value.retry_after_s))
    assert daemon.get_session(third)["messages"] == [] and events == []  # nothing changed
    n_before = len(daemon.sessions)
    with pytest.raises(Overloaded):  # an ephemeral turn refused leaves no session behind
        daemon.start_turn(session_id=None, messages=[{"role": "user", "content": "hi"}], params=GREEDY,
                          emit=events.append)
    assert len(daemon.sessions) == n_before
    for sid, stream in streams:
        daemon.cancel_turn(sid)
        assert stream.done.wait(60)
    events, _ = run_turn(daemon, third, "hi")  # room again: admitted
    assert events[-1]["type"] == "done"
    refusals = [d for k, d in published if k == "refusal"]
    assert len(refusals) == 2 and refusals[0]["session"] == third and refusals[0]["class"] == "interactive"


def test_stateless_requests_copy_the_short_prompt_blocks_they_share(daemon, tiny_llama, tmp_path):
    """A request without a session whose prompt starts like an earlier one's gets those 16-token blocks'
    KV rows copied, not computed - and the same answer as a daemon that computes them."""
    common = "Please answer in one short line, and be kind, and be precise, and be brief, and be clear: "
    run_turn(daemon, None, common + "what is the sea?")
    before = prefilled(daemon)
    ev, h = run_turn(daemon, None, common + "what is bread?")
    fed = prefilled(daemon) - before
    assert h.cached_tokens >= 32 and fed == h.prompt_tokens - h.cached_tokens
    assert daemon.store.hot.status()["hits"] == 1
    fresh = make_daemon(tiny_llama, tmp_path / "fresh")
    try:
        ev_fresh, h_fresh = run_turn(fresh, None, common + "what is bread?")
    finally:
        fresh.shutdown()
    assert h_fresh.cached_tokens == 0
    tokens = [[e["token"] for e in evs if e["type"] == "token"] for evs in (ev, ev_fresh)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 3


def test_a_prompt_whose_log_probabilities_are_asked_for_computes_every_row(daemon):
    """A stored prefix's rows have no logits: a raw prompt echoed with its log-probabilities is computed
    whole, so the second of two equal prompts scores every token, as the first did."""
    prompt = "The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox around."
    params = SamplingParams(max_tokens=1, temperature=0)

    def echoed() -> tuple[list, object]:
        events, h = run_to_end(daemon, session_id=None, prompt=prompt, params=params, echo=True)
        return [i for e in events if e["type"] == "prompt_logprobs" for i in e["items"]], h

    first, h1 = echoed()
    run_turn(daemon, None, "Another request between them.")
    second, h2 = echoed()
    assert h1.cached_tokens == 0 and h2.cached_tokens == 0 and len(first) > 16
    assert second == first


def test_a_sessions_state_is_its_turns_as_the_status_rows_say_it(daemon):
    import threading

    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    assert daemon.get_session(sid)["state"] == "idle"
    started, done = threading.Event(), threading.Event()

    def emit(ev):
        if ev["type"] == "token":
            started.set()
        if ev["type"] in ("done", "error"):
            done.set()

    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count"}], params=LONG, emit=emit)
    assert started.wait(60)
    info, row = daemon.get_session(sid), next(r for r in daemon.status()["sessions"] if r["id"] == sid)
    assert info["status"] == "busy" and info["state"] in ("waiting", "running", "paused")
    daemon.cancel_turn(sid)
    assert done.wait(60)
    assert row["state"] in ("waiting", "running", "paused") and daemon.get_session(sid)["state"] == "idle"


def test_a_turn_demoted_while_it_runs_takes_its_new_class_budget(daemon):
    """An interactive turn has no whole-turn budget of its own; demoted mid-turn it is paced to the
    background budget, not left without a deadline behind every other turn."""
    sid = daemon.create_session(SLA(SLAClass.INTERACTIVE))["id"]
    stream = Stream(hold=True)
    daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "Count."}], params=LONG, emit=stream)
    assert stream.first.wait(60)
    try:
        assert daemon.sessions[sid].turn.ttlt_s is None
        daemon.demote(sid)
        assert daemon.sessions[sid].turn.ttlt_s == daemon.profile.routing.background_ttlt_s
    finally:
        daemon.cancel_turn(sid)
        stream.go.set()
        assert stream.done.wait(60)


def test_listing_sessions_beside_a_delete_lists_the_others(daemon, monkeypatch):
    """A session deleted while the list is read is left out; the listing does not fail."""
    ids = [daemon.create_session(SLA(SLAClass.BACKGROUND))["id"] for _ in range(3)]
    real, deleted = daemon.get_session, []

    def get_session(sid: str, messages: bool = True) -> dict:
        info = real(sid, messages)
        if not deleted:  # another request deletes a session while the first one is read
            t = threading.Thread(target=daemon.delete_session, args=(ids[2],))
            t.start()
            t.join(0.5)
            deleted.append(t)
        return info

    monkeypatch.setattr(daemon, "get_session", get_session)
    listed = [s["id"] for s in daemon.list_sessions()]
    deleted[0].join(30)
    assert listed == ids or listed == ids[:2]
    assert [s["id"] for s in daemon.list_sessions()] == ids[:2]


def test_a_kept_sessions_turns_are_events_and_a_stateless_requests_are_not(daemon):
    """A supervisor follows turns on /v1/events: where each started (the pool, what it computes) and how
    it ended (finish reason, tokens, seconds) - for kept sessions; stateless requests would flood the
    backlog."""
    sid = daemon.create_session(SLA(SLAClass.BATCH))["id"]
    run_turn(daemon, sid, "Hello")
    run_turn(daemon, None, "Hello")  # a stateless request
    mine = [e for e in recent_events(daemon) if e["type"] in ("turn_start", "turn_end")]
    assert [(e["type"], e["session"]) for e in mine] == [("turn_start", sid), ("turn_end", sid)]
    start, end = mine
    assert start["pool"] == "cpu" and start["to_compute"] == start["prompt_tokens"] > 0 and not start["detached"]
    assert end["finish_reason"] in ("stop", "length") and end["completion_tokens"] > 0 and end["seconds"] > 0
    assert end["prompt_tokens"] == start["prompt_tokens"] and "error" not in end
