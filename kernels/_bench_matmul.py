"""Time the matrix products of one SmolLM2-135M step: ``python -m weaved.kernels._bench_matmul``.

30 layers x (fused q|k|v 960x576, o 576x576, fused gate|up 3072x576, down 576x1536), all Q4_0, plus
the tied output matrix 49152x576 (Q8_0), with random weights (89.8 MB, streamed from DRAM each
step), at T = 1, 16, 64, 512 tokens per step.  Each product quantizes its input, as in a forward
pass.  Prints ms per step (median over repeated steps, min in brackets), ms per token, the weight
bytes streamed per second and the arithmetic rate.  Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from . import matmul, threads
from .ggml import GGMLType, row_bytes

D, FF, VOCAB, LAYERS = 576, 1536, 49152, 30
LAYER_SHAPES = (("qkv", 960, D), ("o", D, D), ("gate|up", 2 * FF, D), ("down", D, FF))


def random_raw(qtype: GGMLType, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF rows: random quants, fp16 scales in [1e-3, 1e-2)."""
    raw = rng.integers(0, 256, (n_out, row_bytes(qtype, n_in)), dtype=np.uint8)
    bsz = 18 if qtype == GGMLType.Q4_0 else 34
    blocks = raw.reshape(n_out, -1, bsz)
    d = rng.uniform(1e-3, 1e-2, blocks.shape[:2]).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(n_out, -1, 2)
    return raw


def build(rng: np.random.Generator) -> tuple[list[list[matmul.PackedWeight]], matmul.PackedWeight]:
    layers = [[matmul.pack_weight(random_raw(GGMLType.Q4_0, n, k, rng), GGMLType.Q4_0, n, k)
               for _, n, k in LAYER_SHAPES] for _ in range(LAYERS)]
    out = matmul.pack_weight(random_raw(GGMLType.Q8_0, VOCAB, D, rng), GGMLType.Q8_0, VOCAB, D)
    return layers, out


def step(seq: list[matmul.PackedWeight], xa: np.ndarray, xb: np.ndarray, ys: dict[int, np.ndarray]) -> None:
    """The products of one step in forward-pass order."""
    for w in seq:
        matmul.linear(w, xb if w.n_in == FF else xa, out=ys[w.n_out])


def timeit(fn, min_time: float, min_reps: int) -> tuple[float, float]:
    fn()
    ts: list[float] = []
    end = time.perf_counter() + min_time
    while len(ts) < min_reps or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64,512", help="tokens per step (comma separated)")
    ap.add_argument("--threads", type=int, default=0, help="threads (default: all this process may use)")
    ap.add_argument("--min-time", type=float, default=2.0, help="seconds of timed steps per case")
    ap.add_argument("--path", choices=("vnni", "portable"), default=None, help="force a kernel path")
    args = ap.parse_args(argv)
    if args.threads:
        threads.set_threads(args.threads)
    if args.path:
        matmul.set_kernel_path(args.path)
    rng = np.random.default_rng(0)
    layers, out_w = build(rng)
    layer_bytes = sum(w.nbytes for w in layers[0]) * LAYERS
    out_bytes = out_w.nbytes
    macs_layers = LAYERS * sum(n * k for _, n, k in LAYER_SHAPES)
    macs_out = VOCAB * D
    print(f"# kernels: {matmul.kernel_path()}, threads {threads.get_threads()}; weights streamed per step:"
          f" layers {layer_bytes / 1e6:.1f} MB + output {out_bytes / 1e6:.1f} MB (packed)")
    for T in (int(t) for t in args.tokens.split(",")):
        xa = rng.standard_normal((T, D)).astype(np.float32)
        xb = rng.standard_normal((T, FF)).astype(np.float32)
        ys = {n: np.empty((T, n), np.float32) for n in (960, D, 2 * FF, VOCAB)}  # output buffers by n_out
        seq = [w for ws in layers for w in ws]
        cases = (("layers+output", seq + [out_w], layer_bytes + out_bytes, macs_layers + macs_out),
                 ("layers only", seq, layer_bytes, macs_layers))
        for label, ws, nbytes, macs in cases:
            if T >= 512 and len(ws) > len(seq):
                continue  # prefill computes logits for the last token only
            med, lo = timeit(lambda: step(ws, xa, xb, ys), args.min_time, 3 if T >= 256 else 10)  # noqa: B023
            print(f"T={T:4d} {label:14s} {med * 1e3:9.2f} ms/step (min {lo * 1e3:8.2f})"
                  f"  {med / T * 1e3:7.3f} ms/token  {nbytes / med / 1e9:6.1f} GB/s"
                  f"  {2 * macs * T / med / 1e9:6.0f} GOP/s", flush=True)


if __name__ == "__main__":
    main()
