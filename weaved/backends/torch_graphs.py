"""Decode steps replayed from CUDA graphs (the torch backend on CUDA).

A decode step of a small model is mostly the host's work: a 16-layer step launches ~175 kernels,
each costing the CPU more than the GPU takes to run it.  A CUDA graph records a step's launches once
and replays them as one.  What a graph records is fixed - every tensor's address and shape, every
grid - so a graph serves one *bucket* of steps:

- rows: the step's sequences, padded up to 1, 2, 4, ..., 64.  A padding row is a sequence at position
  0 whose block table and K/V slot are the pool's scratch block (``PagedKV.scratch_block``): it writes
  there and reads there, and its outputs are dropped.  Every kernel is row-wise or per (row, head), so
  a real row's bits do not depend on the padding (nor on the tile sizes a bucket's row count picks).
- chunks of keys: the attention grid covers the longest row's chunks of 512 keys; a bucket is a power
  of two of them.  A row with fewer chunks skips the rest, and one chunk merged alone gives the bits of
  one chunk written directly (``triton_attention``), so the count changes no bits either.

The step's inputs (block tables, positions, slots, token ids) are one int64 buffer the graph reads:
filled on the host in pinned memory and copied in one transfer before each replay.  The graph's
outputs are the final rows, normed, and the step's new K/V rows; the logits (whose refinement picks a
data-dependent set of candidates) and the copies to the host run after it as before.

A graph also holds the addresses of the RoPE tables, so it is made with them grown to its bucket's
positions, and every graph is dropped when a table grows (they grow by doubling: seldom).  Graphs
share one memory pool: only one replays at a time, and their outputs are read before the next.

On torch's CPU device (tests, under Triton's interpreter) nothing is captured: the same buffers, the
same padding and buckets, with the step run directly - what the tests compare with the plain path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from weaved.backends.base import Logits, SeqChunk
from weaved.backends.torch_paged import PagedKV, Table
from weaved.backends.torch_step import PagedStep
from weaved.kernels.torch_attention import CHUNK
from weaved.kernels.torch_rowwise import RopeTable
from weaved.model.config import ModelConfig


class GraphedBackend(Protocol):
    """What the graphs need of the torch backend (``weaved.backends.torch.TorchBackend``)."""

    config: ModelConfig
    device: torch.device

    @property
    def kv_pool(self) -> PagedKV: ...

    @property
    def rope(self) -> RopeTable: ...

    @property
    def rope_swa(self) -> RopeTable: ...

    def layers(self, ids: torch.Tensor, pos_d: torch.Tensor, paged: PagedStep | None,
               new_kv: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, x: torch.Tensor) -> torch.Tensor: ...

class GraphUnavailable(RuntimeError):
    """Making a graph failed (a capture the driver refused, memory): the step runs without one."""


ROWS = (1, 2, 4, 8, 16, 32, 64)  # the row buckets; a decode step of more sequences runs without a graph


def bucket_rows(n: int) -> int:
    return next(r for r in ROWS if r >= n)


def bucket_chunks(last: int) -> int:
    """Chunks of keys a step whose highest position is ``last`` is run with: a power of two."""
    need = last // CHUNK + 1
    return 1 << (need - 1).bit_length()


@dataclass(eq=False)
class StepGraph:
    """One bucket's graph and the buffers it reads and writes."""

    rows: int
    chunks: int
    width: int  # blocks of each row's table: the bucket's positions / BLOCK
    inp: torch.Tensor  # int64 [rows * width + 5 * rows] on the device: tables | seq | pos | blk | off | ids
    host: torch.Tensor  # the same on the host (pinned on CUDA), filled each step
    hs: torch.Tensor | None = None  # float32 [rows, d_model]: the final rows, normed (the last replay's)
    new_kv: torch.Tensor | None = None  # float16 [L, 2, Hkv, rows, D]: the last replay's K/V rows
    graph: object | None = None  # torch.cuda.CUDAGraph; None on torch's CPU device
    seconds: float = 0.0  # what making it took (warm-up and capture)


