"""How fast a backend runs: prefill, single-stream decode, batched decode, and KV promotion."""

from __future__ import annotations

import time

import numpy as np
import torch

from weaved.backends.base import Backend, Logits, SeqChunk
from weaved.kv.cache import KVCache


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def token_ids(n: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, min(vocab, 30000), n).astype(np.int32)


def prefill_and_decode(be: Backend, prompt: int, steps: int, seed: int = 1) -> dict:
    """Tokens/s of one ``prompt``-token prefill and of ``steps`` single-stream decode steps after it."""
    kv = be.new_kv(prompt + steps + 1)
    t0 = time.perf_counter()
    logits = be.forward([SeqChunk(kv, token_ids(prompt, be.config.vocab_size, seed), Logits.LAST)])[0]
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = np.asarray([int(np.argmax(logits[-1]))], np.int32)
        logits = be.forward([SeqChunk(kv, tok, Logits.LAST)])[0]
    t_decode = time.perf_counter() - t0
    return {"prefill_tokens": prompt, "prefill_tok_s": prompt / t_prefill,
            "decode_steps": steps, "decode_tok_s": steps / t_decode if steps else None}


def batched_decode(be: Backend, batch: int, context: int, steps: int, seed: int = 2) -> dict:
    """Aggregate tokens/s of ``steps`` decode steps of ``batch`` sequences, each ``context`` tokens in."""
    kvs = [be.new_kv(context + steps + 1) for _ in range(batch)]
    # prompts one at a time, as a pool's token budget would feed them: a step's activations stay small
    outs = [be.forward([SeqChunk(kv, token_ids(context, be.config.vocab_size, seed + i), Logits.LAST)])[0]
            for i, kv in enumerate(kvs)]
    be.forward([SeqChunk(kv, np.asarray([int(np.argmax(o[-1]))], np.int32)) for kv, o in zip(kvs, outs, strict=True)])
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = be.forward([SeqChunk(kv, np.asarray([int(np.argmax(o[-1]))], np.int32))
                           for kv, o in zip(kvs, outs, strict=True)])
    dt = time.perf_counter() - t0
    for kv in kvs:
        be.release(kv)
    return {"batch": batch, "context": context, "steps": steps, "tok_s": batch * steps / dt,
            "step_bytes": step_bytes(be, batch, context + 1 + steps // 2), "step_seconds": dt / steps}


def promotion(be: Backend, positions: int, device: torch.device) -> dict:
    """A session of ``positions`` KV rows moving onto the backend's device (``adopt``), against a plain
    host-to-device copy of the same bytes (and, on CUDA, one from pinned memory: the link's rate); the
    rows on the device are then read back and must equal the host's (an AssertionError fails the part)."""
    cfg = be.config
    data = np.random.default_rng(3).standard_normal(
        (cfg.n_layers, 2, cfg.n_kv_heads, positions, cfg.head_dim), dtype=np.float32).astype(np.float16)
    kv = KVCache(data, positions)
    raw = torch.from_numpy(data)
    _sync(device)
    t0 = time.perf_counter()
    copy = raw.to(device)
    _sync(device)
    t_raw = time.perf_counter() - t0
    del copy
    link = None  # the link's own rate: the same bytes from pinned memory
    if device.type == "cuda":
        pinned = raw.pin_memory()
        pinned.to(device)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        copy = pinned.to(device, non_blocking=True)
        _sync(device)
        link = data.nbytes / (time.perf_counter() - t0)
        del copy, pinned
    t0 = time.perf_counter()
    moved = be.adopt(kv)
    _sync(device)
    t_adopt = time.perf_counter() - t0
    paged = be.kv_pool
    rows = paged.pool[:, paged.ids(paged.table(kv))].permute(0, 2, 3, 1, 4, 5)  # [L, 2, Hkv, blocks, B, D]
    rows = rows.reshape(*data.shape[:3], -1, data.shape[4])[:, :, :, :positions].cpu().numpy()
    be.release(kv)
    if not np.array_equal(rows, data):
        raise AssertionError(f"the promoted session's rows differ from the host's at "
                             f"{int((rows != data).sum())} of {data.size} values")
    return {"positions": positions, "bytes": moved, "seconds": t_adopt, "gb_s": moved / t_adopt / 1e9,
            "raw_copy_gb_s": data.nbytes / t_raw / 1e9, "vs_raw_copy": t_adopt / t_raw, "rows_equal": True,
            "pinned_copy_gb_s": link / 1e9 if link else None,
            "vs_pinned_copy": t_adopt * link / moved if link else None}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """The device's memory rate in bytes/s: a device-to-device copy of ``nbytes``, counting the bytes read
    and the bytes written, median of ``repeats`` (events on CUDA, the host clock elsewhere)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()  # not zeros: see the docs
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / float(np.median(times))


def step_bytes(be, batch: int, positions: int) -> int:
    """The fewest bytes a decode step of ``batch`` sequences, each attending ``positions`` positions, reads
    from device memory: every weight once (a separate embedding table only for its ``batch`` rows) and
    every sequence's KV."""
    w = be.weights
    weights = w.nbytes
    if w.output is not w.embedding:
        weights -= w.embedding.nbytes  # looked up a row per token, not streamed
    return weights + batch * positions * be.config.kv_bytes_per_token


def device_memory(be, device: torch.device) -> dict:
    """What the backend holds on its device: weights, the KV pool, and the allocator's peak."""
    out = {"weights_bytes": be.weights.nbytes, "kv_pool_bytes": be.device_kv_capacity()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(peak_allocated_bytes=torch.cuda.max_memory_allocated(device), device_total_bytes=total,
                   device_free_bytes=free)
    return out
