"""A daemon for simulation: the real ``Daemon`` - router, admission, scheduler, engines, KV store and
journal - over ``SimBackend``s, on a virtual clock, with no thread of its own (``driver.py`` steps it).

Its KV store keeps the simulation's small layout (``shapes.layout``) in a scratch directory, so caps,
reservations and shared prefixes are counted in positions exactly as for real; its tokenizer is the
default model's (turns are token ids; every simulated step samples the same ordinary token).  The
profile's pools are the simulated host's: speculative variants run plain (a simulated step samples
no real text for drafts to match) and ring pools are left out (no peers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from weaved.backends.base import Backend
from weaved.calibration.cost import StepCost
from weaved.config.profile import PoolConfig, Profile
from weaved.daemon.core import Daemon
from weaved.model.config import ModelConfig
from weaved.sim.backend import SimBackend
from weaved.sim.clock import VirtualClock
from weaved.sim.cost import Q4_0_BYTES_PER_WEIGHT, describe, gpu_roofline, matrix_weights
from weaved.sim.hardware import HostSpec
from weaved.sim.shapes import layout

DEVICE_SHARE = 0.9  # of a GPU's memory the weights and the KV pool may take


@dataclass
class SimHost:
    daemon: Daemon
    clock: VirtualClock
    shape: ModelConfig
    host: HostSpec
    costs: dict[str, StepCost]  # by backend: "cpu", "torch"
    device_positions: int | None  # a GPU's KV budget in positions

    def parameters(self) -> dict:
        """The cost model's parameters, printed beside every simulated result."""
        return {"simulated": True, "host": self.host.to_dict(), "shape": self.shape.name,
                "kv_bytes_per_token": self.shape.kv_bytes_per_token,
                "weights_bytes": int(matrix_weights(self.shape) * Q4_0_BYTES_PER_WEIGHT),
                "device_kv_positions": self.device_positions,
                "step_costs": {k: describe(v) for k, v in self.costs.items()}}


def build(profile: Profile, *, shape: ModelConfig, host: HostSpec, cpu_cost: StepCost, tokenizer_model: Path,
          data_dir: Path, kv_cap_positions: int) -> SimHost:
    """The simulated daemon of ``profile`` on ``host`` serving a model of ``shape``; ``cpu_cost``: the CPU
    pool's step model there (``cost.scaled_cpu``); ``kv_cap_positions``: the host's KV cap."""
    clock = VirtualClock()
    kv = layout(shape)
    pools = tuple(dataclasses.replace(p, speculative=False, spec_max_concurrency=0)
                  for p in profile.pools if p.strategy == "standard")
    cpu = next((p for p in pools if p.backend == "cpu"), None)
    routing = profile.routing
    if cpu is not None:  # the router and admission predict with the simulated CPU
        routing = dataclasses.replace(routing,
                                      cpu_prefill_tokens_per_s=cpu_cost.prefill_tokens_per_s(cpu.prefill_chunk),
                                      cpu_decode_tokens_per_s=cpu_cost.decode_tokens_per_s(cpu.max_batch))
    prof = dataclasses.replace(profile, pools=pools, routing=routing, host=dataclasses.replace(
        profile.host, data_dir=Path(data_dir), kv_cap_bytes=kv_cap_positions * kv.kv_bytes_per_token))
    costs: dict[str, StepCost] = {"cpu": cpu_cost}
    device_positions = None
    if host.gpus:
        gpu = host.gpus[0]
        costs["torch"] = gpu_roofline(shape, gpu)
        free = gpu.memory_bytes * DEVICE_SHARE - matrix_weights(shape) * Q4_0_BYTES_PER_WEIGHT
        device_positions = max(0, int(free // shape.kv_bytes_per_token))
    made: dict[str, Backend] = {}

    def make_backend(cfg: PoolConfig) -> Backend:
        kind = cfg.backend
        if kind not in made:
            if kind == "torch":
                if not host.gpus:
                    raise ValueError(f"pool {cfg.name!r} needs a GPU, and {host.name} has none")
                gpu = host.gpus[0]
                weights = int(matrix_weights(shape) * Q4_0_BYTES_PER_WEIGHT)
                made[kind] = SimBackend("torch", kv, costs["torch"], clock,
                                        real_kv_bytes_per_token=shape.kv_bytes_per_token,
                                        device_positions=device_positions, link_bw=gpu.link_bw,
                                        device={"index": 0, "name": f"{gpu.name} (simulated)",
                                                "memory_total": gpu.memory_bytes, "weights_bytes": weights})
            else:
                made[kind] = SimBackend("cpu", kv, cpu_cost, clock, real_kv_bytes_per_token=shape.kv_bytes_per_token)
        return made[kind]

    d = Daemon(prof, tokenizer_model, data_dir=data_dir, log_fn=lambda m: None, clock=clock.now, wall=clock.now)
    d.load(config=kv, make_backend=make_backend, drive=False)
    for pool in d.pools.values():  # what a real daemon calibrates, the simulated host's cost model gives
        pool.use_step_model(costs[pool.config.backend], prof.routing.step_target_s)
    return SimHost(d, clock, shape, host, costs, device_positions)
