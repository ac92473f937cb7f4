"""The files of the model shapes (``shapes``): written once per machine into the cache.

``shape_gguf`` writes a shape as a GGUF with random F16 weights and quantizes it to Q4_0 with llama.cpp's
own quantizer (``pure``: every matrix, the token embedding included).  A shape whose F16 file would not
fit beside its Q4_0 one on a disk of tens of GB (the full Qwen3-30B-A3B: 61 GB of F16) is quantized
tensor by tensor in this process instead, with gguf-py's Q4_0 quantizer - the same bytes llama.cpp's
writes (``tests/model/test_convert.py`` holds the two equal, expert stacks included) - so no F16 file
is ever written.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from weaved.bench.shapes import SHAPES, ModelShape, llama3_rope_freqs
from weaved.model.default import cache_dir, exclusive, shipped_smollm2_path

CONTROL, NORMAL = 3, 1  # llama.cpp token types
FORMAT_VERSION = 1  # bump when the files this writes change
DIRECT_F16_BYTES = 20 << 30  # an F16 file larger than this is never written: quantized in-process


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
    with exclusive(target.with_name(target.name + ".lock")):
        if target.is_file():
            return target
        say = progress or (lambda m: None)
        f16 = target.with_name(target.name + ".f16.tmp")
        tmp = target.with_name(target.name + ".tmp")
        n = layers or shape.n_layers
        try:
            if f16_bytes(shape, n) > DIRECT_F16_BYTES:
                say(f"writing {name} ({n} layers) with random weights, quantized to Q4_0 here (its F16 file would "
                    f"be {f16_bytes(shape, n) / 2**30:.0f} GiB)")
                write_q4_0(shape, tmp, n, progress=say)
            else:
                say(f"writing {name} ({'all' if layers is None else layers} layers) with random F16 weights")
                write_f16(shape, f16, n)
                say("quantizing to Q4_0 with llama.cpp")
                llama_quantize_q4_0(f16, tmp)
            tmp.replace(target)
        finally:
            f16.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return target


def f16_bytes(shape: ModelShape, n_layers: int) -> int:
    """The size of the shape's F16 file cut to ``n_layers``."""
    per_layer = (shape.params - shape.vocab * shape.d_model * (1 if shape.tied else 2)) // shape.n_layers
    return 2 * (per_layer * n_layers + shape.vocab * shape.d_model * (1 if shape.tied else 2))


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


def tokenizer_metadata(shape: ModelShape) -> list[tuple[str, object, object, object]]:
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


def tensor_plan(shape: ModelShape, n_layers: int) -> list[tuple[str, tuple[int, ...], str]]:
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


def tensor_values(shape: ModelShape, name: str, dims: tuple[int, ...], kind: str, rng: np.random.Generator
                  ) -> np.ndarray:
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
    """Write the shape as an F16 GGUF (norms, biases, rope factors and a router F32), tensor by tensor.
    ``tokenizer=False``: no tokenizer metadata (a file run on token ids only, where SmolLM2's
    tokenizer, which the metadata is made from, is not installed)."""
    _write(shape, path, n_layers, seed, tokenizer, q4_0=False)


def write_q4_0(shape: ModelShape, path: Path, n_layers: int, seed: int = 0,
               progress: Callable[[str], None] | None = None) -> None:
    """Write the shape as the Q4_0 GGUF llama.cpp's pure quantization of ``write_f16``'s file would be
    (the same F16 values, quantized by gguf-py tensor by tensor), without the F16 file."""
    _write(shape, path, n_layers, seed, True, q4_0=True, progress=progress)


def _write(shape: ModelShape, path: Path, n_layers: int, seed: int, tokenizer: bool, q4_0: bool,
           progress: Callable[[str], None] | None = None) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType

    q4 = GGMLQuantizationType.Q4_0
    arch = shape.arch
    w = GGUFWriter(path, arch)
    w.add_name(f"{shape.name} (random weights)")
    w.add_file_type(2 if q4_0 else 1)  # mostly Q4_0 / mostly F16
    if q4_0:
        w.add_quantization_version(2)
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
    for key, value, vtype, sub in tokenizer_metadata(shape) if tokenizer else ():
        w.add_key_value(key, value, vtype, sub)
    tensors = tensor_plan(shape, n_layers)
    block, size = GGML_QUANT_SIZES[q4]
    for name, dims, kind in tensors:
        if kind in ("embed", "matrix") and q4_0:  # float32 placeholder: the shape counts elements
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) // block * size, q4)
            continue
        dtype = np.float16 if kind in ("embed", "matrix") else np.float32
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, dims, kind) in enumerate(tensors):
        values = tensor_values(shape, name, dims, kind, rng)
        if kind in ("embed", "matrix") and q4_0:
            values = _quantized_q4_0(values)
        w.write_tensor_data(values)
        if progress is not None and name.endswith("ffn_norm.weight"):
            progress(f"layer {name.split('.')[1]} of {n_layers} written ({i + 1}/{len(tensors)} tensors)")
    w.close()


def _quantized_q4_0(values: np.ndarray) -> np.ndarray:
    """F16 values as Q4_0 rows (uint8 [..., row bytes]), a slab at a time (a 3-D expert stack is GBs)."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    rows = values.reshape(-1, values.shape[-1])
    out = []
    step = max(1, (1 << 22) // values.shape[-1])
    for a in range(0, rows.shape[0], step):
        out.append(gguf_quants.quantize(rows[a:a + step].astype(np.float32), GGMLQuantizationType.Q4_0))
    return np.concatenate(out).reshape(*values.shape[:-1], -1)
