"""The daemon's core in-process: turns reuse KV, restarts and kill -9 lose nothing committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from weaved.config.load import load_profile
from weaved.daemon.core import Daemon
from weaved.daemon.journal import Journal
from weaved.engine.sampling import SamplingParams
from weaved.errors import ContextTooLong, InvalidRequest, NotFound
from weaved.routing.types import SLA, SLAClass

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def make_daemon(model: Path, data_dir: Path) -> Daemon:
    d = Daemon(load_profile("cpu-only"), model, data_dir=data_dir, log_fn=lambda m: None)
    d.load()
    return d


def run_turn(d: Daemon, sid: str | None, text: str, params: SamplingParams = GREEDY) -> tuple[list[dict], object]:
    done = threading.Event()
    events: list[dict] = []

    def emit(ev: dict) -> None:
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    h = d.start_turn(session_id=sid, messages=[{"role": "user", "content": text}], params=params, emit=emit)
    assert done.wait(120), "turn did not finish"
    return events, h


def prefilled(d: Daemon) -> int:
    return sum(e.counters.tokens_prefilled for e in d.engines.values())


@pytest.fixture
def daemon(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    yield d
    d.shutdown()


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
        with pytest.raises(InvalidRequest, match="no chat template.*--chat-template FILE.*/v1/completions"):
            run_turn(daemon, sid, "hi")
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
        j = Journal(data / "journal.sqlite")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the answer has some committed tokens
            rec = j.get(sid)
            if rec is not None and rec.messages and rec.kv_length > len(rec.messages[-1]["token_ids"] or []) + 5:
                break
            time.sleep(0.05)
        j.close()
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
    d.shutdown()


LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


class Stream:
    """A turn's events as a client reads them, with a wait for its first token and for its end."""

    def __init__(self, hold: bool = False) -> None:
        self.events: list[dict] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.go = threading.Event()  # with hold: the engine thread waits in the first token for this
        if not hold:
            self.go.set()

    def __call__(self, ev: dict) -> None:  # the engine thread
        self.events.append(ev)
        if ev["type"] == "token" and not self.first.is_set():
            self.first.set()
            self.go.wait(30)
        if ev["type"] in ("done", "error"):
            self.done.set()


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
    with pytest.raises(Conflict):
        daemon.start_turn(session_id=sid, messages=[{"role": "user", "content": "hi"}], params=GREEDY,
                          emit=lambda ev: None)
    daemon.cancel_turn(sid)
    assert stream.done.wait(60)


def test_a_session_created_empty_is_placed_again_by_its_first_turn(daemon):
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND))["id"]
    before = daemon.get_session(sid)["placement"]["reasons"]
    assert any("short prompt (0 <" in r for r in before)
    events, h = run_turn(daemon, sid, "Tell me about the sea and the sky")
    after = daemon.get_session(sid)["placement"]
    assert after["reasons"][0] == f"placed again at its first turn, which brought {h.prompt_tokens} tokens"
    assert any(f"short prompt ({h.prompt_tokens} <" in r for r in after["reasons"])
    assert h.placement == after  # what the API reports for the turn
    assert daemon.journal.list(with_tokens=False)[-1].placement == after  # and what a restart finds
    run_turn(daemon, sid, "And the stars?")
    assert daemon.get_session(sid)["placement"] == after  # later turns keep it
    # a stateless request's session is placed once, with its prompt: one event, not a first guess too
    q0 = daemon.subscribe(backlog=200)
    seen = q0.qsize()
    _, h = run_turn(daemon, None, "Tell me about the sea and the sky")
    q = daemon.subscribe(backlog=200)
    new = [q.get_nowait() for _ in range(q.qsize())][seen:]
    placed = [e for e in new if e["type"] == "placement"]
    assert len(placed) == 1 and placed[0]["session"] == h.session_id
    assert not any("short prompt (0 <" in r for r in placed[0]["placement"]["reasons"])  # it saw the prompt


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


def test_events_keep_a_backlog_for_new_subscribers():
    import asyncio

    from weaved.daemon.events import BACKLOG, EventBus

    bus = EventBus()
    for i in range(BACKLOG + 5):  # published while nobody listens (e.g. while the daemon loads)
        bus.publish("placement", {"n": i})

    async def main() -> tuple[list[int], list[int]]:
        bus.attach_loop(asyncio.get_running_loop())
        fresh, late = bus.subscribe(), bus.subscribe(backlog=3)
        bus.publish("placement", {"n": -1})
        await asyncio.sleep(0)
        drain = lambda q: [q.get_nowait()["n"] for _ in range(q.qsize())]  # noqa: E731
        return drain(fresh), drain(late)

    fresh, late = asyncio.run(main())
    assert fresh == [-1] and late == [BACKLOG + 2, BACKLOG + 3, BACKLOG + 4, -1]


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
