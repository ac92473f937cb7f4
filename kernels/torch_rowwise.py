"""Row-wise kernels of the torch backend: fixed-order sums, exp, RMSNorm, RoPE, SwiGLU, GeGLU.

Batch invariance in torch needs care, because torch picks code paths by tensor size: an elementwise
op runs its vector loop over most elements and a scalar loop over the tail of each thread's range,
and ``exp``/``sin``/``log`` give different bits in the two (Sleef vs libm); ``sqrt`` may go to MKL's
vector math, which is not correctly rounded; a reduction may split or reorder its work by the
shape.  So everything here is built from ops whose result is one IEEE rounding per element whatever
the path - add, sub, mul, division by a *tensor*, floor, round, min/max, comparisons, casts - and
sums are explicit sequences or trees of adds (``tree_sum``), never torch's float reductions.  (Not
``scalar / tensor``: torch computes it as ``reciprocal(tensor) * scalar``, two roundings; nor a
division by a Python scalar, which CUDA turns into a multiplication by its reciprocal.)

The recipes are the CPU kernels' (``elementwise``, ``_rope``, ``_rowwise.exp_f32``), op for op
where torch allows it: the results are the CPU kernels' bits (RMSNorm: unless the float64 sum of
squares, added in another order, rounds differently - the squares of float32 values usually sum
exactly in float64, and a difference then still has to cross a float32 rounding boundary).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# exp_f32's constants (kernels/_rowwise.py), as float32 values
_F = lambda v: float(np.float32(v))  # noqa: E731
_LOG2E = _F(1.44269504088896341)
_LN2_HI, _LN2_LO = _F(0.693359375), _F(-2.12194440e-4)
_EXP_LO, _EXP_HI = _F(-87.33654), _F(88.37626)
_P = [_F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3), _F(4.1665795894e-2),
      _F(1.6666665459e-1), _F(5.0000001201e-1)]


def check_tensor(name: str, t, dtype: torch.dtype, ndim: int | None = None) -> None:
    """A clear ValueError unless ``t`` is a torch tensor of ``dtype`` (and ``ndim`` dims)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or (ndim is not None and t.ndim != ndim):
        desc = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        dims = f" with {ndim} dims" if ndim is not None else ""
        raise ValueError(f"{name} must be a {dtype} tensor{dims}, got {desc}")


def div_scalar(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c with one IEEE rounding per element (see the module docstring for why not ``x / c``)."""
    return torch.div(x, torch.full_like(x, c))


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by a fixed tree of adds: the length is (virtually) padded with -0.0 to the
    next power of two P and element i is added to element i + P/2, halving until one is left.

    Each output depends only on its own inputs and their count, never on the other dimensions.
    Padding with -0.0 changes nothing (x + -0.0 == x bitwise), so trailing zeros that fit the tree
    do not change the result either (up to the sign of a zero sum).  Over 16 lanes this is the
    CPU attention kernel's shuffle tree (lane i + lane i+8, then +4, +2, +1)."""
    dim = dim % x.ndim
    n = x.shape[dim]
    if n == 0:
        shape = list(x.shape)
        del shape[dim]
        return x.new_zeros(shape)
    while n > 1:
        half = 1 << ((n - 1).bit_length() - 1)  # P / 2 for P the next power of two >= n
        lo, hi = x.narrow(dim, 0, half), x.narrow(dim, half, n - half)
        if n == 2 * half:
            x = lo + hi
        else:  # the partners of lo's last 2*half - n entries are padding: they stay as they are
            x = lo.clone()
            x.narrow(dim, 0, n - half).add_(hi)
        n = half
    return x.squeeze(dim)


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """e**x of a float32 tensor: the CPU kernels' ``exp_f32`` op for op (a Cephes-style polynomial
    within 1 ulp; 0 below -87.34, inf above 88.38), so the same bits on every path and device."""
    check_tensor("x", x, torch.float32)
    xc = torch.clamp(x, _EXP_LO, _EXP_HI)
    n = torch.floor(xc * _LOG2E + 0.5)  # e**x = 2**n * e**r, |r| <= ln2 / 2
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    p = r * _P[0] + _P[1]
    for c in _P[2:]:
        p = p * r + c
    p = p * (r * r) + r + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2**n, n in [-126, 127]
    y = p * two_n
    y = torch.where(x < _EXP_LO, torch.zeros_like(y), y)
    return torch.where(x > _EXP_HI, torch.full_like(y, math.inf), y)


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root of x >= 0 (float32), as ``sqrtss`` computes it.

    torch.sqrt on the CPU may go through MKL's vector math, which is not correctly rounded (seen:
    1 ulp off).  So: the float64 root rounded to float32 (within an ulp), then moved by one ulp
    where x lies beyond the square of the midpoint to its neighbour - midpoints have 25 bits, so
    their squares and the comparisons are exact in float64."""
    check_tensor("x", x, torch.float32)
    x64 = x.to(torch.float64)
    y = torch.sqrt(x64).to(torch.float32)
    up, down = torch.nextafter(y, torch.full_like(y, math.inf)), torch.nextafter(y, torch.zeros_like(y))
    mid_up = (y.to(torch.float64) + up.to(torch.float64)) * 0.5
    mid_down = (y.to(torch.float64) + down.to(torch.float64)) * 0.5
    y = torch.where(x64 > mid_up * mid_up, up, y)
    return torch.where(x64 < mid_down * mid_down, down, y)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, ggml's way: float32 squares summed in float64 (a fixed tree), the
    mean rounded to float32, scale = 1 / sqrt(mean + eps), y = (x * scale) * w.
    x float32 [..., D], w float32 [D] -> float32 [..., D]."""
    check_tensor("x", x, torch.float32)
    check_tensor("w", w, torch.float32, 1)
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"weight length {w.shape[0]} != row length {x.shape[-1]}")
    s = tree_sum((x * x).to(torch.float64), -1)  # [...] float64: the squares are exact in it
    mean = div_scalar(s, float(x.shape[-1])).to(torch.float32)
    scale = torch.reciprocal(sqrt_f32(mean + _F(eps)))  # reciprocal: one IEEE division 1 / y
    return (x * scale.unsqueeze(-1)) * w


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up = gate / (1 + exp(-gate)) * up: float32 [T, 2F] (gate | up) -> [T, F]."""
    check_tensor("gate_up", gate_up, torch.float32, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up width must be even (gate and up halves), got {gate_up.shape[1]}")
    g, u = gate_up.chunk(2, dim=1)
    return g / (exp_f32(-g) + 1.0) * u


def gelu_table(device: torch.device | str) -> torch.Tensor:
    """The CPU kernel's GELU table (``_geglu.GELU_TABLE``, float32 [65536]) on ``device``, for ``geglu``."""
    from weaved.kernels._geglu import GELU_TABLE

    return torch.from_numpy(GELU_TABLE).to(device)


def geglu(gate_up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up as the CPU kernel (``_geglu``) computes it: 0 below -10, the gate above 10, else
    the float16-table value of the gate rounded to float16; ``table``: ``_geglu.GELU_TABLE`` on the
    device.  gate_up float32 [T, 2F] -> float32 [T, F]."""
    check_tensor("gate_up", gate_up, torch.float32, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up width must be even (gate and up halves), got {gate_up.shape[1]}")
    g, u = gate_up.chunk(2, dim=1)
    idx = g.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # round to nearest even
    a = table[idx]
    a = torch.where(g <= -10.0, torch.zeros_like(g), torch.where(g >= 10.0, g, a))
    return a * u


class RopeTable:
    """cos/sin of the rotary angles per position, on the device, grown in fixed blocks of positions.

    The values are the CPU kernel's own (``_rope.rope_cos_sin``: ggml's float32 angles with any
    frequency factors and YaRN mix, float32 cos/sin times the magnitude scale), so both backends
    rotate by the same bits.  A position's values never depend on when or with what it was first
    needed."""

    BLOCK = 256

    def __init__(self, params: tuple, device: torch.device | str):
        """``params``: ``_rope.rope_params`` of the rope this table serves."""
        self.params = params
        self.n_rot = int(params[0])
        self.device = torch.device(device)
        self.cos = torch.empty((0, self.n_rot // 2), dtype=torch.float32, device=self.device)  # [P, n_rot/2]
        self.sin = torch.empty_like(self.cos)

    def _blocks(self, b0: int, b1: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin float32 [(b1 - b0) * BLOCK, n_rot/2] of the positions of blocks b0..b1-1."""
        from weaved.kernels._rope import rope_cos_sin  # numba: imported when first needed

        return rope_cos_sin(np.arange(b0 * self.BLOCK, b1 * self.BLOCK, dtype=np.int64), self.params)

    def ensure(self, need: int) -> None:
        """Hold positions 0..need-1.  A growth at least doubles the table, so a long session's tables
        are copied O(log n) times - and a CUDA graph holding this table's memory (``torch_graphs``)
        is made again as seldom."""
        have = self.cos.shape[0] // self.BLOCK
        if need > have * self.BLOCK:
            c, s = self._blocks(have, max(-(-need // self.BLOCK), 2 * have))
            self.cos = torch.cat([self.cos, torch.from_numpy(c).to(self.device)])
            self.sin = torch.cat([self.sin, torch.from_numpy(s).to(self.device)])

    def lookup(self, positions: torch.Tensor, need: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] (on the device) -> cos, sin float32 [T, n_rot/2].  ``need``: one past the
        highest position, when the caller knows it (else the device is asked: a wait, and none may be
        made while a CUDA graph is captured)."""
        check_tensor("positions", positions, torch.int64, 1)
        if need is None:
            need = int(positions.max()) + 1 if positions.numel() else 0
        self.ensure(need)
        return self.cos[positions], self.sin[positions]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotary embedding of the first n_rot = 2 * cos.shape[1] dims of every head: x float32
    [T, H, Dh], cos/sin float32 [T, n_rot/2] -> a new tensor.  neox pairs (x[i], x[i + n_rot/2])
    (qwen2/3), else (x[2i], x[2i+1]) (llama); x0' = x0 c - x1 s, x1' = x0 s + x1 c."""
    check_tensor("x", x, torch.float32, 3)
    T, _, Dh = x.shape
    half = cos.shape[1]
    if cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > Dh:
        raise ValueError(f"cos/sin must be [{T}, n_rot/2] with n_rot <= {Dh}, got {tuple(cos.shape)}")
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    y = x.clone()
    if neox:
        x0, x1 = x[..., :half], x[..., half:2 * half]
        y[..., :half] = x0 * c - x1 * s
        y[..., half:2 * half] = x0 * s + x1 * c
    else:
        pairs = x[..., :2 * half].unflatten(-1, (half, 2))  # [T, H, half, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = y[..., :2 * half].unflatten(-1, (half, 2))  # a view of y
        out[..., 0] = x0 * c - x1 * s
        out[..., 1] = x0 * s + x1 * c
    return y
