"""The daemon's core: model, sessions, router, one batch engine per pool, journal and KV store.

The API calls only this class.  Methods other than ``load`` and ``shutdown`` do no heavy work and
are called from the API's event loop; the engines call back from their own threads (``_commit``,
``_on_turn_event``: ``turn_events.py``), so session state shared between the two is guarded by
``self._lock``.

Its parts are mixins, one file each: ``lifecycle`` (load, recovery and the two halves of a stop),
``turn_start`` (starting and cancelling a turn), ``turn_events`` (a turn's events and commits),
``chains`` (stored responses), ``forks``, ``choices`` (n > 1) and ``device_room``.  Here: sessions,
SLA changes, idle demotion and status.

Collaborators: ``SessionMoves`` (where a turn runs and how a session moves between pools),
``EventBus`` (``/v1/events``), ``Mover`` (KV copies between backends), the ``Journal`` and the
``KVStore``; ``status`` describes pools and sessions for ``/v1/status``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weaved.config.profile import Profile, operator_profile_file
from weaved.daemon.chains import ResponseChains
from weaved.daemon.choices import TurnChoices
from weaved.daemon.device_room import DeviceRoom
from weaved.daemon.events import EventBus, Subscription
from weaved.daemon.forks import FORKING, SessionForks
from weaved.daemon.housekeeping import Housekeeper
from weaved.daemon.lifecycle import DaemonLifecycle, aligned
from weaved.daemon.moves import SessionMoves
from weaved.daemon.session import Session, pending_answer, transcript_view
from weaved.daemon.status import (
    device_kv_bytes,
    device_kv_free_bytes,
    hardware_status,
    kernel_status,
    pool_status,
    session_status,
)
from weaved.daemon.turn_events import TurnEvents
from weaved.daemon.turn_start import CANCEL_WAIT_S, TurnStarts
from weaved.engine.engine import BatchEngine
from weaved.errors import Conflict, ContextTooLong, InvalidRequest, NotFound
from weaved.routing.tree import place
from weaved.routing.types import SLA, RoutingError, SessionRequest, SLAClass, SystemState
from weaved.sizes import human_size

log = logging.getLogger("weave.daemon")


DELETED_KEPT = 10_000  # deleted sessions whose place in the list is remembered (for paging past them)


class Daemon(DaemonLifecycle, TurnStarts, SessionForks, ResponseChains, TurnChoices, DeviceRoom, TurnEvents):
    def __init__(self, profile: Profile, model_path: Path, *, data_dir: Path | None = None,
                 log_fn: Callable[[str], None] = print, federation=None, chat_template: str | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        """``clock`` (deadlines, token times) and ``wall`` (activity stamps, idle demotion) are the real
        clocks but in a simulation (weaved.sim), which runs the daemon on virtual time."""
        self.profile = profile
        self.clock, self.wall = clock, wall
        # where this daemon serves its control plane (weaved.federation.service.FederationListen), or
        # None: it then neither homes rings nor joins its peers' groups
        self.federation = federation
        self.member_groups = None
        self.waiting_groups: list[str] = []  # member groups whose thread was still in a network wait at shutdown
        self.model_path = Path(model_path)
        self.chat_template = chat_template  # replaces the model's own when given
        self.data_dir = Path(data_dir or profile.host.data_dir)
        self.log = log_fn  # one line at a time, for the operator (weave serve prints them)
        self._lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        # shared prefixes are copied here, off the engine threads, one at a time
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weave-prefix")
        self.engines: dict[str, BatchEngine] = {}
        self.pools: dict = {}  # name -> weaved.daemon.pools.Pool
        self.pool_notes: list[str] = []
        self.events = EventBus()
        self.moves: SessionMoves | None = None
        self.housekeeper: Housekeeper | None = None
        # the kernels numba compiled (weaved.daemon.warmup.CompileWatch): in ``load``, then while serving
        self.compiled = self.compiled_serving = None
        self._turns_stopped = False  # (stop_turns has run)
        self.unrecovered: dict[str, str] = {}  # sessions of the journal left out at load -> why
        self.deleted_created: OrderedDict[str, float] = OrderedDict()  # recently deleted session -> created
        self._data_lock: int | None = None  # the data directory's lock (data_lock.py), held while loaded
        self.started = wall()
        self.instance = secrets.token_hex(8)  # this daemon process, as its peers' checks see it

    # ---- sessions --------------------------------------------------------------------------------
    def _system_state(self) -> SystemState:
        free = max(0, (self.profile.host.kv_cap_bytes - self.store.reserved_bytes()) // self.config.kv_bytes_per_token)
        pools = [p.state(int(free), self.idle_device_bytes(p.backend)) for p in self.pools.values()]
        node = int(self.profile.host.kv_cap_bytes // self.config.kv_bytes_per_token)
        alive = self.peers.peers_alive()
        rings = any(p.config.strategy == "qring" for p in self.pools.values())
        depth = sum(1 for s in self.sessions.values() if s.placement.decode_strategy == "qring")
        # a pipeline prefill runs on a ring's group and scatters into its shards (RingBackend)
        return SystemState(tuple(pools), peers_alive=alive, ring_batch_depth=depth, node_kv_tokens=node,
                           pipeline_possible=rings and alive > 0)

    def _place(self, sla: SLA, prompt_tokens: int, max_context: int | None):
        try:
            return place(SessionRequest(sla, prompt_tokens, max_context), self._system_state(), self.profile.routing)
        except RoutingError as exc:
            raise ContextTooLong(str(exc), param="max_context") from exc

    def create_session(self, sla: SLA, max_context: int | None = None, system: str | None = None, *,
                       ephemeral: bool = False, prompt_tokens: int = 0, forked_from: str | None = None) -> dict:
        limit = self.config.context_length
        if max_context is not None and not 1 <= max_context <= limit:
            raise ContextTooLong(f"max_context must be between 1 and the model's context ({limit})",
                                 param="max_context")
        with self._lock:
            if not ephemeral:  # a request's throwaway session is bounded by admission, not by this cap
                self._make_session_room(keep=forked_from)
            placement = self._place(sla, prompt_tokens, max_context)
            sid = ("tmp-" if ephemeral else "s-") + secrets.token_hex(8)
            context = max_context or min(self.profile.host.default_context, limit)
            cap = aligned(context)
            kv = self._new_kv(sid, placement, cap, memory_only=ephemeral)
            s = Session(sid, sla, context, system, placement, kv, [], [], ephemeral=ephemeral,
                        last_active=self.wall(), forked_from=forked_from)
            if not ephemeral:
                try:
                    # a fork is recorded as being made until its context is copied: a crash between
                    # leaves nothing the client was never given (the next start removes it)
                    self.journal.create_session(sid, sla.to_dict(), s.max_context, system, placement.to_dict(),
                                                status=FORKING if forked_from else "active", forked_from=forked_from)
                except BaseException:  # (a full disk): its KV file goes too, nothing is left half-made
                    self._free_kv(s)
                    raise
            self.sessions[sid] = s
        if not ephemeral:  # (a stateless request's session is no event, as its turn is none)
            self.publish("placement", {"session": sid, "placement": placement.to_dict()})
            self.log(f"session {sid}: {sla.cls.value} -> {placement.decode_pool} ({'; '.join(placement.reasons)})")
        return self.get_session(sid)

    def _new_kv(self, sid: str, placement, capacity: int, tokens: list[int] | None = None,
                memory_only: bool = False, unfilled: bool = False):
        """A session's KV: its file here (``memory_only``: in memory, for an ephemeral session, which
        never outlives its request; ``unfilled``: a lost file made again, its journal's tokens not yet
        computed into it), or for Q-Ring decode its ring handle (the rows live on the ring's nodes; the
        transcript ``tokens`` rebuild them)."""
        if placement.decode_strategy == "qring":
            return self.pools[placement.decode_pool].backend.new_kv(capacity, tokens or (), label=sid)
        if tokens is not None:
            return self.store.open(sid, len(tokens))
        return self.store.create(sid, capacity, memory_only=memory_only, unfilled=unfilled)

    def _get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            if sid in self.unrecovered:  # kept on disk for the daemon that can serve it
                raise Conflict(f"session {sid} is in the data directory but this daemon did not recover it: "
                               f"{self.unrecovered[sid]}", param="session")
            raise NotFound(f"no session {sid!r}", param="session")
        return s

    def _idle_kept(self, sid: str, verb: str, done: str) -> Session:
        """Session ``sid`` for an operation on its whole context (``verb``: "fork", ``done``: "forked"): a
        kept session with no turn running (caller holds the lock)."""
        s = self._get(sid)
        if s.ephemeral:
            raise InvalidRequest(f"an ephemeral session cannot be {done}", param="session")
        if s.busy:
            raise Conflict(f"session {sid} is generating a turn; {verb} it once the turn has ended", param="session",
                           retryable=True)
        self._record_unrecorded(s)  # (its last answer, if a full disk kept it out: 507 while it still does)
        return s

    def get_session(self, sid: str, messages: bool = True) -> dict:
        """The session as the API shows it; ``messages=False`` leaves its transcript out (``messages``:
        null), for lists of many long sessions."""
        with self._lock:
            s = self._get(sid)
            return {
                "id": s.id, "sla": s.sla.to_dict(), "max_context": s.max_context, "system": s.system,
                "placement": s.placement.to_dict(), "status": "busy" if s.busy else "idle",
                # its turn's state, as the status's session rows say it: waiting, running, paused or idle
                "state": s.turn.status.value if s.busy else "idle",
                "context_tokens": s.context_tokens,
                # (with its last answer when a full disk kept it out of the journal: the context holds it)
                "messages": [transcript_view(m) for m in s.messages + pending_answer(s)] if messages else None,
                "created": s.created, "forked_from": s.forked_from,
                "pool": s.pool, "backend": self.engines[s.pool].backend.name if s.pool in self.engines else None,
            }

    def list_sessions(self, messages: bool = True) -> list[dict]:
        """Every stored session as ``get_session`` gives it, read in one hold of the lock (a session
        deleted meanwhile is simply not listed)."""
        with self._lock:
            return [self.get_session(sid, messages) for sid, s in self.sessions.items() if not s.ephemeral]

    def clear_prefixes(self) -> dict:
        """The stored prefixes emptied but for the files sessions map (``KVStore.clear_prefixes``) - after
        the publications queued before it (a stateless request's conversation, stored as its answer
        ended), on the publisher's one thread, so none lands after the clear."""
        try:
            out = self._publisher.submit(self.store.clear_prefixes).result()
        except RuntimeError:  # (shutting down: the publisher takes no more work)
            out = self.store.clear_prefixes()
        self.log(f"stored prefixes cleared: {out['files']} file(s), {human_size(out['bytes'])} "
                 f"({out['kept_files']} kept: sessions map them)")
        return out

    def delete_session(self, sid: str) -> None:
        with self._lock:
            if sid in self.unrecovered:  # (e.g. its KV file is another model's): its records and files go
                self.journal.delete(sid)
                self.store.delete(sid)
                del self.unrecovered[sid]
                self.log(f"session {sid}: deleted (it was not recovered)")
                return
            s = self._get(sid)
            if s.busy:  # its stream ends with finish_reason "cancelled" (_on_turn_event)
                s.turn.cancel_requested = True
                self.engines[s.pool].cancel(sid)
            del self.sessions[sid]
            if not s.ephemeral:  # where it stood in the list: a client paging past it goes on from there
                self.deleted_created[sid] = s.created
                while len(self.deleted_created) > DELETED_KEPT:
                    self.deleted_created.popitem(last=False)
        try:
            if not s.ephemeral:  # its record first: a stop before its files go leaves no session to bring back
                self.journal.delete(sid)  # (and files without a record are removed at the next start)
        finally:  # (a record that cannot be deleted - a full disk - still lets its KV go now)
            if s.publishing is not None:  # the publisher reads its rows: free them once it is done
                s.publishing.wait(CANCEL_WAIT_S)
            self._free_kv(s)

    def set_system(self, sid: str, system: str | None) -> None:
        """Replace a session's system prompt (its next turn re-renders the conversation: the context
        from the first changed token is fed again, and reported)."""
        with self._lock:
            s = self._get(sid)
            if not s.ephemeral:  # the journal first: a write that fails (a full disk) leaves it as it was
                self.journal.set_system(sid, system)
            s.system = system

    def cut_detached_turns(self) -> list[tuple[str, dict, int]]:
        """(session, request, transcript length before it) of each detached turn a stop or a crash cut,
        for the API to run again (``start_turn``'s ``detached``).  A session left out at load (another
        model's) keeps its record for when that model is served again; a record whose session's
        transcript does not end with that turn's cut answer is stale and dropped (run again, it would
        take back turns that came after)."""
        out = []
        with self._lock:
            for sid, body, n in self.journal.detached():
                s = self.sessions.get(sid)
                if s is None:
                    continue
                last = s.messages[-1] if s.messages else {}
                cut = (len(s.messages) == n + len(body.get("messages") or ()) + 1 and last.get("role") == "assistant"
                       and last.get("finish_reason") in ("shutdown", "interrupted"))
                if cut or len(s.messages) == n:  # (n: taken back to before the turn, not yet run again)
                    out.append((sid, body, n))
                else:
                    self.log(f"session {sid}: a detached turn's record no longer matches its transcript; dropped")
                    self.journal.drop_detached(sid)
        return out

    def forget_detached_turn(self, sid: str) -> None:
        """Give up running a cut detached turn again (it was refused); its partial answer stays."""
        self.journal.drop_detached(sid)

    # ---- SLA changes ---------------------------------------------------------------------------------
    def promote(self, sid: str) -> dict:
        return self._change_sla(sid, SLAClass.INTERACTIVE, 500.0, "promotion")

    def demote(self, sid: str, reason: str = "demotion", idle_since: float | None = None) -> dict | None:
        """To background (off a GPU pool where a CPU pool has room); a batch session, already below
        background, keeps its class and is only re-placed.  ``idle_since``: only if the session is still
        idle since then (a demotion for idleness or for room decided before a turn started in between:
        None, nothing changed)."""
        return self._change_sla(sid, SLAClass.BACKGROUND, None, reason, idle_since)

    def _change_sla(self, sid: str, cls: SLAClass, ttft_ms: float | None, kind: str,
                    idle_since: float | None = None) -> dict | None:
        """The session's class and first-token target change; its whole-answer budget (``ttlt_s``), the
        client's own, is kept - and so is its first-token target when the class stays (promoting an
        interactive session re-places it, e.g. onto a GPU pool that now has room).  A demotion never
        raises a batch session."""
        with self._lock:
            s = self._get(sid)
            if idle_since is not None and (not s.settled or s.last_active != idle_since):
                return None
            if cls is SLAClass.BACKGROUND and s.sla.cls is SLAClass.BATCH:
                cls = SLAClass.BATCH
            if s.sla.cls is cls:
                ttft_ms = s.sla.ttft_ms
            kept, sla = s.sla, SLA(cls, ttft_ms, s.sla.ttlt_s)
            s.sla = sla
            try:
                new = self.moves.replace(s, kind)
            except BaseException:  # (its journal write failed: the session stays as it was)
                s.sla = kept
                raise
            info = self.get_session(sid)  # (as changed: a delete right after must not make it a 404)
        event = "promotion" if sla.cls is SLAClass.INTERACTIVE else "demotion"
        self.publish(event, {"session": sid, "placement": new.to_dict(), "reason": kind})
        return info

    # ---- idle demotion -------------------------------------------------------------------------------
    def demote_idle(self, now: float) -> list[str]:
        """Demote sessions whose KV sat idle on a GPU pool with ``idle_demote_s`` for longer than that:
        they leave the GPU pool if a CPU pool has room, and their device copy is freed either way."""
        with self._lock:
            due = [(sid, self.sessions[sid].last_active) for sid in self.moves.idle_on_gpu(self.sessions.values(), now)]
        demoted = []
        for sid, since in due:
            try:
                if self.demote(sid, reason="idle demotion", idle_since=since) is not None:
                    demoted.append(sid)
            except Exception:
                log.exception("idle demotion of %s failed", sid)
        return demoted

    # ---- status and events -----------------------------------------------------------------------
    def publish(self, kind: str, data: dict) -> None:
        """Send an event to every ``/v1/events`` subscriber (any thread)."""
        self.events.publish(kind, data)

    def subscribe(self, backlog: int = 0, after: str | None = None) -> Subscription:
        return self.events.subscribe(backlog, after)

    def unsubscribe(self, sub: Subscription) -> None:
        self.events.unsubscribe(sub)

    def status(self) -> dict:
        """``/v1/status``: everything ``weave top`` shows."""
        pools = list(self.pools.values())
        now = self.clock()
        with self._lock:
            sessions = [session_status(s, self.pools, now) for s in self.sessions.values()]
        return {
            "model": {"name": self.model_name, "path": str(self.model_path), "arch": self.config.arch,
                      "context_length": self.config.context_length},
            "profile": self.profile.name, "profile_file": operator_profile_file(self.profile),
            "durability": self.profile.host.durability, "data_dir": str(self.data_dir),
            "uptime_s": round(self.wall() - self.started, 1),
            "pools": [pool_status(p) for p in pools], "pool_notes": self.pool_notes, "sessions": sessions,
            # sessions of the data directory this daemon could not serve, and why (DELETE removes them)
            "unrecovered": [{"id": sid, "reason": why} for sid, why in sorted(self.unrecovered.items())],
            "kv": {**self.store.tiers(), "device_bytes": device_kv_bytes(pools),
                   "device_free_bytes": device_kv_free_bytes(pools)},
            "hardware": hardware_status(pools),
            "peers": self.peers.list() if getattr(self, "peers", None) is not None else [],
            "migrations": self.mover.counters.to_dict() if hasattr(self, "mover") else None,
            "rates": self.rates.to_dict() if getattr(self, "rates", None) is not None else None,
            "device_rates": [r.to_dict() for r in getattr(self, "device_rates", ())],
            # the groups this daemon serves for its peers' rings (it is their home's member)
            "groups": self.member_groups.status() if self.member_groups is not None else [],
            "kernels": kernel_status(self.compiled, self.compiled_serving),
        }
