"""Products with two-level Q8_0 activations: x = d1*q1 + d2*q2, the second level quantizing the
first one's rounding error.

Used for the output (logits) matrix: quantizing the final hidden state to Q8_0 is the largest
single source of error in the next-token distribution (measured on SmolLM2-135M: mean KL from a
float64 reference 0.0035 with one level, 0.0026 with float activations at this layer).  The second
level shrinks the activation error ~250x, so the result is as good as float activations, while the
work stays in the batch-invariant integer kernel: the two levels of a row are two columns of one
product (at decode the weights stream once for both), summed per row in a fixed order.
"""

from __future__ import annotations

import numpy as np

from .matmul import PackedWeight, linear_q
from .quants import QK, Q8Activations, quantize_activations


def quantize_two_level(x: np.ndarray) -> Q8Activations:
    """x float32 [T, K] -> Q8Activations of 2T rows: rows 0..T-1 the first level, T..2T-1 the
    second (the Q8_0 quantization of x minus the first level's dequantized value)."""
    T = x.shape[0]
    a = quantize_activations(x)
    x1 = (a.q.astype(np.float32) * a.d[:, :, None]).transpose(1, 0, 2).reshape(T, -1)  # [T, K]
    b = quantize_activations(np.ascontiguousarray(x - x1))
    return Q8Activations(np.concatenate([a.q, b.q], axis=1), np.concatenate([a.d, b.d], axis=1),
                         np.concatenate([a.s, b.s], axis=1))


def linear_residual(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    """x float32 [T, n_in] -> float32 [T, n_out] = x @ W.T with two-level activations (Q4_0 / Q8_0
    weights).  Row t depends only on row t of x: batch invariant."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.n_in \
            or x.shape[1] % QK or not x.flags.c_contiguous:
        raise ValueError(f"linear_residual: x must be a C-contiguous float32 [T, {w.n_in}] array, got "
                         f"{getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    T = x.shape[0]
    if T == 0:
        return np.empty((0, w.n_out), np.float32)
    y = linear_q(w, quantize_two_level(x))  # [2T, n_out]
    np.add(y[:T], y[T:], out=y[:T])  # in place: a fresh [T, vocab] array costs page faults per step
    return y[:T]
