"""Calibrations kept on disk: one JSON file per (model, host, backend, device, threads, kernel path).

They live in the data directory (``calibration/``), where ``weave status`` reports them, and are also
written to the machine's cache, so that another data directory on the same host and model - a second
daemon, a test - reads them instead of measuring again.  ``weave calibrate`` measures afresh and
replaces both.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from weaved.calibration.cost import StepCost

FORMAT = 1


def host_id() -> str:
    """This host as calibrations name it: its name and processor."""
    return f"{socket.gethostname()}/{platform.processor() or platform.machine()}"


def calibration_key(fingerprint: str, backend: str, device: str, threads: int, kernels: str) -> str:
    return f"{fingerprint}-{backend}-{device.replace(':', '')}-{threads}t-{kernels}"


@dataclass(frozen=True)
class Calibration:
    cost: StepCost
    fingerprint: str  # the model's (weaved.kv.store.model_fingerprint): its shape, not its weights
    backend: str  # "cpu" | "torch"
    device: str
    threads: int
    kernels: str  # the kernel path (e.g. "vnni", "portable", "triton", "torch")
    host: str = field(default_factory=host_id)
    measured_at: float = field(default_factory=time.time)
    seconds: float = 0.0  # how long measuring took
    fit_error: float = 0.0  # the fit's largest relative error over its points
    points: tuple[dict, ...] = ()

    @property
    def key(self) -> str:
        return calibration_key(self.fingerprint, self.backend, self.device, self.threads, self.kernels)

    def rates(self, chunk: int, max_batch: int) -> tuple[float, float]:
        """(prefill tokens/s of a 1,024-token prompt in ``chunk``-token chunks, aggregate decode tokens/s
        of ``max_batch`` sequences of 1,024 positions): the rates the router and the scheduler use."""
        return self.cost.prefill_tokens_per_s(chunk), self.cost.decode_tokens_per_s(max_batch)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "cost": self.cost.to_dict(), "fingerprint": self.fingerprint,
                "backend": self.backend, "device": self.device, "threads": self.threads, "kernels": self.kernels,
                "host": self.host, "measured_at": self.measured_at, "seconds": self.seconds,
                "fit_error": self.fit_error, "points": list(self.points)}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        if d.get("format") != FORMAT:
            raise ValueError(f"calibration format {d.get('format')} is not {FORMAT}")
        return cls(StepCost.from_dict(d["cost"]), str(d["fingerprint"]), str(d["backend"]), str(d["device"]),
                   int(d["threads"]), str(d["kernels"]), str(d["host"]), float(d["measured_at"]),
                   float(d.get("seconds", 0.0)), float(d.get("fit_error", 0.0)), tuple(d.get("points", ())))


class CalibrationStore:
    """Calibrations under ``data_dir/calibration``, read through the machine-wide ``cache``."""

    def __init__(self, data_dir: Path, cache: Path | None = None):
        self.dir = Path(data_dir) / "calibration"
        self.cache = cache

    def path(self, key: str) -> Path:
        """The data directory's file of calibration ``key`` (the copy the daemon reads first)."""
        return self.dir / f"{key}.json"

    def _paths(self, key: str) -> list[Path]:
        return [self.path(key), *([self.cache / f"{key}.json"] if self.cache is not None else [])]

    def load(self, key: str) -> Calibration | None:
        """The stored calibration ``key`` of this host, or None (unreadable files count as none)."""
        for i, path in enumerate(self._paths(key)):
            try:
                cal = Calibration.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if cal.host != host_id():
                continue
            if i:  # found in the machine's cache: the data directory keeps its own copy from now on
                self._write(self.dir / path.name, cal)
            return cal
        return None

    def save(self, cal: Calibration) -> None:
        for path in self._paths(cal.key):
            self._write(path, cal)

    @staticmethod
    def _write(path: Path, cal: Calibration) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cal.to_dict(), indent=1))
            tmp.replace(path)
        except OSError:  # a read-only cache: the data directory's copy is what counts
            pass
