"""Which kernels a torch device gets, and the products and row-wise operations the torch backend calls.

``kernel_path`` picks Triton on CUDA (``triton_q4``, ``triton_rowwise``) and plain torch ops elsewhere
(``torch_q4``, ``torch_rowwise``); ``Rowwise`` holds one path's RMSNorm, RoPE, SwiGLU, GeGLU and
activation quantization, and ``Products`` its Q4_0 / Q8_0 products: the layers' ``linear`` and the
logits' ``linear_residual`` (the second activation level on each row's candidate logits).  Both paths
have the same arithmetic, so the choice changes speed, not bits (on a GPU; Triton's interpreter differs
from a fused multiply-add by a rounding, in the products).
"""

from __future__ import annotations

import os

import torch
from weaved.kernels import torch_moe, torch_q4, torch_rowwise
from weaved.kernels.refine_rule import REFINE_MARGIN, REFINE_TOP
from weaved.kernels.torch_q4 import DeviceWeight, Q8Act, linear_float


def kernel_path(device: torch.device | str) -> str:
    """"triton" on CUDA when triton imports, else "torch".  ``WEAVE_TORCH_KERNELS=torch`` forces
    torch ops; ``=triton`` forces Triton (on a CPU device only with TRITON_INTERPRET=1, for tests)."""
    env = os.environ.get("WEAVE_TORCH_KERNELS", "").strip().lower()
    if env not in ("", "auto", "torch", "triton"):
        raise ValueError(f"WEAVE_TORCH_KERNELS must be 'auto', 'torch' or 'triton', got {env!r}")
    if env == "torch":
        return "torch"
    cuda = torch.device(device).type == "cuda"
    if env == "triton":
        if not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("WEAVE_TORCH_KERNELS=triton needs a CUDA device (or TRITON_INTERPRET=1)")
        return "triton"
    if not cuda:
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def _check_path(path: str) -> None:
    if path not in ("torch", "triton"):
        raise ValueError(f"kernel path must be 'torch' or 'triton', got {path!r}")


