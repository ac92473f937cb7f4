"""GPU pools' calibration: on a CUDA device, the torch backend's step-time model (``weaved.calibration``,
as for the CPU pool) and the host-to-device bandwidth a promotion's KV copy gets, measured once per
model and host (the step model is stored beside the CPU's; the bandwidth, a few milliseconds to
measure, at each start) and shown in ``/v1/status``.  Torch's CPU device standing in for a GPU is not
calibrated: its numbers would describe nothing real (``stand_ins`` lets a test run the same path).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from weaved.backends.base import Backend
from weaved.calibration.store import Calibration, CalibrationStore
from weaved.daemon.pools import Pool
from weaved.daemon.rates import calibration_of
from weaved.kv.cache import KVCache

LINK_POSITIONS = 4096  # the KV rows a bandwidth measurement copies


@dataclass(frozen=True)
class DeviceRates:
    pools: tuple[str, ...]  # the pools on this backend
    device: str
    calibration: Calibration
    link_bytes_per_s: float  # host to device, a promotion's KV copy

    def to_dict(self) -> dict:
        c = self.calibration
        return {"pools": list(self.pools), "device": self.device,
                "prefill_tokens_per_s": round(c.cost.prefill_tokens_per_s(2048), 1),
                "step_cost": c.cost.to_dict(), "fit_error": round(c.fit_error, 4), "measured_at": c.measured_at,
                "age_s": round(time.time() - c.measured_at, 1), "link_gb_s": round(self.link_bytes_per_s / 1e9, 3)}


def link_bandwidth(backend: Backend, positions: int = LINK_POSITIONS) -> float:
    """Bytes/s of ``backend.adopt`` copying ``positions`` rows of KV from host memory (then released)."""
    c = backend.config
    rows = np.random.default_rng(0).standard_normal((c.n_layers, 2, c.n_kv_heads, positions, c.head_dim),
                                                    dtype=np.float32).astype(np.float16)
    kv = KVCache(rows, positions)
    sync = _sync(backend)
    sync()
    t0 = time.perf_counter()
    copied = backend.adopt(kv)
    sync()
    dt = time.perf_counter() - t0
    backend.release(kv)
    return copied / max(dt, 1e-9)


def _sync(backend: Backend) -> Callable[[], None]:
    device = getattr(backend, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def calibrate_devices(pools: dict[str, Pool], fingerprint: str, store: CalibrationStore, say: Callable[[str], None],
                      *, stand_ins: bool = False, step_target_s: float | None = None) -> list[DeviceRates]:
    """The calibration of every GPU pool's backend on a CUDA device (each backend once); each pool then
    uses it (``Pool.use_step_model``, with ``step_target_s`` for the steps an interactive turn decodes in)."""
    by_backend: dict[int, list[Pool]] = {}
    for p in pools.values():
        if p.device_kind == "gpu" and p.config.strategy == "standard" and (stand_ins or not p.stand_in):
            by_backend.setdefault(id(p.backend), []).append(p)
    out = []
    for group in by_backend.values():
        backend = group[0].backend
        cal = calibration_of(backend, fingerprint, max(p.config.prefill_chunk for p in group),
                             max(p.config.max_batch for p in group), store, say)
        for p in group:  # turns predicted and steps sized by it
            p.use_step_model(cal.cost, step_target_s)
        out.append(DeviceRates(tuple(p.name for p in group), str(getattr(backend, "device", "?")), cal,
                               link_bandwidth(backend)))
    return out
