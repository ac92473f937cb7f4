"""A GPU pool (the torch backend; on torch's CPU device here) beside the CPU pool in one daemon:
co-execution, routing, promotion/demotion moving KV bytes without recomputing, long-prompt prefill on
the GPU with decode on the CPU, idle demotion, and a crash while a session sits on the device."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.daemon.support import Stream, wait_for_commits
from weaved.backends.cpu import CPUBackend
from weaved.config.load import load_profile
from weaved.config.profile import PoolConfig, Profile
from weaved.daemon.core import Daemon
from weaved.engine.sampling import SamplingParams
from weaved.routing.types import SLA, SLAClass

pytest.importorskip("torch")

GREEDY = SamplingParams(max_tokens=12, temperature=0)
BG, IA = SLA(SLAClass.BACKGROUND), SLA(SLAClass.INTERACTIVE, 500.0)


def coexec_profile(*, long_prompt: int = 4096, idle: float | None = None, gpu_batch: int = 4) -> Profile:
    base = load_profile("cpu-only")
    gpu = PoolConfig(name="gpu", backend="torch", device="cpu", max_batch=gpu_batch, prefill_chunk=128,
                     token_budget=128 + gpu_batch, idle_demote_s=idle)
    cpu = dataclasses.replace(base.pools[0], max_batch=4, prefill_chunk=128, token_budget=132)
    return dataclasses.replace(base, pools=(gpu, cpu), threads=dataclasses.replace(base.threads, kernels=1),
                               routing=dataclasses.replace(base.routing, long_prompt_tokens=long_prompt))


class Turn:
    """A turn's events, with a way to wait for the n-th token."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.times: list[float] = []  # arrival of each token event
        self.done = threading.Event()
        self.cond = threading.Condition()

    def emit(self, ev: dict) -> None:
        with self.cond:
            self.events.append(ev)
            if ev["type"] == "token":
                self.times.append(time.monotonic())
            self.cond.notify_all()
        if ev["type"] in ("done", "error"):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e["token"] for e in self.events if e["type"] == "token" and e["token"] is not None]

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.tokens) >= n or self.done.is_set(), timeout)
        assert len(self.tokens) >= n, self.events[-1:]

    def finish(self, timeout: float = 180) -> list[dict]:
        assert self.done.wait(timeout), "turn did not finish"
        assert self.events[-1]["type"] == "done", self.events[-1]
        return self.events


def start(d: Daemon, sid: str, prompt: list[int], params: SamplingParams = GREEDY) -> Turn:
    t = Turn()
    d.start_turn(session_id=sid, prompt=prompt, params=params, emit=t.emit)
    return t


def backends(d: Daemon):
    return d.pools["gpu"].backend, d.pools["cpu"].backend


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 200, n - 1).tolist()


@pytest.fixture
def daemon_factory(tiny_llama, tmp_path):
    made: list[Daemon] = []

    def make(**kw) -> Daemon:
        d = Daemon(coexec_profile(**kw), tiny_llama, data_dir=tmp_path / f"data{len(made)}", log_fn=lambda m: None)
        d.load()
        made.append(d)
        return d

    yield make
    for d in made:
        d.shutdown()


def record_migrations(d: Daemon) -> list[dict]:
    """The daemon's migration events from now on, as its mover publishes them."""
    moves: list[dict] = []
    publish = d.mover._publish

    def record(kind: str, data: dict) -> None:
        if kind == "migration":
            moves.append(data)
        publish(kind, data)

    d.mover._publish = record
    return moves


def kv_digest(kv, n: int) -> str:
    return hashlib.sha256(np.ascontiguousarray(kv.data[:, :, :, :n]).tobytes()).hexdigest()


