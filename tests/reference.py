"""The truth oracle: a float64 numpy forward pass of the exactly dequantized weights.

No activation quantization, no float16 KV, no fused anything: the function the weights define, for
every architecture Weave runs (RoPE frequency factors and YaRN from the metadata, gemma3's embedding
scale, sliding windows, post norms and GELU, a mixture of experts' router and experts).  Slow but
simple; used teacher-forced.  Layers are dequantized when they run (and kept only for a small model),
so a real-size model fits in memory.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType
from weaved.kernels.elementwise import rope_angles64, rotate64

from weaved.model.config import ModelConfig, RopeSpec, RopeStyle
from weaved.model.gguf_file import GGUFFile

KEEP_BYTES = 2 * 2**30  # dequantized weights up to this size stay cached between calls


def dequant(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    arr = quants.dequantize(np.asarray(t.raw), GGMLQuantizationType(t.type_id))
    return np.asarray(arr, dtype=np.float64).reshape(t.shape)


def _corr_dims(n_rot: int, spec: RopeSpec) -> tuple[float, float]:
    """YaRN's correction dimensions (ggml's formula, exact)."""
    def dim(beta: float) -> float:
        return n_rot * math.log(spec.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(spec.base))
    return max(0.0, math.floor(dim(spec.beta_fast))), min(n_rot - 1.0, math.ceil(dim(spec.beta_slow)))


def gelu64(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


class ReferenceModel:
    def __init__(self, f: GGUFFile, cfg: ModelConfig):
        self.f, self.cfg = f, cfg
        n_weights = sum(math.prod(t.shape) for t in f.tensors.values())
        self._cache: dict[str, np.ndarray] | None = {} if n_weights * 8 <= KEEP_BYTES else None

    def w(self, name: str) -> np.ndarray:
        if self._cache is None:
            return dequant(self.f, name)
        if name not in self._cache:
            self._cache[name] = dequant(self.f, name)
        return self._cache[name]

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray, spec: RopeSpec) -> np.ndarray:
        """x [T, H, D] float64; the exact rotation of ``spec``."""
        n = self.cfg.n_rot
        corr = _corr_dims(n, spec) if spec.ext_factor else (0.0, 0.0)
        angles = rope_angles64(pos, n, spec.base, spec.freq_scale, spec.freq_factors, spec.ext_factor, corr)
        mscale = spec.attn_factor * ((1.0 + 0.1 * math.log(1.0 / spec.freq_scale)) if spec.ext_factor else 1.0)
        return rotate64(x, angles, n, self.cfg.rope_style == RopeStyle.NEOX, mscale)

    def _attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int) -> np.ndarray:
        """Causal (windowed) attention, one head at a time: q [T, H, D], k, v [T, Hkv, D] -> [T, H*D]."""
        cfg = self.cfg
        T, H, D = q.shape
        g = H // k.shape[1]
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        visible = (j <= i) & ((i - j < window) if window else True)
        out = np.empty((T, H, D))
        for h in range(H):
            s = (q[:, h] @ k[:, h // g].T) * cfg.scores_scale  # [T, T]
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, h // g]
        return out.reshape(T, H * D)

    def route(self, p: str, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The router of layer prefix ``p`` on h [T, d_model]: (experts [T, k], weights [T, k]) - the k
        most probable by softmax over every expert, most probable first, weights renormalized to 1."""
        z = h @ self.w(p + "ffn_gate_inp.weight").T  # [T, E]
        prob = np.exp(z - z.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        top = np.argsort(-prob, axis=-1, kind="stable")[:, : self.cfg.n_experts_used]
        wt = np.take_along_axis(prob, top, -1)
        return top, wt / wt.sum(-1, keepdims=True)

    def _experts(self, p: str, h: np.ndarray) -> np.ndarray:
        """A mixture-of-experts FFN: each token's k experts (SwiGLU), weighted and summed."""
        top, wt = self.route(p, h)
        gate, up, down = (self.w(p + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
        y = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, c in zip(top[t], wt[t], strict=True):
                g, u = gate[e] @ h[t], up[e] @ h[t]
                y[t] += c * (down[e] @ (g / (1 + np.exp(-g)) * u))
        return y

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits after every prefix: [T, vocab] float64."""
        return self.hidden(tokens) @ self._output().T

    def _output(self) -> np.ndarray:
        return self.w("token_embd.weight") if self.cfg.tied_output else self.w("output.weight")

    def token_stats(self, tokens: list[int], block: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """(log-probability of each next token [T-1], argmax after each prefix [T]), the logits taken a
        block of rows at a time (a long context's [T, vocab] would not fit)."""
        hs, out = self.hidden(tokens), self._output()
        lp, top = np.empty(len(tokens) - 1), np.empty(len(tokens), np.int64)
        for a in range(0, len(tokens), block):
            z = hs[a:a + block] @ out.T  # [n, vocab]
            m = z.max(-1, keepdims=True)
            lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
            top[a:a + len(z)] = z.argmax(-1)
            for r in range(len(z)):
                if a + r + 1 < len(tokens):
                    lp[a + r] = z[r, tokens[a + r + 1]] - lse[r]
        return lp, top

    def hidden(self, tokens: list[int]) -> np.ndarray:
        """The final-normed hidden state after every prefix: [T, d_model] float64."""
        cfg, w = self.cfg, self.w
        T = len(tokens)
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pos = np.arange(T)
        x = w("token_embd.weight")[tokens]  # [T, d_model]
        if cfg.embed_scale != 1.0:
            x = x * math.sqrt(cfg.d_model)
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, w(p + "attn_norm.weight"))
            q, k, v = (h @ w(p + f"attn_{m}.weight").T for m in "qkv")
            if cfg.attn_bias:
                q, k, v = (y + w(p + f"attn_{m}.bias") for y, m in zip((q, k, v), "qkv", strict=True))
            q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
            if cfg.qk_norm:
                q = self._rms(q, w(p + "attn_q_norm.weight"))
                k = self._rms(k, w(p + "attn_k_norm.weight"))
            spec = cfg.layer_rope(i)
            q, k = self._rope(q, pos, spec), self._rope(k, pos, spec)
            y = self._attention(q, k, v, cfg.layer_window(i)) @ w(p + "attn_output.weight").T
            x = x + (self._rms(y, w(p + "post_attention_norm.weight")) if cfg.post_norms else y)
            h = self._rms(x, w(p + "ffn_norm.weight"))
            if cfg.moe:
                y = self._experts(p, h)
            else:
                gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
                act = gelu64(gate) if cfg.act == "gelu" else gate / (1 + np.exp(-gate))
                y = (act * up) @ w(p + "ffn_down.weight").T
            x = x + (self._rms(y, w(p + "post_ffw_norm.weight")) if cfg.post_norms else y)
        return self._rms(x, w("output_norm.weight"))
