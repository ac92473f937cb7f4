"""The KV store's prefix sharing: mapping stored prefix files over a session's first positions, copying
short kept blocks in, publishing a session's blocks, taking its own copy back before a rewrite, forks.

A mixin of ``KVStore`` (``store.py``), which holds the sessions, their mappings and the lock these
methods take; ``prefixes.py`` holds the prefix files, ``hot_prefixes.py`` the short blocks.
"""

from __future__ import annotations

import json
import logging
import mmap
import os

import numpy as np

from weaved.kv.cache import KVCache, SharedRows
from weaved.kv.errors import DiskFull, KVStoreError
from weaved.kv.hot_prefixes import BLOCK as HOT_BLOCK
from weaved.kv.open_session import OpenSession
from weaved.kv.prefixes import BLOCK as PREFIX_BLOCK
from weaved.kv.tiers import punch_hole

log = logging.getLogger("weave.kv")


class NoMapsLeft(Exception):
    """The process's mapping budget (``map_budget``) has no room for one more session's prefix alias."""


class PrefixSharing:
    """Prefix sharing over a ``KVStore``'s sessions (``self._open``, ``self._lock``, ``self.prefixes``,
    ``self.hot``, ``self.share``)."""

    def share_prefix(self, kv: KVCache, tokens: list[int]) -> int:
        """Map the longest stored prefix of ``tokens`` (leaving at least one token to feed) over a new
        session's first positions; its length (0 when none applies).  ``kv.length`` becomes that length:
        those rows are the prefix file's pages, read where they lie."""
        session_id = self._session_of(kv)
        with self._lock:
            s = self._open[session_id]
            if not self.share or kv.length or s.shared or not s.mm.can_alias or len(tokens) < 2:
                return 0
            # the session is the file's user from the lookup on: nothing evicts it before it is mapped
            found = self.prefixes.longest(tokens, len(tokens) - 1, user=session_id)
            if found is None:
                return 0
            prefix, n = found
            try:
                if not self._alias(kv, session_id, s, prefix.key, n):
                    self.prefixes.drop_user(prefix.key, session_id)
                    return 0
            except NoMapsLeft:
                pass  # its own copy of the rows instead, outside the lock (reserve takes it)
            except BaseException:
                self.prefixes.drop_user(prefix.key, session_id)
                raise
            else:
                kv.length = n
                self._write_meta(session_id, s, {"key": prefix.key, "positions": n})
                return n
        try:
            return self._copy_from_prefix(kv, prefix, n)
        finally:  # (copied: the session's rows are its own)
            self.prefixes.drop_user(prefix.key, session_id)

    def _alias(self, kv: KVCache, session_id: str, s: OpenSession, key: str, n: int) -> bool:
        """Map the prefix file ``key``'s positions [0, n) over the session's - a branch's from each file of
        its chain (``PrefixStore.segments``); False when the layout's runs are not whole pages (a head
        size too small for this page size).  ``NoMapsLeft`` when the process's mapping budget cannot take
        the session's aliases (one per run and file, each splitting the session's own mapping: a chain of
        k files makes k + 1 pieces of every run)."""
        prefix = self.prefixes.get(key)
        if prefix is None:
            raise KVStoreError(f"session {session_id}: its shared prefix {key} is gone from {self.prefixes.dir}")
        if n > prefix.positions:  # (a sidecar naming blocks the file's own never recorded: a lost update)
            raise KVStoreError(f"session {session_id}: its shared prefix {key} holds {prefix.positions} positions, "
                               f"not {n}")
        try:
            segments = self.prefixes.segments(key, n)
        except KeyError as e:
            raise KVStoreError(f"session {session_id}: a file its shared prefix {key} branches from is gone") from e
        row = self.config.head_dim * 2
        if (s.capacity * row) % mmap.PAGESIZE or (n * row) % mmap.PAGESIZE or any(
                (p.capacity * row) % mmap.PAGESIZE or (start * row) % mmap.PAGESIZE for p, start, _ in segments):
            return False
        if not s.mm.claim_maps_upto((len(segments) + 1) * self.prefixes.runs()):
            self._note_no_maps()
            raise NoMapsLeft(f"session {session_id}: no room under vm.max_map_count to map a shared prefix")
        fds: list[int] = []
        done = 0
        try:
            for p, _, _ in segments:
                fds.append(os.open(p.path, os.O_RDONLY))
            for r in range(self.prefixes.runs()):
                done += 1
                for fd, (p, start, stop) in zip(fds, segments, strict=True):
                    s.mm.alias((r * s.capacity + start) * row, fd, (r * p.capacity + start) * row, (stop - start) * row)
        except BaseException:  # the kernel refused part-way: the runs mapped read-only are the session's again
            if done:  # (else its next write there would fault), holding the prefix's rows - the same bits as
                self._own_pages(session_id, s, done, n)  # the rows the aliases replaced, which were private or
                self._copy_segments(s.data, segments, done)  # punched out of its file: gone
            raise
        finally:
            for fd in fds:
                os.close(fd)
        s.prefix, s.shared = key, n
        kv.shared = SharedRows(tuple(prefix.keys[:n // self.prefixes.block]), self.prefixes.block)
        s.reserved = max(s.reserved, n)
        self.prefixes.use(key, session_id)
        return True

    def _copy_segments(self, data: np.ndarray, segments: list, runs: int | None = None) -> None:
        """The segments' rows (``PrefixStore.segments``) copied from their prefix files into ``data`` (a
        session's rows, [L, 2, H, cap, D]): into every (layer, k|v, head) run, or its first ``runs``."""
        own = data.view()
        own.shape = (-1, *data.shape[3:])  # [runs, cap, head_dim]: a view (an error, never a copy written to)
        for p, start, stop in segments:
            src = np.memmap(p.path, dtype=np.float16, mode="r", shape=self._shape(p.capacity))
            own[:runs, start:stop] = src.reshape(own.shape[0], p.capacity, -1)[:runs, start:stop]
            del src

    def _note_no_maps(self) -> None:
        if not self.maps.refused_logged:
            self.maps.refused_logged = True
            st = self.maps.status()
            log.warning("KV files hold %d of the process's memory mappings, of the %d that vm.max_map_count allows "
                        "(%d kept for the rest of the process): new sessions copy shared prefixes instead of "
                        "mapping them (more disk and page cache, nothing recomputed); raise vm.max_map_count to "
                        "share them again", st["used"], st["max_map_count"], st["max_map_count"] - st["budget"])

    def _rows_from_prefix(self, data: np.ndarray, prefix, n: int) -> None:
        """Copy prefix file ``prefix``'s positions [0, n) (from each file of its chain) into ``data`` (a
        session's own rows, allocated), for a session that may not map them; OSError or ValueError when a
        file is gone or damaged."""
        try:
            segments = self.prefixes.segments(prefix.key, n)
        except KeyError as e:
            raise ValueError(f"a file the shared prefix {prefix.key} branches from is gone") from e
        self._copy_segments(data, segments)
        self.prefixes.copied += 1

    def _copy_from_prefix(self, kv: KVCache, prefix, n: int) -> int:
        """A new session's own copy of a stored prefix's positions [0, n) (when it may not map them); the
        positions it holds then (0 when the KV cap has no room, or the prefix went meanwhile)."""
        try:
            self.reserve(kv, n)
            self._rows_from_prefix(kv.data, prefix, n)
        except (KVStoreError, OSError, ValueError):
            return 0
        kv.length = n
        return n

    def _reshare(self, kv: KVCache, session_id: str, s: OpenSession, key: str, n: int) -> None:
        """At a restart, the session's first ``n`` positions are prefix ``key``'s: map it over them again,
        or (no mappings left) copy its rows into the session's own file.  ``KVStoreError``, with the
        session closed again, when neither can be done.  (Under the store's lock.)"""
        try:
            ok = self._alias(kv, session_id, s, key, n)
        except NoMapsLeft:  # (_alias found the prefix: it is there)
            self._own_copy(session_id, s, key, n)
            return
        except (KVStoreError, OSError, ValueError) as e:
            self._open.pop(session_id).mm.release()
            why = str(e).removeprefix(f"session {session_id}: ")  # (an error of _alias names it too)
            raise KVStoreError(f"session {session_id}: its shared prefix cannot be mapped: {why}") from e
        if not ok:
            self._open.pop(session_id).mm.release()
            raise KVStoreError(f"session {session_id}: its shared prefix no longer fits its layout")

    def _own_copy(self, session_id: str, s: OpenSession, key: str, n: int) -> None:
        """At a restart, instead of mapping prefix ``key`` again: the session's own copy of its first ``n``
        positions (none when ``n`` is 0), its sidecar naming no prefix any more.  ``KVStoreError``, with
        the session closed again, when the prefix's rows cannot be read.  (Under the store's lock.)"""
        try:
            if n:
                prefix = self.prefixes.get(key)
                if prefix is None:
                    raise KVStoreError(f"its shared prefix {key} is gone from {self.prefixes.dir}")
                self._allocate(session_id, s, 0, n)
                self._rows_from_prefix(s.data, prefix, n)
            self._write_meta(session_id, s, None)
        except (KVStoreError, OSError, ValueError) as e:
            self._open.pop(session_id).mm.release()
            why = str(e).removeprefix(f"session {session_id}: ")
            raise KVStoreError(f"session {session_id}: its shared prefix's rows cannot be copied: {why}") from e

    def copy_prefix(self, kv: KVCache, tokens: list[int], start: int) -> int:
        """Past the ``start`` positions a new session holds (0, or a mapped prefix's), copy in the kept
        16-token blocks of ``tokens`` that follow (``hot_prefixes``; at least one token is left to feed);
        the positions it holds then.  Nothing is copied when the KV cap has no room for them."""
        if not self.share or kv.length != start:
            return kv.length
        blocks = self.hot.take(tokens, start, len(tokens) - 1)
        if not blocks:
            return start
        end = start + len(blocks) * HOT_BLOCK
        try:
            self.reserve(kv, end)
        except KVStoreError:
            return start
        for i, rows in enumerate(blocks):
            kv.data[:, :, :, start + i * HOT_BLOCK:start + (i + 1) * HOT_BLOCK] = rows
        kv.length = end
        return end

    def keep_prefix(self, kv: KVCache, tokens: list[int]) -> int:
        """Keep the short blocks of a first turn's fed prompt ``tokens`` for later sessions to copy: those
        past its last full 128-position block (which a prefix file holds), or all of a shorter prompt -
        a few blocks, so the copy is small; how many were added."""
        if not self.share or len(tokens) > kv.length:
            return 0
        with self.pinned(kv) as open_:
            if not open_:  # deleted meanwhile: its rows may be zeros by now
                return 0
            return self.hot.keep(kv.data, tokens, start=(len(tokens) // PREFIX_BLOCK) * PREFIX_BLOCK)

    def cached_prefix(self, tokens: list[int]) -> int:
        """Positions of ``tokens`` a new session would not compute: a prefix file's, then kept short blocks."""
        if not self.share:
            return 0
        return self.hot.covered(tokens, self.prefixes.covered(tokens))

    def unshare(self, kv: KVCache, keep: int) -> None:
        """Before positions from ``keep`` on are rewritten (the caller's journal no longer names them: a
        rewind, a history rewrite): if a shared prefix covers them, the session goes on mapping the
        prefix's full blocks below ``keep`` and takes its own copy of the rows from there to ``keep`` (at
        most a block) back into its file - not the whole prefix, which on a long context is hundreds of
        megabytes copied and held twice."""
        session_id = self._session_of(kv)
        with self._lock:
            s = self._open[session_id]
            if not s.shared or keep >= s.shared:
                return
            n, block = s.shared, self.prefixes.block
            m = (keep // block) * block  # positions still the prefix's: whole pages of every run
            while m and (m * self.config.head_dim * 2) % mmap.PAGESIZE:
                m -= block
            rows = np.array(s.data[:, :, :, m:keep])  # [L, 2, H, keep - m, D] the rows kept past them, copied
            self._own_pages(session_id, s, self.prefixes.runs(), n, start=m)
            s.data[:, :, :, m:keep] = rows
            if m:
                s.shared = m
                kv.shared = SharedRows(kv.shared.keys[:m // block], block) if kv.shared is not None else None
                self._write_meta(session_id, s, {"key": s.prefix, "positions": m})
                return
            self.prefixes.drop_user(s.prefix, session_id)
            s.prefix, s.shared = None, 0
            kv.shared = None
            self._write_meta(session_id, s, None)

    def take_back(self, kv: KVCache, keep: int) -> None:
        """Positions from ``keep`` on leave ``kv`` for good (a rewind; rows the journal could not name):
        a shared prefix's full blocks below the cut stay mapped (``unshare``), the cache is cut, and the
        room the rows past it held goes back to the cap and the disk (``release_past``) - the cut made even
        where the copy fails (the caller's journal has forgotten those positions already)."""
        try:
            self.unshare(kv, keep)
        finally:
            kv.truncate(keep)
            self.release_past(kv, keep)

    def _own_pages(self, session_id: str, s: OpenSession, runs: int, n: int, start: int = 0) -> None:
        """The session's own writable pages again over positions [start, n) of its first ``runs`` (layer,
        k|v, head) runs, where a prefix file was mapped (their contents are not kept)."""
        row = self.config.head_dim * 2
        if s.memory_only:
            for r in range(runs):
                s.mm.renew(r * s.capacity * row + start * row, (n - start) * row)
            if not start and runs == self.prefixes.runs():  # anonymous again: the kernel merges the pieces back
                s.mm.unclaim_maps(s.mm.claimed)  # (not after a part-way alias: the other runs still map a file)
            return
        # (a file's pieces stay apart - each remap opened the file anew - and stay claimed until the
        # session's mapping goes: a later prefix's aliases reuse them)
        self._allocate(session_id, s, start, n, runs)  # (of the runs taken back alone: the others map a file)
        fd = os.open(self._kv_path(session_id), os.O_RDWR)
        try:
            for r in range(runs):
                off = r * s.capacity * row + start * row
                s.mm.alias(off, fd, off, (n - start) * row, writable=True)
        finally:
            os.close(fd)

    def publish_prefix(self, kv: KVCache, tokens: list[int], *, adopt: bool = True) -> int:
        """Store the full blocks of ``tokens`` (the session's committed tokens: their rows are written)
        as a shared prefix, unless one already holds them; the positions it holds (0: nothing new).
        ``adopt``: the session then maps the prefix file over those positions too and gives its own copy
        of them back to the file system, so the rows exist once, whoever shares them."""
        if len(tokens) > kv.length:
            raise KVStoreError(f"{len(tokens)} tokens but only {kv.length} KV rows")
        if not self.share:
            return 0
        with self.pinned(kv) as open_:
            if not open_:  # deleted meanwhile: its rows may be zeros by now, not what ``tokens`` computed
                return 0
            session_id = self._ids[kv]
            # (a user of the file from its making on: no eviction takes it before the session maps it)
            p = self.prefixes.publish(kv.data, tokens, user=session_id)
        if p is None:
            return 0
        n = (len(tokens) // self.prefixes.block) * self.prefixes.block  # (the file may hold more by now)
        try:
            if adopt:
                self._adopt(kv, p.key, n)
        finally:
            with self._lock:
                s = self._open.get(session_id)
                mapped = s is not None and s.prefix == p.key
            if not mapped:  # (the file stays as its publication left it: no eviction here)
                self.prefixes.drop_user(p.key, session_id, evict=False)
        return n

    def _adopt(self, kv: KVCache, key: str, n: int) -> None:
        """Map prefix ``key``'s positions [0, n) (equal to the session's own rows) over the session's and
        punch its own blocks there out."""
        with self._lock:
            session_id, s = self._still_open(kv)
            if s is None or s.shared >= n or not s.mm.can_alias or kv.length < n:  # (deleted meanwhile: None)
                return
            old = s.prefix
            try:
                if not self._alias(kv, session_id, s, key, n):
                    return
            except (NoMapsLeft, KVStoreError):  # it keeps its own copy of the rows (the prefix went meanwhile)
                return
            if old is not None and old != key:  # (only now: until then it still mapped the old one)
                self.prefixes.drop_user(old, session_id)
            if s.memory_only:  # the pages the alias replaced were private: freed with the mapping's change
                return
            # the sidecar names the prefix before the session's own rows go: a stop in between leaves both
            # copies of those rows (one wasted), never neither
            self._write_meta(session_id, s, {"key": key, "positions": n})
            row = self.config.head_dim * 2
            fd = os.open(self._kv_path(session_id), os.O_RDWR)
            try:
                for r in range(self.prefixes.runs()):
                    punch_hole(fd, r * s.capacity * row, n * row)
            finally:
                os.close(fd)

    def copy_rows(self, src: KVCache, dst: KVCache, start: int, stop: int) -> None:
        """Rows [start, stop) of ``src`` into ``dst`` (a fork's part past the shared prefix)."""
        if stop > start:
            self.reserve(dst, stop)
            dst.data[:, :, :, start:stop] = src.data[:, :, :, start:stop]
        dst.length = max(dst.length, stop)

    def clear_prefixes(self) -> dict:
        """The stored prefixes emptied: every file no session maps, and the short prefixes kept in memory
        (``{"files", "bytes", "kept_files", "short_blocks"}``: removed, freed, kept as sessions map them)."""
        with self.prefixes.no_publication():  # (else one could store a file of a name being removed)
            with self._lock:  # (no session is between finding a prefix and mapping it meanwhile)
                gone, freed, kept = self.prefixes.clear()
            for path in gone:  # (the sidecar first: a stop between leaves a file the next start sweeps)
                path.with_suffix(".json").unlink(missing_ok=True)
                path.unlink(missing_ok=True)
        return {"files": len(gone), "bytes": freed, "kept_files": kept, "short_blocks": self.hot.clear()}

    def fork_prefix(self, parent: KVCache, child: KVCache, tokens: list[int]) -> int:
        """A new session ``child`` starting with ``parent``'s first ``len(tokens)`` rows: the full blocks
        shared through a prefix file (published from the parent if none holds them yet), the rest
        copied; the positions shared."""
        try:
            self.publish_prefix(parent, tokens)
        except DiskFull:  # no room for a prefix file: the child gets its own copy of every row, if it can
            log.warning("no room for a shared prefix of %d tokens: the fork copies its rows", len(tokens))
        shared = self.share_prefix(child, tokens + [0])  # (a token to feed after them: share_prefix's rule)
        self.copy_rows(parent, child, shared, len(tokens))
        return shared

    def _write_meta(self, session_id: str, s: OpenSession, prefix: dict | None) -> None:
        if s.memory_only:  # nothing on disk to describe: it is never reopened
            return
        meta = self._meta(s.capacity)
        if prefix is not None:
            meta["prefix"] = prefix
        tmp = self._meta_path(session_id).with_suffix(".json.tmp")
        if self.durable:  # the rows it names first, then the description, then its name in the directory
            fd = os.open(self._kv_path(session_id), os.O_RDWR)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        with open(tmp, "w") as f:
            f.write(json.dumps(meta))
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self._meta_path(session_id))
        if self.durable:
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
