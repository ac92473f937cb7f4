"""A contiguous range of the CPU backend's layers, and the pieces of one layer that Q-Ring splits.

``LayerRunner`` runs layers [first, last) of a loaded ``CPUBackend`` with the backend's own weights,
kernels and order of operations, so federation computes exactly what a single node computes:
a runner over all layers reproduces ``CPUBackend.forward`` bit for bit (tested), and a pipeline of
runners reproduces it too (hidden states travel as float32, bit for bit).  The half-layers around
attention are the backend's own ``pre_attention`` / ``post_attention``; the embedding and the logits
read its attributes (``_emb_raw``, ``out_norm``, ``_logits``).  Whatever runs kernels runs on the process's
one kernel thread (``kernels.threads.on_kernel_thread``), as the backend's own methods do.

Stage-local KV: a stage keeps KV for its own layers only, in the standard layout with the layer axis
counted from ``first`` (``[last - first, 2, n_kv_heads, capacity, head_dim]``).
"""

from __future__ import annotations

import numpy as np

from weaved.backends.base import Logits
from weaved.backends.cpu import CPUBackend
from weaved.kernels import attention as ka
from weaved.kernels import elementwise as ke
from weaved.kernels.threads import on_kernel_thread
from weaved.kv.cache import KVCache


class LayerRunner:
    """Layers [first, last) of ``backend``'s model (embedding and logits are separate calls)."""

    def __init__(self, backend: CPUBackend, first: int = 0, last: int | None = None):
        cfg = backend.config
        last = cfg.n_layers if last is None else last
        if not 0 <= first < last <= cfg.n_layers:
            raise ValueError(f"bad layer range [{first}, {last}) of {cfg.n_layers} layers")
        self.backend = backend
        self.config = cfg
        self.first, self.last = first, last
        self.scale = backend.attn_scale  # 1/sqrt(head_dim), the backend's own float

    @property
    def n_layers(self) -> int:
        return self.last - self.first

    def new_kv(self, capacity: int) -> KVCache:
        """An empty stage-local cache: this range's layers only."""
        c = self.config
        return KVCache(np.zeros((self.n_layers, 2, c.n_kv_heads, capacity, c.head_dim), np.float16))

    # ---- the ends of the model ---------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token embeddings, float32 [T, d_model] (the first stage only)."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        return self.backend.embed(ids)

    @on_kernel_thread
    def logits(self, x_rows: np.ndarray) -> np.ndarray:
        """Final norm and output matrix for the given hidden rows: float32 [n, vocab] (the last stage)."""
        if len(x_rows) == 0:
            return np.empty((0, self.config.vocab_size), np.float32)
        hs = ke.rmsnorm(np.ascontiguousarray(x_rows), self.backend.out_norm, self.config.rms_eps)
        # the product's rows may be padded apart (kernels.matmul.padded_out); messages are contiguous
        return np.ascontiguousarray(self.backend.output(hs))

    # ---- one layer, in the two dense halves around attention ------------------------------------------

    def pre_attention(self, li: int, x: np.ndarray, positions: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer ``li`` up to attention (the CPU backend's own half-layer): q [T, n_heads, head_dim],
        k and v [T, n_kv_heads, head_dim], float32, rotated."""
        return self.backend.pre_attention(li, x, positions)

    def post_attention(self, li: int, x: np.ndarray, att: np.ndarray) -> None:
        """Layer ``li`` after attention, in place on x [T, d_model] (the CPU backend's own half-layer)."""
        self.backend.post_attention(li, x, att)

    # ---- the range with standard (single-node) attention -------------------------------------------------

    @on_kernel_thread
    def run(self, x: np.ndarray, kvs, seq_starts: np.ndarray, pos0: np.ndarray) -> np.ndarray:
        """Layers [first, last) over a ragged batch, in place on x [T, d_model]: rows seq_starts[s] ..
        seq_starts[s+1]-1 belong to sequence s and sit at positions pos0[s] ...; their K/V rows go to
        the stage-local arrays ``kvs`` (``ka.kv_list``, one per sequence, layer axis from ``first``)
        and attention reads them causally.  Lengths are the caller's to advance."""
        cfg = self.config
        T = x.shape[0]
        lens = np.diff(seq_starts)
        positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(pos0, lens, strict=True)])
        att = np.empty((T, cfg.n_heads, cfg.head_dim), dtype=np.float32)
        lse = np.empty((T, cfg.n_heads), dtype=np.float32)
        for li in range(self.first, self.last):
            q, k, v = self.pre_attention(li, x, positions)
            ka.kv_store(kvs, li - self.first, seq_starts, pos0, k, v)
            ka.attend(q, kvs, li - self.first, seq_starts, pos0, self.scale, att, lse, cfg.layer_window(li))
            self.post_attention(li, x, att)
        return x

    @on_kernel_thread
    def forward(self, kvs: list[KVCache], tokens: list[np.ndarray], logits: list[Logits] | None = None
                ) -> list[np.ndarray]:
        """The whole model over a ragged batch, as ``CPUBackend.forward`` computes it (a runner over
        every layer only): one logits array per sequence; advances each cache's length."""
        if self.first != 0 or self.last != self.config.n_layers:
            raise ValueError("forward needs a runner over every layer")
        logits = logits or [Logits.LAST] * len(tokens)
        lens = [len(t) for t in tokens]
        seq_starts = np.zeros(len(tokens) + 1, dtype=np.int64)
        seq_starts[1:] = np.cumsum(lens)
        pos0 = np.array([kv.length for kv in kvs], dtype=np.int64)
        for kv, n in zip(kvs, lens, strict=True):
            if kv.length + n > kv.capacity:
                raise ValueError(f"KV cache full: {kv.length} + {n} tokens > capacity {kv.capacity}")
        x = self.embed(np.concatenate([np.asarray(t, np.int32) for t in tokens]))
        self.run(x, ka.kv_list([kv.data for kv in kvs]), seq_starts, pos0)
        rows = [wanted_rows(lg, int(s), n) for lg, s, n in zip(logits, seq_starts[:-1], lens, strict=True)]
        out = self.logits(x[[r for rs in rows for r in rs]])
        for kv, n in zip(kvs, lens, strict=True):
            kv.length += n
        return split_rows(out, [len(r) for r in rows])


def wanted_rows(logits: Logits, start: int, n: int) -> range:
    """Rows of a chunk whose logits are wanted (``Logits`` of a chunk of n rows starting at ``start``)."""
    return {Logits.NONE: range(0), Logits.LAST: range(start + n - 1, start + n), Logits.ALL: range(start, start + n)}[
        Logits(logits)
    ]


def split_rows(rows: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    out, o = [], 0
    for n in counts:
        out.append(rows[o : o + n])
        o += n
    return out