def test_pools_are_placed_by_class_and_run_together(daemon_factory):
    d = daemon_factory()
    st = d.status()
    kinds = {p["name"]: (p["backend"], p["device_kind"], p["stand_in"]) for p in st["pools"]}
    assert kinds == {"gpu": ("torch", "gpu", True), "cpu": ("cpu", "cpu", False)}
    assert any("stands in" in n for n in st["pool_notes"])
    ia = d.create_session(IA)["id"]
    bg = d.create_session(BG)["id"]
    assert d.get_session(ia)["pool"] == "gpu" and d.get_session(bg)["pool"] == "cpu"
    for sid in (ia, bg):  # warm both pools (first calls load compiled kernels)
        start(d, sid, prompt_ids(8, 0), SamplingParams(max_tokens=2, temperature=0)).finish()
    # co-execution: a whole CPU turn runs while the GPU pool's longer turn is streaming - started
    # after its first token, finished before its last (the stand-in decodes ~10x slower than the CPU)
    a = start(d, ia, prompt_ids(20, 1), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    a.wait_tokens(1)
    b = start(d, bg, prompt_ids(20, 2), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    b.finish()
    a.finish()
    assert len(a.tokens) == 200 and len(b.tokens) == 20  # ignore_eos: exactly max_tokens
    gpu, cpu = backends(d)
    assert gpu.stats.decode_tokens >= 199 and cpu.stats.decode_tokens >= 19
    assert a.times[0] < b.times[0] and b.times[-1] < a.times[-1]


def test_promotion_mid_generation_moves_bytes_and_recomputes_nothing(daemon_factory, tiny_llama):
    d = daemon_factory()
    sid = d.create_session(BG)["id"]
    prompt = prompt_ids(24, 3)
    n_gen = 36
    t = start(d, sid, prompt, SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True))
    s = d.sessions[sid]
    moves = record_migrations(d)
    t.wait_tokens(8)
    d.promote(sid)
    deadline = time.monotonic() + 60
    while s.kv_at != "gpu" and not t.done.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert s.kv_at == "gpu", "the running turn did not move to the GPU pool"
    gpu, cpu = backends(d)
    assert gpu.device_kv_bytes() > 0
    n_moved = s.kv.length
    digest = kv_digest(s.kv, n_moved)
    t.wait_tokens(len(t.tokens) + 8)
    d.demote(sid)
    events = t.finish()
    assert s.kv_at != "gpu" and gpu.device_kv_bytes() == 0  # demotion freed the device copy
    assert kv_digest(s.kv, n_moved) == digest  # the rows that travelled are the same bytes
    # nothing recomputed: the prompt was prefilled once, on the CPU; the GPU only decoded
    assert cpu.stats.prefill_tokens == len(prompt) and gpu.stats.prefill_tokens == 0
    assert gpu.stats.decode_tokens > 0
    assert s.kv.length == len(prompt) + n_gen - 1 == len(s.committed)
    mig = d.status()["migrations"]
    assert mig["count"] == 2 and mig["by_reason"] == {"promotion": 1, "demotion": 1}
    # the promotion copied every row the session had when it moved (the GPU may decode more before we look)
    promoted = next(m for m in moves if m["reason"] == "promotion")
    assert promoted["to_backend"] == gpu.name and promoted["kv_tokens"] <= n_moved
    assert promoted["bytes"] >= promoted["kv_tokens"] * d.config.kv_bytes_per_token
    assert promoted["kv_tokens"] >= len(prompt) + 8 - 1
    # the same greedy continuation as a CPU-only run, except at near-ties
    ref = CPUBackend.from_file(tiny_llama, threads=1)
    kv = ref.new_kv(256)
    got = [e["token"] for e in events if e["type"] == "token"]
    logits = ref.forward([_chunk(kv, prompt)])[0][-1]
    for i, tok in enumerate(got):
        want = int(np.argmax(logits))
        if tok != want:
            assert logits[want] - logits[tok] < 0.3, f"token {i}: {tok} vs {want} is not a near-tie"
            break
        logits = ref.forward([_chunk(kv, [tok])])[0][-1]


def _chunk(kv, toks):
    from weaved.backends.base import Logits, SeqChunk

    return SeqChunk(kv, np.asarray(toks, np.int32), Logits.LAST)


def test_promotion_with_the_gpu_pool_full_raises_priority_on_the_cpu(daemon_factory):
    d = daemon_factory(gpu_batch=1)
    ia = d.create_session(IA)["id"]
    t = start(d, ia, prompt_ids(16, 4), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    t.wait_tokens(1)
    bg = d.create_session(BG)["id"]
    info = d.promote(bg)
    t_reasons = " ".join(info["placement"]["reasons"])
    d.cancel_turn(ia)
    assert info["pool"] == "cpu" and info["placement"]["priority"] == 2
    assert "full" in t_reasons and "priority raised" in t_reasons


def test_long_prompt_prefills_on_the_gpu_and_decodes_on_the_cpu(daemon_factory):
    d = daemon_factory(long_prompt=48)
    sid = d.create_session(BG)["id"]
    prompt = prompt_ids(64, 5)
    start(d, sid, prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)).finish()
    gpu, cpu = backends(d)
    assert gpu.stats.prefill_tokens == len(prompt) and cpu.stats.prefill_tokens == 0
    assert cpu.stats.decode_tokens == 9 and gpu.stats.decode_tokens == 0
    assert d.sessions[sid].pool == "cpu" and gpu.device_kv_bytes() == 0
    assert d.status()["migrations"]["by_reason"].get("prefill handoff") == 1
    # a short follow-up stays on the CPU
    start(d, sid, prompt_ids(8, 6), SamplingParams(max_tokens=4, temperature=0)).finish()
    assert gpu.stats.prefill_tokens == len(prompt)


def test_idle_sessions_leave_the_gpu(daemon_factory):
    d = daemon_factory(idle=0.2)
    sid = d.create_session(IA)["id"]
    start(d, sid, prompt_ids(16, 7)).finish()
    gpu, _ = backends(d)
    deadline = time.monotonic() + 30
    while gpu.device_kv_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gpu.device_kv_bytes() == 0
    info = d.get_session(sid)
    assert info["pool"] == "cpu" and info["sla"]["class"] == "background"
    # the person comes back: an interactive turn brings the session back to the GPU with one copy
    t = Turn()
    d.start_turn(session_id=sid, prompt=prompt_ids(6, 8), params=GREEDY, sla=IA, emit=t.emit)
    t.finish()
    assert d.get_session(sid)["pool"] == "gpu"
    assert d.status()["migrations"]["by_reason"].get("promotion") == 1


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.daemon.test_coexec import coexec_profile
    from weaved.daemon.core import Daemon
    from weaved.engine.sampling import SamplingParams
    from weaved.routing.types import SLA, SLAClass
    d = Daemon(coexec_profile(), Path(sys.argv[1]), data_dir=Path(sys.argv[2]), log_fn=lambda m: None)
    d.load()
    sid = d.create_session(SLA(SLAClass.INTERACTIVE, 500.0))["id"]
    d.start_turn(session_id=sid, prompt=list(range(5, 40)), emit=lambda ev: None,
                 params=SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
    print(sid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_kill_9_while_on_the_device_loses_nothing_committed(tiny_llama, tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_llama), str(data)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        sid = child.stdout.readline().strip()
        assert sid.startswith("s-")
        wait_for_commits(data / "journal.sqlite", sid, lambda rec: rec.kv_length > 35 + 10)  # some answer committed
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    d = Daemon(coexec_profile(), tiny_llama, data_dir=data, log_fn=lambda m: None)
    d.load()
    try:
        s = d.sessions[sid]
        assert s.kv.length == len(s.committed) > 45
        # the committed rows in the file are the ones a CPU prefill of the same tokens writes
        ref = CPUBackend.from_file(tiny_llama, threads=1)
        kv = ref.new_kv(s.kv.capacity)
        ref.forward([_chunk(kv, s.committed)])
        n = s.kv.length
        np.testing.assert_allclose(s.kv.data[:, :, :, :n].astype(np.float32), kv.data[:, :, :, :n].astype(np.float32),
                                   atol=0.05, rtol=0.02)
        t = start(d, sid, prompt_ids(6, 9))
        t.finish()
        gpu, cpu = backends(d)
        assert gpu.stats.prefill_tokens + cpu.stats.prefill_tokens < 10  # nothing stored was recomputed
    finally:
        d.shutdown()


def test_promote_then_demote_before_the_move_lands_ends_where_the_last_change_says(daemon_factory):
    d = daemon_factory()
    sid = d.create_session(BG)["id"]
    t = start(d, sid, prompt_ids(16, 10), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    t.wait_tokens(3)
    d.promote(sid)
    d.demote(sid)  # likely before the engine's next step boundary
    t.finish()
    s = d.sessions[sid]
    assert s.pool == "cpu" and s.placement.decode_pool == "cpu"
    assert d.pools["gpu"].backend.device_kv_bytes() == 0
    assert len(t.tokens) == 60


def test_deleted_and_ephemeral_sessions_free_their_device_copy(daemon_factory):
    d = daemon_factory()
    gpu, _ = backends(d)
    sid = d.create_session(IA)["id"]
    start(d, sid, prompt_ids(12, 11)).finish()
    assert gpu.device_kv_bytes() > 0
    d.delete_session(sid)
    assert gpu.device_kv_bytes() == 0
    t = Turn()  # an OpenAI-style call without a session: an ephemeral interactive session on the GPU
    d.start_turn(session_id=None, prompt=prompt_ids(12, 12), params=GREEDY, emit=t.emit)
    t.finish()
    deadline = time.monotonic() + 10
    while d.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not d.sessions and gpu.device_kv_bytes() == 0


def test_a_promotion_while_a_prefilled_prompt_moves_to_its_decode_pool_is_carried_out(daemon_factory):
    """A background turn's long prompt prefilled on the GPU pool is on its way to the CPU pool (no engine
    holds it) when the session is promoted: once it has arrived, it moves again - to the GPU pool its
    placement now names, at the interactive rank - with the same tokens as a turn that never moved."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = prompt_ids(64, 5)
    d = daemon_factory(long_prompt=48)
    sid = d.create_session(BG)["id"]
    bring, promoted = d.moves._bring_kv, []

    def bring_kv(s, to, reason):
        if reason == "prefill handoff" and not promoted:
            promoted.append(d.promote(sid))  # (the daemon's lock is free: the hand-off copies without it)
        bring(s, to, reason)

    d.moves._bring_kv = bring_kv
    t = start(d, sid, prompt, params)
    t.finish()
    assert promoted and promoted[0]["placement"]["decode_pool"] == "gpu"
    want = start(d, d.create_session(BG)["id"], prompt, params)  # (its prompt's blocks shared: same rows)
    want.finish()
    s = d.sessions[sid]
    assert s.pool == s.kv_at == "gpu" and s.turn.rank.name == "INTERACTIVE"
    assert t.tokens == want.tokens
    gpu, _ = backends(d)
    assert gpu.stats.decode_tokens > 0  # the rest of the answer was decoded where the promotion sent it


def test_a_session_deleted_while_its_move_to_the_gpu_waits_leaves_nothing_on_the_device(daemon_factory):
    """A promotion queues the running turn's move to the GPU pool; the session is deleted before the
    engine gets to it: nothing of it is copied onto the device (with the garbage collector off, a copy
    would stay until the session's arrays were collected)."""
    import gc

    d = daemon_factory()
    sid = d.create_session(BG)["id"]
    stream = Stream(hold=True)
    d.start_turn(session_id=sid, prompt=prompt_ids(24, 3), emit=stream,
                 params=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    assert stream.first.wait(60) and d.sessions[sid].pool == "cpu"
    gpu, _ = backends(d)
    gc.disable()
    try:
        d.promote(sid)  # the move waits for the CPU engine's next step boundary
        d.delete_session(sid)
        stream.go.set()
        assert stream.done.wait(60) and stream.events[-1]["finish_reason"] == "cancelled"
        cpu = d.pools["cpu"].engine
        deadline = time.monotonic() + 30
        while cpu.has_work() and time.monotonic() < deadline:  # the move's hand-over has been carried out
            time.sleep(0.02)
        time.sleep(0.2)  # (and whatever it started on the way)
        assert not cpu.has_work() and gpu.device_kv_bytes() == 0
    finally:
        gc.enable()


def test_a_promotion_racing_a_turns_start_moves_that_turn(daemon_factory):
    """A promotion decided while a turn is being started (on another thread) waits for the turn to be in
    its engine, so the move finds it: the turn decodes on the GPU pool it was promoted to."""
    d = daemon_factory()
    sid = d.create_session(BG)["id"]
    cpu = d.pools["cpu"].engine
    submit = cpu.submit

    def promote_meanwhile(seq):
        racer = threading.Thread(target=d.promote, args=(sid,))
        racer.start()
        racer.join(1.0)  # (it waits for the daemon's lock, held while the turn is started)
        submit(seq)

    cpu.submit = promote_meanwhile
    t = Turn()
    d.start_turn(session_id=sid, prompt=prompt_ids(24, 3), emit=t.emit,
                 params=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    cpu.submit = submit
    t.finish()
    s = d.sessions[sid]
    gpu, _ = backends(d)
    assert s.placement.decode_pool == s.pool == s.kv_at == "gpu"
    assert gpu.stats.decode_tokens > 0


def test_a_demotion_during_a_promotions_copy_brings_the_turn_back(daemon_factory):
    """The promoted turn's KV is being copied to the GPU (no engine holds the turn) when the session is
    demoted: once it has arrived, it goes back where the last change says - not left decoding on the GPU
    under a placement that says CPU."""
    d = daemon_factory()
    sid = d.create_session(BG)["id"]
    bring, demoted = d.moves._bring_kv, []

    def bring_kv(s, to, reason):
        if reason == "promotion" and not demoted:
            demoted.append(d.demote(sid))  # (the daemon's lock is free: the copy runs without it)
        bring(s, to, reason)

    t = start(d, sid, prompt_ids(16, 10), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    t.wait_tokens(3)
    d.moves._bring_kv = bring_kv
    d.promote(sid)
    t.finish()
    s = d.sessions[sid]
    assert demoted and s.pool == s.placement.decode_pool == "cpu" and len(t.tokens) == 60
    assert d.pools["gpu"].backend.device_kv_bytes() == 0


def test_a_promotion_without_device_room_leaves_the_running_turn_where_it_was(daemon_factory):
    """The GPU has no room for the promoted turn's KV and nothing to free: the turn goes on decoding on
    the CPU to its end, rather than failing half-way."""
    from weaved.backends.torch_paged import DeviceKVFull

    d = daemon_factory()
    gpu, _ = backends(d)

    def full(kv):
        raise DeviceKVFull("no device KV left", need_bytes=1)

    d.moves.make_room = lambda backend, n: False
    sid = d.create_session(BG)["id"]
    t = start(d, sid, prompt_ids(16, 10), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    t.wait_tokens(3)
    gpu.adopt = full
    d.promote(sid)
    t.finish()
    assert t.events[-1]["type"] == "done" and len(t.tokens) == 60
    assert d.sessions[sid].pool == "cpu"


def test_a_session_whose_turn_is_being_recorded_is_not_idle(daemon_factory, monkeypatch):
    """Between a long turn's last token and its record, the session's last activity is still the turn's
    start: it is not idle then, and idle demotion leaves it (and its device copy) alone."""
    import weaved.daemon.turn_events as turn_events

    d = daemon_factory(idle=1000.0)
    if d.housekeeper is not None:
        d.housekeeper.stop()
    entered, go = threading.Event(), threading.Event()
    real = turn_events.parsed_answer

    def recording_slowly(*args):
        entered.set()
        go.wait(30)
        return real(*args)

    monkeypatch.setattr(turn_events, "parsed_answer", recording_slowly)
    sid = d.create_session(IA)["id"]
    t = start(d, sid, prompt_ids(12, 13))
    try:
        assert entered.wait(60)
        assert d.demote_idle(d.wall() + 2000.0) == []
    finally:
        go.set()
    t.finish()
    assert d.get_session(sid)["sla"]["class"] == "interactive"


def test_a_queued_turn_demoted_off_the_gpu_is_not_copied_onto_it_first(daemon_factory):
    """A turn waiting in the GPU pool's queue is demoted before its first step there: it leaves for the
    CPU pool without its KV being brought onto the device first (here the device has no room, so that
    copy would have failed the turn)."""
    from weaved.backends.torch_paged import DeviceKVFull

    d = daemon_factory()
    gpu, _ = backends(d)
    first = Stream(hold=True)  # the GPU engine thread waits in this turn's first token
    a = d.create_session(IA)["id"]
    d.start_turn(session_id=a, prompt=prompt_ids(12, 14), params=GREEDY, emit=first)
    assert first.first.wait(60)
    b = d.create_session(IA)["id"]
    t = start(d, b, prompt_ids(12, 15))  # queued behind the held step

    def full(kv):
        raise DeviceKVFull("no device KV left", need_bytes=1)

    gpu.adopt = full
    d.moves.make_room = lambda backend, n: False
    d.demote(b)
    first.go.set()
    t.finish()
    assert t.events[-1]["type"] == "done" and d.sessions[b].pool == "cpu"
