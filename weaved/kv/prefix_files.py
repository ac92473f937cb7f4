"""The shared prefixes' files on disk (``prefixes.py`` holds their index): finding them at start, writing a
file's rows and its sidecar, giving rows' disk back.

A file ``<key>.kv`` is the layout of a session's file (``[layer][k|v][kv_head][position][head_dim]``,
float16) with room for ``capacity`` positions in every run, sparse: only the blocks it holds use disk.
Its sidecar ``<key>.json`` names the model (``fingerprint``), the key after each block it holds
(``keys``), the block size and the shape; the rows a sidecar names are on the disk before it is.  A
branch's sidecar also names its ``parent`` file and the ``base`` blocks it takes from it: the branch holds
the rows of its own blocks only, at their own positions (the parent's part a hole).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from weaved.kv.tiers import allocated_bytes, punch_hole
from weaved.model.config import ModelConfig

Found = tuple[str, list[str], Path, int, float, str | None, int]
# (key, keys, path, capacity, last modified, parent key or None, blocks taken from the parent)
Foreign = tuple[float, Path, int, str | None]  # another model's file: (last modified, path, bytes on disk, parent)


def scan(directory: Path, config: ModelConfig, fingerprint: str, block: int) -> tuple[list[Found], list[Foreign]]:
    """The prefix files under ``directory`` this model can map, and other models' (kept for them, oldest
    first).  What no model can use goes: publications a crash cut, files without a sidecar or with one
    nobody can read, files shorter than their sidecar says (a read past a mapped file's end kills the
    process), branches whose parent is gone or holds other blocks, and the disk of rows a stop left past
    what a sidecar names."""
    if not directory.is_dir():
        return [], []
    for pattern in ("*.kv.tmp", "*.json.tmp"):  # a publication a crash cut
        for tmp in directory.glob(pattern):
            tmp.unlink(missing_ok=True)
    found: list[Found] = []
    foreign: list[Foreign] = []
    unsure: set[str] = set()
    bpt = config.kv_bytes_per_token
    for meta in sorted(directory.glob("*.json")):
        kv = meta.with_suffix(".kv")
        try:
            m = json.loads(meta.read_text())
            key, keys = m["key"], list(m["chain"] if "parent" in m else m["keys"])
            capacity = int(m["shape"][3]) if "shape" in m else len(keys) * block  # (older files: no room)
            if capacity < len(keys) * block or capacity % block:
                raise ValueError(f"capacity {capacity} for {len(keys)} blocks")
            parent, base = m.get("parent"), int(m.get("base", 0))
            if parent is not None and (not isinstance(parent, str) or parent == key or not 0 < base < len(keys)):
                raise ValueError(f"a branch of {base} blocks from {parent!r}")
        except (ValueError, KeyError, TypeError, IndexError):  # no model can read this file: its disk goes back
            meta.unlink(missing_ok=True)
            kv.unlink(missing_ok=True)
            continue
        except OSError:  # (unreadable now: kept for a later start, and so are its branches)
            unsure.add(meta.stem)
            continue
        try:
            st = kv.stat()
        except FileNotFoundError:  # a publication a crash cut between the sidecar and the file
            meta.unlink(missing_ok=True)
            continue
        except OSError:
            unsure.add(meta.stem)
            continue
        if m.get("fingerprint") != fingerprint:  # another model's: kept for it, counted, evicted first
            foreign.append((st.st_mtime, kv, allocated_bytes(kv), parent))  # (its blocks: a file with room is sparse)
            continue
        if st.st_size != capacity * bpt:  # cut short: nothing may map it
            meta.unlink(missing_ok=True)
            kv.unlink(missing_ok=True)
            continue
        if allocated_bytes(kv) > ((len(keys) - base) * block + block // 2) * bpt:  # rows a stop left between
            shape = (config.n_layers, 2, config.n_kv_heads, capacity, config.head_dim)  # growing the file and
            give_back(kv, shape, len(keys) * block, capacity)  # naming them
        found.append((key, keys, kv, capacity, st.st_mtime, parent, base))
    found = _rooted(found, unsure)
    for kv in directory.glob("*.kv"):
        if not kv.with_suffix(".json").exists():  # its sidecar is lost: nothing can map it again
            kv.unlink(missing_ok=True)
    foreign.sort(key=lambda f: f[0])  # oldest first
    return found, foreign


def _rooted(found: list[Found], unsure: set[str]) -> list[Found]:
    """``found`` less the branches that cannot be mapped - their parent is gone, holds other blocks than
    the branch's first, or starts its own rows no earlier (chains go forward: no cycle) - and theirs in
    turn, their files removed (their own rows mean nothing without the parent's); but a branch of a file
    that could not be read now (``unsure``) is only left out, kept for a later start."""
    by_key = {f[0]: f for f in found}
    while True:
        broken = [f for f in by_key.values() if f[5] is not None and (
            f[5] not in by_key or by_key[f[5]][6] >= f[6] or len(by_key[f[5]][1]) < f[6]
            or by_key[f[5]][1][f[6] - 1] != f[1][f[6] - 1])]
        if not broken:
            return list(by_key.values())
        for f in broken:
            del by_key[f[0]]
            unsure_parent = f[5] in unsure
            if unsure_parent:  # (and its own branches in turn, the same way)
                unsure.add(f[0])
            else:
                f[2].with_suffix(".json").unlink(missing_ok=True)
                f[2].unlink(missing_ok=True)


def write_sidecar(path: Path, meta: dict) -> None:
    """``meta`` as the sidecar at ``path``, on the disk before it is named: a file sessions map is described
    again and again as it grows, and a power loss must leave one description or the other."""
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def write_rows(path: Path, data: np.ndarray, start: int, stop: int, shape: tuple[int, ...], *,
                create: bool) -> None:
    """Positions [start, stop) of ``data`` (float16 [L, 2, H, cap, D]) into the file at ``path`` (a new one
    with ``create``, sized for ``shape``'s capacity and sparse) and synced: each run's blocks allocated
    first (a full disk fails here, with ENOSPC), then its rows written with ``pwrite``.  Not through a
    mapping: a store into a mapped page of a sparse file dirties the whole page-cache folio around it
    (up to megabytes on recent kernels), and its writeback fills the holes beside the rows - measured,
    a block of every run written so made a 180 MB file of 151 MB on disk, not 3."""
    row = shape[4] * 2
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o600)  # (prompts' KV: the user's alone)
    try:
        if create:
            os.ftruncate(fd, int(np.prod(shape)) * 2)  # a hole: only the blocks written cost disk
        offsets = _run_offsets(shape, start)
        for offset in offsets:
            os.posix_fallocate(fd, offset, (stop - start) * row)
        flat = data.reshape(-1, *data.shape[3:])  # [L * 2 * H, cap, D]: one run a row
        for r, offset in enumerate(offsets):
            _pwrite_all(fd, flat[r, start:stop], offset)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """The directory's entries (a file's new name) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, rows: np.ndarray, offset: int) -> None:
    """``rows`` (contiguous) at ``offset``, however many calls the kernel takes to write them."""
    view = memoryview(np.ascontiguousarray(rows)).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def give_back(path: Path, shape: tuple[int, ...], start: int, stop: int) -> None:
    """Best effort: the blocks of positions [start, stop) of every run back to the file system."""
    row = shape[4] * 2
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        for offset in _run_offsets(shape, start):
            punch_hole(fd, offset, (stop - start) * row)
    finally:
        os.close(fd)


def _run_offsets(shape: tuple[int, ...], start: int) -> list[int]:
    """The byte offset of position ``start`` in each (layer, k|v, head) run of a file of ``shape``."""
    row, capacity = shape[4] * 2, shape[3]
    return [(r * capacity + start) * row for r in range(shape[0] * shape[1] * shape[2])]
