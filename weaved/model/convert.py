"""Conversion of any GGUF model into Weave's shared weight format.

The shared format is a normal GGUF file in which
  * every 2-D weight matrix is Q4_0 (blocks of 32 weights: an fp16 scale and 16 bytes of nibbles),
  * except the token embedding and the output matrix (``token_embd.weight``, ``output.weight``), which
    stay Q4_0 when the source has them Q4_0 and become Q8_0 otherwise (llama.cpp's own Q4_0
    quantization keeps them at higher precision too: they feed every token's logits);
  * 1-D tensors (norms, biases) and a mixture of experts' router (``ffn_gate_inp``) are F32;
  * a mixture of experts' stacked expert matrices (``ffn_{gate,up,down}_exps``, 3-D) are Q4_0 like
    any matrix, row by row.
Every metadata key is copied as it is, except ``general.file_type`` (set to MOSTLY_Q4_0;
``general.quantization_version`` is added if the source has none). The CPU and GPU backends compute
on the same bytes, and llama.cpp loads the file as well, which is how we check it: the tensors come
out byte-identical to llama.cpp's own Q4_0 quantization of the same source.

The source is read memory-mapped (``gguf_scan``; gguf-py's reader takes seconds to parse a large
vocabulary) and converted one tensor at a time, in slabs of rows, so memory use stays near the size
of the largest converted tensor, not the model's. Quantization is gguf-py's (``gguf.quants``), which
is bit-exact with ggml's reference quantizers.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

from weaved.model.architectures import ARCHS
from weaved.model.gguf_scan import GGUFHeader, scan_gguf, tensor_views

Q = GGMLQuantizationType

SUPPORTED_ARCHS = tuple(ARCHS)
NATIVE_TYPES = frozenset({Q.F32, Q.F16, Q.Q4_0, Q.Q8_0})
# Matrices that may stay at 8 bits: the embedding lookup and the logits projection.
EMBEDDING_TENSORS = ("token_embd.weight", "output.weight")
# A mixture of experts' router stays F32, as llama.cpp's quantizer keeps it: it picks which experts run
ROUTER_SUFFIX = "ffn_gate_inp.weight"
EXPERTS_SUFFIX = "_exps.weight"  # [n_experts, rows, cols]: each expert's rows quantized like a matrix
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts of Q4_0 / Q8_0 written here

# Rows are dequantized and requantized in slabs of about this many weights, which bounds the float32
# temporaries (~16 MiB) whatever the size of the tensor.
_SLAB_ELEMENTS = 1 << 22

ProgressFn = Callable[[int, int, str], None]


@dataclass
class ConversionStats:
    """What a conversion changed: the tensors requantized (by source type), and per target type the
    relative RMS error requantizing added to their weights, ||W_new - W_source|| / ||W_source||."""

    requantized: dict[str, int] = field(default_factory=dict)  # source type name -> tensors
    sums: dict[str, list[float]] = field(default_factory=dict)  # target type name -> [err^2, ref^2]

    def add(self, dst: str, err_sq: float, ref_sq: float) -> None:
        acc = self.sums.setdefault(dst, [0.0, 0.0])
        acc[0] += err_sq
        acc[1] += ref_sq

    def relative_error(self, dst: str = "Q4_0") -> float:
        err, ref = self.sums.get(dst, (0.0, 0.0))
        return (err / ref) ** 0.5 if ref else 0.0

    def describe(self) -> str:
        if not self.requantized:
            return "no tensor was requantized"
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.requantized.items()))
        errors = ", ".join(f"{self.relative_error(d):.1%} to the {d} ones" for d in sorted(self.sums))
        return (f"requantized {kinds} tensor(s) to the shared format, adding relative weight error {errors}: "
                f"expect lower quality than the source file, most for small models (Gemma 3 270M's Q4_K_M "
                f"file: perplexity about half as high again; the cost of one format for every backend, see "
                f"docs/benchmarks.md)")


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor: its element shape in numpy order and its source and target types."""

    name: str
    shape: tuple[int, ...]  # numpy order (rows first): reversed ggml order
    src_type: GGMLQuantizationType
    dst_type: GGMLQuantizationType

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def dst_nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.dst_type]
        return self.n_elements // block * type_size


