"""The models people run, in their real shapes (random weights, llama.cpp's own Q4_0) and, for Gemma 3
270M, with real weights: teacher-forced through the API over natural text at short and long
context (every position of the short text, every third of the long one), Weave stays as close to
llama.cpp as llama.cpp's two attention paths are to each other.

The bars: Weave's mean |log-probability difference| from llama.cpp (flash attention on) is within
3x llama.cpp's own flash-on vs flash-off difference + 0.02, and its top-1 agreement with llama.cpp
is within 3 points of llama.cpp's own.  Shapes whose full depth would take minutes here are cut to
a few layers of their real width (the same per-layer arithmetic: head sizes, GQA, RoPE, vocab).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve
from tests.model.real_models import LONG_TEXT_PATH, api_stats, llama_stats
from tests.oracles import NATURAL_TEXT_PATH
from weaved.bench.shape_files import shape_gguf

pytestmark = [pytest.mark.llama, pytest.mark.slow]

# (shape, layers: None = the real depth).  Full depth costs ~4 minutes a model here (llama.cpp's two
# runs over 3,200 tokens dominate); the benchmark runs every shape at full depth.
SHAPES = [
    ("llama-3.2-1b", None),
    ("llama-3.2-3b", 4),
    ("qwen2.5-0.5b", 8),
    ("qwen2.5-1.5b", 4),
    ("qwen2.5-0.5b-yarn", 8),
    ("qwen3-0.6b", 8),
    ("qwen3-1.7b", 4),
    ("qwen3-30b-a3b", 2),  # a mixture of experts: 128 experts, 8 a token (the full 48 layers: 17 GB)
]
LONG_TOKENS = 3200
LONG_EVERY = 3  # positions compared over the long text: every third (1,067 of them), all of the short one


def _texts(tokenizer) -> list[tuple[str, str, list[int]]]:
    """(label, text, tokens): the natural text, and the long text cut to about LONG_TOKENS tokens."""
    short = NATURAL_TEXT_PATH.read_text()
    long_text = LONG_TEXT_PATH.read_text()
    ids = tokenizer.encode_prompt(long_text)
    if len(ids) > LONG_TOKENS:  # cut at a token boundary: the text of the first LONG_TOKENS tokens
        long_text = tokenizer.decode(ids[:LONG_TOKENS])
        if long_text.startswith(tokenizer.bos_text) and tokenizer.add_bos:
            long_text = long_text[len(tokenizer.bos_text):]
    out = []
    for label, text in (("short", short), ("long", long_text)):
        out.append((label, text, tokenizer.encode_prompt(text)))
    assert len(out[1][2]) >= 3000
    return out


def check_model_through_api(path: Path, tmp: Path) -> list[dict]:
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(path)
    report = []
    with weave_serve(tmp, "--model", str(path), "--profile", "cpu-only") as served:
        with uds_client(served.socket, timeout=600.0) as http:
            for label, text, tokens in _texts(tok):
                every = 1 if label == "short" else LONG_EVERY
                ours = api_stats(http, text, tokens).every(every)
                fa = llama_stats(path, tokens, tok, flash_attn=True, every=every)
                nofa = llama_stats(path, tokens, tok, flash_attn=False, every=every)
                row = {"text": label, "tokens": len(tokens), "compared": len(ours.logprob),
                       "own_diff": fa.mean_abs_diff(nofa), "own_top1": fa.top1_agreement(nofa),
                       "diff": ours.mean_abs_diff(fa), "top1": ours.top1_agreement(fa)}
                report.append(row)
                print(path.name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
                assert row["diff"] <= 3 * row["own_diff"] + 0.02, row
                assert row["top1"] >= row["own_top1"] - 0.03, row
    return report


@pytest.mark.parametrize("shape,layers", SHAPES, ids=[f"{s}-L{n}" if n else s for s, n in SHAPES])
def test_real_shape_agrees_with_llama_cpp(shape, layers, tmp_path):
    check_model_through_api(shape_gguf(shape, layers), tmp_path)


def test_gemma3_270m_agrees_with_llama_cpp(gemma3_270m, tmp_path):
    check_model_through_api(gemma3_270m, tmp_path)
