"""The backend contract: one forward pass over a ragged batch of sequences.

A backend owns the model's weights on its device and executes ``forward`` for a batch engine.  It
does not schedule, sample or tokenize.  Every backend reads the same Q4_0 GGUF bytes and keeps KV
in the layout of ``weaved.kv`` ([layer][k|v][kv_head][position][head_dim], float16), which is what
lets a session move between backends without recomputing anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig


class Logits(StrEnum):
    """Which rows of logits a sequence wants back from a step."""

    NONE = "none"  # a prefill chunk that is not the last one
    LAST = "last"  # the next-token distribution only (decode, last prefill chunk)
    ALL = "all"  # every new token's row (prompt log-probabilities, teacher forcing, speculation)


@dataclass
class SeqChunk:
    """One sequence's part of a step: ``tokens`` at positions ``kv.length ...``.

    The backend writes the chunk's K/V rows into ``kv`` at those positions and advances
    ``kv.length`` by ``len(tokens)`` once they are written.
    """

    kv: KVCache
    tokens: np.ndarray  # [n] int32, n >= 1
    logits: Logits = Logits.LAST

    @property
    def pos0(self) -> int:
        return self.kv.length


@dataclass
class BackendStats:
    """Counters a test or benchmark can read; they only ever grow."""

    steps: int = 0
    tokens: int = 0  # every token run through forward
    prefill_tokens: int = 0  # tokens of chunks with more than one token
    decode_tokens: int = 0  # tokens of single-token chunks
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class Backend(ABC):
    """Executes the model for a batch engine.

    Contract:
    - ``forward(chunks)`` runs one step over every chunk together: dense layers as one product
      over all tokens of the step, attention per sequence over its own KV.  It returns one array
      per chunk: float32 ``[1, vocab]`` for ``Logits.LAST``, ``[n, vocab]`` for ``Logits.ALL``,
      ``[0, vocab]`` for ``Logits.NONE``.
    - A chunk's results depend only on that sequence (its tokens and its KV): never on the other
      chunks of the step, their number or their order (batch invariance).  Backends that cannot
      promise bit-identity must stay within mean KL 0.0005 of the CPU backend.
    - On return every chunk's K/V rows are in its ``KVCache`` and ``kv.length`` has advanced.
      A chunk that would exceed ``kv.capacity`` raises ``ValueError`` before anything is written.
    - Thread safety: one engine thread calls ``forward``; it may release the GIL.
    """

    config: ModelConfig
    stats: BackendStats

    @property
    @abstractmethod
    def name(self) -> str:
        """Short backend name shown in placements and status: ``cpu`` or ``torch``."""

    @property
    def host_parallel(self) -> bool:
        """Whether its steps run the host's parallel kernels (on the process's one kernel thread,
        ``kernels.threads.on_kernel_thread``).  Its engine then samples a step's rows there too, in
        parallel, between its own steps; an engine of any other backend samples on its own thread, one
        row after another, rather than wait for the kernel thread behind the CPU pools' steps."""
        return False

    @abstractmethod
    def new_kv(self, capacity: int) -> KVCache:
        """An empty KV cache with room for ``capacity`` positions, in this backend's memory."""

    @abstractmethod
    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        """Run one step; see the class docstring for the contract."""

    # ---- migration between backends --------------------------------------------------------------
    # A session's ``KVCache`` (its array over the session's file) is the one source of truth.  A
    # backend that computes in another memory (a GPU) keeps a device copy beside it, made by ``adopt``
    # and dropped by ``release``; ``forward`` writes every new row to the device copy *and* through to
    # ``kv.data`` in the same step, so the file is current whenever a step has returned: the journal
    # may commit, a crash loses nothing committed, and ``release`` has nothing left to write.

    def adopt(self, kv: KVCache) -> int:
        """Make ``kv`` runnable here; returns the bytes copied into this backend's memory.

        Copies rows ``0 .. kv.length-1`` once (the KV migration of a promotion).  The host backend
        computes on ``kv.data`` itself and copies nothing.  Adopting an adopted cache is a no-op.
        ``forward`` adopts a cache it has not seen (a new session), so calling this first is only
        needed to move a session with history and to account for the copy.
        """
        return 0

    def release(self, kv: KVCache) -> int:
        """Stop running ``kv`` here and free its copy in this backend's memory (if any).

        Returns the bytes written back to ``kv.data``: zero, since ``forward`` writes through.
        Releasing a cache that was never adopted is a no-op.
        """
        return 0

    def drop(self, kv: KVCache) -> int:
        """The session is deleted: free whatever this backend holds for it (a device copy, a ring's
        shards on other nodes).  Returns bytes freed in this backend's memory; defaults to ``release``."""
        return self.release(kv)

    def prepare(self, kv: KVCache, new_length: int) -> None:
        """Called by the engine before a step that grows ``kv`` to ``new_length`` positions, one session
        at a time, so that what cannot be done for one session fails that session's turn alone (e.g. a
        ring that must first rebuild the session's shards).  Raises to refuse; the default does nothing."""
        return None

    def close(self) -> None:
        """Release, at shutdown, what this backend holds beyond the process's own memory: a ring's
        members, a device's memory.  The backend serves no step after."""
        return None

    def device_kv_bytes(self) -> int:
        """Bytes of KV this backend holds in its own memory (the device tier); 0 for the host backend."""
        return 0

    def device_kv_bytes_of(self, kv: KVCache) -> int:
        """Bytes of its own KV memory that releasing ``kv`` would free (0 for the host backend)."""
        return 0

    def device_info(self) -> dict | None:
        """The device this backend computes on, for status (index, name, memory_total, memory_used);
        None for the host's CPU."""
        return None

    def device_kv_free_bytes(self) -> int | None:
        """Bytes of its own KV memory a session could still take (None: its KV is the host's files)."""
        return None

    def device_kv_capacity(self) -> int | None:
        """Bytes of its own KV memory in all, used or free (None: its KV is the host's files)."""
        return None
