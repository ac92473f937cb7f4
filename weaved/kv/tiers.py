"""Where a KV file's bytes live - blocks on disk, pages resident in RAM (the page cache) - and giving
blocks back.

The disk tier is what the file system has allocated (``st_blocks``), which for our sparse files is what
the store reserved, not the logical size.  The RAM tier is measured with ``mincore(2)`` on a mapping of
the file: for a shared file mapping it reports the file's pages present in the page cache, whether this
process touched them or not.  ``mincore`` is reached through ctypes; where libc or the call is missing
(non-Linux, unusual libc) the measurement reports ``None`` and callers show "unknown".
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from weaved.kv.libc import libc_function

PAGE = mmap.PAGESIZE


_mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
_fallocate = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def allocated_bytes(path: Path) -> int:
    """Bytes the file system has allocated for ``path`` (sparse holes cost nothing)."""
    return os.stat(path).st_blocks * 512


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Best effort: give a byte range's blocks back to the file system (Linux fallocate PUNCH_HOLE;
    partial blocks at the ends are zeroed).  Silently does nothing where unsupported."""
    if _fallocate is not None:
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def resident_bytes(buf: np.ndarray) -> int | None:
    """Bytes of the pages spanned by ``buf`` that are resident in RAM, or None if unmeasurable.

    ``buf`` must be a C-contiguous array over a memory mapping (any dtype); the pages it spans are
    queried as a whole, so pass the array over the entire mapping to measure a file.
    """
    if _mincore is None or buf.nbytes == 0:
        return None if _mincore is None else 0
    addr = buf.ctypes.data
    start = addr - addr % PAGE  # mincore wants a page-aligned start
    length = addr + buf.nbytes - start
    n_pages = (length + PAGE - 1) // PAGE
    vec = np.zeros(n_pages, dtype=np.uint8)  # one byte per page; bit 0 = resident
    if _mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec.ctypes.data_as(ctypes.c_void_p)) != 0:
        return None
    return int(np.count_nonzero(vec & 1)) * PAGE


def runs_resident_bytes(data: np.ndarray, start: int, stop: int) -> int | None:
    """Resident bytes of positions [start, stop) of every (layer, k|v, head) run of a session's cache
    ``data`` (``[L, 2, H, capacity, D]``, C-contiguous over a mapping), or None if unmeasurable.  Only the
    pages those rows span are queried: past its reserved rows a run is a hole nobody writes, and asking
    about a whole capacity (32,768 positions) for every session made a status of 256 sessions take 2 s."""
    if _mincore is None:
        return None
    if stop <= start:
        return 0
    n_layers, two, n_heads, capacity, head_dim = data.shape
    row = head_dim * data.itemsize
    span = (stop - start) * row
    runs = n_layers * two * n_heads
    per_run = span // PAGE + 2  # pages a run's rows can span
    vec = np.zeros(runs * per_run, dtype=np.uint8)  # [runs, per_run] one byte per page; bit 0 = resident
    out, base = vec.ctypes.data, data.ctypes.data + start * row
    for r in range(runs):
        addr = base + r * capacity * row
        first = addr - addr % PAGE
        if _mincore(first, addr + span - first, out + r * per_run) != 0:
            return None
    return int(np.count_nonzero(vec & 1)) * PAGE


def file_resident_bytes(path: Path) -> int | None:
    """Page-cache residency of a file this process has not mapped (maps it read-only for the query)."""
    size = os.stat(path).st_size
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)  # [size]
        try:
            return resident_bytes(view)
        finally:
            del view  # release the buffer export before the mapping closes
