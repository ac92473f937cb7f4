"""A fast GGUF reader: the header with plain struct reads, the tensors as memory-mapped numpy views.

gguf-py's ``GGUFReader`` builds a numpy view for every metadata item, which takes seconds for a
49k-token vocabulary (SmolLM2's: ~3 s here). Walking the header with struct takes milliseconds, so
checking a model's tensor types, or converting a small one, does not pay that. Tensor views follow
GGUFReader's conventions (numpy-order shapes; F32 / F16 as floats, other types as uint8 rows of
bytes). Little-endian GGUF v2/v3 only.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

# GGUFValueType -> struct format / numpy dtype of the scalar types
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_DTYPE = {k: np.dtype("<" + v if v != "?" else "?") for k, v in _SCALAR_FMT.items()}
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


@dataclass(frozen=True)
class MetaValue:
    """One metadata value as GGUFWriter.add_key_value takes it.

    ``value`` is a Python scalar, ``bytes`` for a string (kept raw so that any byte survives a copy),
    or a list of those for an array (``sub_type`` is then the element type).
    """

    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): the reverse of ggml's ne order
    type: GGMLQuantizationType
    offset: int  # from the start of the tensor data section

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.type]
        return self.n_elements // block * type_size


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, MetaValue]  # the wanted keys only, in file order
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # where the tensor data section starts in the file


def tensor_views(path: str | os.PathLike[str], header: GGUFHeader) -> dict[str, np.ndarray]:
    """Read-only memory-mapped views of every tensor of the file whose header is ``header``.

    F32 and F16 tensors come as float arrays of their shape; all other types as uint8
    ``[rows..., bytes per row]``, as GGUFReader gives them.
    """
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    views = {}
    for t in header.tensors:
        start = header.data_offset + t.offset
        if start + t.nbytes > mm.size:
            raise ValueError(f"{path}: tensor {t.name} runs past the end of the file (truncated?)")
        raw = mm[start : start + t.nbytes]
        if t.type == GGMLQuantizationType.F32:
            views[t.name] = raw.view(np.float32).reshape(t.shape)
        elif t.type == GGMLQuantizationType.F16:
            views[t.name] = raw.view(np.float16).reshape(t.shape)
        else:
            block, type_size = GGML_QUANT_SIZES[t.type]
            views[t.name] = raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)
    return views


def scan_gguf(path: str | os.PathLike[str], want: Callable[[str], bool] = lambda key: True) -> GGUFHeader:
    """Read the header of the GGUF file at ``path``, decoding the metadata keys for which ``want`` is true.

    Raises FileNotFoundError, or ValueError when the file is not a readable little-endian GGUF v2/v3.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such model file: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is not a readable GGUF file: it is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _Scanner(buf).header(want)
        except struct.error as exc:  # a read past the end: the file stops inside its header
            raise ValueError(f"{path} is not a readable GGUF file: its header is cut short (the file "
                             f"ends at {path.stat().st_size:,} bytes)") from exc
        except RetiredType as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


class RetiredType(ValueError):
    """A tensor type llama.cpp once wrote and no longer reads (gguf-py has no name for it either)."""


_RETIRED = {31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}


class _Scanner:
    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> bytes:
        (n,) = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def strings(self, n: int, keep: bool) -> list[bytes]:
        """``n`` consecutive strings (a vocabulary: the hot loop, hence the locals)."""
        buf, pos, size, unpack_from = self.buf, self.pos, len(self.buf), struct.unpack_from
        out = []
        for _ in range(n):
            (length,) = unpack_from("<Q", buf, pos)
            pos += 8 + length
            if keep:
                out.append(buf[pos - length : pos])
        if pos > size:
            raise ValueError("string array runs past the end of the file")
        self.pos = pos
        return out

    def header(self, want: Callable[[str], bool]) -> GGUFHeader:
        if bytes(self.buf[self.pos:self.pos + 4]) != b"GGUF":  # before the rest: a short text file is no GGUF
            raise ValueError("no GGUF magic")
        magic, version, n_tensors, n_kv = self.unpack("4sIQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (expected 2 or 3, little-endian)")
        metadata: dict[str, MetaValue] = {}
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self.string().decode("utf-8")
            (vtype,) = self.unpack("I")
            if key == "general.alignment":
                value = self.value(vtype)
                alignment = int(value.value)
                if vtype != GGUFValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
                    raise ValueError(f"bad general.alignment {value.value!r}")
                if want(key):
                    metadata[key] = value
            elif want(key):
                metadata[key] = self.value(vtype)
            else:
                self.skip(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = self.string().decode("utf-8")
            (n_dims,) = self.unpack("I")
            dims = self.unpack(f"{n_dims}Q")
            qtype, offset = self.unpack("IQ")
            if qtype in _RETIRED:
                raise RetiredType(f"tensor {name} is {_RETIRED[qtype]}, an ARM repacking llama.cpp no longer "
                                  f"reads either: use the model's plain Q4_0 (or IQ4_NL) file")
            info = TensorInfo(name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset)
            if dims and dims[0] % GGML_QUANT_SIZES[info.type][0]:
                raise ValueError(f"tensor {name}: rows of {dims[0]} are not whole {info.type.name} blocks")
            tensors.append(info)
        data_offset = -(-self.pos // alignment) * alignment
        return GGUFHeader(version, metadata, tensors, alignment, data_offset)

    def value(self, vtype: int) -> MetaValue:
        if vtype in _SCALAR_FMT:
            return MetaValue(self.unpack(_SCALAR_FMT[vtype])[0], GGUFValueType(vtype))
        if vtype == _STRING:
            return MetaValue(self.string(), GGUFValueType.STRING)
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        itype, n = self.unpack("IQ")
        if itype in _SCALAR_DTYPE:
            dtype = _SCALAR_DTYPE[itype]
            values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
            self.pos += n * dtype.itemsize
        elif itype == _STRING:
            values = self.strings(n, keep=True)
        else:
            raise ValueError(f"metadata arrays of type {itype} are not supported")
        return MetaValue(values, GGUFValueType.ARRAY, GGUFValueType(itype))

    def skip(self, vtype: int) -> None:
        if vtype in _SCALAR_DTYPE:
            self.pos += _SCALAR_DTYPE[vtype].itemsize
        elif vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            itype, n = self.unpack("IQ")
            if itype in _SCALAR_DTYPE:
                self.pos += n * _SCALAR_DTYPE[itype].itemsize
            elif itype == _STRING:
                self.strings(n, keep=False)
            else:
                for _ in range(n):
                    self.skip(itype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")
