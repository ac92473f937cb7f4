"""The process's memory maps, counted against the kernel's cap on them.

Linux caps the number of memory mappings (VMAs) of a process at ``vm.max_map_count`` (65,530 by
default).  Past it every ``mmap`` of the process fails with ENOMEM - numpy's large allocations and new
threads' stacks as well as the KV store's own - so the store must stay well below it.  A session's file
is one mapping, but a shared prefix mapped over its first positions (``FileMapping.alias``) is one per
(layer, k|v, kv head) run, and each splits the session's own mapping around it: 2 x runs more (360 on
SmolLM2-135M, 512 on a Llama 3.2 1B shape), so a few hundred sessions sharing a system prompt would
reach the cap.

The budget counts the mappings the KV store makes and leaves ``spare`` of the cap to the rest of the
process.  Sessions' own mappings are always made (``take``); a prefix alias asks first (``try_take``)
and, refused, the session copies the prefix's rows instead: the disk and page cache hold them once more,
nothing is computed again.
"""

from __future__ import annotations

import threading
from pathlib import Path

DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default, where /proc does not say
SPARE = 8192  # left to the rest of the process: libraries, threads' stacks, the allocator's arenas


def max_map_count() -> int:
    """The kernel's cap on a process's mappings (``vm.max_map_count``)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


class MapBudget:
    """Mappings the KV store holds, against ``limit - spare``.  Thread-safe."""

    def __init__(self, limit: int | None = None, spare: int = SPARE):
        self.limit = max_map_count() if limit is None else limit
        self.capacity = max(0, self.limit - min(spare, self.limit // 2))
        self.used = 0
        self.refused = 0  # aliases refused for want of room
        self.refused_logged = False  # the first refusal is logged, once for the process
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Count ``n`` mappings that are made whatever the budget says (a session's own)."""
        with self._lock:
            self.used += n

    def try_take(self, n: int) -> bool:
        """Count ``n`` mappings if they fit under the budget; False (nothing counted) when they do not."""
        with self._lock:
            if self.used + n > self.capacity:
                self.refused += 1
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)

    def status(self) -> dict:
        with self._lock:
            return {"used": self.used, "budget": self.capacity, "max_map_count": self.limit,
                    "refused": self.refused}


_process: MapBudget | None = None
_process_lock = threading.Lock()


def process_budget() -> MapBudget:
    """The one budget of this process (the cap is per process, whatever number of stores it holds)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = MapBudget()
        return _process