def target_type(name: str, src_type: GGMLQuantizationType, n_dims: int) -> GGMLQuantizationType:
    """The shared format's type for a tensor of ``n_dims`` dimensions stored as ``src_type``."""
    if n_dims == 1 or name.endswith(ROUTER_SUFFIX):
        return Q.F32
    if name in EMBEDDING_TENSORS and src_type != Q.Q4_0:
        return Q.Q8_0
    return Q.Q4_0


def needs_conversion(path: str | os.PathLike[str]) -> bool:
    """True when some tensor of the GGUF at ``path`` has a type the engine does not run natively."""
    return any(t not in NATIVE_TYPES for t in tensor_types(path).values())


def tensor_types(path: str | os.PathLike[str]) -> dict[str, GGMLQuantizationType]:
    """The type of every tensor of a GGUF file, read from its header only (milliseconds)."""
    return {t.name: t.type for t in scan_gguf(path, want=lambda key: False).tensors}


def plan_conversion(header: GGUFHeader, views: dict[str, np.ndarray]) -> list[TensorPlan]:
    """Check that the model can be converted and say what happens to each tensor.

    Raises ValueError naming the unsupported architecture, tensor shape or tensor type.
    """
    arch = _arch(header)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r}: Weave runs {', '.join(SUPPORTED_ARCHS)}")
    plans = []
    for t in header.tensors:
        if len(t.shape) > 2 and not (len(t.shape) == 3 and t.name.endswith(EXPERTS_SUFFIX)):
            raise ValueError(f"tensor {t.name} has {len(t.shape)} dimensions; only 1-D and 2-D tensors and "
                             f"3-D expert stacks (*{EXPERTS_SUFFIX}) convert")
        dst = target_type(t.name, t.type, len(t.shape))
        block = GGML_QUANT_SIZES[dst][0]
        if t.shape[-1] % block:
            raise ValueError(f"tensor {t.name}: rows of {t.shape[-1]} weights do not split into {dst.name} "
                             f"blocks of {block}")
        if t.type != dst:
            _check_dequantizable(t.name, t.type, views[t.name])
        plans.append(TensorPlan(t.name, t.shape, t.type, dst))
    return plans


