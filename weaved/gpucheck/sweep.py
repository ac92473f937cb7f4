"""The Q4_0 / Q8_0 product's tile sizes on this device: each of a model's matrices at 1, 16, 64 and 512
rows (a decode step's and a prompt chunk's), timed for a few (outputs a program, blocks a chunk)
pairs, and every result compared with the default's bit for bit (tile sizes change speed, never a
bit).  The defaults in ``triton_q4.linear_q`` came from such a sweep on an H100."""

from __future__ import annotations

import time

import numpy as np
import torch

# (outputs a program, blocks a chunk[, rows a program[, warps[, stages]]]); None: the default.  At 64
# rows a 64 x 32 tile puts a 2,048-wide matrix on 64 programs, fewer than an H100's 132 multiprocessors:
# the 16- and 32-row tiles trade re-reading the weights (from L2) for more programs.  At 512 rows (a
# prompt chunk) there are programs enough; what a tile trades there is the weights re-read per 64 or
# 128 rows against the registers a chunk of blocks' integer sums take, and one block a chunk (a plain
# 2-D int8 dot per block, no register splits) with deeper pipelining against several.
CONFIGS = {1: [(None, None), (16, 16), (32, 8), (32, 16), (64, 16), (32, 16, 16, 2), (32, 16, 16, 8)],
           16: [(None, None), (32, 8), (64, 16), (16, 16), (32, 16, 16, 8)],
           64: [(None, None), (32, 2), (32, 8), (64, 4), (32, 4, 32), (32, 4, 16), (16, 4, 32), (16, 8, 16),
                (32, 4, 64, 8), (32, 4, 32, 8)],
           512: [(None, None), (64, 1, 64), (64, 2, 64), (64, 1, 64, 8), (64, 1, 64, 4, 4), (128, 1, 64, 8),
                 (64, 1, 128, 8), (128, 1, 128, 8), (64, 2, 128, 8), (32, 2, 64, 4, 4)]}


TILE_KEYS = ("block_n", "chunk", "block_m", "warps", "stages")  # linear_q's speed-only arguments, a config's order


def _median_ms(fn, device: torch.device, reps: int = 20) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def matrices(be) -> dict[str, object]:
    """The first layer's quantized matrices and the output, by name (one of each shape)."""
    L = be.weights.layers[0]
    named = {"qkv": L.wqkv[0] if len(L.wqkv) == 1 else None, "out": L.wo, "gate_up": L.wgu[0] if L.wgu else None,
             "down": L.wdown, "output": be.weights.output}
    return {k: w for k, w in named.items() if w is not None and getattr(w, "quantized", False)}


def product_sweep(be, rows: tuple[int, ...] = (1, 16, 64, 512), reps: int = 20, seed: int = 0,
                  configs: dict[int, list] | None = None, only: set[str] | None = None) -> list[dict]:
    """One record per (matrix, rows, config): microseconds, GB/s of weights, equal to the default.
    ``only``: these of ``matrices``' names."""
    from weaved.kernels import torch_q4 as tq
    from weaved.kernels import triton_q4

    rng = np.random.default_rng(seed)
    out = []
    for name, w in matrices(be).items():
        if only is not None and name not in only:
            continue
        for T in rows:
            x = torch.from_numpy(rng.standard_normal((T, w.n_in)).astype(np.float32)).to(w.data.device)
            a = tq.quantize_act(x)
            ref = triton_q4.linear_q(w, a)
            # each tile configuration, then the default tiles with the integer sums made floats by the
            # hardware's converter: what the exact add-and-subtract (``triton_q4.exact_float``) saves
            runs = [dict(zip(TILE_KEYS, (*cfg, None, None, None)[:5], strict=True), converter=False)
                    for cfg in (configs or CONFIGS).get(T, CONFIGS[64])]
            runs.append({**dict.fromkeys(TILE_KEYS), "converter": True})
            for kw in runs:
                y = triton_q4.linear_q(w, a, **kw)
                ms = _median_ms(lambda w=w, a=a, kw=kw: triton_q4.linear_q(w, a, **kw), w.data.device, reps)
                out.append({"matrix": name, "shape": [w.n_out, w.n_in], "rows": T, **kw, "us": ms * 1e3,
                            "gb_s": w.data.numel() / ms / 1e6, "equal": bool(torch.equal(y, ref))})
    return out
