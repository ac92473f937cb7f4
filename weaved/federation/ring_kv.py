"""A Q-Ring session's KV as the home daemon's engine sees it.

The rows live on the ring's nodes (a shard per node, ``shards``), so the home keeps only what it
needs to drive the session and to rebuild it: the capacity, and the transcript of the ids at
positions 0 .. length-1.  The transcript is what makes a ring session survive the loss of a peer or
a restart of the home: its shards can be recomputed on whatever ring exists now.  ``epoch`` names
the ring formation that holds the shards (None: no ring holds them yet, or the ring that did was
lost), which is how the backend knows a session must be rebuilt before it can step.

The engine reads ``length`` and ``capacity`` and the daemon calls ``truncate`` exactly as with a
``KVCache``; the backend advances ``length`` (by extending the transcript) once a step's rows are
stored on the ring.  ``truncate`` only records the cut (``ring_cut``): the ring's shards are cut
by the backend on the engine thread before the session's next step, so that no caller (the daemon
under its lock) waits on the network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class RingKV:
    def __init__(self, rid: int, capacity: int, tokens: Iterable[int] = (),
                 on_truncate: Callable[[RingKV, int], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rid = rid  # the session's id on the ring (an int: it travels in command headers)
        self.capacity = capacity
        self.tokens: list[int] = list(tokens)  # the transcript: ids at positions 0 .. length-1
        if len(self.tokens) > capacity:
            raise ValueError(f"a transcript of {len(self.tokens)} tokens exceeds the capacity {capacity}")
        self.epoch: int | None = None  # the ring formation holding this session's shards
        self.ring_cut = False  # the transcript was cut since the ring's shards last matched it
        self.dropped = False  # deleted: never placed on a ring again
        self._on_truncate = on_truncate

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on; the ring's shards are cut before the next step."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a session of length {self.length} to {length}")
        if self._on_truncate is not None and length < self.length:
            self._on_truncate(self, length)
        del self.tokens[length:]

    def __repr__(self) -> str:
        return f"RingKV(rid={self.rid}, length={self.length}, capacity={self.capacity}, epoch={self.epoch})"
