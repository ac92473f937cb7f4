"""The daemon's core: model, sessions, router, one batch engine per pool, journal and KV store.

The API calls only this class.  Methods other than ``load`` and ``shutdown`` do no heavy work and
are called from the API's event loop; the engines call back from their own threads (``_commit``,
``_on_turn_event``: ``turn_events.py``), so session state shared between the two is guarded by
``self._lock``.

Collaborators: ``SessionMoves`` (where a turn runs and how a session moves between pools),
``EventBus`` (``/v1/events``), ``Mover`` (KV copies between backends), the ``Journal`` and the
``KVStore``; ``status`` describes pools and sessions for ``/v1/status``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weaved.agent.grammar import GrammarEngine
from weaved.agent.plan import AnswerPlan, AnswerSpec
from weaved.agent.tool_results import answered_calls, check_tool_results
from weaved.backends.base import Backend
from weaved.config.profile import PoolConfig, Profile, operator_profile_file
from weaved.daemon.chains import ResponseChains
from weaved.daemon.choices import TurnChoices
from weaved.daemon.data_lock import lock_data_dir
from weaved.daemon.device_room import DeviceRoom
from weaved.daemon.events import EventBus
from weaved.daemon.forks import SessionForks
from weaved.daemon.housekeeping import Housekeeper, InlineExecutor
from weaved.daemon.moves import SessionMoves
from weaved.daemon.recovery import unfed_tail, unfinished_answer
from weaved.daemon.session import Session, transcript_entry, transcript_view
from weaved.daemon.status import (
    device_kv_bytes,
    device_kv_free_bytes,
    hardware_status,
    kernel_status,
    pool_status,
    session_status,
)
from weaved.daemon.turn_events import TurnEvents
from weaved.daemon.turns import (
    TurnHandle,
    chat_turn_tokens,
    check_fits,
    check_names_rendered,
    fitted,
    message_extra,
    prompt_turn_tokens,
    turn_constraint,
    turn_sequence,
)
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import SamplingParams
from weaved.engine.sequence import Sequence, SLARank
from weaved.errors import Conflict, ContextTooLong, InvalidRequest, NotFound, Overloaded, WeaveError
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig
from weaved.routing.tree import place
from weaved.routing.types import SLA, Placement, RoutingError, SessionRequest, SLAClass, SystemState

log = logging.getLogger("weave.daemon")
SLA_RANK = {SLAClass.INTERACTIVE: SLARank.INTERACTIVE, SLAClass.BACKGROUND: SLARank.BACKGROUND,
            SLAClass.BATCH: SLARank.BATCH}
KV_ALIGN = 32  # capacities are multiples of this: keeps the file's per-head runs page-aligned
MIN_KV_POSITIONS = 256  # the smallest KV cap a daemon starts with, in positions of its model
CANCEL_WAIT_S = 30.0  # how long a new turn waits for its session's cancelled turn to end (one engine step)


class Daemon(SessionForks, ResponseChains, TurnChoices, DeviceRoom, TurnEvents):
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
        self._data_lock: int | None = None  # the data directory's lock (data_lock.py), held while loaded
        self.started = wall()
        self.instance = secrets.token_hex(8)  # this daemon process, as its peers' checks see it

    # ---- life cycle ------------------------------------------------------------------------------
    def load(self, progress: Callable[[str], None] | None = None, *, config: ModelConfig | None = None,
             make_backend: Callable[[PoolConfig], Backend] | None = None, drive: bool = True) -> None:
        """Open the model, the KV store and the journal, build the pools, recover the sessions and start.

        A simulation (weaved.sim) replaces three things: ``config`` is the KV layout to keep (the model
        file then only gives the tokenizer), ``make_backend`` makes each pool's backend, and with
        ``drive`` False no thread is started - engines, housekeeper, peers' health checks - and prefixes
        are published inline: the caller steps the engines (``BatchEngine.run_once``).  A load that
        fails lets go of the data directory (``shutdown`` still closes what it opened)."""
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise WeaveError(f"the data directory {self.data_dir} is a file, not a directory: pass another "
                             f"--data-dir (or set the profile's host.data_dir)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._data_lock = lock_data_dir(self.data_dir)  # (before anything in it is read or written)
        try:
            self._load(progress, config, make_backend, drive)
        except BaseException:
            self._release_data_dir()
            raise

    def _release_data_dir(self) -> None:
        if self._data_lock is not None:
            os.close(self._data_lock)
            self._data_lock = None

    def _load(self, progress: Callable[[str], None] | None, config: ModelConfig | None,
              make_backend: Callable[[PoolConfig], Backend] | None, drive: bool) -> None:
        from weaved.calibration.store import CalibrationStore
        from weaved.daemon.device_rates import calibrate_devices
        from weaved.daemon.journal import Journal
        from weaved.daemon.migration import Mover
        from weaved.daemon.pools import build_pools
        from weaved.daemon.rates import apply_rates
        from weaved.daemon.warmup import CompileWatch, warm_up
        from weaved.kv.store import KVStore, model_fingerprint
        from weaved.model.default import cache_dir, served_name
        from weaved.model.loader import open_model
        from weaved.model.tokenizer import Tokenizer

        say = progress or (lambda m: None)
        say(f"opening {self.model_path.name}")
        gguf, file_config = open_model(self.model_path)
        self.config = config or file_config
        self.model_name = served_name(self.model_path)
        self.tokenizer = Tokenizer(self.model_path, gguf, chat_template=self.chat_template)
        self.grammar = GrammarEngine(self.tokenizer)  # builds its tokenizer on the first constrained turn
        from weaved.federation import service as fed
        from weaved.federation.shard_files import delete_group_files

        self._check_kv_cap()
        self.store = KVStore(self.data_dir / "kv", self.config, cap_bytes=self.profile.host.kv_cap_bytes,
                             share=self.profile.host.prefix_cache)
        delete_group_files(self.store)  # ring shards never outlive their group: rebuilt from transcripts
        self.fsync = self.profile.host.durability == "fsync"
        self.journal = Journal(self.data_dir / "journal.sqlite", fsync=self.fsync)
        self.peers = fed.peer_registry(self)  # profile and run-time peers, health-checked in the background
        if make_backend is None and any(p.backend == "cpu" for p in self.profile.pools):
            self._check_memory()
        if not drive:
            self._publisher.shutdown()
            self._publisher = InlineExecutor()
        say("loading weights and kernels")
        ring = fed.ring_factory(self, self.federation) if self.federation is not None else None
        with CompileWatch(on_first=lambda: say("compiling the kernels for this machine (once; about a minute)")
                          ) as self.compiled:
            self.pools, self.pool_notes = build_pools(self.profile, gguf, self.config, commit=self._commit,
                                                      reserve=self._reserve, on_event=self.publish, ring=ring,
                                                      progress=say, make_room=self.make_device_room,
                                                      make_backend=make_backend, clock=self.clock)
            self.engines = {name: p.engine for name, p in self.pools.items()}
            if make_backend is None:  # the first request then finds them compiled
                for backend in {id(p.backend): p.backend for p in self.pools.values()
                                if p.config.backend == "cpu" and p.config.strategy == "standard"}.values():
                    warm_up(backend, self.config.vocab_size)
            calibrations = CalibrationStore(self.data_dir, cache_dir() / "calibration")
            self.profile, self.rates = apply_rates(self.profile, self.pools, model_fingerprint(self.config),
                                                   calibrations, say)
            self.device_rates = [] if make_backend is not None else calibrate_devices(  # (a simulation's are modelled)
                self.pools, model_fingerprint(self.config), calibrations, say,
                step_target_s=self.profile.routing.step_target_s)
        if not any(p.config.strategy == "standard" for p in self.pools.values()):
            raise WeaveError("the profile has no pool this daemon can run: "
                             + "; ".join(self.pool_notes or ["it names none with the standard strategy"]))
        if self.federation is not None:
            self.member_groups = fed.member_groups(self, self.federation)
        self.mover = Mover(self.publish, self.clock)
        self.moves = SessionMoves(pools=self.pools, routing=self.profile.routing, journal=self.journal,
                                  store=self.store, peers=self.peers, mover=self.mover, publish=self.publish,
                                  system_state=self._system_state, lock=self._lock, make_room=self.make_device_room)
        say("recovering sessions")
        self._recover()
        reserved, cap = self.store.reserved_bytes(), self.profile.host.kv_cap_bytes
        if reserved > cap:  # (a cap lowered since they were made: they run, new sessions find no room)
            self.pool_notes.append(f"the recovered sessions reserve {reserved / 2**20:.1f} MiB of KV, more than the "
                                   f"cap of {cap / 2**20:.1f} MiB: a new session finds no room until some are "
                                   f"deleted (weave rm) or the cap (host.kv_cap_bytes) is raised")
            self.log(f"note: {self.pool_notes[-1]}")
        if not drive:
            return
        self.compiled_serving = CompileWatch().__enter__()  # left at shutdown
        self.peers.start()
        for e in self.engines.values():
            e.start()
        limits = [p.config.idle_demote_s for p in self.pools.values() if p.config.idle_demote_s is not None]
        self.housekeeper = Housekeeper.for_idle_demotion(limits, self.demote_idle)

    def _check_kv_cap(self) -> None:
        """Refuse a KV cap too small for a useful session of this model (a profile's typo, a unit left
        out), before serving requests that could only fail."""
        bpt, cap = self.config.kv_bytes_per_token, self.profile.host.kv_cap_bytes
        if cap < MIN_KV_POSITIONS * bpt:
            raise WeaveError(f"the profile's host.kv_cap_bytes ({cap:,} bytes) holds {cap // bpt} positions of "
                             f"{self.model_name}'s KV ({bpt:,} bytes each); a session needs at least "
                             f"{MIN_KV_POSITIONS}: raise it (e.g. kv_cap_bytes = \"4GiB\", or \"auto\")")

    def _check_memory(self) -> None:
        """Refuse a model the CPU pool cannot hold: it repacks every matrix into memory once, so its
        weights take about the file's size in RAM."""
        import psutil

        size, total = self.model_path.stat().st_size, psutil.virtual_memory().total
        if size > total:
            raise WeaveError(f"{self.model_path.name} needs about {size / 2**30:.1f} GiB of memory for its weights "
                             f"(the file's size: the CPU pool holds them repacked), but this host has "
                             f"{total / 2**30:.1f} GiB of RAM")

    def _recover(self) -> None:
        for rec in self.journal.list():
            sla = SLA.from_dict(rec.sla)
            placement = Placement.from_dict(rec.placement) if rec.placement else None
            try:
                if placement is None or placement.decode_pool not in self.engines:
                    placement = self._place(sla, rec.kv_length, rec.max_context)
                cap = -(-rec.max_context // KV_ALIGN) * KV_ALIGN
                kv = self._new_kv(rec.id, placement, cap, list(rec.tokens[: rec.kv_length]))
            except Exception as exc:  # a KV file made for another model, or lost; no ring: keep the rest serving
                self.log(f"session {rec.id} not recovered: {exc}")
                self.unrecovered[rec.id] = str(exc)
                continue
            messages = [{**transcript_entry(m["role"], m["content"], m["finish_reason"]), **(message_extra(m) or {})}
                        for m in rec.messages]
            partial = unfinished_answer(rec, self.tokenizer.decode)
            if partial is not None:  # the daemon stopped mid-turn: keep what was committed of the answer
                messages.append(transcript_entry("assistant", partial[0], "interrupted"))
                self.journal.finish_message(rec.id, "assistant", partial[0], partial[1], "interrupted")
            self.sessions[rec.id] = Session(rec.id, sla, rec.max_context, rec.system, placement, kv,
                                            list(rec.tokens), messages, created=rec.created,
                                            forked_from=rec.forked_from,
                                            tail=unfed_tail(rec) if partial is None else [])
        if self.sessions:
            self.log(f"recovered {len(self.sessions)} session(s) from {self.data_dir}")

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The API's event loop: where ``/v1/events`` subscribers read."""
        self.events.attach_loop(loop)

    def stop_turns(self) -> None:
        """Shutdown's first half: the engines stop after their current step (a running turn ends,
        marked ``shutdown``), with the journal still open for what the API records as those turns end
        (a stored response).  ``shutdown`` does it too; once is enough."""
        if self._turns_stopped:
            return
        self._turns_stopped = True
        if self.compiled_serving is not None:
            self.compiled_serving.__exit__(None, None, None)
        if self.housekeeper is not None:
            self.housekeeper.stop()
        if getattr(self, "peers", None) is not None:
            self.peers.stop()
        for e in self.engines.values():  # (their last turns' ends may still queue prefixes to publish)
            e.stop()

    def shutdown(self) -> None:
        self.stop_turns()
        self._publisher.shutdown(wait=True)
        for p in self.pools.values():  # e.g. release the members of this daemon's rings
            p.backend.close()
        if self.member_groups is not None:
            self.member_groups.stop()
        if hasattr(self, "journal"):
            self.journal.close()
        if hasattr(self, "store"):
            self.store.settle(timeout=10.0)
        self._release_data_dir()

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
                self._make_session_room()
            placement = self._place(sla, prompt_tokens, max_context)
            sid = ("tmp-" if ephemeral else "s-") + secrets.token_hex(8)
            context = max_context or min(self.profile.host.default_context, limit)
            cap = -(-context // KV_ALIGN) * KV_ALIGN
            kv = self._new_kv(sid, placement, cap, memory_only=ephemeral)
            s = Session(sid, sla, context, system, placement, kv, [], [], ephemeral=ephemeral,
                        last_active=self.wall(), forked_from=forked_from)
            self.sessions[sid] = s
            if not ephemeral:
                self.journal.create_session(sid, sla.to_dict(), s.max_context, system, placement.to_dict(),
                                            forked_from=forked_from)
        if not ephemeral:  # (an ephemeral session's placement is published once, at its turn, with its prompt)
            self.publish("placement", {"session": sid, "placement": placement.to_dict()})
            self.log(f"session {sid}: {sla.cls.value} -> {placement.decode_pool} ({'; '.join(placement.reasons)})")
        return self.get_session(sid)

    def _new_kv(self, sid: str, placement, capacity: int, tokens: list[int] | None = None,
                memory_only: bool = False):
        """A session's KV: its file here (``memory_only``: in memory, for an ephemeral session, which
        never outlives its request), or for Q-Ring decode its ring handle (the rows live on the ring's
        nodes; the transcript ``tokens`` rebuild them)."""
        if placement.decode_strategy == "qring":
            return self.pools[placement.decode_pool].backend.new_kv(capacity, tokens or (), label=sid)
        if tokens is not None:
            return self.store.open(sid, len(tokens))
        return self.store.create(sid, capacity, memory_only=memory_only)

    def _get(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            if sid in self.unrecovered:  # kept on disk for the daemon that can serve it
                raise Conflict(f"session {sid} is in the data directory but this daemon did not recover it: "
                               f"{self.unrecovered[sid]}", param="session")
            raise NotFound(f"no session {sid!r}", param="session")
        return s

    def get_session(self, sid: str) -> dict:
        with self._lock:
            s = self._get(sid)
            return {
                "id": s.id, "sla": s.sla.to_dict(), "max_context": s.max_context, "system": s.system,
                "placement": s.placement.to_dict(), "status": "busy" if s.busy else "idle",
                "context_tokens": s.context_tokens, "messages": [transcript_view(m) for m in s.messages],
                "created": s.created, "forked_from": s.forked_from,
                "pool": s.pool, "backend": self.engines[s.pool].backend.name if s.pool in self.engines else None,
            }

    def list_sessions(self) -> list[dict]:
        with self._lock:
            ids = [sid for sid, s in self.sessions.items() if not s.ephemeral]
        return [self.get_session(sid) for sid in ids]

    def delete_session(self, sid: str) -> None:
        with self._lock:
            s = self._get(sid)
            if s.busy:  # its stream ends with finish_reason "cancelled" (_on_turn_event)
                s.turn.cancel_requested = True
                self.engines[s.pool].cancel(sid)
            del self.sessions[sid]
        if s.publishing is not None:  # the publisher reads its rows: free them once it is done
            s.publishing.wait(CANCEL_WAIT_S)
        self._free_kv(s)
        if not s.ephemeral:
            self.journal.delete(sid)

    def set_system(self, sid: str, system: str | None) -> None:
        """Replace a session's system prompt (its next turn re-renders the conversation: the context
        from the first changed token is fed again, and reported)."""
        with self._lock:
            s = self._get(sid)
            s.system = system
            if not s.ephemeral:
                self.journal.set_system(sid, system)

    # ---- turns -----------------------------------------------------------------------------------
    def start_turn(self, *, session_id: str | None, messages: list[dict] | None = None,
                   prompt: str | list[int] | None = None, params: SamplingParams, sla: SLA | None = None,
                   echo: bool = False, emit: Callable[[dict], None], answer: AnswerSpec | None = None,
                   answer_plan: AnswerPlan | None = None, continues: int | None = None) -> TurnHandle:
        """Start a turn: ``messages`` (a chat turn; ``answer`` says what its answer may hold - tools,
        response format - see ``weaved.agent``) or a raw ``prompt`` (``answer_plan``: a prompt that ends
        where a chat answer starts - a forked choice - and is constrained as that answer).  ``continues``:
        the transcript length the turn follows (a stored response's end, ``chains``): entries past it are
        dropped first.  WeaveError for a turn it refuses; nothing else has changed then."""
        if (messages is None) == (prompt is None):
            raise InvalidRequest("a turn needs either messages or a prompt")
        if messages is not None and not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if messages is not None and not self.tokenizer.chat_template:
            raise InvalidRequest(f"the model {self.model_name} has no chat template, so it cannot take messages: "
                                 f"serve it with --chat-template FILE, or send a prompt to /v1/completions",
                                 param="messages")
        plan = AnswerPlan(answer or AnswerSpec(), self.tokenizer, self.grammar) if messages is not None else answer_plan
        if plan is not None and plan.spec.constrained:
            _ = self.grammar.lltokenizer  # built once (seconds for a large vocabulary), not under the lock
        if session_id is None:
            info = self.create_session(sla or SLA(SLAClass.INTERACTIVE), ephemeral=True)
            session_id = info["id"]
        self._await_previous_turn(session_id)
        with self._lock:
            s = self._get(session_id)
            if s.turn is not None and not s.turn.ended.is_set():
                raise Conflict(f"session {session_id} is already generating a turn", param="session")
            if continues is not None:
                self._rewind(s, continues)
            try:
                if messages is not None:
                    check_tool_results(messages, answered_calls(s.messages))
                    check_names_rendered(plan.render, list(s.messages) + list(messages))
                    new, keep = chat_turn_tokens(self.tokenizer, s, messages, render=plan.render)
                else:
                    new, keep = prompt_turn_tokens(self.tokenizer, s, prompt)
                # the answer the router budgets for: what max_tokens allows, or a typical one when unset
                answer = min(params.max_tokens, self.profile.routing.answer_tokens) if params.fit_context \
                    else params.max_tokens
                params = fitted(params, s, keep, new)
                check_fits(s, keep, new, params.max_tokens)
                constraint = turn_constraint(plan, params)
                # a fresh session's prompt may start with a stored prefix: its prefill cost is the rest
                cached = self.store.cached_prefix(new[:-1]) if (
                    not s.committed and isinstance(s.kv, KVCache) and self.store.share) else 0
                moved, predicted = self._admit(s, new[cached:], params, sla or s.sla, answer)
            except WeaveError:
                if s.ephemeral:
                    self._drop_ephemeral(s)
                raise
            reprefilled = len(s.committed) - keep
            if reprefilled:  # the template rewrote history (e.g. dropped earlier thinking): re-prefill from there
                self.publish("reprefill", {"session": s.id, "from": keep, "tokens": reprefilled})
                if isinstance(s.kv, KVCache):
                    self.store.unshare(s.kv, keep)
                s.kv.truncate(keep)
                del s.committed[keep:]
                if not s.ephemeral:
                    self.journal.truncate(s.id, keep)
            s.tail = []
            first = not s.committed  # the session's first turn: its prompt may start with a stored prefix
            if first and isinstance(s.kv, KVCache):
                shared = self.store.share_prefix(s.kv, new)
                held = self.store.copy_prefix(s.kv, new, shared)  # kept short blocks past it, copied
                if held:  # those rows are mapped or copied, not computed: the turn feeds the rest
                    s.committed.extend(new[:held])
                    if not s.ephemeral:
                        if self.fsync and held > shared:
                            self.store.flush(s.kv)  # the copied rows reach the disk before the journal
                        self.journal.commit_tokens(s.id, new[:held], held)
                    new, keep = new[held:], held
            resla = sla is not None and sla.cls != s.sla.cls
            if sla is not None and sla != s.sla:
                s.sla = sla
            if resla or self.moves.misplaced(s):  # a check-in: the router re-places the session first
                new_pl = self.moves.replace(s, "promotion" if s.sla.cls is SLAClass.INTERACTIVE else "demotion")
                self.publish("placement", {"session": s.id, "placement": new_pl.to_dict()})
            elif moved is not None:  # a throughput-tolerant turn spills to a GPU pool, or returns to the CPU
                self.moves.send(s, moved, "spill" if self.pools[moved.decode_pool].device_kind == "gpu" else "return")
                self.publish("placement", {"session": s.id, "placement": moved.to_dict()})
            elif first:  # its first turn: the router sees the real prompt now (what a stored prefix leaves)
                new_pl = self.moves.place_first_turn(s, len(new))
                if new_pl is not None or s.ephemeral:
                    self.publish("placement", {"session": s.id, "placement": s.placement.to_dict()})
            if messages is not None:
                for i, m in enumerate(messages):
                    s.messages.append(dict(m))
                    if not s.ephemeral:  # the last message carries the turn's prompt tokens (see recovery)
                        ids = list(new) if i == len(messages) - 1 else None
                        self.journal.add_message(s.id, m["role"], m["content"], ids, extra=message_extra(m))
            elif not s.ephemeral:
                self.journal.add_message(s.id, "prompt", prompt if isinstance(prompt, str) else "", list(new))
            seq = turn_sequence(s, new, params, self.tokenizer, echo=echo, arrival=self.clock(),
                                default_ttlt_s=self._default_ttlt(s.sla),
                                constraint=constraint)
            seq.forecast = predicted
            n_prompt = len(s.committed) + len(new)
            seq.emit = lambda ev, s=s, seq=seq: self._on_turn_event(s, seq, ev, emit, n_prompt, first)
            s.turn = seq
            s.answer_plan, s.call_seed = plan, secrets.token_hex(8)
            s.last_active = self.wall()
            run_in = self.moves.prepare_turn(s, seq, len(new))
        handle = TurnHandle(s.id, n_prompt, keep, cancel=lambda sid=s.id: self.cancel_turn(sid),
                            placement=s.placement.to_dict(), answer=plan,
                            reprefilled=reprefilled, call_seed=s.call_seed)
        self.engines[run_in].submit(seq)
        return handle

    def _admit(self, s: Session, new: list[int], params: SamplingParams, sla: SLA, answer: int
               ) -> tuple[Placement | None, tuple[float, float] | None]:
        """Where the turn runs (``SessionMoves.route_turn``: a placement to move the session to, or None to
        stay) and the router's forecast for it there, or Overloaded (503 with Retry-After) for a turn no
        pool can take without missing an SLA it has accepted (``weaved.engine.admission``); nothing has
        changed yet when it refuses."""
        probe = Sequence(session_id=s.id, kv=s.kv, pending=list(new), params=params,
                         rank=SLA_RANK[sla.cls], ttft_s=sla.ttft_ms / 1000 if sla.ttft_ms else None,
                         ttlt_s=sla.ttlt_s or self._default_ttlt(sla))
        moved, pool, refusal = self.moves.route_turn(s, probe, sla, answer)
        if refusal is not None:
            self.publish("refusal", {"session": s.id, "pool": pool, "class": sla.cls.value,
                                     "reason": refusal.reason, "retry_after_s": round(refusal.retry_after_s, 1)})
            raise Overloaded(f"pool {pool!r} is at capacity: {refusal.reason}; retry in "
                             f"{refusal.retry_after_s:.0f} s", retry_after_s=refusal.retry_after_s)
        return moved, probe.forecast

    def _default_ttlt(self, sla: SLA) -> float | None:
        """The TTLT budget of a throughput-tolerant turn whose SLA names none (the profile's)."""
        th = self.profile.routing
        return {SLAClass.BACKGROUND: th.background_ttlt_s, SLAClass.BATCH: th.batch_ttlt_s}.get(sla.cls)

    def _await_previous_turn(self, sid: str) -> None:
        """Wait (bounded) for the session's last turn to be over when it is only ending: cancelled by a
        client that hung up and came back, or finished but not yet recorded.  A turn still generating
        is left alone (start_turn refuses the new one)."""
        with self._lock:
            s = self.sessions.get(sid)
            turn = s.turn if s is not None else None
        if turn is not None and (turn.cancel_requested or turn.status.done):
            turn.ended.wait(CANCEL_WAIT_S)
        if s is not None and s.publishing is not None:  # its prefix is being copied: its rows must hold still
            s.publishing.wait(CANCEL_WAIT_S)

    def cancel_turn(self, sid: str) -> None:
        with self._lock:
            s = self.sessions.get(sid)
            if s is None or not s.busy:
                return
            s.turn.cancel_requested = True
        self.engines[s.pool].cancel(sid)

    # ---- SLA changes ---------------------------------------------------------------------------------
    def promote(self, sid: str) -> dict:
        return self._change_sla(sid, SLAClass.INTERACTIVE, 500.0, "promotion")

    def demote(self, sid: str, reason: str = "demotion") -> dict:
        return self._change_sla(sid, SLAClass.BACKGROUND, None, reason)

    def _change_sla(self, sid: str, cls: SLAClass, ttft_ms: float | None, kind: str) -> dict:
        """The session's class and first-token target change; its whole-answer budget (``ttlt_s``), the
        client's own, is kept - and so is its first-token target when the class stays (promoting an
        interactive session re-places it, e.g. onto a GPU pool that now has room)."""
        with self._lock:
            s = self._get(sid)
            if s.sla.cls is cls:
                ttft_ms = s.sla.ttft_ms
            sla = s.sla = SLA(cls, ttft_ms, s.sla.ttlt_s)
            new = self.moves.replace(s, kind)
        event = "promotion" if sla.cls is SLAClass.INTERACTIVE else "demotion"
        self.publish(event, {"session": sid, "placement": new.to_dict(), "reason": kind})
        return self.get_session(sid)

    # ---- idle demotion -------------------------------------------------------------------------------
    def demote_idle(self, now: float) -> list[str]:
        """Demote sessions whose KV sat idle on a GPU pool with ``idle_demote_s`` for longer than that:
        they leave the GPU pool if a CPU pool has room, and their device copy is freed either way."""
        with self._lock:
            due = self.moves.idle_on_gpu(self.sessions.values(), now)
        for sid in due:
            try:
                self.demote(sid, reason="idle demotion")
            except Exception:
                log.exception("idle demotion of %s failed", sid)
        return due

    # ---- status and events -----------------------------------------------------------------------
    def publish(self, kind: str, data: dict) -> None:
        """Send an event to every ``/v1/events`` subscriber (any thread)."""
        self.events.publish(kind, data)

    def subscribe(self, backlog: int = 0) -> asyncio.Queue:
        return self.events.subscribe(backlog)

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.events.unsubscribe(q)

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
