"""GGML tensor types this package understands, and their block geometry.

The ids are ggml's own (the same numbers as ``gguf.GGMLQuantizationType``), so a GGUF tensor's
``tensor_type`` converts with ``GGMLType(int(t.tensor_type))``.
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q8_0 = 8


BLOCK_ELEMS = 32  # weights per quantization block (Q4_0 and Q8_0)
# bytes per block: an fp16 scale, then 16 bytes of nibbles (Q4_0) or 32 int8 (Q8_0)
BLOCK_BYTES = {GGMLType.Q4_0: 18, GGMLType.Q8_0: 34}
_ELEM_BYTES = {GGMLType.F32: 4, GGMLType.F16: 2}


def row_bytes(qtype: GGMLType | int, n_in: int) -> int:
    """Bytes of one row of ``n_in`` elements stored as ``qtype``.

    Raises ValueError for an unknown type, a negative length, or a quantized row whose length is
    not a multiple of 32."""
    qt = as_ggml_type(qtype)
    if n_in < 0:
        raise ValueError(f"row length must be >= 0, got {n_in}")
    if qt in BLOCK_BYTES:
        if n_in % BLOCK_ELEMS:
            raise ValueError(f"{qt.name} rows need a length that is a multiple of {BLOCK_ELEMS}, got {n_in}")
        return n_in // BLOCK_ELEMS * BLOCK_BYTES[qt]
    return n_in * _ELEM_BYTES[qt]


def as_ggml_type(qtype: GGMLType | int) -> GGMLType:
    """``qtype`` (a GGMLType, a gguf.GGMLQuantizationType or a plain int) as a GGMLType."""
    try:
        return GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise ValueError(f"unsupported GGML type {qtype!r} (supported: F32, F16, Q4_0, Q8_0)") from None
