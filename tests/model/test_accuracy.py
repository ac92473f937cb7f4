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
