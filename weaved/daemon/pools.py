"""The daemon's pools: one batch engine per profile pool, over backends shared per device.

Every CPU pool shares one ``CPUBackend`` (one numba thread pool, sized by the profile's kernel thread
budget).  Torch pools share one ``TorchBackend`` per device, so moving a session between two pools on
one GPU (the speculative and the plain variant) copies nothing.  Engines over one backend share a
lock: only one of them runs a step at a time, while engines over different backends (the GPU and the
CPU) run at the same time, each in its own thread - that is the co-execution.

A torch pool is a GPU pool for the router.  On a host without CUDA a torch pool on ``device = "cpu"``
stands in for one (tests and functional runs of the benchmarks); it is flagged ``stand_in``.  A pool
on a CUDA device that this host does not have is left out with a note instead of failing the daemon.

A ``qring`` pool's backend is a ``RingBackend`` over the CPU backend (its home runs the dense layers
with the same weights); it has a lock of its own, since most of its step is waiting on the ring, and
the CPU pools keep stepping meanwhile.  It needs a daemon that federates (``ring`` below); without
one it is left out with a note.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from weaved.backends.base import Backend
from weaved.backends.device_memory import DevicePlan, plan
from weaved.calibration.cost import StepCost
from weaved.config.profile import PoolConfig, Profile
from weaved.engine.admission import Capacity
from weaved.engine.engine import BatchEngine
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import SeqStatus, Sequence
from weaved.errors import SettingRefused
from weaved.model.config import ModelConfig
from weaved.model.gguf_file import GGUFFile
from weaved.routing.types import PoolState, pool_state

log = logging.getLogger("weave.pools")


class PoolError(SettingRefused):
    """A pool of the profile that this host cannot run, though the profile asks for it."""


@dataclass
class Pool:
    config: PoolConfig
    backend: Backend
    engine: BatchEngine
    lock: threading.Lock  # shared by every pool on the same backend
    step_cost: StepCost | None = None  # the backend's calibrated step-time model, once known

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def device_kind(self) -> str:
        return "gpu" if self.config.backend == "torch" else "cpu"

    @property
    def stand_in(self) -> bool:
        """A torch pool on the CPU device standing in for a GPU pool."""
        return self.config.backend == "torch" and self.config.cuda_device is None

    def use_step_model(self, cost: StepCost, itl_target_s: float | None) -> None:
        """The backend's calibrated step-time model: the router predicts turns on this pool with it, and
        while an interactive turn decodes the scheduler keeps steps within ``itl_target_s`` by it (both
        scaled by how the engine's steps run against it: ``BatchEngine.step_drift``)."""
        self.step_cost = cost
        self.engine.config = dataclasses.replace(self.engine.config, step_cost=cost, step_target_s=itl_target_s)
        self.engine.step_drift.reset()  # (measured against the model this one replaces)

    def turns(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decoding, waiting or preempted) turns of the pool now."""
        seqs = [s for s in self.engine.snapshot() if not s.status.done]
        running = [s for s in seqs if s.status is SeqStatus.RUNNING]
        return running, [s for s in seqs if s.status is not SeqStatus.RUNNING]

    def state(self, free_kv_tokens: int, reclaimable_bytes: int = 0) -> PoolState:
        """The router's view; ``free_kv_tokens`` is the host's, which a device's own KV pool may cap (its
        free bytes, and ``reclaimable_bytes`` held for idle sessions, which leave when room is needed)."""
        device_free = self.backend.device_kv_free_bytes()
        device_tokens = 0
        if device_free is not None:
            device_free += reclaimable_bytes
            bpt = self.backend.config.kv_bytes_per_token
            free_kv_tokens = min(free_kv_tokens, device_free // bpt)
            device_tokens = (self.backend.device_kv_capacity() or 0) // bpt
        running, waiting = self.turns()
        return pool_state(self.config, free_kv_tokens=free_kv_tokens, batch_depth=len(running),
                          queue_depth=len(waiting), queued_prefill_tokens=sum(len(s.pending) for s in waiting
                                                                               if s.prefilling),
                          device_kind=self.device_kind, context_tokens=sum(s.kv.length for s in running + waiting),
                          step_cost=None if self.step_cost is None else self.engine.step_drift.scaled(self.step_cost),
                          step_s=self.engine.recent_step_s if running or waiting else 0.0,
                          lateness=self.engine.lateness, device_kv_tokens=device_tokens)


def _capacity(cfg: PoolConfig, profile: Profile) -> Capacity | None:
    """The pool's admission capacity (``weaved.engine.admission``): with the SLA router only (the
    benchmark's baselines admit everything), the profile's CPU decode rate as the prior of a CPU pool."""
    th = profile.routing
    if th.policy != "sla":
        return None
    cpu = cfg.backend == "cpu" and cfg.device == "cpu"
    if th.cpu_decode_tokens_per_s is None or th.cpu_prefill_tokens_per_s is None:  # set once calibrated
        return Capacity(cfg.max_batch, None, 1.0)
    return Capacity(cfg.max_batch, th.cpu_decode_tokens_per_s if cpu else None,
                    th.cpu_decode_tokens_per_s / th.cpu_prefill_tokens_per_s)


def _speculative(cfg: PoolConfig):
    """The pool's speculative-decoding variant, or None."""
    if not cfg.speculative:
        return None
    from weaved.engine.speculative import SpecConfig

    return SpecConfig.from_pool(cfg)


