"""Process environment the kernels need, applied before numba is first imported.

* ``NUMBA_CACHE_DIR``: compiled kernels are cached on disk (every kernel is ``cache=True``), so only
  the first process on a machine pays for compilation.  Unless the variable is already set, the
  cache lives in ``$XDG_CACHE_HOME/weave/numba/<hash>`` (``~/.cache/weave/numba/<hash>`` without
  XDG_CACHE_HOME).  ``<hash>`` digests the source of every numba module of this package: numba checks
  only the modification time of the file that defines a cached function, not of the modules its
  LLVM intrinsics and callees live in, so without it an edit to a helper module could leave stale
  machine code in use.
* ``NUMBA_THREADING_LAYER_PRIORITY`` defaults to OpenMP first (numba's own order puts TBB first when
  it is installed): the kernels' thread plan - one kernel thread starting every region, spinning
  threads between regions, static splits with work stealing - was built and measured on numba's
  OpenMP layer (``threads.on_kernel_thread``).  TBB, then numba's work queue, remain the fallbacks.
* ``OPENBLAS_NUM_THREADS`` defaults to 1: OpenBLAS's spinning worker threads and numba's pool fight
  for the cores when both are active in one process (measured: millisecond stalls on 2 cores).  It
  only takes effect if numpy has not been imported yet.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

LAYER_PRIORITY = ("omp", "tbb", "workqueue")


def _source_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(Path(__file__).resolve().parent.glob("*.py")):
        # benchmark scripts and the torch/Triton kernels: no numba kernel depends on them
        if p.name.startswith(("_bench", "torch_", "triton_")):
            continue
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    """Where compiled kernels are cached when NUMBA_CACHE_DIR is not set."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "weave" / "numba" / _source_digest()


def apply() -> None:
    if not os.environ.get("NUMBA_CACHE_DIR"):
        os.environ["NUMBA_CACHE_DIR"] = str(default_cache_dir())
        numba_mod = sys.modules.get("numba")
        if numba_mod is not None:  # numba imported before us: its config has already read the environment
            numba_mod.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    if not os.environ.get("NUMBA_THREADING_LAYER_PRIORITY"):
        os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = " ".join(LAYER_PRIORITY)
        numba_mod = sys.modules.get("numba")
        if numba_mod is not None:  # (read at its import; it picks a layer at the first parallel region)
            numba_mod.config.THREADING_LAYER_PRIORITY = list(LAYER_PRIORITY)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


apply()
