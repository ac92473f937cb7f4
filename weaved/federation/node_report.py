"""What this node tells its peers (``GET /federation/v1/info``): its model, hardware, free KV and load.

The peers decide with it: the model fingerprint says whether the node can hold their layers (KV
shards or pipeline stages of another model are meaningless), free KV how much context it can take,
the pools' depths how busy it is.  Hardware is probed once per process (NVML is slow to start) and
the rest read from the daemon's counters, without taking an engine step's time.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

REPORT_VERSION = 1


@functools.cache
def _hardware() -> dict:
    from weaved.config.hardware import detect

    hw = detect()
    return {"physical_cores": hw.physical_cores, "logical_cpus": hw.logical_cpus, "memory_bytes": hw.memory_bytes,
            "cpu_model": hw.cpu_model, "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in hw.gpus]}


def hardware_report() -> dict:
    return dict(_hardware())


def weights_fingerprint(daemon: Any) -> str:
    """What peers compare before sharing work: the model's shape (``weaved.kv.store.model_fingerprint``,
    which names the KV layout) and its weights (a digest of the file's size, header and sampled content,
    ``weaved.model.default.content_digest``), so that two daemons serving a fine-tune or another
    quantization of one shape never split a prompt's layers between them.  Read once per daemon."""
    from weaved.kv.store import model_fingerprint

    shape = model_fingerprint(daemon.config)
    path = getattr(daemon, "model_path", None)
    if path is None:  # (an object standing in for a daemon, without a file)
        return shape
    st = os.stat(path)
    return f"{shape}-{_file_digest(str(path), st.st_size, st.st_mtime_ns)}"


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The file's content digest, read once per file as it stands (its size and time in the key)."""
    from weaved.model.default import content_digest

    return content_digest(Path(path))


def node_report(daemon: Any) -> dict:
    """The report of a loaded ``weaved.daemon.core.Daemon`` (or anything with its attributes)."""
    cfg, prof = daemon.config, daemon.profile
    per_token = cfg.kv_bytes_per_token
    cap = prof.host.kv_cap_bytes
    reserved = daemon.store.reserved_bytes()
    free = max(0, cap - reserved)
    pools = []
    for p in daemon.pools.values():
        st = p.state(free // per_token)
        pools.append({"name": st.name, "strategy": st.strategy, "device_kind": st.device_kind,
                      "batch_depth": st.batch_depth, "queue_depth": st.queue_depth, "max_batch": st.max_batch})
    return {
        "version": REPORT_VERSION,
        "node": prof.host.name,
        "instance": getattr(daemon, "instance", None),  # this process's id: a peer that is us says it
        "model": {"name": daemon.model_name, "arch": cfg.arch, "fingerprint": weights_fingerprint(daemon),
                  "n_layers": cfg.n_layers, "kv_bytes_per_token": per_token, "context_length": cfg.context_length},
        "hardware": hardware_report(),
        "kv": {"cap_bytes": cap, "reserved_bytes": reserved, "free_bytes": free, "free_tokens": free // per_token},
        "load": {"pools": pools, "sessions": len(daemon.sessions)},
        "speed": prefill_speed(daemon),
    }


MEASURED_AFTER = 256  # prefill tokens a CPU backend must have run before its own rate is trusted


def measured_prefill_rate(stats) -> float | None:
    """Tokens per second a backend's counters (``BackendStats``) show, once it has prefilled enough
    to say (all its steps, prefill chunks among them); None before."""
    if stats.prefill_tokens >= MEASURED_AFTER and stats.seconds > 0:
        return stats.tokens / stats.seconds
    return None


def prefill_speed(daemon: Any) -> dict:
    """How fast this node prefills, for a pipeline's layer split: measured on its CPU backend, else the
    profile's estimate."""
    cpu = next((p.backend for p in daemon.pools.values() if p.backend.name == "cpu"), None)
    rate = measured_prefill_rate(cpu.stats) if cpu is not None else None
    if rate is not None:
        return {"prefill_tokens_per_s": round(rate, 1), "source": "measured"}
    return {"prefill_tokens_per_s": daemon.profile.routing.cpu_prefill_tokens_per_s, "source": "profile"}
