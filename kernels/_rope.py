"""RoPE (rotary position embedding), llama.cpp's way: ggml's rope_f32 with ext_factor 0.

The angle of pair i is built in float32 as ggml does (``theta_scale = powf(base, -2 / n_rot)``,
``theta *= theta_scale`` per pair, times ``freq_scale = 1 / scale``), then cos/sin in float32; so
far positions carry ggml's float32 angle drift.  ``rope_ref`` models that recipe in numpy,
``rope_ref64`` is the exact rotation in float64 (the truth oracle's).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange
from weaved.kernels._rowwise import OPTS, PAR_MIN_ROPE, check_f32


@njit(**OPTS)
def _rope_row(x, pos, n_rot, theta_scale, freq_scale, neox, cache):
    """Rotate every head of one token in place (x float32 [H, Dh]); ggml's rope_f32 with
    ext_factor 0, no frequency factors, attn_factor 1.  cache: float32 scratch [n_rot]."""
    theta = np.float32(pos)
    for i in range(n_rot // 2):
        t = freq_scale * theta
        cache[2 * i] = np.cos(t)
        cache[2 * i + 1] = np.sin(t)
        theta = theta * theta_scale  # the angle of pair i is built by repeated float32 products
    half = n_rot // 2
    for h in range(x.shape[0]):
        for i in range(half):
            c = cache[2 * i]
            s = cache[2 * i + 1]
            if neox:
                i0 = i
                i1 = i + half
            else:
                i0 = 2 * i
                i1 = 2 * i + 1
            x0 = x[h, i0]
            x1 = x[h, i1]
            x[h, i0] = x0 * c - x1 * s
            x[h, i1] = x0 * s + x1 * c


@njit(**OPTS)
def _rope_serial(x, positions, n_rot, theta_scale, freq_scale, neox):
    cache = np.empty(n_rot, np.float32)
    for t in range(x.shape[0]):
        _rope_row(x[t], positions[t], n_rot, theta_scale, freq_scale, neox, cache)


@njit(parallel=True, **OPTS)
def _rope_parallel(x, positions, n_rot, theta_scale, freq_scale, neox):
    for t in prange(x.shape[0]):
        cache = np.empty(n_rot, np.float32)
        _rope_row(x[t], positions[t], n_rot, theta_scale, freq_scale, neox, cache)


@njit(**OPTS)
def rope_drive(x, positions, n_rot, theta_scale, freq_scale, neox):
    """The serial or the parallel driver, by size (the same bits either way)."""
    if x.size >= PAR_MIN_ROPE:
        _rope_parallel(x, positions, n_rot, theta_scale, freq_scale, neox)
    else:
        _rope_serial(x, positions, n_rot, theta_scale, freq_scale, neox)


@functools.lru_cache(maxsize=64)  # the same few argument sets every layer of every step
def rope_params(n_rot: int, head_dim: int, base: float, scale: float, style: str) -> tuple:
    if style not in ("norm", "neox"):
        raise ValueError(f"rope style must be 'norm' or 'neox', got {style!r}")
    if not (isinstance(n_rot, int | np.integer) and 0 < n_rot <= head_dim and n_rot % 2 == 0):
        raise ValueError(f"n_rot must be an even int in 1..{head_dim}, got {n_rot!r}")
    if not (base > 0 and scale > 0):
        raise ValueError(f"rope base and scale must be positive, got {base}, {scale}")
    # ggml: theta_scale = powf(freq_base, -2.0f / n_dims), freq_scale = 1 / scale, all float32
    theta_scale = np.power(np.float32(base), np.float32(-2.0) / np.float32(n_rot))
    return int(n_rot), np.float32(theta_scale), np.float32(1.0 / scale), style == "neox"


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, scale: float, style: str
         ) -> np.ndarray:
    """Rotary embedding in place.  x float32 [T, H, Dh]; positions int64 [T]; the first ``n_rot``
    dims of every head rotate by theta_i = (pos / scale) * base**(-2i / n_rot).  style "norm":
    pairs (x[2i], x[2i+1]) (llama); "neox": pairs (x[i], x[i + n_rot/2]) (qwen2/3)."""
    check_f32("x", x, 3)
    p = positions
    if not isinstance(p, np.ndarray) or p.dtype != np.int64 or p.shape != x.shape[:1]:
        desc = f"{p.dtype} {p.shape}" if isinstance(p, np.ndarray) else type(p).__name__
        raise ValueError(f"positions must be int64 [{x.shape[0]}], got {desc}")
    params = rope_params(n_rot, x.shape[2], base, scale, style)
    rope_drive(x, positions, *params)
    return x


def _pair_index(n_rot: int, neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the first and second member of every rotated pair."""
    half = n_rot // 2
    if neox:
        return np.arange(half), np.arange(half) + half
    return np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)


def rope_ref(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, scale: float, style: str
             ) -> np.ndarray:
    """numpy model of the float32 recipe (angles by repeated float32 products, cos/sin rounded to
    float32); returns a new float32 array.  Matches ``rope`` to about 1 ulp of the rotated values."""
    n_rot, theta_scale, freq_scale, neox = rope_params(n_rot, x.shape[2], base, scale, style)
    half = n_rot // 2
    theta = positions.astype(np.float32)  # [T]
    angles = np.empty((x.shape[0], half), np.float32)
    for i in range(half):
        angles[:, i] = freq_scale * theta
        theta = theta * theta_scale
    c = np.cos(angles.astype(np.float64)).astype(np.float32)[:, None, :]  # [T, 1, half]
    s = np.sin(angles.astype(np.float64)).astype(np.float32)[:, None, :]
    y = x.copy()
    i0, i1 = _pair_index(n_rot, neox)
    x0, x1 = x[:, :, i0], x[:, :, i1]
    y[:, :, i0] = x0 * c - x1 * s
    y[:, :, i1] = x0 * s + x1 * c
    return y


def rope_ref64(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, scale: float, style: str
               ) -> np.ndarray:
    """Exact-math RoPE in float64 (the truth oracle's): returns a new float64 array."""
    n_rot, _, _, neox = rope_params(n_rot, x.shape[2], base, scale, style)
    half = n_rot // 2
    inv_freq = float(base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # [half]
    angles = (positions.astype(np.float64) / float(scale))[:, None] * inv_freq[None, :]  # [T, half]
    c, s = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    y = x.astype(np.float64)
    i0, i1 = _pair_index(n_rot, neox)
    x0, x1 = y[:, :, i0].copy(), y[:, :, i1].copy()
    y[:, :, i0] = x0 * c - x1 * s
    y[:, :, i1] = x0 * s + x1 * c
    return y
