"""What this host has: CPU cores, memory and NVIDIA GPUs.

Profiles resolve their ``"auto"`` values from a ``Hardware`` record.  CPU facts come from psutil
(respecting the process's CPU affinity, so a container limited to 4 CPUs counts 4), GPUs from NVML
(the ``pynvml`` module of the nvidia-ml-py package), filtered by ``CUDA_VISIBLE_DEVICES`` the way
CUDA itself filters them.  No driver, no NVML library or no visible device all mean "no GPU":
detection never raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class GPUInfo:
    index: int  # NVML index (physical order, before CUDA_VISIBLE_DEVICES renumbering)
    name: str  # e.g. "NVIDIA L40S"
    memory_bytes: int
    uuid: str = ""


@dataclass(frozen=True)
class Hardware:
    """A snapshot of the host.  ``physical_cores`` are the cores this process may use."""

    physical_cores: int
    logical_cpus: int
    memory_bytes: int
    cpu_model: str = ""
    gpus: tuple[GPUInfo, ...] = ()

    def __post_init__(self) -> None:
        if self.physical_cores < 1 or self.logical_cpus < self.physical_cores:
            raise ValueError(f"bad CPU counts: {self.physical_cores} cores, {self.logical_cpus} CPUs")
        if self.memory_bytes < 1:
            raise ValueError(f"bad memory size {self.memory_bytes}")

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def detect_cpu() -> tuple[int, int]:
    """(physical cores, logical CPUs) this process may run on."""
    logical_all = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical_all = psutil.cpu_count(logical=False) or logical_all
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical_all
    logical = max(1, min(usable, logical_all))
    # an affinity mask of n logical CPUs holds about n / (threads per core) physical cores
    smt = max(1, logical_all // max(1, physical_all))
    physical = max(1, min(physical_all, logical // smt))
    return physical, logical


def _visible(gpus: list[GPUInfo], spec: str | None) -> tuple[GPUInfo, ...]:
    """Apply CUDA_VISIBLE_DEVICES: a comma list of indexes or UUID prefixes; CUDA stops at the
    first entry that names no device, and "" or "-1" hides every device."""
    if spec is None:
        return tuple(gpus)
    out: list[GPUInfo] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            match = [g for g in gpus if g.index == int(item)]
        else:
            match = [g for g in gpus if g.uuid and g.uuid.startswith(item)]
        if not match or match[0] in out:
            break
        out.append(match[0])
    return tuple(out)


def _text(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def detect_gpus() -> tuple[GPUInfo, ...]:
    """NVIDIA GPUs visible to this process; () without pynvml, a driver or a visible device."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ... : no usable GPU
        return ()
    gpus: list[GPUInfo] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(h))
            except Exception:
                uuid = ""
            gpus.append(GPUInfo(
                index=i,
                name=_text(pynvml.nvmlDeviceGetName(h)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                uuid=uuid,
            ))
    except Exception:
        return ()
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def detect() -> Hardware:
    """Probe this host (a few milliseconds; NVML is initialised and shut down again)."""
    physical, logical = detect_cpu()
    return Hardware(
        physical_cores=physical,
        logical_cpus=logical,
        memory_bytes=int(psutil.virtual_memory().total),
        cpu_model=_cpu_model(),
        gpus=detect_gpus(),
    )
