"""Moving sessions between pools: where a turn runs (a long prompt may prefill on a GPU pool, or as a
pipeline across peers), re-placement when a session's SLA changes, and bringing its KV along.

Where a session is:
- ``placement.decode_pool``: where the router wants its turns decoded;
- ``Session.where``: the pool running (or about to run) its turn - differs from the placement while a
  long prompt prefills on a GPU pool, or while a running turn waits for the step boundary to move;
- ``Session.kv_at``: the pool whose backend holds a copy of its KV (None: only the file).

Moving into a GPU pool is lazy for an idle session: the one host-to-device copy happens when its next
turn is admitted, in that pool's engine thread (``Sequence.on_admit``).  Moving out of one releases the
device copy at once, since that frees device memory and copies nothing (rows were written through).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable

from weaved.backends.base import Backend
from weaved.config.profile import RoutingThresholds
from weaved.daemon.migration import Mover
from weaved.daemon.pools import Pool
from weaved.daemon.session import Session, rank_of
from weaved.engine.admission import Refusal
from weaved.engine.sequence import Sequence
from weaved.routing.predict import forecast
from weaved.routing.tree import place, place_turn, promote, spill_targets
from weaved.routing.types import (
    SLA,
    Placement,
    RoutingError,
    SessionRequest,
    SLAClass,
    SystemState,
    pools_of,
    with_room,
)

log = logging.getLogger("weave.daemon")


class SessionMoves:
    """The daemon's collaborator for moves.  It sees the daemon through a narrow interface: the pools,
    the routing thresholds, the journal and KV store, the peer registry, the mover, the event
    publisher, the router's view of the node now (``system_state``) and the daemon's session lock,
    which the callers of ``prepare_turn``, ``replace`` and ``misplaced`` hold."""

    def __init__(self, *, pools: dict[str, Pool], routing: RoutingThresholds, journal, store, peers, mover: Mover,
                 publish: Callable[[str, dict], None], system_state: Callable[[], SystemState],
                 lock: threading.RLock, make_room: Callable[[Backend, int], bool] | None = None,
                 alive: Callable[[Session], bool] = lambda s: True):
        self.pools, self.routing, self.journal, self.store = pools, routing, journal, store
        self.peers, self.mover, self.publish = peers, mover, publish
        self.system_state, self.lock = system_state, lock
        self.make_room = make_room  # frees a GPU's KV memory for a promotion that lacks it
        self.alive = alive  # whether a session is still the daemon's (not deleted); under ``lock``

    # ---- bringing KV where the turn runs ---------------------------------------------------------
    def _bring_kv(self, s: Session, to: str, reason: str) -> None:
        """Make pool ``to``'s backend hold the session's KV (engine thread of ``to``, or any thread when
        ``to`` is a host pool)."""
        src, dst = self.pools.get(s.kv_at) if s.kv_at else None, self.pools[to]
        try:
            self.mover.move_kv(s.id, s.kv, src, dst, reason)
        except Exception as exc:  # the device's KV pool is full: idle sessions leave it, then once more
            s.kv_at = None  # the source let go before the copy failed: the KV is in its file only
            need = getattr(exc, "need_bytes", 0)
            if not (need and self.make_room is not None and self.make_room(dst.backend, need)):
                raise
            self.mover.move_kv(s.id, s.kv, None, dst, reason)
        s.kv_at = to
        s.move_reason = None

    def _turn_pool(self, s: Session, n_new: int) -> tuple[str, str | None]:
        """(pool to run this turn in, why it is not the decode pool).  A throughput-tolerant session whose
        turn brings a long prompt prefills it on a GPU pool with room, then decodes where it lives."""
        here = s.placement.decode_pool
        th = self.routing
        if (th.policy != "sla" or n_new < th.long_prompt_tokens or self.pools[here].device_kind == "gpu"
                or s.placement.decode_strategy == "qring"):  # a ring session's KV lives on the ring's nodes
            return here, None
        g = with_room(pools_of(self.system_state(), "gpu"), s.context_tokens + n_new, plain_first=True)
        if g is None:
            return here, None
        return g.name, (f"turn prompt of {n_new} tokens >= {th.long_prompt_tokens}: prefill on GPU pool {g.name!r}, "
                        f"decode on {here!r}")

    def _pipeline_ring(self, s: Session, seq: Sequence, n_new: int):
        """The ring backend whose group prefills this turn's prompt as a pipeline across the peers, or
        None: a throughput-tolerant standard session's first turn (the pipeline starts at position 0)
        with a prompt of at least ``pipeline_min_prompt_tokens``, while a ring pool has live peers."""
        th = self.routing
        if (th.policy != "sla" or s.sla.cls is SLAClass.INTERACTIVE or s.placement.decode_strategy != "standard"
                or s.committed or n_new < th.pipeline_min_prompt_tokens or seq.prompt_logprobs
                or self.peers.peers_alive() == 0):
            return None
        return next((p.backend for p in self.pools.values() if p.config.strategy == "qring"), None)

    def _pipeline_prefill(self, s: Session, seq: Sequence, ring) -> int:
        """(engine thread) Prefill all but the prompt's last token through the pipeline, into the
        session's file; the engine feeds the last one and samples the first token from its logits."""
        ids = seq.pending[:-1]
        self.store.reserve(seq.kv, len(ids))  # the cap is checked before anything is written
        return len(ids) if ring.pipeline_gather(seq.kv, ids) else 0

    def prepare_turn(self, s: Session, seq: Sequence, n_new: int) -> str:
        """Route the turn (caller holds ``self.lock``); returns the pool to submit it to."""
        ring = self._pipeline_ring(s, seq, n_new)
        if ring is not None:
            self.publish("placement", {"session": s.id, "turn_prefill": "pipeline", "reason": (
                f"first prompt of {n_new} tokens >= {self.routing.pipeline_min_prompt_tokens}: pipeline "
                f"prefill across the ring's peers, decode on {s.placement.decode_pool!r}")})
            seq.prefill_outside = lambda seq, s=s, ring=ring: self._pipeline_prefill(s, seq, ring)
            run_in, why = s.placement.decode_pool, None
        else:
            run_in, why = self._turn_pool(s, n_new)
        if why is not None:
            self.publish("placement", {"session": s.id, "turn_prefill_pool": run_in, "reason": why})
            seq.handoff = lambda seq, s=s: self._handoff(s, seq)
        s.where = run_in
        reason = "prefill" if why else (s.move_reason or "placement")
        seq.on_admit = lambda s=s, run_in=run_in: self._bring_kv(s, run_in, reason)
        return run_in

    def _handoff(self, s: Session, seq: Sequence) -> None:
        """A long prompt was prefilled on a GPU pool: continue decoding in the session's decode pool
        (engine thread of the prefill pool).  The turn belongs to no engine while its KV moves: a change
        of placement meanwhile (its move found no turn to detach) is carried out once it has arrived."""
        with self.lock:
            to = s.placement.decode_pool
            if not self.alive(s):  # deleted meanwhile: its turn ends there (cancelled), nothing is copied
                self.pools[to].engine.submit(seq)
                return
        self._bring_kv(s, to, "prefill handoff")
        with self.lock:
            self._arrived(s, seq, to, "promotion" if s.sla.cls is SLAClass.INTERACTIVE else "demotion")

    def _arrived(self, s: Session, seq: Sequence, to: str, reason: str) -> None:
        """The turn whose KV was brought to pool ``to`` (no engine held it meanwhile) runs there, at its
        session's rank now; a change of placement made while it travelled - whose move found no turn to
        detach - is carried out at once (caller holds ``self.lock``)."""
        s.where = to
        seq.rank, seq.ttlt_s = s.rank, self.turn_budget(s.sla)
        self.pools[to].engine.submit(seq)
        now = s.placement.decode_pool
        if now != to and now in self.pools and not seq.cancel_requested:
            self._move_to(s, now, reason)

    def place_first_turn(self, s: Session, n_prompt: int) -> Placement | None:
        """A session placed before it had a prompt (created empty, so the router saw 0 tokens) is placed
        again when its first turn brings ``n_prompt`` tokens to compute (past a stored prefix); returns
        the new placement, or None when it stays (the same pools and priority - its reasons are brought up
        to date -, or a different decode strategy, whose KV would live elsewhere).  Caller holds
        ``self.lock``."""
        # Whenever it stays, its reasons are brought up to date: the old ones spoke of an empty prompt.
        kept = f"kept where it was at its first turn ({n_prompt} prompt tokens to compute)"
        try:
            new = place(SessionRequest(s.sla, n_prompt, s.max_context), self.system_state(), self.routing)
        except RoutingError as e:  # e.g. no room now: the turn runs where the session is, as before
            self._keep_placement(s, (kept, f"no other placement now: {e}"))
            return None
        if new.decode_strategy != s.placement.decode_strategy:  # its KV would live elsewhere
            self._keep_placement(s, (kept, f"the router now picks {new.decode_strategy} decode, but its KV "
                                           f"is laid out for {s.placement.decode_strategy}"))
            return None
        if dataclasses.replace(new, reasons=()) == dataclasses.replace(s.placement, reasons=()):
            # the same pools and priority (the free KV in reasons changes by itself, so not compared)
            self._keep_placement(s, (kept, *new.reasons))
            return None
        new = Placement(new.prefill_strategy, new.decode_strategy, new.prefill_pool, new.decode_pool, new.priority,
                        (f"placed with its prompt ({n_prompt} tokens to compute)" if s.ephemeral else
                         f"placed again at its first turn ({n_prompt} prompt tokens to compute)", *new.reasons))
        if not s.ephemeral:
            self.journal.set_placement(s.id, new.to_dict())
        s.placement = new
        self._move_to(s, new.decode_pool, "first turn")
        return new

    def _keep_placement(self, s: Session, reasons: tuple[str, ...]) -> None:
        """``s`` stays where it is, for ``reasons`` (caller holds ``self.lock``)."""
        kept = dataclasses.replace(s.placement, reasons=reasons)
        if not s.ephemeral:
            self.journal.set_placement(s.id, kept.to_dict())
        s.placement = kept

    def route_turn(self, s: Session, probe: Sequence, sla: SLA, answer_tokens: int
                   ) -> tuple[Placement | None, str, Refusal | None]:
        """Where this turn of ``s`` runs, before anything changes (caller holds ``self.lock``): (the
        placement to move the session to, or None to stay; the pool that runs it; the refusal of that
        pool's admission, or None).  A throughput-tolerant session spills from a CPU pool to a GPU pool
        when the router predicts the CPU would miss its budget (``routing.tree.place_turn``) or the CPU's
        admission refuses the turn and a GPU pool takes it; it returns to the CPU when that has room.
        ``probe.rank`` is set to the rank the turn will run at there (its placement's priority, which is
        what the engine orders by - not always its class's: the baselines keep one priority for all, a
        session raised to the top priority when no GPU has room), and ``probe.forecast`` to the router's
        forecast there (a throughput-tolerant turn)."""
        new = None
        state = self.system_state()
        if s.committed and sla == s.sla:  # a first turn or a changed SLA is placed by the router itself
            new = place_turn(s.placement, sla, len(probe.pending), len(s.committed), answer_tokens, state,
                             self.routing)
        placed = new or self._placed(s, sla, len(probe.pending), state)
        pool = placed.decode_pool if placed.decode_pool in self.pools else s.pool
        probe.rank = rank_of(placed)
        refusal = self.pools[pool].engine.refusal(probe)
        if refusal is not None and self._may_spill(s, sla, pool):
            need = len(s.committed) + len(probe.pending) + answer_tokens
            for g in spill_targets(state, need, self.routing):
                if self.pools[g.name].engine.refusal(probe) is None:
                    why = (f"CPU pool {pool!r} cannot take the turn ({refusal.reason}): spills to GPU pool "
                           f"{g.describe()}, one host-to-device KV copy")
                    new, pool, refusal = Placement("standard", "standard", g.name, g.name, placed.priority, (why,)), \
                        g.name, None
                    break
        if refusal is not None and refusal.alone:  # refused by an empty pool no other pool relieves: it would
            refusal = None  # be refused however often the client retried - it runs here, late rather than never
        here = next((p for p in state.pools if p.name == pool), None)
        if sla.cls is not SLAClass.INTERACTIVE and here is not None and here.strategy == "standard":
            f = forecast(here, len(probe.pending), answer_tokens, self.routing, len(s.committed))
            probe.forecast = (f.ttft_s, f.step_s)
        return new, pool, refusal

    def _placed(self, s: Session, sla: SLA, n_new: int, state) -> Placement:
        """The placement this turn will run under once ``start_turn`` has placed the session again - its
        first turn (``place_first_turn``), a change of class or a misplaced session (``replace``) - computed
        the same way before anything changes, so that admission judges the pool the turn goes to (and the
        rank it runs at there), not the one it leaves; the session's own placement when it stays."""
        try:
            if not s.committed:
                new = place(SessionRequest(sla, n_new, s.max_context), state, self.routing)
                if new.decode_strategy != s.placement.decode_strategy:  # (it stays: its KV is laid out there)
                    return s.placement
                return new
            if sla.cls != s.sla.cls or self.misplaced(s):
                return self._promoted(s, sla, state, n_new)
        except RoutingError:  # (it stays, as the placing itself would keep it)
            pass
        return s.placement

    def _may_spill(self, s: Session, sla: SLA, pool: str) -> bool:
        return (self.routing.policy == "sla" and sla.cls is not SLAClass.INTERACTIVE
                and s.placement.decode_strategy == "standard" and self.pools[pool].device_kind == "cpu")

    def send(self, s: Session, new: Placement, reason: str) -> None:
        """Run the session's turns where ``new`` says from this turn on: record it and move the session
        (caller holds ``self.lock``; the session has no turn running)."""
        if not s.ephemeral:
            self.journal.set_placement(s.id, new.to_dict())
        s.placement = new
        self._move_to(s, new.decode_pool, reason)

    def replace(self, s: Session, reason: str, turn_tokens: int = 0, new: Placement | None = None) -> Placement:
        """Let the router place the session again for its (new) SLA, record it and send the session
        where it says (caller holds ``self.lock``).  ``turn_tokens``: the prompt of the turn it runs
        next, when a turn brings the change (what a first-token target is predicted for).  ``new``: the
        placement admission already chose for that turn (``route_turn``: a spill to a GPU pool when the
        pool the router picks cannot take it), applied instead of placing again."""
        new = new or self._promoted(s, s.sla, self.system_state(), turn_tokens)
        if not s.ephemeral:  # the journal first: a write that fails leaves the placement as it was
            self.journal.set_sla(s.id, s.sla.to_dict())
            self.journal.set_placement(s.id, new.to_dict())
        s.placement = new
        self._move_to(s, new.decode_pool, reason)
        return new

    def _promoted(self, s: Session, sla: SLA, state, turn_tokens: int) -> Placement:
        """The router's placement of ``s`` under ``sla`` for a turn of ``turn_tokens`` prompt tokens (what
        ``replace`` applies, and what admission judges before it does)."""
        return promote(s.placement, SessionRequest(sla, s.context_tokens, s.max_context), state, self.routing,
                       turn_tokens)

    def misplaced(self, s: Session) -> bool:
        """A latency-sensitive session sitting on a CPU pool while the host has GPU pools (e.g. it was
        demoted when idle): its next turn should make the router look again."""
        return (s.sla.cls is SLAClass.INTERACTIVE and self.routing.policy == "sla"
                and self.pools[s.pool].device_kind == "cpu"
                and any(p.device_kind == "gpu" for p in self.pools.values()))

    def _move_to(self, s: Session, to: str, reason: str) -> None:
        """Send the session to pool ``to`` (caller holds ``self.lock``)."""
        if s.busy:
            if s.turn.handoff is not None:  # mid long-prompt prefill: the handoff goes to the new pool
                return
            if s.pool == to:
                self.pools[to].engine.set_rank(s.id, s.rank, self.turn_budget(s.sla))
                return
            self.pools[s.pool].engine.detach(s.id, lambda seq, s=s, to=to, at=s.pool:
                                             self._detached(s, seq, to, reason, at))
            return
        s.where = to
        s.move_reason = reason
        held = self.pools.get(s.kv_at) if s.kv_at else None
        if held is not None and held.device_kind == "gpu" and (held.backend is not self.pools[to].backend
                                                              or reason in ("idle demotion", "device memory")):
            self.mover.move_kv(s.id, s.kv, held, None, reason)  # frees device memory now; copies nothing
            s.kv_at = None

    def _detached(self, s: Session, seq: Sequence | None, to: str, reason: str, at: str) -> None:
        """Pool ``at``'s engine let go of the running turn (its engine thread), or found none.  The session
        goes where its placement says *now*: an SLA change that came while the move was pending wins over
        ``to``.  A turn that had already left ``at`` (a prefill hand-off) is moved from where it went: its
        KV is brought over once that engine lets go, never while it still writes rows there."""
        with self.lock:
            to = s.placement.decode_pool if s.placement.decode_pool in self.pools else to
            if seq is None:
                if not s.busy:  # its turn ended first: idle now, its KV follows at its next turn
                    if self.alive(s):
                        self._move_to(s, to, reason)
                elif s.pool != at and not s.turn.cancel_requested:  # it left ``at`` first: follow it there
                    self._move_to(s, to, reason)
                return
            if not self.alive(s):  # deleted meanwhile: the turn ends where it was (its cancel is set)
                self.pools[at].engine.submit(seq)
                return
        seq.on_admit = None  # (it brought the KV to ``at``; this move brings it to ``to``)
        try:
            self._bring_kv(s, to, reason)
        except Exception as exc:  # no room on the device: the turn goes on where it was, unharmed
            log.warning("session %s: its turn could not move to pool %s (%s): it goes on in pool %s",
                        s.id, to, exc, at)
            with self.lock:
                s.where = at
                seq.on_admit = lambda s=s, at=at: self._bring_kv(s, at, "move failed")
                self.pools[at].engine.submit(seq)
            return
        with self.lock:
            self._arrived(s, seq, to, reason)

    def turn_budget(self, sla: SLA) -> float | None:
        """A turn's whole-turn budget under ``sla``: the client's own, else its class's default (the
        profile's ``background_ttlt_s`` / ``batch_ttlt_s``; an interactive turn has none).  A running turn
        whose session's class changes takes its new class's: one demoted from interactive is paced to the
        background budget, not left without a deadline behind every other turn."""
        r = self.routing
        return sla.ttlt_s or {SLAClass.BACKGROUND: r.background_ttlt_s, SLAClass.BATCH: r.batch_ttlt_s}.get(sla.cls)

    def idle_on_gpu(self, sessions: Iterable[Session], now: float) -> list[str]:
        """Ids of the sessions whose KV has sat idle on a GPU pool with ``idle_demote_s`` for longer than
        that (caller holds ``self.lock``)."""
        due = []
        for s in sessions:
            held = self.pools.get(s.kv_at) if s.kv_at else None
            limit = held.config.idle_demote_s if held is not None and held.device_kind == "gpu" else None
            if limit is not None and s.settled and now - s.last_active >= limit:
                due.append(s.id)
        return due
