"""Drive one ``Daemon`` through a ``Plan`` in real time and record every turn.

One thread (the caller's) runs a bounded loop over a heap of due actions (heartbeats, check-in
arrivals, exchanges, batch slots) and a queue of ended turns fed by the engines' emit callbacks.  It
stops by itself when the run's wall duration is up (or after ``max_iterations`` loop passes, a guard
that a sane run never reaches), closes the records as they stand, and leaves shutting the daemon down
to the caller.

A session runs one turn at a time, so the replay serializes each agent's turns: a person who checks in
while their agent's heartbeat turn is running is promoted at once (the router may move the session,
and the running turn's priority rises), but their question is sent when that turn ends; the wait is
recorded (``waited_s``) and the question's TTFT counts from its submission.  Heartbeats due during a
check-in run after the person leaves; a second check-in on the same agent queues behind the first.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from weaved.bench.agents.agent_turns import AgentState, AgentTurns
from weaved.bench.agents.records import TurnKind, TurnRecord, TurnStatus
from weaved.bench.agents.tokens import TokenPool
from weaved.bench.agents.workload import CheckIn, Plan


@dataclass
class ReplayResult:
    records: list[TurnRecord]
    t_end: float  # seconds from the start when the run was closed
    status: dict  # daemon.status() at close
    counts: dict  # promotions, demotions, check-ins ... as the replay did them
    errors: list[str]  # daemon errors met along the way (first few)


class Replay:
    def __init__(self, daemon, plan: Plan, tokens: TokenPool, *, max_iterations: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic, idle: Callable[[float], None] | None = None):
        """``clock`` and ``idle(until)`` - wait until that time (from the run's start) or until a turn
        ends - are real time by default; a simulation gives its virtual clock and its driver."""
        self.d = daemon
        self.plan = plan
        self.w = plan.w
        self.max_iterations = max_iterations
        self.agents = [AgentState(i) for i in range(self.w.agents)]
        self.turns = AgentTurns(daemon, self.w, tokens, self._submit, self._note)
        self.records: list[TurnRecord] = []
        self.counts = {"promotions": 0, "demotions": 0, "checkins_started": 0, "checkins_done": 0,
                       "checkins_queued": 0, "batch_jobs_started": 0}
        self.errors: list[str] = []
        self._heap: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()
        self._ended: queue.Queue[TurnRecord] = queue.Queue()  # from the engines' threads
        self._ending: list[tuple[float, int, TurnRecord]] = []  # ended turns by end time, not yet handled
        self._wake = threading.Event()
        self._clock = clock
        self.idle = idle or self._idle_real
        self._lock = threading.Lock()  # engine callbacks vs closing the run
        self._closed = False
        self._batch_jobs = [0] * self.w.batch_concurrency
        self._t0 = 0.0

    # ---- clock and actions -----------------------------------------------------------------------
    def now(self) -> float:
        return self._clock() - self._t0

    def _idle_real(self, until: float) -> None:
        if self._ended.empty():
            self._wake.wait(max(0.0, until - self.now()))
        self._wake.clear()

    def next_end(self) -> float | None:
        """When the earliest ended turn not yet handled ended (seconds from the start), or None."""
        while True:
            try:
                rec = self._ended.get_nowait()
            except queue.Empty:
                break
            heapq.heappush(self._ending, (rec.ended if rec.ended is not None else 0.0, next(self._order), rec))
        return self._ending[0][0] if self._ending else None

    def _at(self, t: float, kind: str, arg: object) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, arg))

    def run(self) -> ReplayResult:
        self._t0 = self._clock()
        for a in self.agents:
            a.heartbeat_due = self.plan.heartbeat(a.index, 0).gap_s
            self._at(a.heartbeat_due, "heartbeat", a)
        for c in self.plan.checkins:
            self._at(c.at_s, "checkin", c)
        for slot in range(self.w.batch_concurrency):
            self._at(0.0, "batch", slot)
        end = self.w.duration_s
        for _ in range(self.max_iterations):
            now = self.now()
            if now >= end:
                break
            due = self._heap[0][0] if self._heap else end
            self.idle(min(due, end))
            # turns are handled in the order they ended, once the clock has reached their end (a
            # simulation's engines run side by side: one may have ended a turn later than another's)
            while self.next_end() is not None and self._ending[0][0] <= self.now():
                self._on_end(heapq.heappop(self._ending)[2])
            while self._heap and self._heap[0][0] <= self.now() < end:
                _, _, kind, arg = heapq.heappop(self._heap)
                self._fire(kind, arg)
        with self._lock:
            self._closed = True
            t_end = self.now()
        try:
            status = self.d.status()
        except Exception as exc:  # noqa: BLE001 - the turns' figures still stand without the daemon's
            self._note(f"status: {type(exc).__name__}: {exc}")
            status = {}
        return ReplayResult(self.records, t_end, status, dict(self.counts), self.errors)

    def _fire(self, kind: str, arg) -> None:
        if kind == "heartbeat":
            self._kick(arg)
        elif kind == "checkin":
            self._arrive(arg)
        elif kind == "exchange":
            arg.asked_at = self.now()
            self._kick(arg)
        elif kind == "exchange-ended":
            self._after_exchange(arg)
        elif kind == "batch":
            self._start_batch(arg)

    # ---- agents ----------------------------------------------------------------------------------
    def _kick(self, a: AgentState) -> None:
        """Start the agent's next turn if it is idle and one is due."""
        self._promote_if_due(a)
        if a.busy is None:
            if a.session is None:  # the first turn creates the session (early if a person is waiting)
                if a.checkin is not None or (a.heartbeat_due is not None and self.now() >= a.heartbeat_due):
                    self._heartbeat(a)
            elif a.checkin is not None:
                if a.asked_at is not None:
                    ex = a.checkin.exchanges[a.exchange]
                    waited = self.now() - a.asked_at
                    a.asked_at = None
                    a.busy = self.turns.exchange(a, a.checkin, a.exchange, ex, waited)
                    if a.busy is None:  # refused: the person moves on (an action, not a recursion)
                        self._at(self.now(), "exchange-ended", a)
            elif a.heartbeat_due is not None and self.now() >= a.heartbeat_due:
                self._heartbeat(a)
        self._promote_if_due(a)

    def _heartbeat(self, a: AgentState) -> None:
        hb = self.plan.heartbeat(a.index, a.next_heartbeat)
        a.heartbeat_due = None
        a.busy = self.turns.heartbeat(a, hb)
        if a.busy is None:  # refused: the agent tries its next heartbeat later
            self._after_heartbeat(a)

    def _after_heartbeat(self, a: AgentState) -> None:
        a.next_heartbeat += 1
        a.heartbeat_due = self.now() + self.plan.heartbeat(a.index, a.next_heartbeat).gap_s
        self._at(a.heartbeat_due, "heartbeat", a)

    def _promote_if_due(self, a: AgentState) -> None:
        if a.checkin is not None and not a.promoted and a.session is not None:
            a.promoted = True
            if self._call(self.d.promote, a.session):
                self.counts["promotions"] += 1

    def _arrive(self, c: CheckIn) -> None:
        a = self.agents[c.agent]
        if a.checkin is not None:
            a.queued.append(c)
            self.counts["checkins_queued"] += 1
            return
        self._begin_checkin(a, c)

    def _begin_checkin(self, a: AgentState, c: CheckIn) -> None:
        # the person asked when they arrived (a queued check-in has waited since then)
        a.checkin, a.exchange, a.asked_at, a.promoted = c, 0, min(c.at_s, self.now()), False
        self.counts["checkins_started"] += 1
        self._kick(a)

    def _end_checkin(self, a: AgentState) -> None:
        if a.promoted and a.session is not None and self._call(self.d.demote, a.session):
            self.counts["demotions"] += 1
        a.checkin, a.promoted, a.asked_at = None, False, None
        self.counts["checkins_done"] += 1
        if a.queued:
            self._begin_checkin(a, a.queued.popleft())

    def _after_exchange(self, a: AgentState) -> None:
        c = a.checkin
        assert c is not None
        a.exchange += 1
        if a.exchange < len(c.exchanges):
            self._at(self.now() + c.exchanges[a.exchange].gap_s, "exchange", a)
        else:
            self._end_checkin(a)
        self._kick(a)

    # ---- batch jobs ------------------------------------------------------------------------------
    def _start_batch(self, slot: int) -> None:
        job = self.plan.batch_job(slot, self._batch_jobs[slot])
        self._batch_jobs[slot] += 1
        self.counts["batch_jobs_started"] += 1
        rec = self.turns.batch(job)
        if rec is None:  # refused: try the slot's next job a little later rather than spin
            self._at(self.now() + 1.0, "batch", slot)

    # ---- turns ending ----------------------------------------------------------------------------
    def _submit(self, rec: TurnRecord, start) -> bool:
        """Record ``rec`` and start it with ``start(emit)``; False when the daemon refused it."""
        self.records.append(rec)
        rec.submitted = self.now()
        try:
            start(self._emit_for(rec))
            return True
        except Exception as exc:  # noqa: BLE001 - a refused turn is a result (missed), not a crash
            rec.status, rec.error = TurnStatus.REJECTED, f"{type(exc).__name__}: {exc}"
            self._note(rec.error)
            return False

    def _emit_for(self, rec: TurnRecord):
        def emit(ev: dict) -> None:  # engine thread
            with self._lock:
                if self._closed:
                    return
                now = self.now()
                kind = ev.get("type")
                if kind == "token" and ev.get("token") is not None:  # token None: the decoder's tail text
                    if rec.first_token is None:
                        rec.first_token = now
                    rec.token_times.append(now)
                elif kind in ("done", "error"):
                    rec.ended = now
                    usage = ev.get("usage") or {}
                    if usage:
                        rec.context_after = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
                    rec.finish_reason = ev.get("finish_reason")
                    ok = kind == "done" and rec.finish_reason == "length" and rec.generated >= rec.max_tokens
                    rec.status = TurnStatus.DONE if ok else TurnStatus.FAILED
                    if kind == "error":
                        rec.error = str(ev.get("message"))
                    self._ended.put(rec)
                    self._wake.set()
        return emit

    def _on_end(self, rec: TurnRecord) -> None:
        if rec.status is TurnStatus.FAILED:
            self._note(f"{rec.kind.value} turn failed: {rec.error or rec.finish_reason}")
        if rec.kind is TurnKind.BATCH:
            self._call(self.d.delete_session, rec.session_id)
            self._start_batch(rec.slot)
            return
        a = self.agents[rec.agent]
        a.busy = None
        ok = rec.status is TurnStatus.DONE and rec.context_after is not None
        a.context = rec.context_after if ok else self.turns.context_of(a.session)  # a failed turn keeps less
        if rec.kind is TurnKind.HEARTBEAT:
            self._after_heartbeat(a)
            self._kick(a)
        else:
            self._after_exchange(a)

    def _call(self, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            self._note(f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}")
            return False

    def _note(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)
