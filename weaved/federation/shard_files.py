"""Ring shards as files in a daemon's own KV store, counted against its KV cap like its sessions.

A shard reserves its whole capacity when it opens (a member that cannot hold it refuses the open, and
the home reports it), and its file is deleted when the session closes or the group ends.  Shard files
never outlive their group: a home rebuilds its ring sessions from their transcripts after a loss or a
restart, so files a crash left behind are deleted when the daemon starts (``SHARD_PREFIX``).
Kept free of torch: a daemon that federates with nobody still cleans up at start.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from weaved.kv.cache import KVCache
from weaved.kv.store import KVStore

SHARD_PREFIX = "shard-"


def shard_files(store: KVStore, prefix: str) -> tuple[Callable[[int, int], KVCache], Callable[[int, KVCache], None]]:
    """(kv_factory, on_close) keeping a group's shards as files ``<prefix><sid>`` in ``store``.  A new
    shard reserves its whole capacity, so the node's KV cap bounds what it agrees to hold."""

    def make(sid: int, capacity: int) -> KVCache:
        name = f"{prefix}{sid}"
        kv = store.create(name, max(1, capacity))
        try:
            store.reserve(kv, max(1, capacity))
        except Exception:
            store.delete(name)
            raise
        return kv

    def close(sid: int, kv: KVCache) -> None:
        store.delete(f"{prefix}{sid}")

    return make, close


def group_prefix(group: str) -> str:
    """A file-name-safe prefix for a group's shard files (group names carry node names)."""
    return f"{SHARD_PREFIX}{hashlib.sha1(group.encode()).hexdigest()[:12]}-"


def delete_group_files(store: KVStore, prefix: str = SHARD_PREFIX) -> int:
    """Delete the shard files whose names start with ``prefix`` (a group's, once it ended; every
    group's, left behind by a crash, when the daemon starts); returns how many."""
    stale = [sid for sid in store.session_ids() if sid.startswith(prefix)]
    for sid in stale:
        store.delete(sid)
    return len(stale)
