"""Copies between the host and the device for the torch backend: a step's results (logits, the new KV
rows) to the host, a session's KV rows to the device.

On CUDA a copy into pageable memory runs at a few GB/s (the driver stages it through a pinned
bounce buffer): a step of 64 rows' logits over a 128K vocabulary (33 MB) took 5.8 ms on an H100, a
third of the step.  Copied into pinned memory it moves at the link's rate.  Pinned tensors come from
torch's caching host allocator, so a step's buffer is the block a released earlier step's was: no
page-locking per step.  The numpy array returned shares the pinned tensor's memory and keeps it
alive for as long as the caller holds it.

The other way, a promotion's rows are gathered layer by layer into pinned memory and sent without
waiting (``to_device``): the host's copy of the next chunk overlaps the link's transfer of this one,
and the caching host allocator keeps each pinned chunk until its transfer is done.  The gather is
what a promotion waits on: one thread copied 4.7 GB/s on an H200's host, whose link took 53 GB/s from
pinned memory, so a chunk is gathered by a few threads of its own (``GATHER_THREADS``; numpy lets go of
the GIL) - not torch's, which the daemon holds to the profile's ``gpu_driver`` cores.  A plain ``.to()``
of pageable memory stages through the driver's bounce buffer one piece at a time, at a few GB/s.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
import torch

STAGE_BYTES = 32 << 20  # a chunk of rows sent to the device: long enough for the link's rate
IN_FLIGHT = 2  # chunks whose copy may still run: one sent while the next is gathered
GATHER_THREADS = min(4, os.cpu_count() or 1)  # a promotion is short and a person waits on it: a few cores


@cache
def _gatherers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="weave-gather")


def gather(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (same shape, ``src`` any strides), split over ``GATHER_THREADS`` threads by
    whole slices of every axis but the last two (a [rows, D] slice: one run of the session's rows)."""
    if dst.shape != src.shape:
        raise ValueError(f"gather: shapes differ, {dst.shape} and {src.shape}")
    lead = list(np.ndindex(src.shape[:-2]))
    n = min(GATHER_THREADS, len(lead))
    if n <= 1 or src.nbytes < (1 << 20):  # threads cost more than they save on a small copy
        np.copyto(dst, src)
        return

    def part(k: int) -> None:
        for i in lead[k::n]:
            np.copyto(dst[i], src[i])

    for f in [_gatherers().submit(part, k) for k in range(n)]:
        f.result()


def to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array on the host, waiting for the copy (and the work before it) to finish."""
    if t.device.type != "cuda":
        return t.cpu().numpy()  # torch's CPU device: the tensor itself
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()


def to_device(host: np.ndarray, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``host`` [n, ...] (any strides) on ``device``, in chunks of whole leading-axis slices: yields
    (i0, i1, rows i0..i1-1 on the device).  On CUDA a chunk's copy may still be running when it is
    yielded: use it on the current stream, which orders the work after the copy.  At most ``IN_FLIGHT``
    chunks' pinned memory is in use, so a long session's promotion reuses the same few blocks."""
    n = host.shape[0]
    per = max(1, STAGE_BYTES // max(1, host[:1].nbytes))  # leading slices per chunk
    sent: deque = deque()  # CUDA events: each chunk's copy done
    for i0 in range(0, n, per):
        i1 = min(n, i0 + per)
        part = host[i0:i1]
        if device.type != "cuda":
            yield i0, i1, torch.from_numpy(np.ascontiguousarray(part)).to(device)
            continue
        if len(sent) >= IN_FLIGHT:
            sent.popleft().synchronize()  # that chunk's pinned block is free again for this one
        stage = torch.empty(part.shape, dtype=torch.from_numpy(part[:0]).dtype, pin_memory=True)
        gather(stage.numpy(), part)  # in pinned memory
        rows = stage.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        sent.append(done)
        yield i0, i1, rows


def warm_staging() -> None:
    """Page-lock ``IN_FLIGHT`` chunks' worth of host memory once, into torch's pinned cache, so that the
    first promotion does not pay for it (locking pages costs about what copying them does)."""
    blocks = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(IN_FLIGHT)]
    del blocks
