"""The configurations the agents scenario compares, and the profile each one runs with.

- ``weave``: Weave's router (policy "sla") over a GPU pool and a CPU pool: promotion on check-in
  migrates the session to the GPU pool, demotion sends it back when the person leaves;
- ``isolation``: the same pools, policy "isolation" (a session is bound to a pool by its class when it
  is created and never moves; a check-in changes neither its pool nor its priority);
- ``fifo``: one pool, policy "fifo" (one priority, the engine orders by arrival) - the GPU pool when
  the host has one, as a plain OpenAI-compatible server would use, else the CPU pool;
- ``gpu-only``: Weave's router over the GPU pool alone - against ``weave``, the co-execution claim
  (nearly +50 % capacity).

A GPU pool is a torch pool on CUDA.  On a host without one, the configurations that can fall back to
the CPU pool alone do so (and say so) and ``gpu-only`` does not run: a torch pool on the CPU device
beside the real CPU pool would compare two kinds of hardware, not the policies.  GPU hosts are
simulated (``weaved.sim``, ``--simulate``).
Every configuration starts from the shipped ``cpu-only`` profile (its CPU pool and its calibrated
routing rates) and changes only the pools, the policy and the thread budget.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from weaved.config.load import load_profile
from weaved.config.profile import PoolConfig, Profile

CONFIG_NAMES = ("weave", "weave-noprefix", "isolation", "fifo", "gpu-only")
BASE_PROFILE = "cpu-only"


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    policy: str
    pools: tuple[str, ...]  # "gpu" and/or "cpu"
    description: str
    cpu_fallback: bool = True  # without a GPU pool, run on the CPU pool alone (else: unavailable)
    prefix_cache: bool = True  # shared prefixes (the profile's [host] prefix_cache)


SPECS = {
    "weave": ConfigSpec("weave", "sla", ("gpu", "cpu"),
                        "router + SLA batch engine; promotion migrates to the GPU pool, demotion back"),
    "weave-noprefix": ConfigSpec("weave-noprefix", "sla", ("gpu", "cpu"),
                                 "Weave without shared prefixes: every session prefills its whole first prompt",
                                 prefix_cache=False),
    "isolation": ConfigSpec("isolation", "isolation", ("gpu", "cpu"),
                            "pools bound by class at creation; check-ins change neither pool nor priority"),
    "fifo": ConfigSpec("fifo", "fifo", ("gpu",), "one pool, first come first served"),
    "gpu-only": ConfigSpec("gpu-only", "sla", ("gpu",), "Weave's router on the GPU pool alone (no co-execution)",
                           cpu_fallback=False),
}


@dataclass(frozen=True)
class GpuSupport:
    torch_backend: bool  # weaved/backends/torch.py is in this build
    cuda: bool  # torch sees a CUDA device

    @property
    def pool_possible(self) -> bool:
        """A real GPU pool: the torch backend on CUDA.  Torch's CPU device standing in for a GPU beside
        the real CPU pool would compare two kinds of hardware, not the policies (``--simulate`` does
        GPU hosts)."""
        return self.torch_backend and self.cuda



def detect_gpu_support() -> GpuSupport:
    backend = importlib.util.find_spec("weaved.backends.torch") is not None
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    return GpuSupport(backend, cuda)


@dataclass(frozen=True)
class ResolvedConfig:
    spec: ConfigSpec
    pools: tuple[str, ...]  # what it runs with here
    note: str | None = None  # how it differs from the spec on this host

    @property
    def name(self) -> str:
        return self.spec.name


def resolve(name: str, gpu: GpuSupport) -> ResolvedConfig | str:
    """The configuration as this host can run it, or why it cannot."""
    spec = SPECS[name]
    if "gpu" in spec.pools and not gpu.pool_possible:
        why = "no CUDA GPU here" if gpu.torch_backend else "no torch backend in this build"
        if not spec.cpu_fallback:
            return f"needs a GPU pool ({why}; --simulate l40s-epyc simulates a GPU host)"
        return ResolvedConfig(spec, ("cpu",), f"{why}: runs on the CPU pool alone")
    return ResolvedConfig(spec, spec.pools)


def gpu_pool() -> PoolConfig:
    """The GPU pool: the L40S profile's plain GPU variant (wide batch, 512-token prefill chunks, short
    steps while an interactive turn decodes)."""
    return PoolConfig(name="gpu", backend="torch", device="cuda", max_batch=64, prefill_chunk=512, token_budget=1024,
                      interactive_token_budget=256)


def build_profile(cfg: ResolvedConfig, data_dir: Path, threads: int | None = None,
                  base: Profile | None = None) -> Profile:
    base = base or load_profile(BASE_PROFILE)
    cpu = base.pool("cpu")
    pools = tuple(gpu_pool() if p == "gpu" else cpu for p in cfg.pools)
    routing = dataclasses.replace(base.routing, policy=cfg.spec.policy)
    budget = base.threads
    kernels = budget.kernels if threads is None else threads
    if "gpu" in cfg.pools and budget.gpu_driver == 0:
        # the base profile is a host without a GPU (no core for a launching thread): a GPU pool's engine
        # thread would fight the CPU pool's kernel threads for every core, and its steps stretch with
        # theirs.  Leave it one core, as a profile's "auto" does for each CUDA device.
        budget = dataclasses.replace(budget, gpu_driver=1)
        if threads is None:
            kernels = max(1, kernels - 1)
    if kernels != budget.kernels:
        # rates a profile gives were scaled by its kernel threads at load: rescale them with the budget
        # (calibrated ones are measured with the budget the daemon runs)
        scale = kernels / budget.kernels
        if routing.cpu_prefill_tokens_per_s is not None and routing.cpu_decode_tokens_per_s is not None:
            routing = dataclasses.replace(routing, cpu_prefill_tokens_per_s=routing.cpu_prefill_tokens_per_s * scale,
                                          cpu_decode_tokens_per_s=routing.cpu_decode_tokens_per_s * scale)
        budget = dataclasses.replace(budget, kernels=kernels)
    host = dataclasses.replace(base.host, data_dir=Path(data_dir), prefix_cache=cfg.spec.prefix_cache)
    return dataclasses.replace(base, name=f"agents-{cfg.name}", pools=pools, routing=routing, threads=budget,
                               host=host, notes=())
