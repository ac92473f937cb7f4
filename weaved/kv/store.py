"""File-backed KV store: one sparse, memory-mapped file per session in the data directory.

A session's file ``<id>.kv`` holds exactly ``KVCache.data``: float16 ``[n_layers, 2, n_kv_heads,
capacity, head_dim]`` with no header, so the array over the mapping *is* the cache every backend reads
and writes.  A sidecar ``<id>.json`` (written once, at creation) records the shape, dtype and a model
fingerprint so a file made for another model is refused on ``open``.

The file's logical size covers the session's whole capacity but is sparse: blocks are allocated ahead
of the rows a step writes, within a cap on all sessions' KV bytes (``store_room``).

A session that never outlives its request (an ephemeral one) may instead be ``memory_only``: the same
array over private memory, no file.

Thread safety: bookkeeping is guarded by one lock, so the engine thread may reserve while the API reads
``tiers()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict
from enum import Enum
from pathlib import Path

import numpy as np

from weaved.kv.cache import KVCache
from weaved.kv.errors import KVFileMismatch, KVStoreError
from weaved.kv.hot_prefixes import BLOCK as HOT_BLOCK
from weaved.kv.hot_prefixes import HotPrefixes
from weaved.kv.map_budget import MapBudget, process_budget
from weaved.kv.mapping import FileMapping
from weaved.kv.open_session import OpenSession
from weaved.kv.prefixes import PrefixStore
from weaved.kv.releaser import Releaser
from weaved.kv.store_prefixes import PrefixSharing
from weaved.kv.store_room import RoomAccounting
from weaved.kv.tiers import allocated_bytes
from weaved.model.config import ModelConfig

FORMAT_VERSION = 1
LAYOUT = "[layer][k|v][kv_head][position][head_dim]"
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HOT_CAP_BYTES = 64 << 20  # memory for short shared prefixes (hot_prefixes)


def model_fingerprint(config: ModelConfig) -> str:
    """Short hash of every hyper-parameter: KV made under any other config is meaningless."""
    fields = {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(config).items()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class KVStore(PrefixSharing, RoomAccounting):
    """Per-session KV files under ``data_dir`` for one model (sharing prefixes: ``store_prefixes``; growth,
    the cap, durability and where the bytes live: ``store_room``)."""

    def __init__(self, data_dir: Path, config: ModelConfig, cap_bytes: int | None = None, chunk: int = 256,
                 share: bool = True, maps: MapBudget | None = None, durable: bool = False):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 position, got {chunk}")
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.cap_bytes = cap_bytes
        self.chunk = chunk
        self.fingerprint = model_fingerprint(config)
        # shared prefixes: their own cap, a quarter of the KV cap (counted inside it)
        self.prefixes = PrefixStore(self.dir / "prefixes", config, self.fingerprint,
                                    cap_bytes=None if cap_bytes is None else cap_bytes // 4)
        self.share = share  # False: no prefix is published or mapped (what reuse saves can be measured)
        # True: what the store writes of a session's description (its sidecar) reaches the disk before
        # the call returns, after the rows it names - the daemon's ``[host] durability = "fsync"``
        self.durable = durable
        self.maps = maps if maps is not None else process_budget()  # the process's mappings (map_budget)
        # short prefixes (hot_prefixes): blocks of 16 positions copied, beside the mapped 128-position
        # files; HOT_CAP_BYTES of memory, or a sixteenth of a smaller KV cap
        hot = min(HOT_CAP_BYTES, cap_bytes // 16) if cap_bytes is not None else HOT_CAP_BYTES
        self.hot = HotPrefixes(self.fingerprint, HOT_BLOCK * config.kv_bytes_per_token, hot if share else 0)
        self._lock = threading.Lock()
        self._releaser = Releaser("kv-release")  # deleted files let go of off the deleting thread
        self._open: dict[str, OpenSession] = {}
        self._ids: weakref.WeakKeyDictionary[KVCache, str] = weakref.WeakKeyDictionary()
        # Files left by an earlier run count against the cap by their allocated blocks until opened.
        bpt = config.kv_bytes_per_token
        self._unopened = {sid: -(-allocated_bytes(self._kv_path(sid)) // bpt) for sid in self.session_ids()}
        # a file left by an earlier run whose first positions are a stored prefix's pages keeps that prefix
        # (its rows are nowhere else) until it is opened - which names it again - or deleted; the others
        # go now if the prefixes are over their cap (files kept from runs with a larger one)
        for sid in self._unopened:
            shared = self._sidecar_prefix(sid)
            if shared is not None and self.prefixes.get(shared) is not None:
                self.prefixes.use(shared, sid)
            elif shared is not None:  # (another model's session, kept for it: so is its prefix file)
                self.prefixes.keep_foreign(shared)
        self.prefixes.evict()

    # -- paths and metadata ------------------------------------------------------------------------

    def _check_id(self, session_id: str) -> None:
        if not isinstance(session_id, str) or not _ID_RE.match(session_id):
            raise KVStoreError(f"invalid session id {session_id!r}: use 1-64 of A-Z a-z 0-9 _ -")

    def _kv_path(self, session_id: str) -> Path:
        return self.dir / f"{session_id}.kv"

    def _meta_path(self, session_id: str) -> Path:
        return self.dir / f"{session_id}.json"

    def _shape(self, capacity: int) -> tuple[int, int, int, int, int]:
        c = self.config
        return (c.n_layers, 2, c.n_kv_heads, capacity, c.head_dim)

    def _meta(self, capacity: int) -> dict:
        return {
            "format": FORMAT_VERSION,
            "layout": LAYOUT,
            "dtype": "float16",
            "shape": list(self._shape(capacity)),
            "model": {"arch": self.config.arch, "name": self.config.name},
            "fingerprint": self.fingerprint,
        }

    # -- lifecycle ---------------------------------------------------------------------------------

    def create(self, session_id: str, capacity: int, *, memory_only: bool = False,
               unfilled: bool = False) -> KVCache:
        """Create the session's (sparse) file for ``capacity`` positions; error if it exists.

        ``unfilled``: a file made again for a session whose journal names committed tokens (its old file
        was lost): its sidecar says its rows were never computed, so that a restart before they are
        (``filled``) does not take the journal's length for rows that hold nothing.

        ``memory_only``: no file at all - the rows live in private memory (shared prefixes still map
        over it), for a session deleted when its request ends.  It skips what only persistence needs:
        the file and its fsync'd sidecar, allocating blocks ahead (a full disk cannot hit memory), and at
        delete the freeing of hundreds of scattered extents - together ~10 ms of system calls per
        request for SmolLM2.  It counts against the cap like any session and is never reopened."""
        self._check_id(session_id)
        if capacity < 1:
            raise KVStoreError(f"session {session_id}: capacity must be >= 1, got {capacity}")
        with self._lock:
            if session_id in self._open or self._kv_path(session_id).exists():
                raise KVStoreError(f"session {session_id}: KV file already exists")
            if memory_only:
                mm = FileMapping.anonymous_memory(capacity * self.config.kv_bytes_per_token, self.maps)
                return self._hold(session_id, capacity, 0, mm, memory_only=True)
            meta = self._meta_path(session_id)
            tmp = meta.with_suffix(".json.tmp")
            try:
                with open(tmp, "w") as f:
                    json.dump({**self._meta(capacity), **({"unfilled": True} if unfilled else {})}, f)
                    f.flush()
                    os.fsync(f.fileno())  # once per session: the sidecar must survive a power loss
                fd = os.open(self._kv_path(session_id), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, capacity * self.config.kv_bytes_per_token)  # a hole: costs no disk
                finally:
                    os.close(fd)
                os.replace(tmp, meta)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                self._kv_path(session_id).unlink(missing_ok=True)
                raise self._os_error(session_id, "creating its KV file", e) from e
            return self._map(session_id, capacity, length=0)

    def open(self, session_id: str, length: int) -> KVCache:
        """Map an existing file after a restart; ``length`` is the committed length from the journal."""
        self._check_id(session_id)
        with self._lock:
            if session_id in self._open:
                raise KVStoreError(f"session {session_id}: KV file is already open")
            path, meta_path = self._kv_path(session_id), self._meta_path(session_id)
            if not path.exists():
                raise KVStoreError(f"session {session_id}: no KV file in {self.dir}")
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError) as e:
                raise KVStoreError(f"session {session_id}: unreadable metadata {meta_path}: {e}") from e
            if meta.get("fingerprint") != self.fingerprint or meta.get("format") != FORMAT_VERSION:
                made = meta.get("model") if isinstance(meta.get("model"), dict) else {}
                raise KVFileMismatch(
                    f"session {session_id}: its KV file was made for model {made.get('name', '?')!r} "
                    f"({made.get('arch', '?')}, fingerprint {meta.get('fingerprint')}, format {meta.get('format')}), "
                    f"not {self.config.name!r} ({self.config.arch}, fingerprint {self.fingerprint}, format "
                    f"{FORMAT_VERSION}): serve that model again to bring it back"
                )
            capacity = int(meta["shape"][3])
            if list(self._shape(capacity)) != meta["shape"] or meta.get("dtype") != "float16":
                raise KVStoreError(
                    f"session {session_id}: metadata shape {meta['shape']} does not match the model"
                )
            if path.stat().st_size != capacity * self.config.kv_bytes_per_token:
                raise KVStoreError(f"session {session_id}: KV file size does not match capacity {capacity}")
            if not 0 <= length <= capacity:
                raise KVStoreError(f"session {session_id}: length {length} outside capacity {capacity}")
            if meta.get("unfilled") and length:
                raise KVStoreError(f"session {session_id}: its KV file was made again after an earlier restart and "
                                   f"its {length} committed positions were never computed into it")
            self._unopened.pop(session_id, None)
            kv = self._map(session_id, capacity, length)
            if meta.get("unfilled"):  # (length 0: the journal names nothing it lacks; a stop came before filled)
                self._write_meta(session_id, self._open[session_id], meta.get("prefix"))
            shared = meta.get("prefix")
            s = self._open[session_id]
            if shared is not None:  # its first positions are a shared prefix's pages: map them again
                n = int(shared["positions"])
                try:
                    if n > length:  # mapped, then stopped before the journal committed them: its own copy of those
                        self._own_copy(session_id, s, shared["key"], length)  # it did
                    else:
                        self._reshare(kv, session_id, s, shared["key"], n)
                finally:  # kept for it since the start (``__init__``): let go once it does not map the file
                    if self._open.get(session_id) is not s or s.prefix != shared["key"]:
                        self.prefixes.drop_user(shared["key"], session_id)
            # the blocks an earlier run allocated ahead of its commits count against the cap as they did
            # then (they hold the disk): whole chunks of them, never more than are there - positions
            # counted as reserved are not allocated again before a step writes them
            ahead = allocated_bytes(path) // self.config.kv_bytes_per_token // self.chunk * self.chunk
            s.reserved = max(s.reserved, min(s.capacity, s.shared + ahead))
            return kv

    def filled(self, kv: KVCache) -> None:
        """The session's journal no longer names positions its file never held (``create``'s ``unfilled``):
        from now on its rows are computed and committed as any session's."""
        session_id = self._session_of(kv)
        with self._lock:
            s = self._open[session_id]
            self._write_meta(session_id, s, None if s.prefix is None else {"key": s.prefix, "positions": s.shared})

    def _map(self, session_id: str, capacity: int, length: int) -> KVCache:
        fd = os.open(self._kv_path(session_id), os.O_RDWR)
        try:
            mm = FileMapping(fd, capacity * self.config.kv_bytes_per_token, self.maps)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        # Without this, the first write fault in a run makes the kernel read ahead up to megabytes
        # around it, filling the page cache with zero pages of holes; KV access is per-run, so
        # readahead only wastes RAM.  Committed rows of a reopened session are prefetched instead.
        mm.madvise(mmap.MADV_RANDOM)
        if length:
            for off, n in self._runs(capacity, 0, length):
                mm.madvise(mmap.MADV_WILLNEED, off, n)
        return self._hold(session_id, capacity, length, mm)

    def _hold(self, session_id: str, capacity: int, length: int, mm: FileMapping,
              memory_only: bool = False) -> KVCache:
        data = mm.array(self._shape(capacity), np.float16)
        kv = KVCache(data, length)
        # Committed rows were written, so their blocks exist; reserve() allocates from there on.
        self._open[session_id] = OpenSession(capacity, reserved=length, mm=mm, data=data, memory_only=memory_only)
        self._ids[kv] = session_id
        return kv

    def delete(self, session_id: str, wait: bool = True) -> None:
        """Remove the session's files and free its reservation, its file's mapping and its disk blocks.
        A KVCache still held (an engine's step in flight) stays readable and writable, over anonymous
        memory that is freed with it (``FileMapping.release``).  With ``wait=False`` the mapping is let
        go of (and the disk blocks freed) on the store's release thread moments later, so a thread that
        must not stall - an engine between two steps - does not do the kernel's work; ``settle`` waits
        for it.  The reservation and the files' names go at once either way."""
        self._check_id(session_id)
        with self._lock:
            s = self._open.pop(session_id, None)
            self._unopened.pop(session_id, None)
            named = self._sidecar_prefix(session_id) if s is None else None  # (a file never opened: read it first)
            self._kv_path(session_id).unlink(missing_ok=True)
            self._meta_path(session_id).unlink(missing_ok=True)
            if s is not None and s.prefix is not None:
                self.prefixes.drop_user(s.prefix, session_id)
            elif s is None:  # never opened: the prefix its file named was kept for it
                self.prefixes.drop_session(session_id, named)
            if s is not None and s.readers:  # a copy reads its rows now: the last reader lets go (``pinned``)
                s.deleted, s = True, None
        if s is not None:
            if wait:
                s.mm.release()
            else:
                self._releaser.submit(s.mm.release)

    @contextlib.contextmanager
    def pinned(self, kv: KVCache) -> Iterator[bool]:
        """While held, the session's rows stay its file's even if it is deleted meanwhile (its release -
        which would swap them for zeros - waits for the last reader): a copy made off the store's lock
        (a prefix published from them, short blocks kept) reads what its tokens say.  Yields False, and
        nothing should be read, when ``kv`` is not an open session of this store any more."""
        with self._lock:
            _, s = self._still_open(kv)
            if s is not None:
                s.readers += 1
        try:
            yield s is not None
        finally:
            if s is not None:
                with self._lock:
                    s.readers -= 1
                    release = s.deleted and not s.readers
                if release:
                    self._releaser.submit(s.mm.release)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the files of sessions deleted with ``wait=False`` are let go of."""
        return self._releaser.settle(timeout)

    def _sidecar_prefix(self, session_id: str) -> str | None:
        """The stored prefix a session's sidecar says its file maps, if any (None when unreadable)."""
        try:
            shared = json.loads(self._meta_path(session_id).read_text()).get("prefix")
            return str(shared["key"]) if shared is not None else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def session_ids(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.kv") if _ID_RE.match(p.stem))

    def _still_open(self, kv: KVCache) -> tuple[str | None, OpenSession | None]:
        """``kv``'s session id and open state, or (None, None) when it was deleted - also when its id
        was made again since, for another session (caller holds the store's lock)."""
        session_id = self._ids.get(kv)
        s = self._open.get(session_id) if session_id is not None else None
        return (session_id, s) if s is not None and s.data is kv.data else (None, None)

    def _session_of(self, kv: KVCache) -> str:
        session_id = self._ids.get(kv)
        if session_id is None or session_id not in self._open:
            raise KVStoreError("this KVCache is not an open session of this store")
        return session_id
