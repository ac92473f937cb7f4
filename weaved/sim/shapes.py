"""Model shapes as the simulator sees them: a real model's sizes (``weaved.bench.shapes``) as a
``ModelConfig`` - what its steps cost and how much KV a position takes; no weights."""

from __future__ import annotations

from weaved.bench.shapes import SHAPES, ModelShape
from weaved.model.config import ModelConfig, RopeSpec, RopeStyle


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})")
    s: ModelShape = SHAPES[name]
    if s.experts is not None:  # a step's weight reads depend on the experts its tokens touch
        raise ValueError(f"{name} is a mixture of experts; the simulator's cost model covers dense models "
                         f"(known dense shapes: {', '.join(n for n, x in SHAPES.items() if x.experts is None)})")
    return ModelConfig(arch=s.arch, name=s.name, n_layers=s.n_layers, d_model=s.d_model, n_heads=s.n_heads,
                       n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, d_ff=s.d_ff, vocab_size=s.vocab,
                       context_length=s.context, rms_eps=s.rms_eps,
                       rope_style=RopeStyle.NORM if s.arch == "llama" else RopeStyle.NEOX,
                       rope=RopeSpec(base=s.rope_base), tied_output=s.tied)


def layout(shape: ModelConfig, vocab: int = 1024) -> ModelConfig:
    """The daemon's KV layout in a simulation: one layer with one 64-wide KV head (256 bytes a position)
    and the real context.  Every count the daemon keeps in positions - the KV cap, reservations,
    shared prefixes, a device's budget - holds as for the real shape, for a fraction of the disk; the
    cost model prices the real shape's bytes.  ``vocab``: the logits a simulated step returns."""
    return ModelConfig(arch="llama", name=f"{shape.name} (simulated)", n_layers=1, d_model=64, n_heads=1,
                       n_kv_heads=1, head_dim=64, d_ff=64, vocab_size=vocab, context_length=shape.context_length,
                       rms_eps=1e-6, rope_style=RopeStyle.NORM)
