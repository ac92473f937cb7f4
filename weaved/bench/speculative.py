"""Benchmark of the speculative-decoding variant: single-stream decode with and without it, in-process.

Two workloads: repetitive text (an agent asked to write back a file it was given, with a small
change - drafts from prompt lookup get accepted) and non-repetitive prose (drafts are rare and mostly
miss, which shows what the variant costs when it does not help).  Both runs go through the real
``BatchEngine`` on the CPU backend, greedy, with no stop condition but ``n_gen``; decode tokens/s is
measured from the first token to the last, so the prefill is not in it.  The two runs must produce
the same tokens - the result says whether they did.

Not a test: it measures wall-clock time.  ``weave bench`` wires it in (``measure`` and ``format_result``).
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any

from weaved.engine.speculative import SpecConfig

_FILE = '''import json
from pathlib import Path


def load_config(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save_config(path: str, config: dict) -> None:
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def list_configs(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).glob("*.json"))
'''

WORKLOADS: dict[str, str] = {
    "repetitive": ("Here is a Python file:\n\n```python\n" + _FILE + "```\n\nWrite the whole file again, "
                   "unchanged except that load_config should use Path(path).read_text()."),
    "natural": ("Write a short story about a lighthouse keeper who finds a message in a bottle, in a quiet, "
                "observant style, with no lists and no repetition."),
}


def _run(backend, prompt: list[int], spec: SpecConfig | None, n_gen: int) -> dict[str, Any]:
    from weaved.engine.engine import BatchEngine
    from weaved.engine.sampling import SamplingParams
    from weaved.engine.scheduler import SchedulerConfig
    from weaved.engine.sequence import Sequence, SLARank

    done = threading.Event()
    eng = BatchEngine("bench", backend, SchedulerConfig(token_budget=4096, prefill_chunk=4096), speculative=spec)
    seq = Sequence("bench", backend.new_kv(len(prompt) + n_gen + 8), list(prompt),
                   SamplingParams(max_tokens=n_gen, temperature=0), SLARank.INTERACTIVE,
                   emit=lambda ev: ev["type"] in ("done", "error") and done.set())
    eng.submit(seq)
    eng.start()
    try:
        if not done.wait(600):
            raise TimeoutError("a benchmark turn did not finish in 600 s")
    finally:
        eng.stop()
    if seq.error:
        raise RuntimeError(seq.error)
    span = (seq.last_token_at or 0.0) - (seq.first_token_at or 0.0)
    c = eng.counters
    return {"tokens": list(seq.generated), "tps": (len(seq.generated) - 1) / span if span > 0 else 0.0,
            "drafted": c.drafted, "accepted": c.accepted, "verify_steps": c.verify_steps}


def measure(model: str | Path, threads: int, *, n_gen: int = 128, reps: int = 3,
            spec: SpecConfig | None = None, workloads: tuple[str, ...] = ("repetitive", "natural")) -> dict[str, Any]:
    """Decode tokens/s of one greedy stream, plain and speculative, per workload (median of ``reps``
    alternating pairs after one unrecorded warm-up pair).

    Returns ``{"model", "threads", "n_gen", "spec": {...}, <workload>: {"plain_tps", "spec_tps",
    "speedup", "acceptance" (accepted / drafted draft tokens), "tokens_per_verify" (tokens a verify step
    yielded, the correction included), "identical" (same tokens both ways), "tokens"}}``."""
    from weaved.backends.cpu import CPUBackend
    from weaved.model.tokenizer import Tokenizer

    spec = spec or SpecConfig()
    backend = CPUBackend.from_file(model, threads=threads)
    tok = Tokenizer(model)
    out: dict[str, Any] = {"model": str(model), "threads": threads, "n_gen": n_gen,
                           "spec": {"draft_tokens": spec.draft_tokens, "ngram_sizes": list(spec.ngram_sizes)}}
    for name in workloads:
        prompt = tok.encode_chat(tok.render_chat([{"role": "user", "content": WORKLOADS[name]}]))
        plain_tps, spec_tps, identical = [], [], True
        for rep in range(reps + 1):
            a, b = _run(backend, prompt, None, n_gen), _run(backend, prompt, spec, n_gen)
            identical &= a["tokens"] == b["tokens"]
            if rep:  # the first pair warms caches (and compiles nothing new, but pages weights in)
                plain_tps.append(a["tps"])
                spec_tps.append(b["tps"])
        p, s = statistics.median(plain_tps), statistics.median(spec_tps)
        out[name] = {
            "plain_tps": round(p, 2), "spec_tps": round(s, 2), "speedup": round(s / p, 3) if p else None,
            "acceptance": round(b["accepted"] / b["drafted"], 3) if b["drafted"] else None,
            "tokens_per_verify": round((b["accepted"] + b["verify_steps"]) / b["verify_steps"], 2)
            if b["verify_steps"] else None,
            "verify_steps": b["verify_steps"], "identical": identical, "tokens": len(b["tokens"]),
        }
    return out


def format_result(result: dict[str, Any]) -> str:
    """A small table of ``measure``'s result."""
    spec = result["spec"]
    lines = [f"speculative decoding (prompt lookup, {spec['draft_tokens']} draft tokens, n-grams "
             f"{'/'.join(map(str, spec['ngram_sizes']))}): {Path(result['model']).name}, "
             f"{result['threads']} threads, {result['n_gen']} tokens",
             f"{'workload':<12}{'plain tok/s':>13}{'spec tok/s':>12}{'speed-up':>10}{'accepted':>10}"
             f"{'tok/verify':>12}{'identical':>11}"]
    for name in WORKLOADS:
        r = result.get(name)
        if r is None:
            continue
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        up = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"{name:<12}{r['plain_tps']:>13.1f}{r['spec_tps']:>12.1f}{up:>10}{acc:>10}"
                     f"{tpv:>12}{'yes' if r['identical'] else 'NO':>11}")
    return "\n".join(lines)
