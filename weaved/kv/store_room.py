"""The KV store's room: growing a session's file ahead of the rows a step writes, within the cap on all
sessions' KV bytes; flushing it to disk; where the bytes live (``tiers``).

The file's logical size covers the session's whole capacity but is sparse.  Before a step writes
positions up to ``n``, ``reserve`` allocates real blocks for them with ``posix_fallocate`` on every
(layer, k|v, head) run, a chunk of positions at a time.  Writing through a mapping into a hole makes the
kernel allocate the block at page-fault time, and if the disk is full that is a SIGBUS that kills the
daemon; allocating ahead turns a full disk into a ``DiskFull`` for that one turn.

The cap on total KV bytes over all sessions is counted as reserved positions times
``kv_bytes_per_token``.  A session reopened after a restart counts its committed length, or the whole
chunks its file holds beyond it if more (allocated ahead by the earlier run: they hold the disk); a file
not opened yet counts its allocated blocks.

A mixin of ``KVStore`` (``store.py``), which holds the sessions and the lock these methods take.
"""

from __future__ import annotations

import mmap
import os
import shutil

from weaved.kv.cache import KVCache
from weaved.kv.errors import DISK_FULL, DiskFull, KVCapExceeded, KVFileLost, KVStoreError
from weaved.kv.open_session import OpenSession
from weaved.kv.tiers import allocated_bytes, file_resident_bytes, punch_hole, runs_resident_bytes
from weaved.sizes import human_size


