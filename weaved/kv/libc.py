"""The few libc calls the KV store needs that Python's ``os`` and ``mmap`` modules do not offer, through
ctypes.  Each is None where libc or the call is missing (non-Linux, unusual libc): callers degrade."""

from __future__ import annotations

import ctypes
import ctypes.util


def libc_function(name: str, argtypes: list, restype=ctypes.c_int):
    """libc's ``name`` with the given signature (errno kept for ``ctypes.get_errno``), or None."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn
