"""RoPE (rotary position embedding), llama.cpp's way: ggml's CPU rope (``rope_yarn`` over the cache
``ggml_rope_cache_init`` builds for each token).

The angle of pair i at position p is built in float32 as ggml does: ``theta = p`` times
``theta_scale = powf(base, -2 / n_rot)`` once per pair (a running product, so far positions carry
ggml's float32 angle drift), divided by the pair's frequency factor (Llama 3's ``rope_freqs``; 1
without), times ``freq_scale``.  With YaRN (``ext_factor`` != 0) that interpolated angle is mixed
with the extrapolated one by a ramp between the correction dimensions, and cos/sin are scaled by
``mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale))``; without it by ``attn_factor``.  A factor
of exactly 1 changes no bit, so plain RoPE is the same code.

``rope_params`` turns the model's numbers into the tuple the kernels take; ``rope_ref`` models the
float32 recipe in numpy, ``rope_ref64`` is the exact rotation in float64 (the truth oracle's).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit, prange
from weaved.kernels._rowwise import OPTS, PAR_MIN_ROPE, check_f32
from weaved.kernels.threads import on_kernel_thread


@njit(**OPTS)
def cos_sin_row(pos, n_rot, theta_scale, freq_scale, ff, ext, corr0, corr1, mscale, cache):
    """cache float32 [n_rot] <- (cos, sin) of every pair's angle at position ``pos`` (ggml's
    ``ggml_rope_cache_init`` + ``rope_yarn``)."""
    theta = np.float32(pos)
    one = np.float32(1.0)
    for i in range(n_rot // 2):
        t_ext = theta / ff[i]
        t = freq_scale * t_ext
        if ext != 0:
            y = (np.float32(i) - corr0) / max(np.float32(0.001), corr1 - corr0)
            mix = (one - min(one, max(np.float32(0.0), y))) * ext
            t = t * (one - mix) + t_ext * mix
        cache[2 * i] = np.cos(t) * mscale
        cache[2 * i + 1] = np.sin(t) * mscale
        theta = theta * theta_scale  # the angle of pair i is built by repeated float32 products


@njit(**OPTS)
def _rotate(x, n_rot, neox, cache):
    """Rotate every head of one token in place (x float32 [H, Dh]) by the (cos, sin) in cache."""
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
def _rope_serial(x, positions, n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale):
    cache = np.empty(n_rot, np.float32)
    for t in range(x.shape[0]):
        cos_sin_row(positions[t], n_rot, theta_scale, freq_scale, ff, ext, corr0, corr1, mscale, cache)
        _rotate(x[t], n_rot, neox, cache)


@njit(parallel=True, **OPTS)
def _rope_parallel(x, positions, n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale):
    for t in prange(x.shape[0]):
        cache = np.empty(n_rot, np.float32)
        cos_sin_row(positions[t], n_rot, theta_scale, freq_scale, ff, ext, corr0, corr1, mscale, cache)
        _rotate(x[t], n_rot, neox, cache)


@njit(**OPTS)
def rope_drive(x, positions, p):
    """The serial or the parallel driver, by size (the same bits either way); p: ``rope_params``."""
    n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale = p
    if x.size >= PAR_MIN_ROPE:
        _rope_parallel(x, positions, n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale)
    else:
        _rope_serial(x, positions, n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale)


@njit(**OPTS)
def _cos_sin_rows(positions, p, cos, sin):
    n_rot, theta_scale, freq_scale, _neox, ff, ext, corr0, corr1, mscale = p
    cache = np.empty(n_rot, np.float32)
    for t in range(positions.shape[0]):
        cos_sin_row(positions[t], n_rot, theta_scale, freq_scale, ff, ext, corr0, corr1, mscale, cache)
        for i in range(n_rot // 2):
            cos[t, i] = cache[2 * i]
            sin[t, i] = cache[2 * i + 1]


def _corr_dim(n_rot: int, orig_ctx: int, beta: float, base: float) -> np.float32:
    """ggml's ``ggml_rope_yarn_corr_dim``, in float32."""
    f32 = np.float32
    two_pi = f32(2) * f32(math.pi)
    return f32(n_rot) * np.log(f32(orig_ctx) / (f32(beta) * two_pi)) / (f32(2) * np.log(f32(base)))


