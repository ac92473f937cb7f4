"""Models in the exact shapes of the ones people run, without their weights, for tests and benchmarks.

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

import contextlib
import ctypes
import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weaved.model.default import cache_dir, shipped_smollm2_path

CONTROL, NORMAL = 3, 1  # llama.cpp token types
FORMAT_VERSION = 1  # bump when the files this writes change


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


def shapes_dir() -> Path:
    return cache_dir() / "shapes"


def shape_path(name: str, layers: int | None = None) -> Path:
    cut = f"-L{layers}" if layers else ""
    return shapes_dir() / f"{name}{cut}-v{FORMAT_VERSION}-q4_0.gguf"


def shape_gguf(name: str, layers: int | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """The Q4_0 GGUF of shape ``name`` (cut to ``layers`` layers), built into the cache on first use."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})")
    shape = SHAPES[name]
    if layers is not None and not 1 <= layers <= shape.n_layers:
        raise ValueError(f"{name} has {shape.n_layers} layers; cannot cut it to {layers}")
    target = shape_path(name, layers)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(target.name + ".lock")):
        if target.is_file():
            return target
        say = progress or (lambda m: None)
        f16 = target.with_name(target.name + ".f16.tmp")
        tmp = target.with_name(target.name + ".tmp")
        try:
            say(f"writing {name} ({'all' if layers is None else layers} layers) with random F16 weights")
            write_f16(shape, f16, layers or shape.n_layers)
            say("quantizing to Q4_0 with llama.cpp")
            llama_quantize_q4_0(f16, tmp)
            tmp.replace(target)
        finally:
            f16.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def llama_quantize_q4_0(src: Path, dst: Path, threads: int | None = None) -> None:
    """llama.cpp's quantizer, every tensor it quantizes to Q4_0 (``pure``: the embedding too)."""
    import llama_cpp

    from weaved.model.tokenizer import quiet_llama_logs

    quiet_llama_logs(llama_cpp)  # its per-tensor log lines
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.pure = True
    params.nthread = threads or os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")


def _tokenizer_metadata(shape: ModelShape) -> list[tuple[str, object, object, object]]:
    """(key, value, vtype, sub_type) of SmolLM2's tokenizer padded to the shape's vocabulary, with the
    family's special tokens at their ids."""
    from gguf import GGUFValueType as V

    from weaved.model.gguf_scan import scan_gguf

    meta = scan_gguf(shipped_smollm2_path(), want=lambda key: key.startswith("tokenizer.")).metadata
    tokens = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in meta["tokenizer.ggml.tokens"].value]
    types = list(meta["tokenizer.ggml.token_type"].value)
    n = len(tokens)
    tokens += [f"<pad_{i}>" for i in range(n, shape.vocab)]
    types += [NORMAL] * (shape.vocab - n)
    sp = shape.specials
    where = {t: i for i, t in enumerate(tokens)}
    for i, text in sp.tokens.items():
        j = where.get(text)
        if j is not None and j != i:  # SmolLM2 has it elsewhere (e.g. <|im_start|>): token texts are unique
            tokens[j], types[j] = f"<unused_{j}>", NORMAL
        tokens[i], types[i] = text, CONTROL
    out = [("tokenizer.ggml.model", "gpt2", V.STRING, None), ("tokenizer.ggml.pre", sp.pre, V.STRING, None),
           ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
           ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)]
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        out.append(("tokenizer.ggml.merges", merges.value, V.ARRAY, V.STRING))
    out += [("tokenizer.ggml.bos_token_id", sp.bos, V.UINT32, None),
            ("tokenizer.ggml.eos_token_id", sp.eos, V.UINT32, None),
            ("tokenizer.ggml.add_bos_token", sp.add_bos, V.BOOL, None)]
    if sp.eot is not None:
        out.append(("tokenizer.ggml.eot_token_id", sp.eot, V.UINT32, None))
    if sp.pad is not None:
        out.append(("tokenizer.ggml.padding_token_id", sp.pad, V.UINT32, None))
    return out


