"""Models in the exact shapes of the ones people run, without their weights, for tests and benchmarks:
the table of shapes (the files themselves are written by ``shape_files``).

A shape is a real model's architecture, sizes, RoPE and vocabulary (Llama 3.2 1B/3B, Qwen 2.5
0.5B/1.5B, Qwen 3 0.6B/1.7B, the Qwen3-30B-A3B mixture of experts, ...).  ``shape_gguf`` writes one
as a GGUF with random F16 weights and
quantizes it to Q4_0 with llama.cpp's own quantizer (every matrix, the token embedding included, so
Weave and llama.cpp read the same bytes), once per machine into the cache.  The weights are well
conditioned like a trained model's - token embeddings of std 0.05, matrices of std 1/sqrt(fan-in),
norms near 1 - so two correct engines agree about as well as on real weights; random weights of
another scale make outputs chaotic, and then even llama.cpp's two attention paths disagree.

The tokenizer is SmolLM2's (shipped with Weave), padded to the real vocabulary size, with the real
model's special tokens at their real ids (BOS, EOS/EOT, the chat markers) and its BOS rule, so
prompts tokenize as they would for that family: Llama 3 adds ``<|begin_of_text|>``, Qwen adds
nothing.  ``layers`` cuts a shape to fewer layers of the same width (a test's cost, the same
per-layer work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Specials:
    """A tokenizer family: its special tokens (id -> text), BOS/EOS ids, BOS rule and pre-tokenizer."""

    tokens: dict[int, str]
    bos: int
    eos: int
    add_bos: bool
    pre: str
    eot: int | None = None
    pad: int | None = None


LLAMA3 = Specials({128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
                   128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>",
                   128010: "<|python_tag|>"},
                  bos=128000, eos=128009, eot=128009, add_bos=True, pre="llama-bpe")
QWEN2 = Specials({151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151657: "<tool_call>",
                  151658: "</tool_call>"},
                 bos=151643, eos=151645, pad=151643, add_bos=False, pre="qwen2")
QWEN3 = Specials({**QWEN2.tokens, 151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>",
                  151668: "</think>"},
                 bos=151643, eos=151645, pad=151643, add_bos=False, pre="qwen2")


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    context: int
    rope_base: float
    rms_eps: float
    specials: Specials
    tied: bool = True
    llama3_rope: tuple[float, float, float, int] | None = None  # (factor, low, high, original context)
    yarn: tuple[float, int] | None = None  # (factor, original context)
    experts: tuple[int, int, int] | None = None  # a mixture of experts: (experts, used a token, expert FFN)
    extra: dict = field(default_factory=dict)

    @property
    def params(self) -> int:
        """Weights (matrices and embeddings)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = self.d_model * (q + 2 * kv) + q * self.d_model + self._ffn(self.experts[0] if self.experts else 0)
        return self.n_layers * per_layer + self.vocab * self.d_model * (1 if self.tied else 2)

    @property
    def active_params(self) -> int:
        """Weights one token reads (a mixture of experts: the router and the experts it picks)."""
        if self.experts is None:
            return self.params
        dense = self.params - self.n_layers * self._ffn(self.experts[0])
        return dense + self.n_layers * self._ffn(self.experts[1])

    def _ffn(self, experts: int) -> int:
        if self.experts is None:
            return 3 * self.d_model * self.d_ff
        return self.experts[0] * self.d_model + experts * 3 * self.d_model * self.experts[2]


SMOLLM2 = Specials({0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}, bos=1, eos=2, add_bos=False,
                   pre="smollm")

SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0, 1e-5, SMOLLM2),
    ModelShape("llama-3.2-1b", "llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0, 1e-5, LLAMA3,
               llama3_rope=(32.0, 1.0, 4.0, 8192)),
    ModelShape("llama-3.2-3b", "llama", 28, 3072, 24, 8, 128, 8192, 128256, 131072, 500000.0, 1e-5, LLAMA3,
               llama3_rope=(32.0, 1.0, 4.0, 8192)),
    ModelShape("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, 32768, 1e6, 1e-6, QWEN2),
    ModelShape("qwen2.5-1.5b", "qwen2", 28, 1536, 12, 2, 128, 8960, 151936, 32768, 1e6, 1e-6, QWEN2),
    # Qwen 2.5's long-context setting: YaRN factor 4 over the 32K it was trained at
    ModelShape("qwen2.5-0.5b-yarn", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, 131072, 1e6, 1e-6, QWEN2,
               yarn=(4.0, 32768)),
    ModelShape("qwen3-0.6b", "qwen3", 28, 1024, 16, 8, 128, 3072, 151936, 40960, 1e6, 1e-6, QWEN3),
    ModelShape("qwen3-1.7b", "qwen3", 28, 2048, 16, 8, 128, 6144, 151936, 40960, 1e6, 1e-6, QWEN3),
    # larger models, for the capacity simulator (weaved.sim) more than for files on a 24 GB machine
    ModelShape("llama-3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0, 1e-5, LLAMA3,
               tied=False, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    ModelShape("qwen3-32b", "qwen3", 64, 5120, 64, 8, 128, 25600, 151936, 40960, 1e6, 1e-6, QWEN3, tied=False),
    # the mixture of experts people run on CPUs: 30B weights, 3B read per token (128 experts, 8 a token)
    ModelShape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 6144, 151936, 40960, 1e6, 1e-6, QWEN3, tied=False,
               experts=(128, 8, 768)),
)}


def llama3_rope_freqs(n_rot: int, base: float, factor: float, low: float, high: float, orig_ctx: int) -> np.ndarray:
    """Llama 3.x's ``rope_freqs.weight``: per rotated pair, 1 for short wavelengths, ``factor`` for
    long ones, a smooth blend between (the llama3 rope scaling of the HF config, as llama.cpp's
    converter writes it)."""
    freqs = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)