class RoomAccounting:
    """Growth, cap and durability over a ``KVStore``'s sessions (``self._open``, ``self._unopened``,
    ``self._lock``, ``self.prefixes``, ``self.cap_bytes``, ``self.chunk``)."""

    # -- growth ------------------------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        """Bytes counted against the cap: reserved positions of all sessions x kv_bytes_per_token."""
        with self._lock:
            return self._reserved_bytes()

    def _reserved_bytes(self) -> int:
        positions = sum(s.reserved - s.shared for s in self._open.values()) + sum(self._unopened.values())
        return positions * self.config.kv_bytes_per_token + self.prefixes.nbytes()

    def reserve(self, kv: KVCache, new_length: int) -> None:
        """Back positions [0, new_length) with disk blocks before a step writes them.

        Grows in whole chunks (clipped to the capacity, or to ``new_length`` when a whole chunk would
        break the cap).  Raises ``KVCapExceeded`` or ``DiskFull`` with nothing changed.
        """
        session_id = self._session_of(kv)
        with self._lock:
            s = self._open[session_id]
            if new_length <= s.reserved:
                return
            if new_length > s.capacity:
                raise KVStoreError(
                    f"session {session_id}: {new_length} positions exceed its capacity {s.capacity}"
                )
            target = min(-(-new_length // self.chunk) * self.chunk, s.capacity)
            if self.cap_bytes is not None:
                bpt = self.config.kv_bytes_per_token
                others = self._reserved_bytes() - (s.reserved - s.shared) * bpt
                own = s.shared  # positions a shared prefix's pages hold: counted with the prefixes, not here
                over = others + (new_length - own) * bpt - self.cap_bytes
                if over > 0 and self.prefixes.evict(free=over):  # stored prefixes nobody maps make room
                    others = self._reserved_bytes() - (s.reserved - s.shared) * bpt
                if others + (target - own) * bpt > self.cap_bytes:
                    target = new_length  # a whole chunk does not fit: take exactly what this step needs
                if others + (target - own) * bpt > self.cap_bytes:
                    raise self._cap_exceeded(session_id, others, (new_length - own) * bpt)
            if not s.memory_only:  # memory is given as it is written: nothing to allocate ahead
                start = max(s.reserved, s.shared)
                try:
                    self._allocate(session_id, s, start, target)
                except DiskFull:  # stored prefixes nobody maps are a cache: they give the disk back first
                    if not self.prefixes.evict(free=(target - start) * self.config.kv_bytes_per_token):
                        raise
                    self._allocate(session_id, s, start, target)
            s.reserved = target

    def _cap_exceeded(self, session_id: str, others: int, need: int) -> KVCapExceeded:
        """The refusal of ``need`` more bytes for ``session_id`` beside ``others`` reserved: worth a retry
        only if the requests in flight (sessions that end with their request) hold enough to make room
        when they end; otherwise only deleting sessions or a larger cap does."""
        bpt = self.config.kv_bytes_per_token
        passing = bpt * sum(o.reserved - o.shared for sid, o in self._open.items()
                            if o.memory_only and sid != session_id)
        over = others + need - self.cap_bytes
        if passing >= over:
            fix = f"requests in flight hold {human_size(passing)} of it and free it as they end: retry shortly"
        else:
            fix = ("delete sessions no longer needed (weave rm, DELETE /v1/sessions/ID), or raise the profile's "
                   "[host] kv_cap_bytes")
        own = self._open.get(session_id)
        who = "this request" if own is not None and own.memory_only else f"session {session_id}"  # (a stateless
        # request's session is its own, unnamed to its client)
        return KVCapExceeded(
            f"{who}: the KV cap ({human_size(self.cap_bytes)}) is full: {human_size(need)} more are "
            f"needed, {human_size(others)} are held by {len(self._open) + len(self._unopened) - 1} other "
            f"session(s) and stored prefixes; {fix}", retryable=passing >= over)

    def _runs(self, capacity: int, start: int, stop: int) -> list[tuple[int, int]]:
        """Byte ranges (offset, length) of positions [start, stop) in every (layer, k|v, head) run."""
        c = self.config
        row = c.head_dim * 2  # bytes per position per head
        n_runs = c.n_layers * 2 * c.n_kv_heads
        return [(r * capacity * row + start * row, (stop - start) * row) for r in range(n_runs)]

    def release_past(self, kv: KVCache, length: int) -> None:
        """The positions a session reserved past ``length`` (in whole chunks; never a shared prefix's) are
        given back - rows taken back by a rewind, or by a turn that failed: the cap counts them no more, a
        file's blocks go back to the disk (holes punched) and a session in memory drops its pages.  A
        later ``reserve`` allocates them again before a step writes them."""
        with self._lock:
            session_id, s = self._still_open(kv)
            if s is None:
                return
            keep = min(s.capacity, max(s.shared, -(-length // self.chunk) * self.chunk))
            if keep >= s.reserved:
                return
            runs = self._runs(s.capacity, keep, s.reserved)
            s.reserved = keep
            if s.memory_only:
                page = mmap.PAGESIZE
                for off, n in runs:  # (whole pages inside each run only: a run's neighbours keep theirs)
                    first, last = -(-off // page) * page, (off + n) // page * page
                    if last > first:
                        s.mm.madvise(mmap.MADV_DONTNEED, first, last - first)
                return
            try:
                fd = os.open(self._kv_path(session_id), os.O_RDWR)
            except OSError:  # (a file removed behind the daemon: nothing to give back)
                return
            try:
                for off, n in runs:
                    punch_hole(fd, off, n)
            finally:
                os.close(fd)

    def check_file(self, kv: KVCache) -> None:
        """``KVFileLost`` when the file of ``kv``'s session was removed behind the daemon (a session in
        memory only has none to lose): checked before a turn starts, so that it is refused as a whole
        rather than failing once it outgrows the blocks already allocated."""
        with self._lock:
            session_id, s = self._still_open(kv)
        if s is not None and not s.memory_only and not self._kv_path(session_id).exists():
            raise self._lost(session_id)

    def _lost(self, session_id: str) -> KVFileLost:
        return KVFileLost(f"session {session_id}: its KV file {self._kv_path(session_id)} is gone (removed while "
                          f"the daemon ran): delete the session, or restart the daemon to rebuild it from its journal")

    def _allocate(self, session_id: str, s: OpenSession, start: int, stop: int, runs: int | None = None) -> None:
        """Disk for positions [start, stop) of the session's file: of every (layer, k|v, head) run, or of its
        first ``runs``."""
        try:
            fd = os.open(self._kv_path(session_id), os.O_RDWR)
        except FileNotFoundError:
            raise self._lost(session_id) from None
        except OSError as e:
            raise self._os_error(session_id, "opening its KV file", e) from e
        try:
            done: list[tuple[int, int]] = []
            try:
                for off, n in self._runs(s.capacity, start, stop)[:runs]:
                    os.posix_fallocate(fd, off, n)
                    done.append((off, n))
            except OSError as e:
                for off, n in done:  # give back what this call allocated: nothing changed
                    punch_hole(fd, off, n)
                raise self._os_error(session_id, f"allocating positions {start}..{stop}", e) from e
        finally:
            os.close(fd)

    def _os_error(self, session_id: str, what: str, e: OSError) -> KVStoreError:
        cls = DiskFull if e.errno in DISK_FULL else KVStoreError
        return cls(f"session {session_id}: {what} in {self.dir} failed: {e.strerror or e}")

    # -- durability and accounting ------------------------------------------------------------------

    def flush(self, kv: KVCache) -> None:
        """Write the session's dirty KV pages to disk and wait for them (fdatasync).

        A killed process loses nothing without this: its writes are already in the shared page cache,
        which the kernel writes back on its own.  It matters against an OS crash or power loss, where
        only KV rows flushed before a journal commit are sure to match it.  One fdatasync covers every
        dirty page of the file in one batch of I/O; an msync per (layer, k|v, head) run waits for each
        run's I/O in turn and costs about 100x more.  It is not free either (about 4 ms here even with
        nothing dirty: the device-cache flush), so the engine calls it per commit batch, not per token.
        """
        with self._lock:  # (no lock held while waiting for the disk)
            session_id, s = self._still_open(kv)
        if s is None:
            raise KVStoreError("this KVCache is not an open session of this store (deleted?)")
        if s.memory_only:
            return
        try:
            fd = os.open(self._kv_path(session_id), os.O_RDWR)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._os_error(session_id, "flushing its KV file", e) from e

    def tiers(self) -> dict:
        """Where KV bytes live: ``file_bytes`` allocated on disk, ``ram_bytes`` resident in RAM - the
        page cache of session and prefix files, each page once however many sessions map them, and the
        memory of memory-only sessions (``ram_measured`` False when mincore is unavailable) -,
        reservation and cap, session count.  Measured off the store's lock (a step's reservation never
        waits for a status): the sessions' arrays stay valid whatever happens to them meanwhile."""
        ids = self.session_ids()  # (the directory's listing, off the lock)
        with self._lock:
            opened = dict(self._open)
            prefix_paths = self.prefixes.paths()
            reserved = self._reserved_bytes()
        file_bytes, rams = 0, []
        for sid in ids:
            path = self._kv_path(sid)
            try:
                file_bytes += allocated_bytes(path)
                s = opened.get(sid)
                # a session's own rows: past the shared prefix's pages it maps (counted with the prefix)
                rams.append(runs_resident_bytes(s.data, s.shared, s.reserved) if s is not None
                            else file_resident_bytes(path))
            except FileNotFoundError:
                continue
        in_memory = [s for s in opened.values() if s.memory_only]
        rams += [runs_resident_bytes(s.data, s.shared, s.reserved) for s in in_memory]
        for path in prefix_paths:  # shared pages: once, from their own file
            try:
                rams.append(file_resident_bytes(path))
            except FileNotFoundError:
                continue
        measured = None not in rams
        ram_bytes = sum(r for r in rams if r is not None)
        return {
            "file_bytes": file_bytes,
            "ram_bytes": ram_bytes if measured else 0,
            "ram_measured": measured,
            "reserved_bytes": reserved,
            "cap_bytes": self.cap_bytes,
            "sessions": len(ids) + len(in_memory),
            "prefixes": self.prefixes.status(),
            "short_prefixes": self.hot.status(),
            "memory_maps": self.maps.status(),  # the process's mappings, under vm.max_map_count
            "disk_free_bytes": shutil.disk_usage(self.dir).free,  # what the files may still grow into
        }

