"""The batch engine of one pool: continuous batching in its own thread.

Each step: admit new turns, let the scheduler pick work under the token budget by SLA, reserve KV
rows, run one ``backend.forward`` over every picked chunk, then for each sequence commit the fed
tokens to the journal (their KV rows are written by then), sample, check stops and stream events.
The kernels release the GIL, so the API's event loop keeps serving while a step runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from weaved.backends.base import Backend
from weaved.bursts import burst
from weaved.calibration.cost import StepCost
from weaved.engine.admission import Capacity, Refusal, judge
from weaved.engine.engine_step import EngineStep
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import SeqStatus, Sequence, SLARank
from weaved.engine.speculative import Drafter, SpecConfig
from weaved.engine.step_drift import StepDrift
from weaved.engine.turn_output import TurnOutput

log = logging.getLogger("weave.engine")


class EngineStopping(RuntimeError):
    """The engine is shutting down and takes no more work."""


@dataclass
class PoolCounters:
    steps: int = 0
    tokens_generated: int = 0
    tokens_prefilled: int = 0
    preemptions: int = 0
    busy_s: float = 0.0
    # speculative variant: draft tokens fed for verification, those accepted, and (sequence, step)
    # pairs that verified a draft; accepted / drafted is the acceptance rate
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0


class BatchEngine(EngineStep):
    """Runs the sequences of one pool.  ``submit``/``cancel``/``set_rank`` are thread-safe.

    ``commit(seq, fed_tokens)`` is called after each step for every sequence that fed tokens, once
    their KV rows are written: the daemon records them in the journal there.  ``reserve(seq, n)``
    is called before a step writes rows up to position ``n`` (the new total length: the KV store grows
    the file, enforces the cap);
    if it raises, that sequence fails with the error's message and the others continue.
    ``on_event(kind, data)`` receives pool-level events (preemption) for ``/v1/events``.

    Moving a turn to another pool happens between steps: ``detach`` hands a running sequence to a
    callback at the next step boundary, and a sequence with ``handoff`` set leaves by itself once its
    prefill is done (a long prompt prefilled on a GPU pool, decoded on a CPU pool).  Engines that share
    one backend share ``forward_lock`` so that only one of them runs a step at a time.

    ``speculative`` turns on the pool's speculative-decoding variant (``weaved.engine.speculative``):
    while fewer sequences decode than its threshold, each decode step also verifies a prompt-lookup
    draft; the tokens, events and commits are exactly those of plain decoding, only more per step.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        config: SchedulerConfig,
        *,
        commit: Callable[[Sequence, list[int]], None] | None = None,
        reserve: Callable[[Sequence, int], None] | None = None,
        on_event: Callable[[str, dict], None] | None = None,
        forward_lock: threading.Lock | None = None,
        speculative: SpecConfig | None = None,
        capacity: Capacity | None = None,
        make_room: Callable[[Backend, int], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.backend = backend
        self.config = config
        self._commit = commit
        self._reserve = reserve
        self._on_event = on_event
        self._cond = threading.Condition()
        self._incoming: list[Sequence] = []
        self._active: list[Sequence] = []
        self._cancel: set[str] = set()
        self._detach: list[tuple[str, Callable[[Sequence | None], None]]] = []
        self._forward_lock = forward_lock or threading.Lock()
        self.speculative = speculative
        self._drafter = Drafter(speculative) if speculative is not None else None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counters = PoolCounters()
        self.tps_window: list[tuple[float, int]] = []  # (time, tokens generated) per step, recent
        self.capacity = capacity  # None: every turn is admitted (admission.judge)
        # the pool's pace now: a moving mean of its steps' durations (the router predicts a turn's answer
        # with it, since it holds the prefill chunks other turns feed beside the decodes)
        self.recent_step_s = 0.0
        self.step_drift = StepDrift()  # the step model as this host runs it now (scheduling, admission)
        # (backend, bytes) -> whether it freed that much of the backend's own KV memory (a GPU's, by
        # demoting idle sessions): tried once before a step that lacks the room fails a turn
        self._make_room = make_room
        self._clock = clock  # seconds: deadlines, token times, step durations (a simulation's virtual clock)
        self.out = TurnOutput(name, self.counters, clock)  # tokens, stops, events, the ends of turns

    @property
    def lateness(self) -> float:
        """How late the pool's turns end against the router's forecasts (``TurnOutput.lateness``)."""
        return self.out.lateness

    @lateness.setter
    def lateness(self, value: float) -> None:
        self.out.lateness = value

    # ---- control (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in flight, then stop; unfinished turns end with finish_reason 'shutdown'."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise EngineStopping("the engine is shutting down")
            self._incoming.append(seq)
            self._cond.notify_all()

    def refusal(self, seq: Sequence) -> Refusal | None:
        """Why this pool cannot take ``seq`` beside the turns it holds without missing an SLA it has
        accepted (``admission.judge``), or None."""
        if self.capacity is None:
            return None
        with self._cond:
            live = list(self._active) + list(self._incoming)
        cost, target = self.step_cost_now(), self.config.step_target_s
        return judge(live, seq, self.capacity, self._clock(), (cost, target) if cost is not None and target else None)

    def step_cost_now(self) -> StepCost | None:
        """The pool's step model as the host runs it now (``step_drift``), or None before calibration: what
        the scheduler, admission and the router predict steps with."""
        cost = self.config.step_cost
        return None if cost is None else self.step_drift.scaled(cost)

    def _scheduling(self) -> SchedulerConfig:
        """The scheduler's configuration with the step model as the host runs it now."""
        cfg, cost = self.config, self.step_cost_now()
        return cfg if cost is cfg.step_cost else dataclasses.replace(cfg, step_cost=cost)

    def cancel(self, session_id: str) -> None:
        """Cancel the session's turn this engine holds now (it ends at the next step boundary with
        finish_reason 'cancelled').  A turn of the session submitted later is not touched: the cancel
        marks the sequences here now (``cancel_requested``, which a caller may also set itself for a
        turn on its way between engines)."""
        with self._cond:
            for s in self._active + self._incoming:
                if s.session_id == session_id and not s.status.done:
                    s.cancel_requested = True
            self._cancel.add(session_id)  # (wakes the engine thread)
            self._cond.notify_all()

    def detach(self, session_id: str, on_detached: Callable[[Sequence | None], None]) -> None:
        """Take the session's sequence out of this engine at the next step boundary and call
        ``on_detached(seq)`` from the engine thread (``None`` if it has no live sequence here by then).
        The sequence keeps its state (pending tokens, sampler, stream) and continues where it is
        submitted next."""
        with self._cond:
            self._detach.append((session_id, on_detached))
            self._cond.notify_all()

    def set_rank(self, session_id: str, rank: SLARank, ttlt_s: float | None) -> bool:
        """Change a running turn's SLA rank and whole-turn budget (its new class's); it takes effect at
        the next step."""
        with self._cond:
            for s in self._active + self._incoming:
                if s.session_id == session_id and not s.status.done:
                    s.rank, s.ttlt_s = rank, ttlt_s
                    return True
        return False

    def snapshot(self) -> list[Sequence]:
        with self._cond:
            return list(self._active) + list(self._incoming)

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._active) + len(self._incoming)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.has_work():
                    self._cond.wait()
                if self._stopping:
                    break
            self.run_once()
        with self._cond:
            rest = self._active + self._incoming
            self._active, self._incoming = [], []
        for s in rest:
            if not s.status.done:
                self.out.finish(s, SeqStatus.CANCELLED, "shutdown")

    def now(self) -> float:
        """The engine's clock (seconds; its token times and the tokens/s window are on it)."""
        return self._clock()

    def has_work(self) -> bool:
        """Turns to run, or cancellations and hand-overs to carry out."""
        return bool(self._incoming or self._active or self._cancel or self._detach)

    def run_once(self) -> None:
        """One pass of the engine loop: take in new turns, carry out cancellations and hand-overs, admit,
        then run one step.  The engine thread calls it in a loop; a simulation calls it instead of
        starting the thread (weaved.sim.driver), on its own clock.  Its events are handed over as one burst
        (``weaved.bursts``): whoever listens is woken once, after the pass."""
        with burst():
            self._run_once()

    def _run_once(self) -> None:
        with self._cond:
            self._active.extend(self._incoming)
            self._incoming.clear()
            self._cancel.clear()
            detach, self._detach = self._detach, []
        # cancels first: a turn cancelled while it queued brings no KV to this pool's device, and is
        # not prefilled elsewhere (the flag: set by ``cancel``, or before the sequence reached this engine)
        for s in self._active:
            if s.cancel_requested and not s.status.done:
                self.out.finish(s, SeqStatus.CANCELLED, "cancelled")
        # hand-overs next: a turn leaving before its first step here brings nothing to this pool's device
        # (a queued turn demoted off a GPU pool is not copied in first, making room it does not need)
        for sid, callback in detach:
            self._hand_over(sid, callback)
        admitted = [s for s in self._active if s.on_admit is not None and not s.status.done]
        outside = [s for s in self._active if s.prefill_outside is not None and not s.status.done]
        for s in admitted:
            admit, s.on_admit = s.on_admit, None
            try:
                admit()
            except Exception as exc:  # e.g. no device memory for its KV: that turn fails
                self._fail_turn(s, exc, "admitting", f"could not bring the session's KV to pool {self.name!r}")
        for s in outside:
            self._prefill_outside(s)
        self._active = [s for s in self._active if not s.status.done]
        if self._active:
            try:
                self.step()
            except Exception as exc:  # a bug in one step must not kill the pool: fail its turns
                status = getattr(exc, "http_status", None)  # the server's capacity (a ring lost its room)
                if status is None:
                    log.exception("engine %s: step failed", self.name)
                for s in self._active:
                    self.out.fail(s, str(exc) if status else f"internal error: {exc}", status)
            self._active = [s for s in self._active if not s.status.done]

    def _prefill_outside(self, s: Sequence) -> None:
        """Let ``s.prefill_outside`` write the KV of the turn's first prompt tokens (a pipeline prefill
        across peers); they count as fed here.  A failure only means this engine prefills them itself."""
        fn, s.prefill_outside = s.prefill_outside, None
        if s.status.done:
            return
        try:
            n = fn(s)
        except Exception:
            log.exception("engine %s: prefilling %s outside failed; prefilling here", self.name, s.session_id)
            return
        if n:
            self._feed(s, n, prefill=True)

    def _hand_over(self, sid: str, callback: Callable[[Sequence | None], None]) -> None:
        seq = next((s for s in self._active if s.session_id == sid and not s.status.done), None)
        if seq is not None:
            self._active.remove(seq)
        self._hand_over_to(seq, callback)

    def _hand_over_to(self, seq: Sequence | None, callback: Callable) -> None:
        try:
            callback(seq)
        except EngineStopping:  # the daemon is shutting down while the turn moves: it ends like the rest
            if seq is not None:
                self.out.finish(seq, SeqStatus.CANCELLED, "shutdown")
        except Exception as exc:  # the receiving side failed: the turn fails, the pool goes on
            log.exception("engine %s: handing over %s failed", self.name, seq and seq.session_id)
            if seq is not None:
                self.out.fail(seq, f"moving the session failed: {exc}")

    def _fail_turn(self, s: Sequence, exc: Exception, doing: str, what: str) -> None:
        """``s``'s turn fails, the step's others go on: a traceback in the log for a bug, none for the
        server's capacity (an error with an ``http_status``: no device memory, a full disk)."""
        status = getattr(exc, "http_status", None)
        if status is None:
            log.exception("engine %s: %s %s failed", self.name, doing, s.session_id)
        self.out.fail(s, f"{what}: {exc}", status, cause=exc)

    def _event(self, kind: str, data: dict) -> None:
        if self._on_event is not None:
            self._on_event(kind, data)
