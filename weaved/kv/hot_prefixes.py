"""Short shared prefixes: the KV rows of recent prompts' leading 16-token blocks, kept in memory and
copied into a new session's first positions.

The prefix files (``prefixes.py``) share whole 128-token blocks by mapping them, which is what long
system prompts and tool lists need.  A short prompt never fills such a block - yet a chat template's
default system prompt and a client's fixed instructions are the first few dozen tokens of every
stateless request, computed again each time (on SmolLM2, 30 of a typical 40-token chat prompt).  Here
each full 16-token block of a first turn's prompt is kept after it is fed, named like a prefix file's
block by a hash chained over every token before its end, and a new session whose prompt starts with
kept blocks gets their rows copied in (368 KB a block for SmolLM2: tens of microseconds, against
milliseconds to compute them).  The engine is batch- and chunk-invariant, so copied rows are the
bits the session would have computed.

Blocks are evicted least recently used past ``cap_bytes``.  Nothing maps them, so nothing pins them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from weaved.kv.prefixes import chain_keys

BLOCK = 16  # positions per kept block


class HotPrefixes:
    """Rows of 16-token prompt blocks by chained key, at most ``cap_bytes`` of them."""

    def __init__(self, fingerprint: str, bytes_per_block: int, cap_bytes: int):
        self.fingerprint = fingerprint
        self.capacity = max(0, cap_bytes // max(1, bytes_per_block))  # blocks kept at most
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()  # key -> float16 [L, 2, H, BLOCK, D]
        self._lock = threading.Lock()
        self.hits = 0
        self.copied_tokens = 0

    def __len__(self) -> int:
        return len(self._rows)

    def covered(self, tokens: Sequence[int], start: int = 0) -> int:
        """Positions of ``tokens`` from 0 that kept blocks hold, counting from ``start`` (a multiple of
        BLOCK that something else already holds): the end of the consecutive run found from there."""
        keys = chain_keys(self.fingerprint, tokens, BLOCK)
        n = start // BLOCK
        with self._lock:
            while n < len(keys) and keys[n] in self._rows:
                n += 1
        return max(start, n * BLOCK)

    def take(self, tokens: Sequence[int], start: int, limit: int) -> list[np.ndarray]:
        """The rows of the kept blocks of ``tokens`` from position ``start`` on, consecutive, ending at
        or before ``limit`` positions: a list of float16 [L, 2, H, BLOCK, D] (copies are the caller's
        to make; these are not changed after they are kept)."""
        if start % BLOCK:
            return []
        keys = chain_keys(self.fingerprint, tokens[:limit], BLOCK)
        out = []
        with self._lock:
            for k in keys[start // BLOCK:]:
                rows = self._rows.get(k)
                if rows is None:
                    break
                self._rows.move_to_end(k)
                out.append(rows)
            if out:
                self.hits += 1
                self.copied_tokens += len(out) * BLOCK
        return out

    def keep(self, data: np.ndarray, tokens: Sequence[int], start: int = 0) -> int:
        """Keep the full blocks of ``tokens`` from position ``start`` on (their KV rows are
        ``data[:, :, :, :len(tokens)]``, written and not to change) not kept yet; how many were added."""
        if not self.capacity:
            return 0
        keys = chain_keys(self.fingerprint, tokens, BLOCK)
        added = 0
        for i, k in enumerate(keys):
            if i * BLOCK < start:
                continue
            with self._lock:
                if k in self._rows:
                    self._rows.move_to_end(k)
                    continue
            rows = np.array(data[:, :, :, i * BLOCK:(i + 1) * BLOCK])  # [L, 2, H, BLOCK, D] a copy
            with self._lock:
                self._rows[k] = rows
                added += 1
                while len(self._rows) > self.capacity:
                    self._rows.popitem(last=False)
        return added

    def clear(self) -> int:
        """Forget every block kept; how many there were."""
        with self._lock:
            n = len(self._rows)
            self._rows.clear()
            return n

    def status(self) -> dict:
        with self._lock:
            return {"blocks": len(self._rows), "capacity_blocks": self.capacity, "hits": self.hits,
                    "copied_tokens": self.copied_tokens}
