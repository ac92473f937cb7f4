"""``python -m weaved.gpucheck``: see the package docstring.  Plain argparse (no typer, no server), so it
runs where only numpy, numba, torch and gguf are installed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m weaved.gpucheck", description=(
        "Run the CPU backend and the torch backend on one model and the same token ids: do their logits "
        "agree, how fast is the device (prefill, decode, batched decode, KV promotion), how much memory "
        "does it use.  Exit code 0: the logits agree; 1: they do not."))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="a GGUF file (converted to Q4_0 first if it is not)")
    src.add_argument("--shape", help="write a random-weight Q4_0 file of this real model's shape instead "
                                     "(llama-3.2-1b, qwen3-1.7b, ...; see weaved.bench.shapes)")
    p.add_argument("--layers", type=int, default=None, help="with --shape: cut it to this many layers")
    p.add_argument("--device", default="cuda", help="the torch backend's device (default: cuda)")
    p.add_argument("--threads", type=int, default=None, help="CPU backend threads (default: all cores)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for agreement and prefill")
    p.add_argument("--steps", type=int, default=32, help="decode steps compared and timed")
    p.add_argument("--batches", default="16,64", help="batch sizes of the batched decode timing")
    p.add_argument("--context", type=int, default=512, help="context of each batched sequence")
    p.add_argument("--promote", type=int, default=8192, help="KV positions of the promotion timing")
    p.add_argument("--profile", default="", help="also profile decode steps at these batch sizes (e.g. 1,64): "
                                                   "wall time against the kernels' device time, launches a step, "
                                                   "the costliest kernels")
    p.add_argument("--graphs", default="1,64", help="decode steps at these batch sizes replayed from CUDA graphs "
                                                     "and launched kernel by kernel: tokens/s of each, logits "
                                                     "compared ('' for none)")
    p.add_argument("--no-graphs", action="store_true", help="no decode graphs anywhere (every other part "
                                                             "then times kernel-by-kernel launches)")
    p.add_argument("--sweep", action="store_true", help="also time the Q4_0 product's tile sizes on each of the "
                                                         "model's matrices (the Triton path; every result compared "
                                                         "with the default's bits)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--work", type=Path, default=None, help="where a --shape file is written (default: a temp dir)")
    return p.parse_args(argv)


def _model(a: argparse.Namespace, say) -> Path:
    from weaved.model.convert import convert_gguf, needs_conversion

    work = a.work or Path(tempfile.mkdtemp(prefix="gpucheck-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.shape:
        from weaved.bench.shape_files import write_f16
        from weaved.bench.shapes import SHAPES

        if a.shape not in SHAPES:
            raise SystemExit(f"unknown shape {a.shape!r} (known: {', '.join(SHAPES)})")
        shape = SHAPES[a.shape]
        f16 = work / f"{a.shape}-f16.gguf"
        say(f"writing {a.shape} ({a.layers or shape.n_layers} layers) with random F16 weights to {f16}")
        write_f16(shape, f16, a.layers or shape.n_layers, tokenizer=False)
        src = f16  # F16 runs as it is, but the product to check is the shared format's: always convert
    else:
        src = Path(a.model)
        if not needs_conversion(src):
            return src
    dst = work / (src.stem + "-q4_0.gguf")
    say(f"converting {src.name} to Q4_0 ({dst})")
    return convert_gguf(src, dst, force=True)


def _section(results: dict, name: str, say, fn) -> None:
    """Run one part of the check; a part that raises is recorded (and fails the check) but does not stop
    the others, so one bad kernel on a lent machine does not cost the rest of its numbers."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded and reported, never swallowed
        results.setdefault("errors", {})[name] = traceback.format_exc()
        say(f"{name}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    import numpy as np
    import torch

    from weaved.backends.cpu import CPUBackend
    from weaved.backends.torch import TorchBackend
    from weaved.gpucheck.agreement import teacher_forced
    from weaved.gpucheck.speed import batched_decode, copy_bandwidth, device_memory, prefill_and_decode, promotion
    from weaved.model.loader import open_model

    def say(msg: str) -> None:
        print(msg, flush=True)

    t_start = time.perf_counter()
    path = _model(a, say)
    device = torch.device(a.device)
    gguf, cfg = open_model(path)
    say(f"model {path.name}: {cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}")
    if device.type == "cuda":
        say(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, triton {_version('triton')}")
    cpu = CPUBackend(gguf, cfg, threads=a.threads or os.cpu_count())
    dev = TorchBackend(gguf, cfg, device=device, graphs=False if a.no_graphs else None)
    say(f"torch backend on {device}: kernels {dev.kernels}, weights {dev.weights.nbytes / 2**30:.2f} GiB, "
        f"KV pool {dev.device_kv_capacity() / 2**30:.2f} GiB, decode graphs {'on' if dev.graphs else 'off'}")
    results: dict = {"model": str(path), "arch": cfg.arch, "device": str(device), "kernels": dev.kernels,
                     "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "triton": _version("triton")}

    prompt = [int(t) for t in np.random.default_rng(0).integers(10, min(cfg.vocab_size, 30000), a.prompt)]

    def step_line(r) -> None:
        tag = "bit-equal" if r.bit_equal else f"KL {r.kl:.2e}" + ("" if r.greedy_equal else
                                                               (" near-tie" if r.near_tie else " GREEDY DIFFERS"))
        say(f"  step {r.step:3d}: {tag}")

    def agreement() -> None:
        say(f"agreement: {a.prompt}-token prompt, then {a.steps} teacher-forced decode steps (CPU's greedy token)")
        agree = teacher_forced(cpu, dev, prompt, a.steps, a.prompt + a.steps + 1, step_line)
        results["agreement"] = agree.to_dict()
        say(f"agreement: {'PASS' if agree.passed else 'FAIL'} "
            f"({'bit-equal' if agree.bit_equal else f'mean KL {agree.mean_kl:.2e}'})")

    def speed() -> None:
        say("speed (the torch backend, then the CPU backend for scale)")
        results["device_speed"] = prefill_and_decode(dev, a.prompt, a.steps)
        results["cpu_speed"] = prefill_and_decode(cpu, a.prompt, min(a.steps, 8))
        for name in ("device_speed", "cpu_speed"):
            r = results[name]
            say(f"  {name.split('_')[0]:6s}: prefill {r['prefill_tok_s']:9.1f} tok/s, "
                f"decode {r['decode_tok_s']:8.1f} tok/s")

    def bandwidth() -> None:
        results["copy_bytes_per_s"] = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
        say(f"device memory rate (a copy, bytes read + written): {results['copy_bytes_per_s'] / 1e9:.0f} GB/s")

    def batched(b: int) -> None:
        r = batched_decode(dev, b, a.context, a.steps)
        rate = results.get("copy_bytes_per_s")
        if rate:  # the step's time at the memory rate over its measured time
            r["roofline_fraction"] = r["step_bytes"] / rate / r["step_seconds"]
        results["batched"].append(r)
        roof = f", {r['roofline_fraction']:.0%} of the memory roofline" if rate else ""
        say(f"  batch {b:3d} at {a.context} tokens: {r['tok_s']:9.1f} tok/s "
            f"({r['step_seconds'] * 1e3:.2f} ms a step for {r['step_bytes'] / 2**20:.0f} MiB{roof})")

    def promote() -> None:
        r = results["promotion"] = promotion(dev, a.promote, device)
        say(f"promotion of {a.promote} positions ({r['bytes'] / 2**20:.0f} MiB): {r['gb_s']:.2f} GB/s "
            f"(a plain copy: {r['raw_copy_gb_s']:.2f} GB/s; {r['vs_raw_copy']:.2f}x its time"
            + (f"; from pinned memory {r['pinned_copy_gb_s']:.2f} GB/s, {r['vs_pinned_copy']:.2f}x"
               if r["pinned_copy_gb_s"] else "") + "); rows read back equal")

    def memory() -> None:
        results["memory"] = device_memory(dev, device)
        say("memory: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in results["memory"].items()))

    _section(results, "agreement", say, agreement)
    _section(results, "speed", say, speed)
    _section(results, "bandwidth", say, bandwidth)
    results["batched"] = []
    for b in (int(x) for x in a.batches.split(",") if x):
        _section(results, f"batch {b}", say, lambda b=b: batched(b))
    _section(results, "promotion", say, promote)

    def profile_steps(b: int) -> None:
        from weaved.gpucheck.profile import step_profile

        r = step_profile(dev, b, a.context)
        results.setdefault("profile", []).append(r)
        say(f"  profile, batch {b} at {a.context}: {r['wall_ms']:.2f} ms a step, kernels {r['device_ms']:.2f} ms "
            f"({r['busy']:.0%} busy), {r['launches']:.0f} launches")
        for name, ms, n in r["top"]:
            say(f"    {ms:8.3f} ms  {n:5.0f}x  {name[:60]}")

    def graph_ab(b: int) -> None:
        from weaved.gpucheck.graphs import graphs_ab

        r = graphs_ab(dev, b, a.context, a.steps)
        results.setdefault("graphs", []).append(r)
        say(f"  batch {b:3d}: graphs {r['graphs_tok_s']:9.1f} tok/s, kernel by kernel {r['eager_tok_s']:9.1f} "
            f"tok/s ({r['speedup']:.2f}x), logits {'equal' if r['equal'] else 'NOT EQUAL'}; "
            f"{r['graphs_made']} graphs made in {r['graphs_seconds']:.2f} s")
        if not r["equal"]:
            raise RuntimeError("a graph's logits differ from the same step launched kernel by kernel")

    if dev.graphs is not None and a.graphs:
        say(f"decode graphs against kernel-by-kernel launches, at {a.context} tokens")
        for b in (int(x) for x in a.graphs.split(",") if x):
            _section(results, f"graphs {b}", say, lambda b=b: graph_ab(b))

    for b in (int(x) for x in a.profile.split(",") if x):
        _section(results, f"profile {b}", say, lambda b=b: profile_steps(b))

    def sweep() -> None:
        from weaved.gpucheck.sweep import product_sweep

        if dev.kernels != "triton":
            raise RuntimeError("the tile sweep times the Triton kernels: a CUDA device (or Triton's interpreter)")
        results["sweep"] = product_sweep(dev)
        for r in results["sweep"]:
            say(f"  {r['matrix']:8s} {r['shape'][0]:6d}x{r['shape'][1]:<5d} {r['rows']:3d} rows "
                f"({str(r['block_n']):>4s}, {str(r['chunk']):>4s}, {str(r['block_m']):>4s}, {str(r['warps']):>4s}, "
                f"{str(r['stages']):>4s}{', converter' if r['converter'] else ''}): "
                f"{r['us']:8.1f} us {r['gb_s']:7.0f} GB/s"
                f"{'' if r['equal'] else '  NOT EQUAL'}")
        if not all(r["equal"] for r in results["sweep"]):
            raise RuntimeError("a tile size changed a product's bits")

    if a.sweep:
        say("the Q4_0 product's tile sizes (outputs a program, blocks a chunk, rows a program, warps, stages; None: "
            "the default)")
        _section(results, "sweep", say, sweep)
    _section(results, "memory", say, memory)
    results["seconds"] = time.perf_counter() - t_start
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=2))
    passed = results.get("agreement", {}).get("passed", False) and "errors" not in results
    if "errors" in results:
        say(f"FAIL: {', '.join(results['errors'])} raised")
    return 0 if passed else 1


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