class Rowwise:
    """The row-wise operations of one kernel path, each with ``torch_rowwise``'s (or ``torch_q4``'s, for
    the quantizations, ``torch_moe``'s for a mixture of experts' router) signature and bits: ``rmsnorm``,
    ``rope``, ``swiglu``, ``geglu``, ``quantize_act``, ``quantize_two_level``, ``route``; and three that
    run operations following one another in every layer, one launch each on the Triton path
    (``triton_fused``): ``add_norm_quant``, ``glu_quant``, ``rope_qkv``."""

    def __init__(self, path: str):
        _check_path(path)
        self.path = path
        if path == "triton":
            from weaved.kernels import triton_router
            from weaved.kernels import triton_rowwise as rw

            ops, quant, router = rw, rw, triton_router
        else:
            ops, quant, router = torch_rowwise, torch_q4, torch_moe
        self.rmsnorm, self.rope, self.swiglu, self.geglu = ops.rmsnorm, ops.rope, ops.swiglu, ops.geglu
        self.quantize_act, self.quantize_two_level = quant.quantize_act, quant.quantize_two_level
        self.route = router.route
        self._fused = None
        if path == "triton":
            from weaved.kernels import triton_fused

            self._fused = triton_fused

    def add_norm_quant(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, Q8Act]:
        """(x + y, h = rmsnorm(x + y, w), h's Q8_0): the residual add, the next norm and what the
        projections after it read; one launch on the Triton path, the same bits as the three ops."""
        if self._fused is not None and x.shape[-1] % 32 == 0:
            return self._fused.add_norm_quant(x, y, w, eps)
        x = x if y is None else x + y
        h = self.rmsnorm(x, w, eps)
        return x, h, self.quantize_act(h)

    def rope_qkv(self, qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
                 neox: bool, norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float, kv_out: torch.Tensor,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q|k|v [T, (H + 2 Hkv) D] -> q [T, H, D] normed (``norms``: q_norm, k_norm) and rotated; k (the
        same) and v in float16 into kv_out [2, Hkv, T, D] and, with ``pool`` (the layer's pool, each
        row's block and offset), into their slots there.  One launch on the Triton path."""
        if self._fused is not None:
            return self._fused.rope_qkv(qkv, heads, cos, sin, neox, norms, eps, kv_out, pool)
        H, Hkv, D = heads
        T = qkv.shape[0]
        q = qkv[:, :H * D].reshape(T, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
        if norms is not None:
            q = self.rmsnorm(q, norms[0], eps)
            k = self.rmsnorm(k, norms[1], eps)
        q = self.rope(q, cos, sin, neox)
        kv_out[0] = self.rope(k, cos, sin, neox).transpose(0, 1)  # [Hkv, T, D], rounded to float16
        kv_out[1] = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D).transpose(0, 1)
        if pool is not None:
            blocks, blk, off = pool
            blocks[blk, :, :, off] = kv_out.permute(2, 0, 1, 3)  # [T, 2, Hkv, D] into their slots
        return q

    def glu_quant(self, gate_up: torch.Tensor, table: torch.Tensor | None) -> tuple[torch.Tensor, Q8Act]:
        """(SwiGLU, or GeGLU by ``table``, of gate | up, its Q8_0): one launch on the Triton path."""
        if self._fused is not None and gate_up.shape[-1] % 64 == 0:
            return self._fused.glu_quant(gate_up, table)
        y = self.geglu(gate_up, table) if table is not None else self.swiglu(gate_up)
        return y, self.quantize_act(y)


class Products:
    """The Q4_0 / Q8_0 products of one kernel path: ``linear(w, x)`` and ``linear_residual(w, x)``
    (activations quantized by ``rows``, the path's ``Rowwise``)."""

    def __init__(self, path: str, rows: Rowwise | None = None):
        _check_path(path)
        self.path = path
        self.rows = rows if rows is not None else Rowwise(path)
        if path == "triton":
            from weaved.kernels import triton_q4

            self._linear_q = triton_q4.linear_q
            self._pair_dots = triton_q4.pair_dots
        else:
            self._linear_q = torch_q4.linear_q
            self._pair_dots = None

    def linear(self, w: DeviceWeight, x: torch.Tensor) -> torch.Tensor:
        """x float32 [T, n_in] @ W.T -> float32 [T, n_out] (Q8_0 activations for quantized W)."""
        if not w.quantized:
            return linear_float(w, x)
        return self._linear_q(w, self.rows.quantize_act(x))

    def linear_act(self, w: DeviceWeight, a: Q8Act) -> torch.Tensor:
        """``linear`` with activations already quantized (shared by several weights)."""
        if not w.quantized:
            raise ValueError("linear_act needs Q4_0 or Q8_0 weights")
        return self._linear_q(w, a)

    def linear_residual(self, w: DeviceWeight, x: torch.Tensor, margin: float = REFINE_MARGIN,
                        top: int = REFINE_TOP) -> torch.Tensor:
        """x @ W.T with the second activation level on each row's candidate logits
        (``residual.linear_residual``, the same set and the same bits): the logits."""
        if not w.quantized:
            return linear_float(w, x)
        T = x.shape[0]
        a1, a2 = self.rows.quantize_two_level(x)
        y = self._linear_q(w, a1)  # [T, n_out]
        if T == 0:
            return y
        # the threshold: max - margin (float32), raised to the k-th largest value
        lo = y.max(dim=1).values - margin  # [T]
        thr = torch.maximum(lo, torch.topk(y, min(int(top), w.n_out), dim=1).values[:, -1])
        if self._pair_dots is not None:  # every row's candidates in one launch, no host sync per row
            rows, cols = torch.nonzero(y >= thr.unsqueeze(1), as_tuple=True)
            y[rows, cols] = y[rows, cols] + self._pair_dots(w, a2, rows, cols)
            return y
        for t in range(T):
            sel = torch.nonzero(y[t] >= thr[t]).flatten()  # [n]
            rows = DeviceWeight(w.qtype, int(sel.numel()), w.n_in, w.data[sel])
            y[t, sel] = y[t, sel] + self._linear_q(rows, Q8Act(a2.q[t:t + 1], a2.d[t:t + 1]))[0]
        return y