def _tensors(shape: ModelShape, n_layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape as stored (rows, cols), kind) of every tensor; kind picks the initialisation."""
    d, q, kv = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (shape.vocab, d), "embed"),
                                                  ("output_norm.weight", (d,), "norm")]
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, d), "embed"))
    if shape.llama3_rope is not None:
        out.append(("rope_freqs.weight", (shape.head_dim // 2,), "rope_freqs"))
    for i in range(n_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,), "norm"), (b + "attn_q.weight", (q, d), "matrix"),
                (b + "attn_k.weight", (kv, d), "matrix"), (b + "attn_v.weight", (kv, d), "matrix")]
        if shape.arch == "qwen2":
            out += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                    (b + "attn_v.bias", (kv,), "bias")]
        if shape.arch in ("qwen3", "qwen3moe"):
            out += [(b + "attn_q_norm.weight", (shape.head_dim,), "norm"),
                    (b + "attn_k_norm.weight", (shape.head_dim,), "norm")]
        out += [(b + "attn_output.weight", (d, q), "matrix"), (b + "ffn_norm.weight", (d,), "norm")]
        if shape.experts is not None:  # the router (F32, as llama.cpp keeps it) and the stacked experts
            E, _, ff = shape.experts
            out += [(b + "ffn_gate_inp.weight", (E, d), "router"), (b + "ffn_gate_exps.weight", (E, ff, d), "matrix"),
                    (b + "ffn_up_exps.weight", (E, ff, d), "matrix"),
                    (b + "ffn_down_exps.weight", (E, d, ff), "matrix")]
            continue
        out += [(b + "ffn_gate.weight", (shape.d_ff, d), "matrix"), (b + "ffn_up.weight", (shape.d_ff, d), "matrix"),
                (b + "ffn_down.weight", (d, shape.d_ff), "matrix")]
    return out


def _values(shape: ModelShape, name: str, dims: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "embed":
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(0.05)).astype(np.float16)
    if kind in ("matrix", "router"):  # std 1 / sqrt(fan-in): a row's length (an expert stack's last axis)
        w = rng.standard_normal(dims, dtype=np.float32) * np.float32(dims[-1] ** -0.5)
        return w if kind == "router" else w.astype(np.float16)
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
    if kind == "bias":
        return (0.1 * rng.standard_normal(dims)).astype(np.float32)
    factor, low, high, orig = shape.llama3_rope
    return llama3_rope_freqs(shape.head_dim, shape.rope_base, factor, low, high, orig)


def write_f16(shape: ModelShape, path: Path, n_layers: int, seed: int = 0, tokenizer: bool = True) -> None:
    """Write the shape as an F16 GGUF (norms, biases and rope factors F32), tensor by tensor.
    ``tokenizer=False``: no tokenizer metadata (a file run on token ids only, where SmolLM2's
    tokenizer, which the metadata is made from, is not installed)."""
    from gguf import GGUFWriter, RopeScalingType

    arch = shape.arch
    w = GGUFWriter(path, arch)
    w.add_name(f"{shape.name} (random weights)")
    w.add_file_type(1)  # mostly F16
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    if shape.experts is not None:
        w.add_expert_count(shape.experts[0])
        w.add_expert_used_count(shape.experts[1])
        w.add_uint32(f"{arch}.expert_feed_forward_length", shape.experts[2])
    if shape.yarn is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn[0])
        w.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    for key, value, vtype, sub in _tokenizer_metadata(shape) if tokenizer else ():
        w.add_key_value(key, value, vtype, sub)
    tensors = _tensors(shape, n_layers)
    for name, dims, kind in tensors:
        dtype = np.float16 if kind in ("embed", "matrix") else np.float32
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in tensors:
        w.write_tensor_data(_values(shape, name, dims, kind, rng))
    w.close()
