"""The grammar scenario's comparison: xgrammar's masks on the same vocabulary and JSON schemas, when
xgrammar is installed (it is not a dependency of Weave: it needs ``transformers`` and ``torch``).

The vocabulary is given to xgrammar as raw token bytes (``VocabType.RAW``), control tokens as empty
strings (xgrammar's mark of a special token), the end-of-generation ids as its stop tokens; each mask
is filled into xgrammar's bitmask and unpacked to booleans, exactly as Weave's own path does, so the two
columns measure the same thing.
"""

from __future__ import annotations

import importlib.util
import json
import time

import numpy as np


def available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def mask_times(tok, schema: dict, tokens: int, rng: np.random.Generator, closers: np.ndarray) -> dict:
    """Compile time and per-token mask times (p50/p99, us) of ``schema`` along random walks."""
    import llama_cpp
    import xgrammar as xgr

    vocab = tok.llama_vocab()
    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    encoded = [b"" if llama_cpp.llama_vocab_get_attr(vocab, i) & control else tok.token_bytes(i)
               for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    bits = bitmask.numpy()  # shares the tensor's memory
    times: list[float] = []
    m = xgr.GrammarMatcher(compiled)
    while len(times) < tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        allowed = np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: tok.vocab_size].view(bool)
        times.append(time.perf_counter() - t0)
        ids = np.flatnonzero(allowed)
        eog = [t for t in ids if t in tok.eog_ids]
        lean = np.intersect1d(ids, closers, assume_unique=True)
        r = rng.random()
        if eog and (r < 0.05 or ids.size == len(eog)):
            m = xgr.GrammarMatcher(compiled)
            continue
        t = int(rng.choice(lean)) if lean.size and r < 0.5 else int(rng.choice(ids))
        m.accept_token(t)
    us = np.asarray(times) * 1e6
    return {"compile_ms": round(compile_s * 1e3, 2), "tokens": int(us.size),
            "p50_us": round(float(np.percentile(us, 50)), 1), "p99_us": round(float(np.percentile(us, 99)), 1),
            "max_us": round(float(us.max()), 1)}
