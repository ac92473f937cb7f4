"""What the host is doing, sampled where ``weave top`` runs (the daemon's host: it speaks over a Unix
socket): CPU load per core and memory with psutil, NVIDIA GPUs with pynvml."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    name: str
    utilization: float  # percent of the last sample period a kernel ran
    memory_used: int  # bytes
    memory_total: int


@dataclass(frozen=True)
class HostSample:
    cpu_percent: tuple[float, ...]  # per logical core, since the previous sample
    memory_used: int  # bytes (total less available)
    memory_total: int
    gpus: tuple[GpuSample, ...] = ()
    gpu_note: str | None = None  # why there are no GPUs to show ("no NVIDIA driver")


class HostProbe:
    """Samples the host.  GPU probing is attempted once: without an NVIDIA driver it reports no GPU."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        psutil.cpu_percent(interval=None, percpu=True)  # the first call only sets the baseline
        self._nvml = None
        self._handles: list = []
        self.gpu_note: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not self._handles:
                self.gpu_note = "no GPU"
        except ImportError:
            self.gpu_note = "no GPU (pynvml is not installed)"
        except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU
            self.gpu_note = "no GPU"

    def sample(self) -> HostSample:
        vm = self._psutil.virtual_memory()
        cpu = tuple(float(p) for p in self._psutil.cpu_percent(interval=None, percpu=True))
        return HostSample(cpu, int(vm.total - vm.available), int(vm.total), self._gpus(), self.gpu_note)

    def _gpus(self) -> tuple[GpuSample, ...]:
        if self._nvml is None:
            return ()
        nv, out = self._nvml, []
        for h in self._handles:
            try:
                name = nv.nvmlDeviceGetName(h)
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                mem = nv.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001 - a GPU that fell off the bus: skip it, keep the view alive
                continue
            out.append(GpuSample(name.decode() if isinstance(name, bytes) else str(name), float(util),
                                 int(mem.used), int(mem.total)))
        return tuple(out)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._nvml = None