@functools.lru_cache(maxsize=64)  # the same few argument sets every layer of every step
def rope_params(n_rot: int, head_dim: int, base: float, freq_scale: float, style: str,
                freq_factors: tuple[float, ...] | None = None, ext_factor: float = 0.0, attn_factor: float = 1.0,
                orig_ctx: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple:
    """The kernels' rope tuple: (n_rot, theta_scale, freq_scale, neox, freq factors float32
    [n_rot/2], ext_factor, corr0, corr1, mscale), float32 numbers as ggml computes them."""
    if style not in ("norm", "neox"):
        raise ValueError(f"rope style must be 'norm' or 'neox', got {style!r}")
    if not (isinstance(n_rot, int | np.integer) and 0 < n_rot <= head_dim and n_rot % 2 == 0):
        raise ValueError(f"n_rot must be an even int in 1..{head_dim}, got {n_rot!r}")
    if not (base > 0 and freq_scale > 0 and attn_factor > 0):
        raise ValueError(f"rope base, freq_scale and attn_factor must be positive, got {base}, {freq_scale}, "
                         f"{attn_factor}")
    f32 = np.float32
    ff = np.ones(n_rot // 2, np.float32)
    if freq_factors is not None:
        if len(freq_factors) < n_rot // 2 or min(freq_factors[: n_rot // 2]) <= 0:
            raise ValueError(f"rope needs {n_rot // 2} positive frequency factors, got {len(freq_factors)}")
        ff[:] = np.asarray(freq_factors[: n_rot // 2], np.float32)
    # ggml: theta_scale = powf(freq_base, -2.0f / n_dims), all float32
    theta_scale = np.power(f32(base), f32(-2.0) / f32(n_rot))
    fs, mscale = f32(freq_scale), f32(attn_factor)
    corr0 = corr1 = f32(0.0)
    if ext_factor:
        if orig_ctx < 1:
            raise ValueError("YaRN rope needs the original context length")
        lo = math.floor(_corr_dim(n_rot, orig_ctx, beta_fast, base))
        hi = math.ceil(_corr_dim(n_rot, orig_ctx, beta_slow, base))
        corr0, corr1 = f32(max(0, lo)), f32(min(n_rot - 1, hi))
        mscale = f32(mscale * (f32(1.0) + f32(0.1) * np.log(f32(1.0) / fs)))
    return (int(n_rot), f32(theta_scale), fs, style == "neox", ff, f32(ext_factor), corr0, corr1, mscale)


def plain_rope(n_rot: int, head_dim: int, base: float, scale: float, style: str) -> tuple:
    """``rope_params`` of plain RoPE with linear scaling ``scale`` (positions divided by it)."""
    return rope_params(n_rot, head_dim, base, float(np.float32(1.0) / np.float32(scale)), style)


def _check_positions(x: np.ndarray, p) -> None:
    if not isinstance(p, np.ndarray) or p.dtype != np.int64 or p.shape != x.shape[:1]:
        desc = f"{p.dtype} {p.shape}" if isinstance(p, np.ndarray) else type(p).__name__
        raise ValueError(f"positions must be int64 [{x.shape[0]}], got {desc}")


@on_kernel_thread
def rope(x: np.ndarray, positions: np.ndarray, params: tuple) -> np.ndarray:
    """Rotary embedding in place.  x float32 [T, H, Dh]; positions int64 [T]; params: ``rope_params``
    (or ``plain_rope``).  style "norm": pairs (x[2i], x[2i+1]) (llama); "neox": pairs (x[i],
    x[i + n_rot/2]) (qwen2/3, gemma3)."""
    check_f32("x", x, 3)
    _check_positions(x, positions)
    if params[0] > x.shape[2]:
        raise ValueError(f"n_rot {params[0]} exceeds the head size {x.shape[2]}")
    rope_drive(x, positions, params)
    return x


def rope_cos_sin(positions: np.ndarray, params: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The (cos, sin) the kernels rotate by, float32 [T, n_rot/2] each (the torch backend's table)."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    half = params[0] // 2
    cos, sin = np.empty((len(positions), half), np.float32), np.empty((len(positions), half), np.float32)
    _cos_sin_rows(positions, params, cos, sin)
    return cos, sin


def _pair_index(n_rot: int, neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the first and second member of every rotated pair."""
    half = n_rot // 2
    if neox:
        return np.arange(half), np.arange(half) + half
    return np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)


def rope_ref(x: np.ndarray, positions: np.ndarray, params: tuple) -> np.ndarray:
    """numpy model of the float32 recipe (angles by repeated float32 products, cos/sin rounded to
    float32); returns a new float32 array.  Matches ``rope`` to about 1 ulp of the rotated values."""
    n_rot, theta_scale, freq_scale, neox, ff, ext, corr0, corr1, mscale = params
    half = n_rot // 2
    theta = positions.astype(np.float32)  # [T]
    angles = np.empty((x.shape[0], half), np.float32)
    for i in range(half):
        t_ext = theta / ff[i]
        t = freq_scale * t_ext
        if ext:
            y = (np.float32(i) - corr0) / max(np.float32(0.001), corr1 - corr0)
            mix = (np.float32(1) - min(np.float32(1), max(np.float32(0), y))) * ext
            t = t * (np.float32(1) - mix) + t_ext * mix
        angles[:, i] = t
        theta = theta * theta_scale
    c = (np.cos(angles.astype(np.float64)).astype(np.float32) * mscale)[:, None, :]  # [T, 1, half]
    s = (np.sin(angles.astype(np.float64)).astype(np.float32) * mscale)[:, None, :]
    y = x.copy()
    i0, i1 = _pair_index(n_rot, neox)
    x0, x1 = x[:, :, i0], x[:, :, i1]
    y[:, :, i0] = x0 * c - x1 * s
    y[:, :, i1] = x0 * s + x1 * c
    return y


def rope_angles64(positions: np.ndarray, n_rot: int, base: float, freq_scale: float = 1.0,
                  freq_factors=None, ext_factor: float = 0.0, corr: tuple[float, float] = (0.0, 0.0)
                  ) -> np.ndarray:
    """Exact angles float64 [T, n_rot/2]: p * base**(-2i/n_rot) / ff_i, scaled by freq_scale and, with
    YaRN, mixed with the unscaled angle by the ramp between the correction dimensions ``corr``."""
    half = n_rot // 2
    inv_freq = float(base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)  # [half]
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors[:half], np.float64)
    ext = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    if not ext_factor:
        return ext * freq_scale
    y = (np.arange(half, dtype=np.float64) - corr[0]) / max(0.001, corr[1] - corr[0])
    mix = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
    return ext * freq_scale * (1.0 - mix) + ext * mix


def rope_ref64(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, style: str, *,
               freq_scale: float = 1.0, freq_factors=None, ext_factor: float = 0.0,
               corr: tuple[float, float] = (0.0, 0.0), mscale: float = 1.0) -> np.ndarray:
    """Exact-math RoPE in float64 (the truth oracle's): returns a new float64 array."""
    angles = rope_angles64(positions, n_rot, base, freq_scale, freq_factors, ext_factor, corr)
    return rotate64(x, angles, n_rot, style == "neox", mscale)


def rotate64(x: np.ndarray, angles: np.ndarray, n_rot: int, neox: bool, mscale: float = 1.0) -> np.ndarray:
    """x [T, H, Dh] rotated by float64 ``angles`` [T, n_rot/2] (cos/sin scaled by ``mscale``): a new
    float64 array."""
    c, s = (np.cos(angles) * mscale)[:, None, :], (np.sin(angles) * mscale)[:, None, :]
    y = x.astype(np.float64)
    i0, i1 = _pair_index(n_rot, neox)
    x0, x1 = y[:, :, i0].copy(), y[:, :, i1].copy()
    y[:, :, i0] = x0 * c - x1 * s
    y[:, :, i1] = x0 * s + x1 * c
    return y
