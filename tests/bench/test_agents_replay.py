"""The replay's logic against a fake daemon (no model): check-in sequence, serialized turns, compaction."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from weaved.bench.agents.records import TurnKind, TurnStatus
from weaved.bench.agents.replay import Replay
from weaved.bench.agents.tokens import TokenPool
from weaved.bench.agents.workload import AgentWorkload, Plan

W = AgentWorkload(agents=3, duration_s=2.0, seed=5, start_context=32, max_context=160, tool_output=(8, 24),
                  agent_gen=(4, 8), heartbeat_s=0.1, checkins_per_min=300, exchanges=(1, 3), question=(4, 8),
                  answer=(4, 8), exchange_gap_s=(0.02, 0.05), batch_concurrency=1, batch_document=40,
                  batch_summary=4, background_ttlt_s=5, batch_ttlt_s=5)


class FakeDaemon:
    """Sessions with a context, one turn at a time each, tokens emitted by one 'engine' thread."""

    def __init__(self):
        self.sessions: dict[str, dict] = {}
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.work: queue.Queue = queue.Queue()
        self.ids = iter(range(10**6))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._engine, daemon=True)
        self.thread.start()

    def _engine(self):
        while not self.stop.is_set():
            try:
                sid, n_prompt, n, emit = self.work.get(timeout=0.05)
            except queue.Empty:
                continue
            for _ in range(n):
                time.sleep(0.0005)
                emit({"type": "token", "token": 1, "text": "x"})
            with self.lock:
                s = self.sessions[sid]
                s["busy"], s["context"] = False, n_prompt + n
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n}
            emit({"type": "done", "finish_reason": "length", "usage": usage})

    def create_session(self, sla, max_context=None, system=None, *, prompt_tokens=0):
        with self.lock:
            sid = f"s-{next(self.ids)}"
            self.sessions[sid] = {"sla": sla.cls.value, "max": max_context, "context": 0, "busy": False}
            self.log.append(("create", sid, sla.cls.value))
        return {"id": sid}

    def start_turn(self, *, session_id, prompt, params, sla=None, emit, **kw):
        with self.lock:
            s = self.sessions[session_id]
            if s["busy"]:
                raise RuntimeError("busy")
            if sla is not None:
                s["sla"] = sla.cls.value
            n_prompt = s["context"] + len(prompt)
            if n_prompt + params.max_tokens > s["max"]:
                raise RuntimeError(f"context {n_prompt} + {params.max_tokens} > {s['max']}")
            assert params.ignore_eos and params.temperature == 0
            s["busy"] = True
            self.log.append(("turn", session_id, s["sla"], len(prompt), params.max_tokens))
        self.work.put((session_id, n_prompt, params.max_tokens, emit))

    def _sla(self, sid, cls):
        with self.lock:
            self.sessions[sid]["sla"] = cls
            self.log.append((cls, sid))

    def promote(self, sid):
        self._sla(sid, "interactive")

    def demote(self, sid):
        self._sla(sid, "background")

    def delete_session(self, sid):
        with self.lock:
            assert not self.sessions[sid]["busy"], "deleted a session with a turn running"
            del self.sessions[sid]
            self.log.append(("delete", sid))

    def get_session(self, sid):
        with self.lock:
            return {"context_tokens": self.sessions[sid]["context"]}

    def status(self):
        return {"pools": [], "kv": {}}


@pytest.fixture(scope="module")
def replayed():
    d = FakeDaemon()
    try:
        result = Replay(d, Plan(W), TokenPool(list(range(1000, 1200)), W.seed)).run()
    finally:
        d.stop.set()
    return d, result


def test_every_turn_ran_and_none_was_refused(replayed):
    d, r = replayed
    assert r.errors == [] and r.records
    assert {rec.status for rec in r.records} <= {TurnStatus.DONE, TurnStatus.RUNNING}
    kinds = {rec.kind for rec in r.records}
    assert kinds == {TurnKind.HEARTBEAT, TurnKind.EXCHANGE, TurnKind.BATCH}
    for rec in r.records:
        if rec.status is TurnStatus.DONE:
            assert rec.generated == rec.max_tokens and rec.first_token <= rec.ended
    assert r.t_end >= W.duration_s


def test_checkin_sequence_promote_exchanges_demote(replayed):
    d, r = replayed
    planned = [c for c in Plan(W).checkins if c.at_s < r.t_end]
    assert r.counts["checkins_started"] + r.counts["checkins_queued"] >= len(planned) - 1
    assert r.counts["promotions"] >= r.counts["checkins_done"] >= 3
    assert r.counts["demotions"] == r.counts["checkins_done"]
    # per session: questions only while promoted, heartbeats only while background
    for entry in d.log:
        if entry[0] == "turn":
            _, sid, cls, n_prompt, n_gen = entry
            if cls == "interactive":
                assert W.question[0] <= n_prompt and W.answer[0] <= n_gen <= W.answer[1]
            else:
                assert W.agent_gen[0] <= n_gen <= W.agent_gen[1] or n_gen == W.batch_summary
    # every check-in's exchanges are one run of its agent's records, in order, with its planned sizes
    by_ci = {}
    for rec in r.records:
        if rec.kind is TurnKind.EXCHANGE:
            by_ci.setdefault(rec.index, []).append(rec)
    plan = {c.index: c for c in Plan(W).checkins}
    for ci, recs in by_ci.items():
        c = plan[ci]
        assert all(rec.agent == c.agent for rec in recs)
        assert [rec.max_tokens for rec in recs] == [e.answer for e in c.exchanges][: len(recs)]
        assert [rec.new_tokens for rec in recs if not rec.compacted] == [
            e.question for e, rec in zip(c.exchanges, recs, strict=False) if not rec.compacted]


def test_turns_of_one_agent_never_overlap(replayed):
    _, r = replayed
    for a in range(W.agents):
        recs = sorted((x for x in r.records if x.agent == a), key=lambda x: x.submitted)
        for prev, nxt in zip(recs, recs[1:], strict=False):
            assert prev.ended is not None and prev.ended <= nxt.submitted


def test_agents_compact_into_a_new_session(replayed):
    d, r = replayed
    compacted = [x for x in r.records if x.compacted and x.kind is TurnKind.HEARTBEAT]
    assert compacted, "the small max_context should make agents compact"
    deleted = {e[1] for e in d.log if e[0] == "delete"}
    for x in compacted:
        assert x.new_tokens >= W.start_context + W.tool_output[0]
        earlier = [y for y in r.records if y.agent == x.agent and y.submitted < x.submitted]
        assert earlier and earlier[-1].session_id != x.session_id and earlier[-1].session_id in deleted
    # first turns start from the start context alone
    firsts = [x for x in r.records if x.kind is TurnKind.HEARTBEAT and x.index == 0]
    assert firsts and all(x.new_tokens == W.start_context for x in firsts)


def test_batch_slots_run_one_job_after_another(replayed):
    d, r = replayed
    jobs = [x for x in r.records if x.kind is TurnKind.BATCH]
    assert [x.index for x in jobs] == list(range(len(jobs))) and len(jobs) > 3
    done = [x for x in jobs if x.status is TurnStatus.DONE]
    assert all(x.session_id in {e[1] for e in d.log if e[0] == "delete"} for x in done)