class _Backends:
    """Backends by (kind, device), created on first use."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, profile: Profile, progress: Callable[[str], None]):
        self.gguf, self.config, self.profile, self.progress = gguf, config, profile, progress
        self.made: dict[tuple[str, str], tuple[Backend, threading.Lock]] = {}
        self.plans: dict[str, DevicePlan] = {}  # device -> how its memory is split

    def get(self, cfg: PoolConfig) -> tuple[Backend, threading.Lock]:
        key = (cfg.backend, cfg.device)
        if key not in self.made:
            if cfg.backend == "cpu":
                from weaved.backends.cpu import CPUBackend

                backend: Backend = CPUBackend(self.gguf, self.config, threads=self.profile.threads.kernels,
                                              progress=_percent(self.progress, "repacking the weights"))
            else:
                import torch

                from weaved.backends.torch import TorchBackend

                # torch's own CPU threads launch GPU work (or, on the CPU device, do it): the profile's
                # gpu_driver cores, so they do not fight the CPU pool's kernel threads for the cores
                torch.set_num_threads(max(1, self.profile.threads.gpu_driver))
                backend = TorchBackend(self.gguf, self.config, device=cfg.device, kv_bytes=self._device_kv(cfg))
                backend.device_plan = self.plans.get(cfg.device)
            self.made[key] = (backend, threading.Lock())
        return self.made[key]


    def shared(self, backend: Backend) -> tuple[Backend, threading.Lock]:
        """A backend made elsewhere, with the one lock every pool on it shares."""
        key = ("made", str(id(backend)))
        if key not in self.made:
            self.made[key] = (backend, threading.Lock())
        return self.made[key]

    def _device_kv(self, cfg: PoolConfig) -> Callable[[int], int] | None:
        """The KV pool's size for the torch backend on ``cfg.device``, as a function of its weights' bytes:
        the device's budget (the pools' smallest ``device_memory``, or what a CUDA device has free now)
        less the weights and the largest step of the pools on it.  None: the CPU device's default."""
        here = [p for p in self.profile.pools if p.backend == "torch" and p.device == cfg.device]
        given = [p.device_memory for p in here if p.device_memory is not None]
        if given:
            budget = min(given)
        elif cfg.cuda_device is not None:
            import torch

            budget = torch.cuda.mem_get_info(cfg.cuda_device)[0]
        else:
            return None
        context = min(self.profile.host.default_context, self.config.context_length)
        step = max(p.token_budget for p in here)
        rows = max(p.max_batch * (1 + (p.spec_draft_tokens if p.speculative else 0)) for p in here)

        def kv_bytes(weights: int) -> int:
            p = self.plans[cfg.device] = plan(self.config, budget=budget, weights=weights, step_tokens=step,
                                              logits_rows=rows, context=context, device=cfg.device)
            return p.kv

        return kv_bytes


