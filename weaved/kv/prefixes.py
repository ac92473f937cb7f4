"""Shared prefixes: the KV of a prompt's leading blocks, computed once, kept in files, mapped by every
session that starts with the same tokens.

A prefix file ``prefixes/<key>.kv`` holds positions [0, n * BLOCK) in the layout of a session's file
(``[layer][k|v][kv_head][position][head_dim]``), with a sidecar ``<key>.json`` listing the key after
each block.  Keys chain: the key after block k is a hash of the key after block k - 1 and block k's
token ids, starting from the model's fingerprint - so equal keys mean equal tokens from the first
position on, under the same model, and (batch invariance) equal KV bits.

A file has room for its publisher's whole context (its capacity, sparse: only the blocks it holds use
disk), and a later publication whose stored part is exactly a file's blocks extends that file in place:
a stateless client sending its conversation again one message longer, or a session forked at growing
depths, keeps one file that grows by its new blocks - not one file per length, each repeating the
shorter ones' rows (disk and writes growing with the square of the conversation).  Sessions mapping
its first blocks are untouched (blocks are whole pages of every run).

Blocks that differ from a file's later ones (a branch: sub-agents sharing a long system prompt and
tools, then each its own conversation) start a new file that holds only the branch's own blocks and
names the file it branches from (``parent``) for the ``base`` blocks before them: the shared part is
stored, and held in the page cache, once for every branch.  A session maps a branch's chain of files,
each over its own positions (``segments``); a file with branches is kept while they are (they pin it),
and chains are at most ``MAX_CHAIN`` files deep (a deeper branch starts a file from position 0 again:
each file in a chain is one more mapping per run for every session that maps it).

A session reuses a prefix by mapping the prefix file's pages over the first positions of its own
mapping (``FileMapping.alias``: one read-only ``mmap`` per (layer, k|v, head) run); nothing is copied,
the page cache holds the prefix once for every session, and the CPU backend reads it where it lies.
Files survive restarts (the index is rebuilt from the sidecars); a file in use by a session is never
evicted; the others go least recently used first when the prefixes' bytes pass their cap (checked when
a file is published, loses its last user, or sessions need room, and at start).  Another
model's files (a data directory the daemon served a different model from) are kept for it, but count
against the cap too and go first, oldest first: the disk they hold is the same disk.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weaved.kv import prefix_files as files
from weaved.kv.errors import DISK_FULL, DiskFull
from weaved.model.config import ModelConfig

BLOCK = 128  # positions per block: whole pages for head sizes from 16 up (128 * head_dim * 2 bytes)
PENDING_WAIT_S = 10.0  # a lookup that meets a block being published waits this long for it
MAX_CHAIN = 4  # files in a branch's chain, its own included
BRANCH_MIN_BLOCKS = 4  # a shared part shorter than this is stored again (it costs less than the mappings)


def chain_keys(fingerprint: str, tokens: Sequence[int], block: int = BLOCK) -> list[str]:
    """The key after each full block of ``tokens`` (``len(tokens) // block`` keys)."""
    keys, h = [], fingerprint.encode()
    ids = np.asarray(tokens, dtype="<i4")
    for k in range(len(ids) // block):
        h = hashlib.sha256(h + ids[k * block:(k + 1) * block].tobytes()).hexdigest()[:32].encode()
        keys.append(h.decode())
    return keys


PUBLISHING = " publishing"  # a user that is no session (ids have no space): a file being extended


@dataclass
class Prefix:
    key: str  # the key after its last block when it was made; its files are <key>.kv and <key>.json
    keys: list[str]  # the key after each block (a new list when the file is extended: readers keep theirs)
    path: Path
    capacity: int = 0  # positions each (layer, k|v, head) run has room for in the file (0: its own blocks)
    parent: str | None = None  # a branch: the file holding its first ``base`` blocks (their rows are there)
    base: int = 0  # blocks taken from ``parent``; the file holds rows from position base * BLOCK on
    users: set[str] = field(default_factory=set)  # sessions mapping it
    last_used: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.capacity = self.capacity or self.positions

    @property
    def positions(self) -> int:
        return len(self.keys) * BLOCK

    @property
    def own(self) -> int:
        """Positions whose rows this file holds (a branch: those past its parent's part)."""
        return (len(self.keys) - self.base) * BLOCK


class PrefixStore:
    """The prefix files of one model under ``directory``."""

    def __init__(self, directory: Path, config: ModelConfig, fingerprint: str, cap_bytes: int | None = None):
        self.dir = Path(directory)  # made with the first prefix
        self.config = config
        self.fingerprint = fingerprint
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one publish at a time: two for one key would share a temp file
        self._by_key: dict[str, Prefix] = {}
        self._index: dict[str, tuple[str, int]] = {}  # key after block k -> (prefix key, k + 1 blocks)
        self._pending: dict[str, threading.Event] = {}  # keys announced, being published
        self.hits = self.misses = self.reused_tokens = self.published = 0
        self.extended = 0  # publications that grew a file in place rather than starting one
        self.branched = 0  # new files that hold only their own blocks past another file's (branches)
        self.copied = 0  # sessions given their own copy of a prefix's rows (no mapping left to map it)
        self._foreign_kept: set[str] = set()  # other models' files their sessions' sidecars name: not evicted
        found, self._foreign = files.scan(self.dir, config, fingerprint, BLOCK)  # (the others: oldest first)
        for key, keys, path, capacity, mtime, parent, base in found:
            self._add(Prefix(key, keys, path, capacity, parent, base, last_used=mtime))

    def _add(self, p: Prefix, start: int = 0) -> None:
        """Index ``p``'s blocks from ``start`` on (all of a new file's own; an extended one's new blocks)."""
        self._by_key[p.key] = p
        _index_blocks(self._index, p, start)

    block = BLOCK

    def runs(self) -> int:
        c = self.config
        return c.n_layers * 2 * c.n_kv_heads

    # ---- lookup ----------------------------------------------------------------------------------
    def announce(self, tokens: Sequence[int]) -> None:
        """Blocks of ``tokens`` about to be published (by another thread): a lookup that needs them waits
        for them rather than missing them by a few milliseconds."""
        ev = threading.Event()
        with self._lock:
            for k in chain_keys(self.fingerprint, tokens):
                if k not in self._index:
                    self._pending.setdefault(k, ev)

    def settle(self, tokens: Sequence[int]) -> None:
        """Whatever became of an announced publication, nobody waits for it any more."""
        with self._lock:
            for k in chain_keys(self.fingerprint, tokens):
                ev = self._pending.pop(k, None)
                if ev is not None:
                    ev.set()

    def await_announced(self, tokens: Sequence[int]) -> None:
        """Wait (at most ``PENDING_WAIT_S``) for the leading blocks of ``tokens`` that another thread has
        announced and not yet published, so that ``longest`` finds them rather than missing them by a
        few milliseconds.  Called holding no lock: ``longest`` itself never waits, since it runs under
        the store's and the daemon's locks, which every engine's step needs."""
        for k in chain_keys(self.fingerprint, tokens):
            if self._index.get(k) is not None:
                continue
            pending = self._pending.get(k)
            if pending is None or not pending.wait(PENDING_WAIT_S) or self._index.get(k) is None:
                return

    def longest(self, tokens: Sequence[int], limit: int, user: str | None = None) -> tuple[Prefix, int] | None:
        """The prefix file holding the most leading blocks of ``tokens`` (at most ``limit`` positions),
        and how many positions of it apply (blocks announced but not yet published are not waited for:
        ``await_announced``); counts a hit or a miss.  ``user``: the session is made one of the file's
        users in the same step, so no eviction can take it before the session maps (or copies) it - the
        caller calls ``drop_user`` if it then does not keep it."""
        best = last = None
        for k in chain_keys(self.fingerprint, tokens[:limit]):
            found = self._index.get(k)
            if found is None:
                break
            best, last = found, k
        with self._lock:
            p = self._by_key.get(best[0]) if best is not None else None
            # (read off the lock, the index may name a file evicted since - and perhaps made again under the
            # same name with fewer blocks: it applies only if it still holds the block found)
            if p is None or best[1] > len(p.keys) or p.keys[best[1] - 1] != last:
                self.misses += 1
                return None
            p.last_used = time.time()
            if user is not None:
                p.users.add(user)
            self.hits += 1
            self.reused_tokens += best[1] * BLOCK
            return p, best[1] * BLOCK

    def get(self, key: str) -> Prefix | None:
        return self._by_key.get(key)

    def segments(self, key: str, n: int) -> list[tuple[Prefix, int, int]]:
        """Where positions [0, n) of file ``key``'s chain lie: ``(file, start, stop)`` for each file that
        holds some of them, the root's first.  KeyError when a file of the chain is not stored (a file is
        kept while it has branches, so only for a ``key`` that is gone itself)."""
        with self._lock:
            out, p, stop = [], self._by_key[key], n
            while True:
                start = min(p.base * BLOCK, stop)
                if start < stop:
                    out.append((p, start, stop))
                if not start:
                    return out[::-1]
                p, stop = self._by_key[p.parent], start

    def _chain(self, p: Prefix) -> int:
        """Files in ``p``'s chain, its own included (under the lock)."""
        depth = 1
        while p.parent is not None:
            p, depth = self._by_key[p.parent], depth + 1
        return depth

    def _branched(self) -> set[str]:
        """The files that some stored file branches from (they are kept while it is; under the lock)."""
        return {p.parent for p in self._by_key.values() if p.parent is not None}

    def use(self, key: str, session: str) -> None:
        with self._lock:
            self._by_key[key].users.add(session)

    def drop_user(self, key: str, session: str, evict: bool = True) -> None:
        """``session`` no longer maps ``key``; a file left with no user goes if the prefixes are over their
        cap (publishing and sessions' growth evict too, but a cap a restart lowered, or files kept while
        mapped, would otherwise stay over it until then) - unless not ``evict`` (a publisher that does not
        map the file it just stored: kept as its publication's own eviction kept it)."""
        with self._lock:
            p = self._by_key.get(key)
            if p is None:
                return
            p.users.discard(session)
            over = evict and not p.users and self.cap_bytes is not None and self._nbytes() > self.cap_bytes
        if over:
            self.evict()

    def keep_foreign(self, key: str) -> None:
        """Another model's file ``key`` is named by one of that model's sessions: never evicted here."""
        with self._lock:
            self._foreign_kept.add(key)

    def drop_session(self, session: str, named: str | None = None) -> None:
        """``session`` maps no prefix any more (a file deleted before it was opened; ``named``: the prefix
        its sidecar named, another model's file kept for it until now)."""
        with self._lock:
            self._foreign_kept.discard(named)
            keys = [p.key for p in self._by_key.values() if session in p.users]
        for key in keys:
            self.drop_user(key, session)

    # ---- publishing ------------------------------------------------------------------------------
    def covered(self, tokens: Sequence[int]) -> int:
        """Positions of ``tokens`` an existing prefix file already holds."""
        n = 0
        for k in chain_keys(self.fingerprint, tokens):
            found = self._index.get(k)
            if found is None:
                break
            n = found[1]
        return n * BLOCK

    def publish(self, data: np.ndarray, tokens: Sequence[int], user: str | None = None) -> Prefix | None:
        """The full blocks of ``tokens`` stored from their KV rows in ``data`` ([L, 2, H, cap, D]): the new
        blocks appended to the file that holds exactly the ones before them (and has room), else a new
        file of them all; None when no new block would be added.  The rows are copied once, here.  The
        file returned may hold more blocks by the time the caller reads it (a later publication extended
        it): the caller's are its first ``len(tokens) // BLOCK``.  ``user``: made a user of the file returned
        in the same step (no eviction takes it before it maps it - ``drop_user`` if it then does not)."""
        with self._writing:
            try:
                return self._publish(data, tokens, user)
            finally:
                self.settle(tokens)

    def _publish(self, data: np.ndarray, tokens: Sequence[int], user: str | None) -> Prefix | None:
        keys = chain_keys(self.fingerprint, tokens)
        held = self.covered(tokens) // BLOCK
        if held >= len(keys) or keys[-1] in self._by_key:  # (all held: a file made with these very blocks)
            return None
        n = len(keys) * BLOCK
        if held:
            p = self._extendable(keys[held - 1], held, n)
            if p is not None:
                try:
                    return self._extend(p, data, keys, user)
                finally:  # (no eviction here: the one after growing it spared it, this one would not)
                    with self._lock:
                        p.users.discard(PUBLISHING)
        parent = self._branch_from(keys, held)  # (made a user meanwhile: PUBLISHING)
        try:
            return self._new_file(data, keys, parent, held if parent is not None else 0, user)
        finally:
            if parent is not None:
                with self._lock:
                    parent.users.discard(PUBLISHING)

    def _branch_from(self, keys: list[str], held: int) -> Prefix | None:
        """The file a new file of ``keys`` branches from, holding its first ``held`` blocks' rows (made a
        user, ``PUBLISHING``, so that no eviction takes it before the branch names it); None when the
        shared part is too short to be worth the mappings, or the chain would be too deep."""
        if held < BRANCH_MIN_BLOCKS:
            return None
        found = self._index.get(keys[held - 1])  # (a file whose own rows hold that block: ``_index_blocks``)
        with self._lock:
            p = self._by_key.get(found[0]) if found is not None else None
            if (p is None or p.key == keys[-1] or not p.base < held <= len(p.keys) or p.keys[held - 1] != keys[held - 1]
                    or self._chain(p) >= MAX_CHAIN):
                return None
            p.users.add(PUBLISHING)
            return p

    def _new_file(self, data: np.ndarray, keys: list[str], parent: Prefix | None, base: int,
                  user: str | None) -> Prefix:
        """A new file of ``keys``' blocks from ``base`` on (a branch of ``parent`` holding the ones before)."""
        key, n = keys[-1], len(keys) * BLOCK
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{key}.kv"
        tmp = path.with_suffix(".kv.tmp")
        capacity = max(n, -(-data.shape[3] // BLOCK) * BLOCK)  # room for the publisher's whole context
        shape = (*data.shape[:3], capacity, data.shape[4])
        try:
            files.write_rows(tmp, data, base * BLOCK, n, shape, create=True)
            self._write_meta(key, keys, shape, parent.key if parent is not None else None, base)
            os.replace(tmp, path)
            files.sync_dir(self.dir)
        except OSError as e:  # a full disk most often: nothing is kept of this prefix, the caller goes on
            tmp.unlink(missing_ok=True)
            (self.dir / f"{key}.json").unlink(missing_ok=True)
            if e.errno in DISK_FULL:
                raise DiskFull(f"storing a shared prefix of {n - base * BLOCK} positions: {e.strerror}") from None
            raise
        p = Prefix(key, keys, path, capacity, parent.key if parent is not None else None, base)
        with self._lock:
            if user is not None:
                p.users.add(user)
            self._add(p)
            self.published += 1
            self.branched += parent is not None
        self.evict(spare=key)
        return p

    def _extendable(self, last: str, blocks: int, n: int) -> Prefix | None:
        """The file whose last block is ``last`` (the ``blocks``-th) with room for ``n`` positions, made a
        user (``PUBLISHING``) so that no eviction takes it while it grows; None when there is none."""
        found = self._index.get(last)
        with self._lock:
            p = self._by_key.get(found[0]) if found is not None else None
            if p is None or len(p.keys) != blocks or p.keys[-1] != last or p.capacity < n:
                return None
            p.users.add(PUBLISHING)
            return p

    def _extend(self, p: Prefix, data: np.ndarray, keys: list[str], user: str | None) -> Prefix:
        """``p``'s file grown in place by the rows of ``keys``' blocks past its own: rows written (and
        synced) first, then the sidecar replaced, then the index - a stop in between leaves the file as its
        sidecar describes it, the rows past it unused.  Sessions mapping its blocks see no change."""
        start, n = p.positions, len(keys) * BLOCK
        shape = (*data.shape[:3], p.capacity, data.shape[4])
        try:
            files.write_rows(p.path, data, start, n, shape, create=False)
            self._write_meta(p.key, keys, shape, p.parent, p.base)
        except OSError as e:
            files.give_back(p.path, shape, start, n)  # (the blocks it allocated past what the sidecar names)
            if e.errno in DISK_FULL:
                raise DiskFull(f"storing a shared prefix's {n - start} new positions: {e.strerror}") from None
            raise
        with self._lock:
            before = len(p.keys)
            p.keys = list(keys)
            p.last_used = time.time()
            if user is not None:
                p.users.add(user)
            if p.key in self._by_key:
                self._add(p, start=before)
            self.published += 1
            self.extended += 1
        self.evict(spare=p.key)
        return p

    def _write_meta(self, key: str, keys: list[str], shape: tuple[int, ...], parent: str | None, base: int) -> None:
        meta = {"fingerprint": self.fingerprint, "key": key, "keys": keys, "block": BLOCK, "shape": list(shape)}
        if parent is not None:  # (its keys under another name: a version that knows no branches removes the
            meta |= {"parent": parent, "base": base, "chain": meta.pop("keys")}  # file, never maps its hole)
        files.write_sidecar(self.dir / f"{key}.json", meta)

    # ---- the cap ---------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the prefix files on disk: this model's, and other models' kept for them."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        bpt = self.config.kv_bytes_per_token
        return sum(p.own for p in self._by_key.values()) * bpt + sum(f[2] for f in self._foreign)

    def evict(self, spare: str | None = None, free: int = 0) -> int:
        """Least recently used files nobody maps (nor ``spare``, just made), and no file branches from, go
        until the prefixes fit their cap, and ``free`` bytes more (sessions need the room: stored prefixes
        are a cache) - a branch's going may free its parent in turn.  Returns the bytes freed."""
        if self.cap_bytes is None and not free:
            return 0
        with self._lock:
            bpt = self.config.kv_bytes_per_token
            total = start = self._nbytes()
            target = max(0, min(self.cap_bytes if self.cap_bytes is not None else total, total - free))
            while total > target:  # other models' files first, oldest first (a file after its branches)
                kept = self._foreign_needed() | {f[3] for f in self._foreign}
                f = next((f for f in self._foreign if f[1].stem not in kept), None)
                if f is None:  # (a session of that model maps each, or a file it maps branches from it)
                    break
                self._foreign.remove(f)
                f[1].unlink(missing_ok=True)
                f[1].with_suffix(".json").unlink(missing_ok=True)
                total -= f[2]
            while total > target:
                branched = self._branched()
                free_now = [p for p in self._by_key.values()
                            if not p.users and p.key != spare and p.key not in branched]
                if not free_now:
                    break
                p = min(free_now, key=lambda x: x.last_used)
                self._forget(p)
                total -= p.own * bpt
            return start - total

    def _foreign_needed(self) -> set[str]:
        """Other models' files their sessions map, and the files those branch from (under the lock)."""
        parents = {f[1].stem: f[3] for f in self._foreign}
        return _with_parents(self._foreign_kept, parents.get)

    def no_publication(self) -> threading.Lock:
        """Held, no publication runs (the caller may remove files the index no longer names, without a
        publication making one of the same name meanwhile)."""
        return self._writing

    def clear(self) -> tuple[list[Path], int, int]:
        """Every file nobody maps (nor branches from) leaves the index - this model's, and another model's
        no session of it names: the cache emptied (a deleted session's context leaves the disk).  (the files to remove -
        the caller unlinks them, outside any lock: gigabytes take a while - bytes freed, files kept
        because sessions map them)."""
        with self._lock:
            start, gone = self._nbytes(), []
            kept = self._foreign_needed()
            for f in list(self._foreign):
                if f[1].stem not in kept:
                    self._foreign.remove(f)
                    gone.append(f[1])
            # the files sessions map, and the ones those branch from
            needed = _with_parents((p.key for p in self._by_key.values() if p.users), lambda k: self._by_key[k].parent)
            for p in list(self._by_key.values()):
                if p.key not in needed:
                    self._forget(p, unlink=False)
                    gone.append(p.path)
            return gone, start - self._nbytes(), len(self._by_key) + len(self._foreign)

    def _forget(self, p: Prefix, unlink: bool = True) -> None:
        del self._by_key[p.key]
        index: dict[str, tuple[str, int]] = {}  # (built aside: lookups read the index off the lock)
        for q in self._by_key.values():
            _index_blocks(index, q)
        self._index = index
        if unlink:
            p.path.unlink(missing_ok=True)
            p.path.with_suffix(".json").unlink(missing_ok=True)

    def paths(self) -> list[Path]:
        with self._lock:
            return [p.path for p in self._by_key.values()]

    def status(self) -> dict:
        with self._lock:
            return {"files": len(self._by_key), "bytes": self._nbytes(), "cap_bytes": self.cap_bytes,
                    "in_use": sum(1 for p in self._by_key.values() if p.users - {PUBLISHING}), "hits": self.hits,
                    "misses": self.misses, "reused_tokens": self.reused_tokens, "published": self.published,
                    "extended": self.extended, "branched": self.branched,
                    "branches": sum(1 for p in self._by_key.values() if p.parent is not None),
                    "copied": self.copied,
                    "other_models": {"files": len(self._foreign), "bytes": sum(f[2] for f in self._foreign)}}


def _index_blocks(index: dict[str, tuple[str, int]], p: Prefix, start: int = 0) -> None:
    """``p``'s own blocks from ``start`` on into ``index`` (key after block i -> (file, i + 1 blocks)): any file
    holding block i under key k holds blocks 0..i, and the file named holds that block's rows itself."""
    for i in range(max(start, p.base), len(p.keys)):
        index.setdefault(p.keys[i], (p.key, i + 1))


def _with_parents(keys: Iterable[str], parent_of: Callable[[str], str | None]) -> set[str]:
    """``keys`` and every file they branch from, however deep (``parent_of``: a file's parent, or None)."""
    out, todo = set(), list(keys)
    while todo:
        key = todo.pop()
        if key is not None and key not in out:
            out.add(key)
            todo.append(parent_of(key))
    return out
