"""Paged device KV for the torch backend (the device tier of docs/architecture.md, "KV cache").

A session's ``KVCache`` (its array over the session's file) is the source of truth; the device holds
a copy of its rows in fixed blocks of ``BLOCK`` positions taken from one pool allocated up front:

    pool: float16 [n_layers, n_blocks, 2, n_kv_heads, BLOCK, head_dim]

A session's block table lists the block of each run of ``BLOCK`` positions.  Growing a session takes
free blocks (nothing is reallocated or copied); releasing it gives them back; a step that needs more
blocks than are free raises ``DeviceKVFull`` for that session alone, before anything is written.

Shared prefixes (``KVCache.shared``) are held once per device.  Their rows are keyed by the prefix's
content keys, so every session that maps a prefix file - or another file holding the same leading
blocks - points its table at the same device blocks, and promoting the tenth such session copies only
its own tail.  A prefix block's device blocks are reference-counted by the tables using them; when no
table does they stay as a cache and are evicted least recently used when a session needs the room
(a prefix's last blocks before its first, which every longer prefix needs).  A session that stops
sharing (its host copy was unshared before a rewrite) gets its own copies of the blocks first
(device to device), so a shared block is never written.

``valid`` counts a table's leading rows known equal to the host's: the backend writes each step's new
rows to both sides (write-through), and rows the host gained elsewhere are caught up before use.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from weaved.backends.torch_transfer import to_device, warm_staging
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig

BLOCK = 32  # positions per device block: divides the prefix files' block, small enough to waste little


class DeviceKVFull(RuntimeError):
    """The device's KV pool has too few free blocks for a session's next step (the server's capacity);
    ``need_bytes``: the free KV that would have been enough."""

    http_status = 503

    def __init__(self, message: str, need_bytes: int):
        super().__init__(message)
        self.need_bytes = need_bytes


@dataclass(eq=False)
class Table:
    blocks: list[int] = field(default_factory=list)  # device block of positions [i * BLOCK, (i + 1) * BLOCK)
    shared: tuple[str, ...] = ()  # content keys of the leading prefix blocks held through the prefix cache
    per_key: int = 0  # device blocks per prefix block (its positions / BLOCK)
    valid: int = 0  # rows 0..valid-1 equal the host's
    _ids: torch.Tensor | None = None  # blocks as a device tensor, made when first needed after a change
    _arr: np.ndarray | None = None  # and as a host array

    def changed(self) -> None:
        self._ids = None
        self._arr = None

    def array(self) -> np.ndarray:
        """The blocks as an int64 numpy array [n_blocks] (a step's tables are built from these: a long
        session's list converted every step cost ~0.2 ms a sequence)."""
        if self._arr is None:
            self._arr = np.asarray(self.blocks, dtype=np.int64)
        return self._arr

    def ids(self, device: torch.device) -> torch.Tensor:
        """The blocks as an int64 device tensor [n_blocks]."""
        if self._ids is None:
            self._ids = torch.tensor(self.blocks, dtype=torch.int64, device=device)
        return self._ids


@dataclass(eq=False)
class _Shared:
    blocks: list[int]  # the device blocks of one prefix block
    users: int = 0


class PagedKV:
    """The paged KV of one device.  ``h2d_bytes`` / ``d2h_bytes`` count KV bytes copied each way.
    Thread safety: the engine thread prepares and steps sessions while a delete or a demotion may
    release one from another thread, and a garbage collection may run a table's drop anywhere: adopting,
    preparing, releasing and writing through hold the pool's lock, so a release waits for a prepare
    under way instead of pulling its table from under it."""

    def __init__(self, config: ModelConfig, device: torch.device, budget_bytes: int, block: int = BLOCK):
        self.config, self.device, self.block = config, device, block
        self.block_bytes = block * config.kv_bytes_per_token
        n_blocks = budget_bytes // self.block_bytes
        if n_blocks < 1:
            raise ValueError(f"a device KV budget of {budget_bytes} bytes holds no block of {block} positions "
                             f"({self.block_bytes} bytes for this model)")
        c = config
        self.pool = torch.empty((c.n_layers, n_blocks, 2, c.n_kv_heads, block, c.head_dim), dtype=torch.float16,
                                device=device)  # [L, n_blocks, 2, Hkv, BLOCK, D]
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: low blocks first
        self._tables: weakref.WeakKeyDictionary[KVCache, Table] = weakref.WeakKeyDictionary()
        self._prefix: OrderedDict[str, _Shared] = OrderedDict()  # content key -> blocks, least recent first
        self._lock = threading.RLock()
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self._scratch: int | None = None
        if device.type == "cuda":
            warm_staging()  # a promotion's pinned chunks, locked now rather than during the first one

    def close(self) -> None:
        """Give the pool's memory back (the backend's shutdown): every table and cached prefix goes, and
        the pool holds no block after."""
        with self._lock:
            self._tables = weakref.WeakKeyDictionary()
            self._prefix.clear()
            self._free = []
            self._scratch = None
            self.n_blocks = 0
            self.pool = self.pool.new_empty((0,) + tuple(self.pool.shape[1:]))

    # ---- accounting ------------------------------------------------------------------------------
    def __contains__(self, kv: KVCache) -> bool:
        return kv in self._tables

    def table(self, kv: KVCache) -> Table:
        return self._tables[kv]

    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    def nbytes(self) -> int:
        """Bytes of blocks in use (sessions' and cached prefixes')."""
        return self.used_blocks() * self.block_bytes

    def capacity_bytes(self) -> int:
        return self.n_blocks * self.block_bytes

    def free_bytes(self) -> int:
        """Free blocks and cached prefix blocks nobody uses (they go when a session needs the room)."""
        with self._lock:
            idle = sum(len(e.blocks) for e in self._prefix.values() if not e.users)
            return (len(self._free) + idle) * self.block_bytes

    def held_bytes(self, kv: KVCache) -> int:
        """Bytes that releasing ``kv`` would free: its own blocks and the shared ones it alone uses."""
        t = self._tables.get(kv)
        if t is None:
            return 0
        with self._lock:
            alone = sum(1 for key in t.shared if key in self._prefix and self._prefix[key].users == 1)
        return (len(t.blocks) - (len(t.shared) - alone) * t.per_key) * self.block_bytes

    def prefix_blocks(self) -> int:
        return sum(len(e.blocks) for e in self._prefix.values())

    def scratch_block(self) -> int:
        """A block no session owns, taken once: the padding rows of a decode graph write and read it
        (``torch_graphs``)."""
        if self._scratch is None:
            self._scratch = self._take(1)[0]
        return self._scratch

    # ---- blocks ----------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:  # cached prefix blocks nobody uses make room, least recent first
                for key in [k for k, e in self._prefix.items() if not e.users]:
                    self._free.extend(self._prefix.pop(key).blocks)
                    if len(self._free) >= n:
                        break
            if len(self._free) < n:
                raise DeviceKVFull(
                    f"device KV full on {self.device}: {n} more blocks of {self.block} positions needed, "
                    f"{len(self._free)} of {self.n_blocks} free ({self.capacity_bytes() / 2**20:.0f} MiB pool)",
                    need_bytes=n * self.block_bytes)
            return [self._free.pop() for _ in range(n)]

    def _give(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(blocks)

    def _unref(self, key: str) -> None:
        with self._lock:
            e = self._prefix.get(key)
            if e is not None:
                e.users -= 1

    def _drop_table(self, t: Table) -> None:
        """Give back a table's own blocks and its references to shared ones."""
        with self._lock:
            self._give(t.blocks[len(t.shared) * t.per_key:])
            for key in t.shared:
                self._unref(key)
            t.blocks, t.shared, t.valid = [], (), 0
            t.changed()

    # ---- rows ------------------------------------------------------------------------------------
    def _upload(self, kv: KVCache, t: Table, a: int, b: int) -> int:
        """Copy host rows a..b-1 into the table's blocks (which exist); returns the bytes copied."""
        if b <= a:
            return 0
        host = kv.data[:, :, :, a:b]  # [L, 2, Hkv, n, D], a view of the session's rows
        _, _, Hkv, _, D = host.shape
        B = self.block
        whole = (b - a) // B if a % B == 0 else 0  # whole blocks from a: each a run of B rows a (k|v, head)
        ids = self.ids(t)[a // B:a // B + whole] if whole else None
        part = self.where(t, a + whole * B, b) if a + whole * B < b else None
        for l0, l1, src in to_device(host, self.device):  # a few layers at a time, the next one's copy overlapping
            if ids is not None:
                # [l, 2, Hkv, whole, B, D] -> [l, whole, 2, Hkv, B, D]: a block's rows copied as runs
                self.pool[l0:l1, ids] = src[:, :, :, :whole * B].reshape(l1 - l0, 2, Hkv, whole, B, D).permute(
                    0, 3, 1, 2, 4, 5)
            if part is not None:  # a partial block: row by row, [n, l, 2, Hkv, D]
                self.pool[l0:l1, part[0], :, :, part[1]] = src[:, :, :, whole * B:].permute(3, 0, 1, 2, 4)
        n = host.size * host.itemsize
        self.h2d_bytes += n
        return n

    def where(self, t: Table, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions a..b-1, each int64 [b - a] on the device."""
        pos = torch.arange(a, b, device=self.device)
        return self.ids(t)[pos // self.block], pos % self.block

    def ids(self, t: Table) -> torch.Tensor:
        return t.ids(self.device)

    def _grow(self, t: Table, positions: int) -> None:
        need = -(-positions // self.block) - len(t.blocks)
        if need > 0:
            t.blocks.extend(self._take(need))
            t.changed()

    # ---- sessions --------------------------------------------------------------------------------
    def adopt(self, kv: KVCache) -> int:
        """Hold ``kv``'s rows 0..length-1 here (shared prefix blocks already held are not copied again);
        the bytes copied, 0 if already held."""
        with self._lock:
            if kv in self._tables:
                return 0
            t = Table()
            self._tables[kv] = t
            weakref.finalize(kv, self._drop_table, t)
            before = self.h2d_bytes
            try:
                self.prepare(kv, 0)
            except BaseException:
                self.release(kv)
                raise
            return self.h2d_bytes - before

    def release(self, kv: KVCache) -> int:
        """Free ``kv``'s blocks here.  Nothing to write back (every step wrote through): returns 0."""
        with self._lock:
            t = self._tables.pop(kv, None)
            if t is not None:
                self._drop_table(t)
        return 0

    def prepare(self, kv: KVCache, n_new: int) -> Table:
        """The table of ``kv`` (adopted if new) holding rows 0..length-1, with blocks for ``n_new`` more.
        Raises ``DeviceKVFull`` (having written nothing the host lacks) when the pool cannot hold them."""
        with self._lock:
            if kv not in self._tables:
                self.adopt(kv)
            t = self._tables[kv]
            t.valid = min(t.valid, kv.length)  # truncated (e.g. rejected draft tokens): later rows are stale
            self._sync_shared(kv, t)
            self._grow(t, kv.length + n_new)
            if kv.length > t.valid:  # the host went on without us: catch up
                self._upload(kv, t, t.valid, kv.length)
                t.valid = kv.length
            return t

    def _sync_shared(self, kv: KVCache, t: Table) -> None:
        """Point the table's leading blocks at the device's copy of each prefix block the host maps (and
        whose rows all lie before ``kv.length``); take own copies of blocks it no longer shares."""
        want: tuple[str, ...] = ()
        sh = kv.shared
        if sh is not None and sh.block % self.block == 0 and (not t.shared or t.per_key * self.block == sh.block):
            want = sh.keys[:kv.length // sh.block]
        keep = 0
        while keep < min(len(t.shared), len(want)) and t.shared[keep] == want[keep]:
            keep += 1
        for j in range(len(t.shared) - 1, keep - 1, -1):  # no longer shared: copy on write, last first
            lo, hi = j * t.per_key, (j + 1) * t.per_key
            mine = self._take(hi - lo)
            self.pool[:, mine] = self.pool[:, t.blocks[lo:hi]]
            t.blocks[lo:hi] = mine
            self._unref(t.shared[j])
            t.shared = t.shared[:j]
            t.changed()
        if want[keep:]:
            t.per_key = sh.block // self.block
            for j in range(keep, len(want)):
                self._share(kv, t, j, want[j])
        with self._lock:  # a prefix's first blocks are worth more than its last (every longer one needs them)
            for key in reversed(t.shared):
                if key in self._prefix:
                    self._prefix.move_to_end(key)

    def _share(self, kv: KVCache, t: Table, j: int, key: str) -> None:
        """Make prefix block ``j`` (content ``key``) of ``kv`` the device's shared copy: the cached one if
        the device has it (the table's own blocks there are given back), else the table's own blocks,
        filled from the host where they are not yet valid, become it."""
        lo, hi = j * t.per_key, (j + 1) * t.per_key
        a, b = lo * self.block, hi * self.block  # its positions
        with self._lock:
            e = self._prefix.get(key)
            if e is not None:
                self._give(t.blocks[lo:hi])
                t.blocks[lo:hi] = e.blocks
                t.valid = max(t.valid, b)
            else:
                self._grow(t, b)
                if t.valid < b:
                    self._upload(kv, t, max(t.valid, a), b)
                    t.valid = b
                e = self._prefix[key] = _Shared(t.blocks[lo:hi])
            e.users += 1
        t.shared = (*t.shared, key)
        t.changed()

    def write_through(self, kv: KVCache, rows: np.ndarray, pos0: int) -> None:
        """Store a step's new rows (float16 [n_layers, 2, n_kv_heads, n, head_dim], already in the
        table's blocks) into the host array at positions pos0.., and count them as valid."""
        n = rows.shape[3]
        kv.data[:, :, :, pos0:pos0 + n] = rows
        self.d2h_bytes += rows.nbytes
        with self._lock:
            t = self._tables.get(kv)
            if t is not None:  # (released during the step: its rows are on the host, nothing to count)
                t.valid = pos0 + n
