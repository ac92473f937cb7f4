"""The truth oracle: a float64 numpy forward pass of the exactly dequantized weights.

No activation quantization, no float16 KV, no fused anything: the function the weights define.
Slow but simple; used teacher-forced over a few hundred tokens.
"""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from weaved.model.config import ModelConfig, RopeStyle
from weaved.model.gguf_file import GGUFFile


def dequant(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    arr = quants.dequantize(np.asarray(t.raw), GGMLQuantizationType(t.type_id))
    return np.asarray(arr, dtype=np.float64).reshape(t.shape)


class ReferenceModel:
    def __init__(self, f: GGUFFile, cfg: ModelConfig):
        self.cfg = cfg
        self.w = {n: dequant(f, n) for n in f.tensors}

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [T, H, D] float64; exact rotation."""
        cfg = self.cfg
        n = cfg.n_rot
        inv = cfg.rope_base ** (-np.arange(0, n, 2, dtype=np.float64) / n)  # [n/2]
        ang = (pos[:, None].astype(np.float64) / cfg.rope_scale) * inv[None, :]  # [T, n/2]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        y = x.copy()
        if cfg.rope_style == RopeStyle.NORM:
            a, b = x[..., 0:n:2], x[..., 1:n:2]
            y[..., 0:n:2] = a * c - b * s
            y[..., 1:n:2] = a * s + b * c
        else:
            a, b = x[..., : n // 2], x[..., n // 2 : n]
            y[..., : n // 2] = a * c - b * s
            y[..., n // 2 : n] = a * s + b * c
        return y

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits after every prefix: [T, vocab] float64."""
        cfg, w = self.cfg, self.w
        T = len(tokens)
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pos = np.arange(T)
        x = w["token_embd.weight"][tokens]  # [T, d_model]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, w[p + "attn_norm.weight"])
            q, k, v = (h @ w[p + f"attn_{m}.weight"].T for m in "qkv")
            if cfg.attn_bias:
                q, k, v = (y + w[p + f"attn_{m}.bias"] for y, m in zip((q, k, v), "qkv", strict=True))
            q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
            if cfg.qk_norm:
                q = self._rms(q, w[p + "attn_q_norm.weight"])
                k = self._rms(k, w[p + "attn_k_norm.weight"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            g = H // Hkv
            k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [T, H, D]
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask  # [H, T, T]
            s = np.exp(s - s.max(-1, keepdims=True))
            a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, H * D)
            x = x + a @ w[p + "attn_output.weight"].T
            h = self._rms(x, w[p + "ffn_norm.weight"])
            gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        h = self._rms(x, w["output_norm.weight"])
        out = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
        return h @ out.T
