"""A shared mapping of a session's KV file that lets go of the file while arrays over it still live.

Python's ``mmap`` object keeps a duplicate of the file's descriptor for its whole life, and the mapping
itself holds the file: a deleted session's descriptor and disk blocks stayed until the last array over
its mapping was garbage-collected - an engine thread may still hold the session's cache, and reference
cycles make that "whenever".  Here the file is mapped with libc's ``mmap`` (no descriptor is kept), the
arrays are numpy views of a ctypes buffer at the mapping's address (unmapped when the last of them
goes), and ``release`` swaps the file's pages for anonymous ones at the same addresses, so the file is
let go at once and the arrays stay valid.  Where libc's calls are unavailable it falls back to Python's
``mmap`` and ``release`` does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

from weaved.kv.libc import libc_function
from weaved.kv.map_budget import MapBudget, process_budget

_mmap = libc_function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int64], restype=ctypes.c_void_p)
_munmap = libc_function("munmap", [ctypes.c_void_p, ctypes.c_size_t])
_madvise = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_MAP_FIXED = 0x10  # Linux's value on every architecture; Python's mmap module does not export it
_MAP_FAILED = ctypes.c_void_p(-1).value
_RW = mmap.PROT_READ | mmap.PROT_WRITE
_NATIVE = None not in (_mmap, _munmap, _madvise)


class FileMapping:
    """``length`` bytes of the file open as ``fd``, mapped shared and writable (the caller may close
    ``fd`` right after: the mapping does not need it); with ``fd`` -1, private anonymous memory instead
    (``anonymous``): a session that never outlives the process, with no file at all."""

    def __init__(self, fd: int, length: int, budget: MapBudget | None = None):
        if length < 1:
            raise ValueError(f"cannot map {length} bytes")
        self.length = length
        self.released = False
        self.anonymous = fd == -1
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if self.anonymous else mmap.MAP_SHARED
        if not _NATIVE:
            self._mm: mmap.mmap | None = mmap.mmap(fd, length, flags=flags)
            self._buf = self._mm
            return
        self._mm = None
        addr = _mmap(None, length, _RW, flags, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.addr = addr
        self._buf = (ctypes.c_char * length).from_address(addr)
        # The process's mappings this one holds (``map_budget``): one, and those that ``claim`` adds.
        self._budget = budget if budget is not None else process_budget()
        self._maps = [1]
        self._budget.take(1)
        # unmapped when the buffer goes: after this object and every array over it
        weakref.finalize(self._buf, _unmap, addr, length, self._budget, self._maps)

    @classmethod
    def anonymous_memory(cls, length: int, budget: MapBudget | None = None) -> FileMapping:
        """``length`` bytes of private anonymous memory, zero until written, with the same interface: its
        pages are allocated as they are first written, and ``alias`` and ``release`` work on it too
        (pages a call replaces are freed then - private memory, not a shared object that keeps them)."""
        return cls(-1, length, budget)

    def renew(self, start: int, length: int) -> None:
        """Fresh private zero pages over bytes [start, start + length) of an anonymous mapping (whole
        pages), in place of what was there - e.g. another file's pages ``alias`` mapped."""
        if not self.anonymous or not self.can_alias:
            raise OSError("only a native anonymous mapping can be renewed in place")
        if (start | length) % mmap.PAGESIZE or start + length > self.length:
            raise ValueError(f"{length} bytes at {start} are not whole pages inside the mapping")
        got = _mmap(self.addr + start, length, _RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        if got != self.addr + start:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A writable array of ``shape`` over the mapping's first bytes (it keeps the mapping alive)."""
        return np.frombuffer(self._buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def madvise(self, advice: int, start: int = 0, length: int | None = None) -> None:
        """``madvise(2)`` over bytes [start, start + length) (start rounded down to a page)."""
        length = self.length - start if length is None else length
        first = start - start % mmap.PAGESIZE
        if self._mm is not None:
            self._mm.madvise(advice, first, start + length - first)
        elif not self.released:
            _madvise(self.addr + first, start + length - first, advice)

    def claim_maps(self, n: int) -> bool:
        """Ask the process's budget for ``n`` more mappings before aliasing (``alias`` splits this one);
        False when there is no room (nothing counted)."""
        if not self.can_alias or not self._budget.try_take(n):
            return False
        self._maps[0] += n
        return True

    def claim_maps_upto(self, n: int) -> bool:
        """``claim_maps`` of what ``n`` claimed mappings lack (a session mapped before may have them)."""
        if not self.can_alias:
            return False
        return self.claimed >= n or self.claim_maps(n - self.claimed)

    @property
    def claimed(self) -> int:
        """Mappings claimed for this one's splits."""
        return self._maps[0] - 1 if self._mm is None else 0

    def unclaim_maps(self, n: int) -> None:
        """Give back ``n`` mappings claimed, once the aliases are replaced by this mapping's own pages."""
        n = min(n, self._maps[0] - 1)
        self._maps[0] -= n
        self._budget.give(n)

    @property
    def split(self) -> bool:
        """Whether mappings are claimed for this one's splits (``claim_maps``)."""
        return self._mm is None and self._maps[0] > 1

    @property
    def can_alias(self) -> bool:
        return self._mm is None and not self.released

    def alias(self, start: int, fd: int, file_offset: int, length: int, *, writable: bool = False) -> None:
        """Map ``length`` bytes of another file (``fd`` at ``file_offset``) over bytes [start, start +
        length) of this mapping, in place: the arrays over this mapping then read that file's pages (the
        page cache's own - nothing is copied).  Read-only unless ``writable``: a write there faults.
        Offsets and length must be whole pages.  OSError when the kernel refuses."""
        if not self.can_alias:
            raise OSError("this mapping cannot alias another file (no native mmap, or released)")
        if (start | file_offset | length) % mmap.PAGESIZE or start + length > self.length:
            raise ValueError(f"alias of {length} bytes at {start} (file offset {file_offset}) is not whole pages "
                             f"inside the mapping")
        prot = _RW if writable else mmap.PROT_READ
        got = _mmap(self.addr + start, length, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, file_offset)
        if got != self.addr + start:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def release(self) -> bool:
        """Let go of the file now: its pages are replaced, at the same addresses, by anonymous zero pages
        (one ``mmap(MAP_FIXED)``, atomic for a thread reading or writing them meanwhile; a step still in
        flight writes into memory nobody reads).  The arrays stay valid; the anonymous pages are unmapped
        with them.  False where unsupported (the file is then held until the arrays go)."""
        if self._mm is not None or self.released:
            return self.released
        got = _mmap(self.addr, self.length, _RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        self.released = got == self.addr
        if self.released:  # one mapping again, whatever was aliased
            self.unclaim_maps(self._maps[0] - 1)
        return self.released


def _unmap(addr: int, length: int, budget: MapBudget, maps: list[int]) -> None:
    _munmap(addr, length)
    budget.give(maps[0])