class DecodeGraphs:
    """The decode graphs of one torch backend on the Triton path.  ``capture``: record CUDA graphs (on
    CUDA); False runs each step directly on the same buffers (torch's CPU device)."""

    def __init__(self, backend: GraphedBackend, capture: bool):
        self._be = backend
        self.capture = capture
        self._graphs: dict[tuple[int, int], StepGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._rope_key: tuple[int, ...] | None = None
        self.made = 0  # graphs made (a table's growth makes some again)
        self.replays = 0
        self.seconds = 0.0  # making them, in all

    @staticmethod
    def takes(chunks: list[SeqChunk]) -> bool:
        """A decode step a graph can run: one token and its logits per sequence, at most 64 sequences."""
        return len(chunks) <= ROWS[-1] and all(len(c.tokens) == 1 and c.logits == Logits.LAST for c in chunks)

    def close(self) -> None:
        """Drop every graph and their memory pool (the backend's shutdown)."""
        self._graphs.clear()
        self._pool = None

    def graphs(self) -> list[StepGraph]:
        return list(self._graphs.values())

    def counters(self) -> dict:
        """What ``/v1/status`` shows of them: graphs held and made, steps replayed, seconds making them."""
        return {"held": len(self._graphs), "made": self.made, "replays": self.replays,
                "seconds": round(self.seconds, 3)}

    def run(self, ids: np.ndarray, tables: list[Table], pos0: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: sequence s's token ``ids[s]`` at position ``pos0[s]`` (its block table
        ``tables[s]`` already holds the slot) -> (its final row normed, float32 [S, d_model]; the step's
        K/V rows float16 [L, 2, Hkv, rows, D], row s sequence s's), both valid until the next step."""
        S = len(tables)
        g = self._graph(bucket_rows(S), bucket_chunks(max(pos0)))
        self._fill(g, ids, tables, pos0)
        g.inp.copy_(g.host, non_blocking=True)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hs, g.new_kv = self._body(g)
        self.replays += 1
        return g.hs[:S], g.new_kv

    # ---- making graphs ---------------------------------------------------------------------------
    def _graph(self, rows: int, chunks: int) -> StepGraph:
        be = self._be
        for table in {id(t): t for t in (be.rope, be.rope_swa)}.values():
            table.ensure(chunks * CHUNK)
        key = tuple(t.cos.data_ptr() for t in (be.rope, be.rope_swa))
        if key != self._rope_key:  # a table grew: the graphs read its old memory
            self._graphs.clear()
            self._rope_key = key
        g = self._graphs.get((rows, chunks))
        if g is None:
            try:
                g = self._make(rows, chunks)
            except Exception as e:  # noqa: BLE001 - reported to the backend, which goes on without graphs
                raise GraphUnavailable(f"making the decode graph for {rows} rows and {chunks} chunks of keys "
                                       f"failed: {type(e).__name__}: {e}") from e
            self._graphs[(rows, chunks)] = g
        return g

    def _make(self, rows: int, chunks: int) -> StepGraph:
        be = self._be
        t0 = time.perf_counter()
        width = chunks * CHUNK // be.kv_pool.block
        n = rows * width + 5 * rows
        dev = be.device
        host = torch.empty(n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        g = StepGraph(rows, chunks, width, torch.empty(n, dtype=torch.int64, device=dev), host)
        self._fill(g, np.zeros(0, np.int64), [], [])  # every row padding: the warm-up writes the scratch block
        g.inp.copy_(g.host)
        if self.capture:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self._body(g)  # compiles the step's Triton kernels (none may compile while capturing)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a promotion's copy) does not spoil the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                g.hs, g.new_kv = self._body(g)
            g.graph = graph
            torch.cuda.synchronize(dev)
        g.seconds = time.perf_counter() - t0
        self.made += 1
        self.seconds += g.seconds
        return g

    def _body(self, g: StepGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the graph's buffers: what is captured."""
        be, cfg = self._be, self._be.config
        R, tw = g.rows, g.rows * g.width
        paged = PagedStep.from_buffer(g.inp, R, g.width, R, g.chunks * CHUNK - 1)  # one row a sequence
        new_kv = torch.empty((cfg.n_layers, 2, cfg.n_kv_heads, R, cfg.head_dim), dtype=torch.float16,
                             device=be.device)
        x = be.layers(g.inp[tw + 4 * R:], g.inp[tw + R:tw + 2 * R], paged, new_kv)  # ids, positions (int64)
        return be.final_norm(x), new_kv

    def _fill(self, g: StepGraph, ids: np.ndarray, tables: list[Table], pos0: list[int]) -> None:
        """The step's inputs into the host buffer; rows past the step's are padding (scratch block)."""
        R, W = g.rows, g.width
        scratch = self._be.kv_pool.scratch_block()
        B = self._be.kv_pool.block
        h = g.host.numpy()
        tab = h[:R * W].reshape(R, W)
        seq, pos, blk, off, tok = h[R * W:].reshape(5, R)
        tab.fill(scratch)
        seq[:] = np.arange(R)
        pos.fill(0)
        blk.fill(scratch)
        off.fill(0)
        tok.fill(0)
        for s, (t, p) in enumerate(zip(tables, pos0, strict=True)):
            blocks = t.array()
            n = min(len(blocks), W)
            tab[s, :n] = blocks[:n]
            pos[s] = p
            blk[s] = blocks[p // B]
            off[s] = p % B
        tok[:len(ids)] = ids