def convert_gguf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    stats: ConversionStats | None = None,
) -> Path:
    """Write the shared-format (Q4_0) version of the GGUF ``src`` to ``dst`` and return ``dst``.

    Everything is checked before anything is written. The file is written next to ``dst`` under a
    temporary name and renamed into place when complete, so ``dst`` is never a partial file.
    ``progress(done, total, name)`` is called after each tensor is written; ``stats`` (if given) is
    filled with what the conversion requantized and the weight error it added.

    Raises FileNotFoundError (no ``src``), FileExistsError (``dst`` exists and not ``force``),
    ValueError (not a GGUF file, unsupported architecture or tensor type, ``src`` is ``dst``).
    """
    src_path, dst_path = Path(src), Path(dst)
    if not src_path.is_file():
        raise FileNotFoundError(f"no such model file: {src_path}")
    if dst_path.exists():
        if not force:
            raise FileExistsError(f"{dst_path} already exists (use force / --force to overwrite it)")
        if dst_path.resolve() == src_path.resolve():
            raise ValueError(f"cannot convert {src_path} onto itself: choose another output path")
    header = scan_gguf(src_path)
    views = tensor_views(src_path, header)
    plans = plan_conversion(header, views)

    dst_path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(dst_path)
    # A fresh hidden name beside dst (same file system, so the final rename is atomic); created by the
    # writer with the usual permissions, unlike mkstemp's 0600.
    tmp = dst_path.with_name(f".{dst_path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        _write(header, views, plans, tmp, progress, stats if stats is not None else ConversionStats())
        _publish(tmp, dst_path, force)
    finally:
        tmp.unlink(missing_ok=True)
    return dst_path


def _sweep_stale(dst_path: Path) -> None:
    """Remove the temporary files of conversions to ``dst_path`` whose process is gone (killed part-way:
    a signal skips the cleanup; a 30B model's would be ~17 GB)."""
    for tmp in dst_path.parent.glob(f".{dst_path.name}.*.tmp"):
        pid = tmp.name[len(dst_path.name) + 2:].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _arch(header: GGUFHeader) -> str:
    value = header.metadata.get("general.architecture")
    if value is None or value.vtype != GGUFValueType.STRING:
        raise ValueError("the model has no general.architecture metadata")
    return value.value.decode("utf-8", errors="replace")


def _check_dequantizable(name: str, qtype: GGMLQuantizationType, data: np.ndarray) -> None:
    first_row = data.reshape(-1, data.shape[-1])[:1]
    try:
        gguf_quants.dequantize(first_row, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {name} has type {qtype.name}, which the converter cannot read") from exc


# ----------------------------------------------------------------------------------------------------
# writing


class _Writer(GGUFWriter):
    """GGUFWriter that can also write empty metadata arrays (valid GGUF, which gguf-py refuses)."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if vtype == GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _write(header: GGUFHeader, views: dict[str, np.ndarray], plans: Sequence[TensorPlan], path: Path,
           progress: ProgressFn | None, stats: ConversionStats) -> None:
    writer = _Writer(path, _arch(header))  # it writes general.architecture first
    writer.data_alignment = header.alignment
    for key, item in header.metadata.items():
        if key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, int(LlamaFileType.MOSTLY_Q4_0))
        else:
            writer.add_key_value(key, item.value, item.vtype, item.sub_type)
    if "general.file_type" not in header.metadata:
        writer.add_uint32("general.file_type", int(LlamaFileType.MOSTLY_Q4_0))
    if "general.quantization_version" not in header.metadata:
        writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)

    for plan in plans:
        # float32 placeholder dtype: with a raw_dtype the writer records the shape as element counts
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.dst_nbytes, plan.dst_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for i, plan in enumerate(plans):
            out = _convert_tensor(plan, views[plan.name], stats)
            assert out.nbytes == plan.dst_nbytes, plan
            writer.write_tensor_data(out)
            if progress is not None:
                progress(i + 1, len(plans), plan.name)
        assert writer.fout is not None
        for f in writer.fout:
            f.flush()
            os.fsync(f.fileno())
    finally:
        writer.close()


def _convert_tensor(plan: TensorPlan, data: np.ndarray, stats: ConversionStats) -> np.ndarray:
    """The tensor's bytes in the target type (uint8 rows for quantized types, float32 otherwise); a
    requantized tensor's error goes to ``stats``."""
    if plan.src_type == plan.dst_type:
        return np.ascontiguousarray(data)
    if plan.dst_type == Q.F32:
        return gguf_quants.dequantize(data, plan.src_type).astype(np.float32).reshape(plan.shape)
    src_rows = data.reshape(-1, data.shape[-1])  # [rows, bytes or weights per row]
    n_rows, n_cols = src_rows.shape[0], plan.shape[-1]
    block, type_size = GGML_QUANT_SIZES[plan.dst_type]
    out = np.empty((n_rows, n_cols // block * type_size), dtype=np.uint8)  # [rows, bytes per row]
    step = max(1, _SLAB_ELEMENTS // n_cols)
    for r0 in range(0, n_rows, step):
        slab = gguf_quants.dequantize(src_rows[r0 : r0 + step], plan.src_type)  # [step, n_cols] float32
        q = gguf_quants.quantize(slab, plan.dst_type)
        out[r0 : r0 + step] = q
        diff = (gguf_quants.dequantize(q, plan.dst_type) - slab).ravel().astype(np.float64)
        ref = slab.ravel().astype(np.float64)
        stats.add(plan.dst_type.name, float(diff @ diff), float(ref @ ref))
    stats.requantized[plan.src_type.name] = stats.requantized.get(plan.src_type.name, 0) + 1
    return out


def _publish(tmp: Path, dst: Path, force: bool) -> None:
    """Move the finished file into place atomically; without ``force`` never replace an existing file."""
    if force:
        os.replace(tmp, dst)
        return
    try:
        os.link(tmp, dst)  # atomic and fails if dst appeared meanwhile
    except FileExistsError:
        raise FileExistsError(f"{dst} already exists (use force / --force to overwrite it)") from None
    except OSError:  # a file system without hard links
        if dst.exists():
            raise FileExistsError(f"{dst} already exists (use force / --force to overwrite it)") from None
        os.replace(tmp, dst)
