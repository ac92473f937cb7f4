"""A step's rows as the Triton attention kernel reads them (the torch backend's path on CUDA).

``PagedStep`` is built once per step: every sequence's block table as one padded int32 tensor, each
row's sequence and position, and where each new row's K/V go in the pool.  Per layer the new rows are
stored there as they are made (``rope_qkv``) and ``attend`` runs ``triton_attention.paged_attention``
over all rows in one launch - instead of gathering each sequence's blocks into one run of keys and attending per
sequence (the torch path, and on torch's CPU device the tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from weaved.backends.torch_paged import PagedKV, Table
from weaved.kernels.torch_attention import CHUNK
from weaved.kernels.torch_q4 import Q8Act


@dataclass
class PagedStep:
    tables: torch.Tensor  # int32 [S, max_blocks]: sequence s's block of positions [i*B, (i+1)*B)
    seq: torch.Tensor  # int32 [T]: each row's sequence
    pos: torch.Tensor  # int32 [T]: each row's position
    blk: torch.Tensor  # int64 [T]: the pool block its new K/V row goes to
    off: torch.Tensor  # int64 [T]: its offset in that block
    last: int  # the highest position of any row (known here, so no layer waits for the device to say)
    _lo: dict[int, torch.Tensor] = field(default_factory=dict)  # first key per row, per sliding window

    @classmethod
    def build(cls, kv: PagedKV, tables: list[Table], pos0: list[int], lens: list[int],
              device: torch.device) -> PagedStep:
        """The step's rows from the tables' host block lists: built in numpy and moved to the device in
        one copy (a step of 64 sequences built per sequence on the device took ~450 small operations)."""
        B = kv.block
        S, T = len(tables), sum(lens)
        width = max(len(t.blocks) for t in tables)
        host = np.zeros(S * width + 4 * T, dtype=np.int64)  # tables | seq | pos | blk | off
        tab = host[:S * width].reshape(S, width)
        seq, pos, blk, off = host[S * width:].reshape(4, T)
        r = 0
        for s, (t, p, n) in enumerate(zip(tables, pos0, lens, strict=True)):
            tab[s, :len(t.blocks)] = t.array()
            rows = np.arange(p, p + n)
            seq[r:r + n] = s
            pos[r:r + n] = rows
            blk[r:r + n] = tab[s, rows // B]
            off[r:r + n] = rows % B
            r += n
        return cls.from_buffer(torch.from_numpy(host).to(device), S, width, T,
                               max(p + n - 1 for p, n in zip(pos0, lens, strict=True)))

    @classmethod
    def from_buffer(cls, buf: torch.Tensor, S: int, width: int, T: int, last: int) -> PagedStep:
        """The step held in one int64 device buffer laid out tables [S, width] | seq | pos | blk | off [T]
        (anything after is the caller's): tables, seq and pos become int32 in one conversion."""
        tw = S * width
        small = buf[:tw + 2 * T].to(torch.int32)  # tables, seq and pos as the kernel reads them
        return cls(small[:tw].view(S, width), small[tw:tw + T], small[tw + T:], buf[tw + 2 * T:tw + 3 * T],
                   buf[tw + 3 * T:tw + 4 * T], last)

    def first_keys(self, window: int) -> torch.Tensor:
        """Each row's first key: 0, or on a sliding-window layer the first of its last ``window``."""
        lo = self._lo.get(window)
        if lo is None:
            lo = (torch.clamp(self.pos + 1 - window, min=0) if window else torch.zeros_like(self.pos)).to(torch.int32)
            self._lo[window] = lo
        return lo

    def attend(self, pool: torch.Tensor, q: torch.Tensor, window: int, scale: float
               ) -> tuple[torch.Tensor, Q8Act | None]:
        """Attend every row over one layer's pool (float16 [n_blocks, 2, Hkv, B, D]), the step's own rows
        already in their slots (``blk``, ``off``: ``Rowwise.rope_qkv`` puts them there): q float32
        [T, H, D] -> (float32 [T, H * D], its Q8_0 for the output projection, written by the same
        launches where the head size is a multiple of 32; else None)."""
        from weaved.kernels.triton_attention import paged_attention, paged_attention_q8

        T, H, D = q.shape
        span = min(self.last, window - 1) if window else self.last  # the most keys before a row's own
        args = (q, pool, self.tables, self.seq, self.pos, self.first_keys(window), scale)
        if D % 32:
            return paged_attention(*args, n_chunks=span // CHUNK + 1).reshape(T, H * D), None
        out, a = paged_attention_q8(*args, n_chunks=span // CHUNK + 1)
        return out.reshape(T, H * D), a
