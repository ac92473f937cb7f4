"""Hosts the simulator can stand for: a GPU described by what bounds it (memory bandwidth, matrix
throughput, a step's launch overhead, its link to the host), and a CPU relative to this host's
calibrated one (threads, and how its cores' integer dot products compare).

The numbers are vendors' peak figures times an efficiency a well-made kernel reaches; they are the
cost model's parameters, printed beside every simulated result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    mem_bw: float  # bytes/s a decode step's reads reach (peak x efficiency)
    matmul_flops: float  # ops/s of the quantized products (peak fp16 tensor x efficiency)
    launch_s: float  # fixed cost of one step (kernel launches, host work), per layer
    link_bw: float  # host-to-device bytes/s (PCIe), what a promotion's KV copy runs at

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CPUSpec:
    name: str
    threads: int  # kernel threads the CPU pool runs
    speed: float  # one thread's speed relative to one of this host's calibrated threads
    mem_bw: float  # bytes/s: a decode step reads every weight at most this fast

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HostSpec:
    name: str
    cpu: CPUSpec | None  # None: this host's own CPU, as calibrated
    gpus: tuple[GPUSpec, ...] = ()
    ram_bytes: int | None = None  # None: this host's; the KV cap is half of it, as the profiles' "auto"
    profile: str = "cpu-only"  # the shipped profile whose pools and routing it runs

    def kv_cap_bytes(self) -> int:
        if self.ram_bytes is not None:
            return self.ram_bytes // 2
        import psutil

        return psutil.virtual_memory().total // 2

    def to_dict(self) -> dict:
        return {"name": self.name, "cpu": self.cpu.to_dict() if self.cpu else "this host (calibrated)",
                "gpus": [g.to_dict() for g in self.gpus], "ram_bytes": self.ram_bytes, "profile": self.profile}


L40S = GPUSpec("NVIDIA L40S 48 GB", 48 * 10**9, mem_bw=864e9 * 0.8, matmul_flops=181e12 * 0.4,
               launch_s=60e-6, link_bw=25e9)
H100 = GPUSpec("NVIDIA H100 SXM 80 GB", 80 * 10**9, mem_bw=3.35e12 * 0.8, matmul_flops=989e12 * 0.4,
               launch_s=40e-6, link_bw=50e9)
# AMD EPYC 7R13 (Zen 3, AVX2 without AVX-512 VNNI): 28 kernel threads beside the GPU's; its integer dot
# products take about 1 / 0.6 of an AVX-512 VNNI core's time; 8 channels of DDR4-3200
EPYC_7R13 = CPUSpec("AMD EPYC 7R13 (28 of 32 cores)", threads=28, speed=0.6, mem_bw=204.8e9 * 0.75)

HOSTS = {
    "this-host": HostSpec("this host", None),
    "l40s-epyc": HostSpec("NVIDIA L40S 48 GB + AMD EPYC 7R13, 512 GiB", EPYC_7R13, (L40S,), 512 * 2**30, "l40s-epyc"),
    "h100-epyc": HostSpec("NVIDIA H100 80 GB + AMD EPYC 7R13, 512 GiB", EPYC_7R13, (H100,), 512 * 2**30, "l40s-epyc"),
}
