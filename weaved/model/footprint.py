"""How much memory a model's weights take once the CPU pool holds them, read from the file's header
alone (milliseconds, whatever the file's size): quantized matrices as stored (repacked once: the same
bytes), float tensors widened to float32 (the kernels' float path: an F16 file takes twice its size),
and a type the engine does not run as the conversion would write it.  A model that does not fit in
RAM is refused with these numbers before anything is converted or loaded."""

from __future__ import annotations

import os

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from weaved.model.gguf_scan import scan_gguf

Q = GGMLQuantizationType
_FLOAT = (Q.F32, Q.F16, Q.BF16)


def weights_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the CPU pool's copy of the weights of the GGUF at ``path`` (after any conversion)."""
    from weaved.model.convert import NATIVE_TYPES, target_type

    tensors = scan_gguf(path, want=lambda key: False).tensors
    converted = any(t.type not in NATIVE_TYPES for t in tensors)  # then every tensor is written anew
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        typ = target_type(t.name, t.type, len(t.shape)) if converted else t.type
        if typ in _FLOAT and (t.name != "token_embd.weight" or tied):  # (an untied embedding is read in place)
            total += 4 * t.n_elements
        else:
            block, size = GGML_QUANT_SIZES[typ]
            total += t.n_elements // block * size
    return total


def too_large(path: str | os.PathLike[str]) -> str | None:
    """Why the model at ``path`` cannot be served on this host (its weights alone exceed the RAM), or
    None when they fit."""
    import psutil

    need, total = weights_bytes(path), psutil.virtual_memory().total
    if need <= total:
        return None
    name = os.path.basename(path)
    return (f"{name} needs about {need / 2**30:.1f} GiB of memory for its weights (as the CPU pool holds them: "
            f"quantized matrices as stored, F16/F32 ones widened to 32 bits), but this host has "
            f"{total / 2**30:.1f} GiB of RAM")
