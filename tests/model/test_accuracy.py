"""Closeness to the truth (float64 forward of the dequantized weights) and to llama.cpp.

The bars (DESIGN.md §11): teacher-forced over natural text, our mean KL from the float64 reference
is no larger than llama.cpp's and our top-1 agreement with it no lower than llama.cpp's minus one
point; against llama.cpp itself mean KL <= 0.005 and top-1 >= 94 %; greedy continuations leave
llama.cpp's only at near-ties (its logit margin between the two tokens < 0.3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.oracles import (
    first_divergence,
    llama_greedy,
    llama_logits,
    llama_model,
    mean_kl,
    top1_agreement,
)
from tests.reference import ReferenceModel
from weaved.backends.base import Logits, SeqChunk
from weaved.backends.cpu import CPUBackend
from weaved.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.llama, pytest.mark.slow]

TEXT = (Path(__file__).parent.parent / "data" / "natural_text.txt").read_text()
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
]


def ours_teacher_forced(be: CPUBackend, tokens: list[int]) -> np.ndarray:
    kv = be.new_kv(len(tokens) + 8)
    return be.forward([SeqChunk(kv, np.array(tokens, np.int32), Logits.ALL)])[0]


def ours_greedy(be: CPUBackend, prompt: list[int], n: int) -> list[int]:
    kv = be.new_kv(len(prompt) + n + 8)
    (row,) = be.forward([SeqChunk(kv, np.array(prompt, np.int32))])
    out = []
    for _ in range(n):
        tok = int(np.argmax(row[0]))
        out.append(tok)
        (row,) = be.forward([SeqChunk(kv, np.array([tok], np.int32))])
    return out


def check_against_truth_and_llama(path: Path, n_tokens: int) -> dict:
    be = CPUBackend.from_file(path, threads=2)
    tok = Tokenizer(path, be.gguf)
    tokens = tok.encode(TEXT)[:n_tokens]
    assert len(tokens) == n_tokens
    ours = ours_teacher_forced(be, tokens)
    llm = llama_model(path, n_ctx=1024)
    theirs = llama_logits(llm, tokens)
    ref = ReferenceModel(be.gguf, be.config).logits(tokens)
    stats = {
        "kl_ours_ref": mean_kl(ref, ours),
        "kl_llama_ref": mean_kl(ref, theirs),
        "top1_ours_ref": top1_agreement(ref, ours),
        "top1_llama_ref": top1_agreement(ref, theirs),
        "kl_llama_ours": mean_kl(theirs, ours),
        "top1_llama_ours": top1_agreement(theirs, ours),
    }
    print(path.name, {k: round(v, 5) for k, v in stats.items()})
    assert stats["kl_ours_ref"] <= stats["kl_llama_ref"], stats
    assert stats["top1_ours_ref"] >= stats["top1_llama_ref"] - 0.01, stats
    assert stats["kl_llama_ours"] <= 0.005, stats
    assert stats["top1_llama_ours"] >= 0.94, stats
    return stats


def check_greedy_near_ties(path: Path, prompts: list[str], n: int) -> list:
    be = CPUBackend.from_file(path, threads=2)
    tok = Tokenizer(path, be.gguf)
    llm = llama_model(path, n_ctx=512)
    report = []
    for text in prompts:
        prompt = tok.encode(text)
        ours = ours_greedy(be, prompt, n)
        theirs, their_logits = llama_greedy(llm, prompt, n)
        d = first_divergence(ours, theirs, their_logits)
        report.append((text[:30], d))
        if d is not None:
            assert d.margin < 0.3, f"{text!r}: diverged at token {d.index} with llama.cpp margin {d.margin:.3f}"
    print("greedy divergences:", report)
    return report


def test_smollm2_close_to_truth_and_llama(smollm2_q4_0):
    check_against_truth_and_llama(smollm2_q4_0, 256)


def test_smollm2_greedy_leaves_llama_only_at_near_ties(smollm2_q4_0):
    check_greedy_near_ties(smollm2_q4_0, GREEDY_PROMPTS, 64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_architectures(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    # all 362 tokens of the text: random weights leave many near-ties, so top-1 needs more positions
    check_against_truth_and_llama(path, 362)
    check_greedy_near_ties(path, GREEDY_PROMPTS[:3], 32)
