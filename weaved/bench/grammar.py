"""``weave bench --scenario grammar``: what constrained decoding costs per token.

For a model's vocabulary: llguidance's tokenizer build and a grammar's compile time once, then the mask
of every step (computed into the constraint's buffer and unpacked to booleans, as the sampler gets it)
along random walks through the grammar - a JSON schema, required tool calls, and ``auto`` tool calls
(free text under a lazy trigger, the common case) - reported as p50 / p99 per token.  Beside it, the
model's own decode step on this host (one sequence, the CPU backend), so the mask's share of a step is
plain.  Walks lean towards tokens that close strings and objects so that they end, like real answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from weaved.agent.formats import GENERIC, HERMES
from weaved.agent.grammar import GrammarEngine
from weaved.agent.grammar_text import AnswerShape, LarkWriter, answer_grammar, closed
from weaved.agent.tools import ChoiceMode, Tool
from weaved.bench import grammar_xgr

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "emails": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}}}},
    "required": ["name", "age"]}
TOOLS = (Tool("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}),
    Tool("search", "", {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                        "required": ["query"]}))
GRAMMARS = {
    "json_schema": AnswerShape(GENERIC, schema=PERSON),
    "tools_required": AnswerShape(GENERIC, TOOLS, ChoiceMode.REQUIRED),
    "tools_auto": AnswerShape(HERMES, TOOLS, ChoiceMode.AUTO),
}


def _envelope_schema(tools) -> dict:
    """The generic format's required-calls answer as one JSON schema (what xgrammar is given for it)."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": closed(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "object", "properties": {"tool_calls": {"type": "array", "minItems": 1,
                                                            "items": {"anyOf": calls}}},
            "required": ["tool_calls"], "additionalProperties": False}


XGR_SCHEMAS = {"json_schema": closed(PERSON), "tools_required": _envelope_schema(TOOLS)}


def _writer(tok, engine: GrammarEngine) -> LarkWriter:
    return LarkWriter(engine.special_id)


def _walk_times(tok, engine: GrammarEngine, lark: str, tokens: int, rng: np.random.Generator,
                closers: np.ndarray) -> list[float]:
    """Seconds per mask over random walks (restarting at each end) until ``tokens`` masks were taken."""
    times: list[float] = []
    c = engine.compile(lark)
    while len(times) < tokens:
        t0 = time.perf_counter()
        mask = c.allowed()  # what the sampler takes (ids are for the walk, as xgrammar's side has them)
        times.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(mask)
        eog = [t for t in allowed[:64] if t in tok.eog_ids] or [t for t in allowed if t in tok.eog_ids]
        lean = np.intersect1d(allowed, closers, assume_unique=True)
        r = rng.random()
        if eog and (r < 0.05 or allowed.size == len(eog)):
            c = engine.compile(lark)  # the answer ended: a new one
            continue
        t = int(rng.choice(lean)) if lean.size and r < 0.5 else int(rng.choice(allowed))
        c.accept(t)
    return times


def _decode_step_s(path: Path, threads: int, steps: int) -> float:
    """Median seconds of one decode step of one sequence (the CPU backend), after a short prompt."""
    from weaved.backends.base import Logits, SeqChunk
    from weaved.backends.cpu import CPUBackend

    be = CPUBackend.from_file(path, threads=threads)
    kv = be.new_kv(256)
    be.prepare(kv, 16)
    be.forward([SeqChunk(kv, np.arange(1, 17, dtype=np.int32), Logits.LAST)])
    out = []
    for i in range(steps):
        be.prepare(kv, kv.length + 1)
        t0 = time.perf_counter()
        be.forward([SeqChunk(kv, np.asarray([100 + i], np.int32), Logits.LAST)])
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def measure(path: Path, threads: int, quick: bool, say: Callable[[str], None]) -> dict:
    """The scenario's numbers for one model file."""
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(path)
    engine = GrammarEngine(tok)
    t0 = time.perf_counter()
    _ = engine.lltokenizer  # built once, timed here
    build_s = time.perf_counter() - t0
    say(f"{path.name}: vocabulary of {tok.vocab_size} tokens, llguidance tokenizer built in {build_s:.2f} s")
    closers = np.asarray([i for i in range(tok.vocab_size) if any(ch in tok.token_bytes(i) for ch in b'"}],')])
    rng = np.random.default_rng(0)
    w = _writer(tok, engine)
    grammars = {}
    for name, shape in GRAMMARS.items():
        lark = answer_grammar(shape, w)
        t0 = time.perf_counter()
        engine.compile(lark)
        compile_s = time.perf_counter() - t0
        times = np.asarray(_walk_times(tok, engine, lark, 300 if quick else 3000, rng, closers)) * 1e6
        grammars[name] = {"compile_ms": round(compile_s * 1e3, 2), "tokens": int(times.size),
                          "p50_us": round(float(np.percentile(times, 50)), 1),
                          "p99_us": round(float(np.percentile(times, 99)), 1),
                          "max_us": round(float(times.max()), 1)}
        say(f"  {name}: p50 {grammars[name]['p50_us']} us, p99 {grammars[name]['p99_us']} us per token")
        if name in XGR_SCHEMAS and grammar_xgr.available():
            x = grammar_xgr.mask_times(tok, XGR_SCHEMAS[name], 300 if quick else 3000, rng, closers)
            grammars[name]["xgrammar"] = x
            say(f"  {name} (xgrammar): p50 {x['p50_us']} us, p99 {x['p99_us']} us per token")
    step = _decode_step_s(path, threads, 8 if quick else 32)
    return {"model": path.name, "vocab": tok.vocab_size, "tokenizer_build_s": round(build_s, 2),
            "decode_step_ms": round(step * 1e3, 2), "grammars": grammars}


def run_grammar_bench(models: list[Path], threads: int, quick: bool, say: Callable[[str], None]) -> dict:
    return {"threads": threads, "quick": quick, "models": [measure(p, threads, quick, say) for p in models]}


def format_table(report: dict) -> str:
    lines = [f"{'model':<32} {'vocab':>7} {'grammar':<26} {'p50 us':>8} {'p99 us':>8} {'compile ms':>10} "
             f"{'step ms':>8} {'p99/step':>9}"]
    for m in report["models"]:
        for name, g in m["grammars"].items():
            for label, row in ((name, g), (f"{name} (xgrammar)", g.get("xgrammar"))):
                if row is None:
                    continue
                share = row["p99_us"] / 1e3 / m["decode_step_ms"] if m["decode_step_ms"] else float("nan")
                lines.append(f"{m['model'][:32]:<32} {m['vocab']:>7} {label:<26} {row['p50_us']:>8} "
                             f"{row['p99_us']:>8} {row['compile_ms']:>10} {m['decode_step_ms']:>8} {share:>8.1%}")
    return "\n".join(lines)
