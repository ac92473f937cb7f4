"""The daemon's life cycle: ``load`` (the data directory's lock, the model, the KV store and the journal,
the pools, the recovered sessions, the engines' threads) and the two halves of a stop (``stop_turns``,
then ``shutdown``).

A mixin of ``weaved.daemon.core.Daemon``: it sets the attributes the rest of the daemon reads once
loaded (``config``, ``tokenizer``, ``store``, ``journal``, ``pools``, ``engines``, ``moves``, ...) and
calls the daemon's own ``_place``, ``_new_kv``, ``_commit`` and ``_reserve``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from weaved.agent.grammar import GrammarEngine
from weaved.backends.base import Backend
from weaved.config.profile import PoolConfig
from weaved.daemon.data_lock import lock_data_dir
from weaved.daemon.forks import FORKING
from weaved.daemon.housekeeping import Housekeeper, InlineExecutor
from weaved.daemon.moves import SessionMoves
from weaved.daemon.recovery import transcript_of, unfed_prompt, unfed_tail, unfinished_answer
from weaved.daemon.session import Session, UnrecordedAnswer, transcript_entry
from weaved.errors import InsufficientStorage, SettingRefused, WeaveError
from weaved.kv.errors import KVFileMismatch, KVStoreError
from weaved.model.config import ModelConfig
from weaved.routing.types import SLA, Placement
from weaved.sizes import human_size

KV_ALIGN = 32  # capacities are multiples of this: keeps the file's per-head runs page-aligned
MIN_KV_POSITIONS = 256  # the smallest KV cap a daemon starts with, in positions of its model


def aligned(positions: int) -> int:
    """A KV file's capacity for ``positions``: the next multiple of ``KV_ALIGN``."""
    return -(-positions // KV_ALIGN) * KV_ALIGN


class DaemonLifecycle:
    """``load`` once, then ``stop_turns`` and ``shutdown`` (in that order, or ``shutdown`` alone)."""

    def load(self, progress: Callable[[str], None] | None = None, *, config: ModelConfig | None = None,
             make_backend: Callable[[PoolConfig], Backend] | None = None, drive: bool = True) -> None:
        """Open the model, the KV store and the journal, build the pools, recover the sessions and start.

        A simulation (weaved.sim) replaces three things: ``config`` is the KV layout to keep (the model
        file then only gives the tokenizer), ``make_backend`` makes each pool's backend, and with
        ``drive`` False no thread is started - engines, housekeeper, peers' health checks - and prefixes
        are published inline: the caller steps the engines (``BatchEngine.run_once``).  A load that
        fails lets go of the data directory (``shutdown`` still closes what it opened)."""
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise SettingRefused(f"the data directory {self.data_dir} is a file, not a directory: pass another "
                             f"--data-dir (or set the profile's host.data_dir)")
        try:  # a new one is the user's alone: it holds transcripts and their KV
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise SettingRefused(f"cannot make the data directory {self.data_dir}: {e.strerror or e}: pass another "
                             f"--data-dir (or set the profile's host.data_dir)") from None
        self._data_lock = lock_data_dir(self.data_dir)  # (before anything in it is read or written)
        try:
            self._load(progress, config, make_backend, drive)
        except BaseException:
            self._release_data_dir()
            raise

    def hand_over_data_dir(self) -> int | None:
        """The data directory's lock descriptor, which ``shutdown`` then leaves open: for a process that
        execs itself again and keeps the directory (``data_lock.INHERITED_ENV``)."""
        fd, self._data_lock = self._data_lock, None
        return fd

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
        if not self.tokenizer.chat_template:  # said once here, not only in each refused request
            say(f"{self.model_path.name} has no chat template: chat and Responses requests will be refused; "
                f"serve it with --chat-template FILE for them, or send prompts to /v1/completions "
                f"(`weave run --raw`)")
        else:
            try:
                self.tokenizer.template.check()
            except ValueError as e:
                say(f"{self.model_path.name}: {e}: chat and Responses requests will be refused (400); serve it "
                    f"with --chat-template FILE for them, or send prompts to /v1/completions")
        self.grammar = GrammarEngine(self.tokenizer)  # builds its tokenizer on the first constrained turn
        from weaved.federation import service as fed
        from weaved.federation.shard_files import delete_group_files

        self._check_kv_cap()
        if make_backend is None and any(p.backend == "cpu" for p in self.profile.pools):
            self._check_memory()  # (before anything is made in the data directory)
            self._check_pool_sizes()  # (the model first: a batch's KV matters only if the model fits)
        self.fsync = self.profile.host.durability == "fsync"
        _check_journal_kept(self.data_dir)
        self.store = KVStore(self.data_dir / "kv", self.config, cap_bytes=self.profile.host.kv_cap_bytes,
                             share=self.profile.host.prefix_cache, durable=self.fsync)
        delete_group_files(self.store)  # ring shards never outlive their group: rebuilt from transcripts
        with _journal_damage(self.data_dir / "journal.sqlite"):
            self.journal = Journal(self.data_dir / "journal.sqlite", fsync=self.fsync)
        self.peers = fed.peer_registry(self)  # profile and run-time peers, health-checked in the background
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

            # (the warm-up's and the calibration's kernels run on the process's kernel thread, as every step's do)
            if make_backend is None:  # the first request then finds them compiled
                for backend in {id(p.backend): p.backend for p in self.pools.values()
                                if p.config.backend == "cpu" and p.config.strategy == "standard"}.values():
                    warm_up(backend, self.config.vocab_size)
            calibrations = CalibrationStore(self.data_dir, cache_dir() / "calibration")
            self.profile, self.rates = apply_rates(self.profile, self.pools, model_fingerprint(self.config),
                                                   calibrations, say)
            self.device_rates = [] if make_backend is not None else calibrate_devices(  # (a simulation's are
                self.pools, model_fingerprint(self.config), calibrations, say,  # modelled)
                step_target_s=self.profile.routing.step_target_s)
        if not any(p.config.strategy == "standard" for p in self.pools.values()):
            raise SettingRefused("the profile has no pool this daemon can run: "
                             + "; ".join(self.pool_notes or ["it names none with the standard strategy"]))
        if self.federation is not None:
            self.member_groups = fed.member_groups(self, self.federation)
        self.mover = Mover(self.publish, self.clock)
        self.moves = SessionMoves(pools=self.pools, routing=self.profile.routing, journal=self.journal,
                                  store=self.store, peers=self.peers, mover=self.mover, publish=self.publish,
                                  system_state=self._system_state, lock=self._lock, make_room=self.make_device_room,
                                  alive=lambda s: self.sessions.get(s.id) is s)
        say("recovering sessions")
        with _journal_damage(self.data_dir / "journal.sqlite"):
            self._recover()
        reserved, cap = self.store.reserved_bytes(), self.profile.host.kv_cap_bytes
        if reserved > cap:  # (a cap lowered since they were made: they run, new sessions find no room)
            self.pool_notes.append(f"the recovered sessions reserve {reserved / 2**20:.1f} MiB of KV, more than the "
                                   f"cap of {cap / 2**20:.1f} MiB: a new session finds no room until some are "
                                   f"deleted (weave rm) or the cap (host.kv_cap_bytes) is raised")
            self.log(f"note: {self.pool_notes[-1]}")
        room = shutil.disk_usage(self.data_dir).free + reserved  # the KV files live there
        if cap > room:  # the cap is what the router counts on: a full disk would fail turns first
            self.pool_notes.append(f"the KV cap (host.kv_cap_bytes, {human_size(cap)}) is more than the data "
                                   f"directory's disk can hold ({human_size(room)} free with the sessions' KV): "
                                   f"sessions past it fail with a full disk rather than being refused; lower the "
                                   f"cap, or use \"auto\"")
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
            raise SettingRefused(f"the profile's host.kv_cap_bytes ({cap:,} bytes) holds {cap // bpt} positions of "
                             f"{self.model_name}'s KV ({bpt:,} bytes each); a session needs at least "
                             f"{MIN_KV_POSITIONS}: raise it (e.g. kv_cap_bytes = \"4GiB\", or \"auto\")")

    def _check_pool_sizes(self) -> None:
        """Refuse a decode batch whose KV alone (at the positions calibration gives each sequence) outgrows
        half the host's memory, before calibration tries it: one zero too many in a profile must not take
        the host down."""
        import psutil

        from weaved.daemon.rates import CONTEXT

        bpt, ram = self.config.kv_bytes_per_token, psutil.virtual_memory().total
        for p in self.profile.pools:  # (a prefill chunk past the model's context is calibrated up to the context)
            need = p.max_batch * (CONTEXT // 2 + 64) * bpt
            if p.backend == "cpu" and need > ram // 2:
                raise SettingRefused(f"pool {p.name}: max_batch ({p.max_batch}) sequences of {CONTEXT // 2} positions "
                                 f"hold {human_size(need)} of {self.model_name}'s KV, more than half this host's "
                                 f"memory ({human_size(ram)}): lower it")

    def _check_memory(self) -> None:
        """Refuse a model the CPU pool cannot hold: it repacks every matrix into memory once
        (``weaved.model.footprint``)."""
        from weaved.model.footprint import too_large

        why = too_large(self.model_path)
        if why is not None:
            raise WeaveError(why)

    def _recover(self) -> None:
        rebuilt = 0
        damaged: dict[str, str] = {}

        def bad_record(sid: str, e: Exception) -> None:
            damaged[sid] = f"its journal record cannot be read ({type(e).__name__}: {e})"

        records = self.journal.list(damaged=bad_record)
        for rec in [r for r in records if r.status == FORKING]:  # cut by a crash while being made: never given
            try:  # to the client, its file goes with the others of no session below
                self.journal.delete(rec.id)
                self.log(f"session {rec.id}: a fork of {rec.forked_from} cut by the last stop before it was "
                         f"complete; removed")
            except InsufficientStorage:  # (a full disk: its record goes at a later start)
                self.log(f"session {rec.id}: a fork cut by the last stop before it was complete; left out")
        records = [r for r in records if r.status != FORKING]
        for sid, why in damaged.items():  # its KV file stays: a repaired journal would find it again
            self.log(f"session {sid} not recovered: {why}")
            self.unrecovered[sid] = why
        recorded = {rec.id for rec in records} | set(damaged)
        for sid in self.store.session_ids():  # a session deleted just before a stop: its record went first
            if sid not in recorded:
                self.store.delete(sid)
                self.log(f"KV file of session {sid} removed: no session of the journal holds it (deleted, or "
                         f"never recorded, before the last stop)")
        for rec in records:
            rebuild = False
            try:
                sla = SLA.from_dict(rec.sla)  # (a field the journal holds that is not one: this session alone)
                placement = Placement.from_dict(rec.placement) if rec.placement else None
                if placement is None or placement.decode_pool not in self.engines:
                    placement = self._place(sla, rec.kv_length, rec.max_context)
                cap = aligned(rec.max_context)
                try:
                    kv = self._new_kv(rec.id, placement, cap, list(rec.tokens[: rec.kv_length]))
                except KVStoreError as exc:
                    if isinstance(exc, KVFileMismatch) or placement.decode_strategy == "qring":
                        raise
                    # lost or damaged (deleted, cut short, its shared prefix gone): the journal holds its
                    # tokens, so a new file is made and its next turn computes them again
                    why = str(exc).removeprefix(f"session {rec.id}: ")  # (the store's errors name it too)
                    self.log(f"session {rec.id}: {why}; rebuilt from its journal (its {rec.kv_length} tokens "
                             f"are computed again at its next turn)")
                    self.store.delete(rec.id)
                    kv, rebuild = self._new_kv(rec.id, placement, cap, unfilled=True), True
            except Exception as exc:  # a KV file made for another model, no ring, a damaged record: keep the rest
                # serving
                why = str(exc).removeprefix(f"session {rec.id}: ")  # (the store's message names it too)
                self.log(f"session {rec.id} not recovered: {why}")
                self.unrecovered[rec.id] = why
                continue
            messages = transcript_of(rec.messages)
            partial = unfinished_answer(rec, self.tokenizer.decode)
            unrecorded = None
            if partial is not None:  # the daemon stopped mid-turn: keep what was committed of the answer
                try:
                    self.journal.finish_message(rec.id, "assistant", partial[0], partial[1], "interrupted")
                    messages.append(transcript_entry("assistant", partial[0], "interrupted"))
                except InsufficientStorage:  # (a full disk at the start: recorded once it has room)
                    unrecorded = UnrecordedAnswer(partial[0], partial[1], "interrupted")
            tail = (unfed_tail(rec) if partial is None else []) or unfed_prompt(rec)
            committed = list(rec.tokens[: rec.kv_length])
            if rebuild:  # every token is unfed now: the next turn feeds them before its own
                committed, tail, rebuilt = [], committed + tail, rebuilt + 1
            self.sessions[rec.id] = Session(rec.id, sla, rec.max_context, rec.system, placement, kv,
                                            committed, messages, created=rec.created,
                                            forked_from=rec.forked_from, tail=tail, rebuild=rebuild,
                                            unrecorded=unrecorded)
        if self.sessions:
            self.log(f"recovered {len(self.sessions)} session(s) from {self.data_dir}"
                     + (f" ({rebuilt} rebuilt from the journal)" if rebuilt else ""))

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
        with self._lock:
            running = [s for s in self.sessions.values() if s.busy and not s.ephemeral]
        for e in self.engines.values():  # (their last turns' ends may still queue prefixes to publish)
            e.stop()
        # said once the engines have stopped (a turn may end by itself in their last step), so that it
        # names the turns the stop cut; the next start tells only which of them run again
        stopped = [s for s in running if s.turn is not None and s.turn.finish_reason == "shutdown"]
        cut = sorted(s.id for s in stopped)
        if cut:
            more = f", +{len(cut) - 5} more" if len(cut) > 5 else ""
            detached = sum(1 for s in stopped if s.detached)
            again = f"; the {detached} detached one(s) run again at the next start" if detached else ""
            self.log(f"stopped: {len(cut)} session turn(s) ended as 'shutdown' ({', '.join(cut[:5])}{more}){again}")

    def shutdown(self) -> None:
        self.stop_turns()
        self._publisher.shutdown(wait=True)
        for p in self.pools.values():  # e.g. release the members of this daemon's rings
            p.backend.close()
        if self.member_groups is not None:
            self.waiting_groups = self.member_groups.stop()
            if self.waiting_groups:
                self.log(f"groups still waiting on their home after leaving: {', '.join(self.waiting_groups)}")
        if hasattr(self, "journal"):
            self._record_answers_left()
            self.journal.close()
        if hasattr(self, "store"):
            self.store.settle(timeout=10.0)
        self._release_data_dir()


    def _record_answers_left(self) -> None:
        """Answers a full disk kept out of the journal, recorded now if it has room (else the next start
        finds their tokens past the transcript's end and keeps them as an answer cut by the stop)."""
        with self._lock:
            for s in self.sessions.values():
                if s.unrecorded is not None:
                    try:
                        self._record_unrecorded(s)
                    except Exception as e:  # (the stop goes on: the next start finds its tokens)
                        self.log(f"session {s.id}: its last answer is not recorded: {e}")


def _check_journal_kept(data_dir) -> None:
    """KV files with no journal beside them (removed, or a partial copy of the directory): the sessions
    they hold cannot be told apart, and the start would sweep them as no session's - refused instead."""
    kv = data_dir / "kv"
    if (data_dir / "journal.sqlite").exists() or not kv.is_dir():
        return
    files = [p for p in kv.glob("*.kv")]
    if files:
        raise WeaveError(f"the data directory {data_dir} holds {len(files)} session KV file(s) but no journal "
                         f"(journal.sqlite): the sessions they belong to are unknown. Restore journal.sqlite (with "
                         f"its -wal file) from a backup, or move {kv} aside to start with no sessions")


@contextmanager
def _journal_damage(path) -> Iterator[None]:
    """SQLite's word for a damaged journal file, said as what it is and what to do."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        raise WeaveError(f"the journal {path} is damaged ({e}): the daemon cannot read its sessions. Restore it "
                         f"from a backup, or move it aside (with its -wal file) to start with no sessions - their "
                         f"KV files are then removed as belonging to no session") from None
