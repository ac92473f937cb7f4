"""Closeness of the CPU backend to the truth (float64 forward of the dequantized weights) and to
llama.cpp; the bars are in ``tests.oracles`` (docs/architecture.md, "Correctness")."""

from __future__ import annotations

import pytest

from tests.oracles import GREEDY_PROMPTS, check_against_truth_and_llama, check_greedy_near_ties
from weaved.backends.cpu import CPUBackend

pytestmark = [pytest.mark.llama, pytest.mark.slow]


def test_smollm2_close_to_truth_and_llama(smollm2_q4_0):
    check_against_truth_and_llama(CPUBackend.from_file(smollm2_q4_0, threads=2), smollm2_q4_0, 256)


def test_smollm2_greedy_leaves_llama_only_at_near_ties(smollm2_q4_0):
    check_greedy_near_ties(CPUBackend.from_file(smollm2_q4_0, threads=2), smollm2_q4_0, GREEDY_PROMPTS, 64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3", "qwen2_yarn", "gemma3"])
def test_synthetic_architectures(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}")
    # all 362 tokens of the text: random weights leave many near-ties, so top-1 needs more positions
    check_against_truth_and_llama(CPUBackend.from_file(path, threads=2), path, 362)
    check_greedy_near_ties(CPUBackend.from_file(path, threads=2), path, GREEDY_PROMPTS[:3], 32)


def test_gemma3_270m_real_weights_close_to_truth(gemma3_270m):
    """Google's weights (Q4_K_M converted to the shared format; llama.cpp runs the same file):
    Weave is at least as close to the float64 truth as llama.cpp."""
    from tests.oracles import NATURAL_TEXT_PATH, llama_logits, llama_model, mean_kl, teacher_forced, top1_agreement
    from tests.reference import ReferenceModel
    from weaved.model.tokenizer import Tokenizer

    be = CPUBackend.from_file(gemma3_270m, threads=2)
    tokens = Tokenizer(gemma3_270m, be.gguf).encode_prompt(NATURAL_TEXT_PATH.read_text())[:256]
    ours, theirs = teacher_forced(be, tokens), llama_logits(llama_model(gemma3_270m, n_ctx=512), tokens)
    ref = ReferenceModel(be.gguf, be.config).logits(tokens)
    assert mean_kl(ref, ours) <= mean_kl(ref, theirs)
    assert top1_agreement(ref, ours) >= top1_agreement(ref, theirs) - 0.01


def test_gemma3_270m_greedy_leaves_llama_only_at_near_ties_or_for_the_truth(gemma3_270m):
    check_greedy_near_ties(CPUBackend.from_file(gemma3_270m, threads=2), gemma3_270m,
                           [p for p in GREEDY_PROMPTS if "<|im_start|>" not in p], 48, truth=True)