def cuda_missing(cfg: PoolConfig) -> str | None:
    """Why a pool's CUDA device cannot be used here, or None."""
    if cfg.cuda_device is None:
        return None
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if cfg.cuda_device >= torch.cuda.device_count():
        return f"this host has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _percent(say: Callable[[str], None], what: str) -> Callable[[int, int], None]:
    """A (done, total) callback that says ``what: N%`` at every quarter."""
    shown = [-1]

    def report(done: int, total: int) -> None:
        quarter = done * 4 // max(total, 1)
        if quarter > shown[0]:
            shown[0] = quarter
            say(f"{what}: {quarter * 25}%")

    return report


def build_pools(profile: Profile, gguf: GGUFFile, config: ModelConfig, *,
                commit: Callable, reserve: Callable, on_event: Callable,
                ring: Callable[[PoolConfig, Backend], Backend] | None = None,
                progress: Callable[[str], None] | None = None,
                make_room: Callable[[Backend, int], bool] | None = None,
                make_backend: Callable[[PoolConfig], Backend] | None = None,
                clock: Callable[[], float] = time.monotonic) -> tuple[dict[str, Pool], list[str]]:
    """One ``Pool`` per pool of the profile this daemon can run, and notes on those it cannot (but for
    the expected ones, which are only logged).
    ``ring(cfg, cpu_backend)`` makes a ``qring`` pool's backend (None: this daemon does not federate);
    ``progress`` hears how loading the weights goes; ``make_room(backend, bytes)`` frees a GPU's KV memory
    for a step that lacks it (``weaved.daemon.device_room``).  A simulation gives ``make_backend`` (each
    pool's backend; pools on one backend share its lock as for real) and its ``clock``."""
    backends = _Backends(gguf, config, profile, progress or (lambda m: None))
    pools: dict[str, Pool] = {}
    notes: list[str] = []
    expected: set[str] = set()  # notes on what a profile implies, not a problem: logged as info
    for cfg in profile.pools:
        if cfg.strategy == "qring" and ring is None:  # a ring pool in a daemon that federates with nobody
            notes.append(f"pool {cfg.name!r} (qring) left out: this daemon does not federate (name [[peers]] or "
                         f"set a [federation] port and token)")
            expected.add(notes[-1])
            continue
        if cfg.strategy == "qring" and config.window:  # a shard's attention has no sliding window
            notes.append(f"pool {cfg.name!r} (qring) left out: {config.arch} has sliding-window layers, which "
                         f"Q-Ring decode does not run")
            continue
        missing = cuda_missing(cfg) if make_backend is None else None
        if missing is not None:  # asked for by name: refused, not left out (only_if_gpu leaves it out at load)
            raise PoolError(f"pool {cfg.name!r} runs on device {cfg.device!r}, which is unavailable ({missing}): "
                            f"set only_if_gpu = true on it to leave it out on a host without a GPU, or remove it "
                            f"from the profile")
        backend, lock = backends.get(cfg) if make_backend is None else backends.shared(make_backend(cfg))
        if cfg.strategy == "qring":
            backend, lock = ring(cfg, backend), threading.Lock()
        order = "fifo" if profile.routing.policy == "fifo" else "sla"
        sched = SchedulerConfig(cfg.token_budget, cfg.max_batch, cfg.prefill_chunk, order, cfg.interactive_token_budget)
        engine = BatchEngine(cfg.name, backend, sched, commit=commit, reserve=reserve, on_event=on_event,
                             forward_lock=lock, speculative=_speculative(cfg), capacity=_capacity(cfg, profile),
                             make_room=make_room, clock=clock)
        pools[cfg.name] = Pool(cfg, backend, engine, lock)
        if pools[cfg.name].stand_in:
            notes.append(f"pool {cfg.name!r}: the torch backend on the CPU device stands in for a GPU pool")
    for n in notes:
        (log.info if n in expected else log.warning)(n)
    # what the profile implies on this host (a ring pool without peers) is logged, not shown in every
    # status as if it were a problem
    return pools, [n for n in notes if n not in expected]
