"""The simulator's backend: it computes nothing, and each step advances the virtual clock by what its
cost model says the step would take on the simulated hardware.

Its KV caches are the daemon's own (the store's files, in the simulation's small layout: the daemon's
accounting of positions, caps and shared prefixes runs as it does for real); the backend only reads
their lengths and advances them.  A GPU pool's backend also keeps the device's KV accounting - its
budget in positions, what each adopted session holds - and charges a promotion's copy at the link's
bandwidth for the real shape's bytes.
"""

from __future__ import annotations

import weakref

import numpy as np

from weaved.backends.base import Backend, BackendStats, Logits, SeqChunk
from weaved.calibration.cost import StepCost
from weaved.kv.cache import KVCache
from weaved.model.config import ModelConfig
from weaved.sim.clock import VirtualClock

TOKEN = 1000  # what every step samples: an ordinary token of any vocabulary (sampling is not simulated)


class DeviceFull(RuntimeError):
    """The simulated device's KV budget is spent (as ``weaved.backends.torch_paged.DeviceKVFull``)."""

    http_status = 503

    def __init__(self, message: str, need_bytes: int):
        super().__init__(message)
        self.need_bytes = need_bytes


class SimBackend(Backend):
    def __init__(self, name: str, config: ModelConfig, cost: StepCost, clock: VirtualClock, *,
                 real_kv_bytes_per_token: int, device_positions: int | None = None, link_bw: float | None = None,
                 device: dict | None = None):
        """``config``: the daemon's (the simulation's KV layout); ``cost``: the step model of the real
        shape on the simulated hardware; ``device_positions``: a GPU's KV budget in positions (None: the
        backend computes on host memory); ``link_bw``: host-to-device bytes/s of a promotion's copy."""
        self._name = name
        self.config = config
        self.cost = cost
        self.clock = clock
        self.stats = BackendStats()
        self.real_kv_bytes_per_token = real_kv_bytes_per_token
        self.device_positions = device_positions
        self.link_bw = link_bw
        self._device_info = device  # a simulated GPU as status shows it
        self._held: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()  # positions on device
        self._row = np.zeros((1, config.vocab_size), np.float32)
        self._row[0, TOKEN] = 1.0

    @property
    def name(self) -> str:
        return self._name

    def new_kv(self, capacity: int) -> KVCache:
        return KVCache.allocate(self.config, capacity)

    # ---- device KV accounting (GPU pools) ---------------------------------------------------------
    def _device(self) -> bool:
        return self.device_positions is not None

    def _used(self) -> int:
        return sum(self._held.values())

    def adopt(self, kv: KVCache) -> int:
        if not self._device() or kv in self._held:
            return 0
        self._take(kv, kv.length)
        nbytes = kv.length * self.config.kv_bytes_per_token
        if self.link_bw:  # the copy, at the link's speed for the real shape's bytes
            self.clock.advance(kv.length * self.real_kv_bytes_per_token / self.link_bw)
        return nbytes

    def release(self, kv: KVCache) -> int:
        self._held.pop(kv, None)
        return 0

    def _take(self, kv: KVCache, positions: int) -> None:
        have = self._held.get(kv, 0)
        free = self.device_positions - self._used()
        if positions - have > free:
            raise DeviceFull(f"device KV full: {positions - have} positions needed, {free} free",
                             (positions - have - free) * self.config.kv_bytes_per_token)
        self._held[kv] = max(have, positions)

    def prepare(self, kv: KVCache, new_length: int) -> None:
        if self._device():
            self._take(kv, new_length)

    def device_info(self) -> dict | None:
        if self._device_info is None:
            return None
        used = self._used() * self.real_kv_bytes_per_token
        return {**self._device_info, "memory_used": self._device_info.get("weights_bytes", 0) + used}

    def device_kv_bytes(self) -> int:
        return self._used() * self.config.kv_bytes_per_token if self._device() else 0

    def device_kv_free_bytes(self) -> int | None:
        if not self._device():
            return None
        return (self.device_positions - self._used()) * self.config.kv_bytes_per_token

    def device_kv_capacity(self) -> int | None:
        return self.device_positions * self.config.kv_bytes_per_token if self._device() else None

    def device_kv_bytes_of(self, kv: KVCache) -> int:
        return self._held.get(kv, 0) * self.config.kv_bytes_per_token

    # ---- the step ---------------------------------------------------------------------------------
    def forward(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        prefill, decode = [], []
        for c in chunks:
            n, p = len(c.tokens), c.kv.length
            if p + n > c.kv.capacity:
                raise ValueError(f"KV cache full: {p} + {n} tokens > capacity {c.kv.capacity}")
            if n > 1:
                prefill.append((n, p))
            else:
                decode.append(p)
        if self._device():
            for c in chunks:
                self._take(c.kv, c.kv.length + len(c.tokens))
        dt = self.cost.chunks_step_s(prefill, decode)
        self.clock.advance(dt)
        out = []
        for c in chunks:
            n = len(c.tokens)
            c.kv.length += n
            rows = {Logits.NONE: 0, Logits.LAST: 1, Logits.ALL: n}[c.logits]
            out.append(np.repeat(self._row, rows, axis=0) if rows != 1 else self._row)
        st = self.stats
        st.steps += 1
        prefill_tokens = sum(n for n, _ in prefill)
        st.tokens += prefill_tokens + len(decode)
        st.prefill_tokens += prefill_tokens
        st.decode_tokens += len(decode)
        st.seconds += dt
        return out
