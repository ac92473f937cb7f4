"""Where a decode step's time goes on the device: the step's wall time against the device time of its
kernels (what the host's launches cost), the launches a step makes, and the kernels that take the
most device time - torch's profiler over a few steps, at the batch sizes asked for."""

from __future__ import annotations

import time

import numpy as np
import torch

from weaved.backends.base import Backend, Logits, SeqChunk
from weaved.gpucheck.speed import token_ids


def step_profile(be: Backend, batch: int, context: int, steps: int = 5, top: int = 8) -> dict:
    """``steps`` decode steps of ``batch`` sequences ``context`` tokens in, timed and then profiled:
    {wall_ms, device_ms, busy, launches, top: [(kernel, device ms a step, launches a step)]}."""
    from torch.profiler import ProfilerActivity, profile

    cuda = be.device.type == "cuda"
    kvs = [be.new_kv(context + 2 * steps + 8) for _ in range(batch)]
    outs = [be.forward([SeqChunk(kv, token_ids(context, be.config.vocab_size, i), Logits.LAST)])[0]
            for i, kv in enumerate(kvs)]

    def step() -> None:
        nonlocal outs
        outs = be.forward([SeqChunk(kv, np.asarray([int(np.argmax(o[-1]))], np.int32))
                           for kv, o in zip(kvs, outs, strict=True)])

    step()  # warm: every kernel of a decode step compiled
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t0) / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    for kv in kvs:
        be.release(kv)
    events = prof.key_averages()
    if cuda:  # the kernels, by device time
        rows = [(e.key, e.self_device_time_total / 1e3 / steps, e.count / steps) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # torch's CPU device: no device time; the step's torch operations, by host time
        rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in events
                if e.key.startswith("aten::")]
    rows.sort(key=lambda r: -r[1])
    device_ms = sum(r[1] for r in rows)
    return {"batch": batch, "context": context, "wall_ms": wall * 1e3, "device_ms": device_ms,
            "busy": device_ms / (wall * 1e3), "launches": sum(r[2] for r in rows),
            "top": [list(r) for r in rows[:top]]}
