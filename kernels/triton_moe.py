"""A mixture of experts' products as grouped Triton kernels: every expert's rows of a step in one launch.

The torch path (``backends.torch_experts``) finds the experts a step uses on the host and runs each one's
products in turn: a host sync and two launches per expert.  Here the step's (token, slot) pairs are
sorted by expert on the device, cut into tiles that each hold one expert's rows, and one launch runs
every tile's product against its expert's weights (stacked [E, n_out, nb, bytes] in the file's
encoding).  A tile's arithmetic is ``triton_q4._q_matmul``'s (``chunk_products``) - an exact integer dot
per 32-block, one fma per block in block order - so every output element has the bits of that expert's ``linear_q`` on
that row, whichever rows share its tile.  No host sync: the grid is the bound ceil(P / BM) + E tiles, and
tiles past the step's own exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from weaved.kernels.torch_q4 import BLOCK_BYTES, QK, Q8Act
from weaved.kernels.torch_rowwise import check_tensor
from weaved.kernels.triton_q4 import chunk_blocks, chunk_products

BM = 16  # rows per tile (tl.dot needs 16 or more)
BN = 32  # outputs per tile (triton_q4.linear_q's measured choice for up to 16 rows)


@triton.jit
def _grouped(x_ptr, xd_ptr, row_ptr, w_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, y_ptr, N, NB: tl.constexpr,
             QTYPE: tl.constexpr, BSZ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             KB: tl.constexpr):
    """Tile i: rows [r0, r1) of the sorted pairs (one expert e's), outputs [j*BN, (j+1)*BN):
    y[r] = x[row[r]] . W[e] rows, x int8 [*, NB*32] with scales [*, NB], W uint8 [E, N, NB, BSZ]."""
    i = tl.program_id(0)
    e = tl.load(tile_e_ptr + i)
    if e < 0:  # past the step's tiles
        return
    r0 = tl.load(tile_r0_ptr + i)
    r1 = tl.load(tile_r1_ptr + i)
    rm = r0 + tl.arange(0, BLOCK_M)  # [BM] sorted pair indices
    mm = rm < r1
    src = tl.load(row_ptr + rm, mask=mm, other=0).to(tl.int64)  # [BM] the activation row of each
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    row_bytes = NB * BSZ
    w_rows = w_ptr + e.to(tl.int64) * N * row_bytes + rn.to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(0, NB // KB):  # triton_q4's tile arithmetic, KB blocks at a time
        acc = chunk_products(acc, x_ptr + src * (NB * 32), xd_ptr + src * NB, w_rows, mm, mn, c, QTYPE, BSZ,
                             BLOCK_M, BLOCK_N, KB)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


def plan(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """The step's pairs sorted by expert, and their tiles, all on the device: (order int64 [P]: pair
    indices by expert, stable; tile_e, tile_r0, tile_r1 int32 [ceil(P/BM) + E]: each tile's expert (-1
    past the step's tiles) and sorted-pair range; counts int64 [E]).  ``experts`` int64 [P]."""
    P = experts.numel()
    dev = experts.device
    order = torch.sort(experts, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, experts, torch.ones_like(experts))  # [E] (bincount would wait for the device to size its output)
    starts = torch.cumsum(counts, 0) - counts  # [E] first sorted pair of each expert
    tiles = (counts + BM - 1) // BM  # [E]
    first_tile = torch.cumsum(tiles, 0) - tiles  # [E]
    bound = -(-P // BM) + n_experts
    t = torch.arange(bound, device=dev)
    e = torch.searchsorted(first_tile + tiles, t, right=True)  # [bound] the expert each tile falls in
    valid = e < n_experts
    e_c = torch.where(valid, e, torch.zeros_like(e))
    r0 = starts[e_c] + (t - first_tile[e_c]) * BM
    r1 = torch.minimum(r0 + BM, starts[e_c] + counts[e_c])
    tile_e = torch.where(valid, e_c, torch.full_like(e_c, -1)).to(torch.int32)
    return order, tile_e, r0.to(torch.int32), r1.to(torch.int32), counts


def grouped_linear(stack: torch.Tensor, qtype: int, a: Q8Act, rows: torch.Tensor, tile_e: torch.Tensor,
                   tile_r0: torch.Tensor, tile_r1: torch.Tensor) -> torch.Tensor:
    """y float32 [P, n_out]: y[r] = expert e(r)'s product with activation row ``rows[r]`` (r in sorted pair
    order; e(r) from the tiles).  stack uint8 [E, n_out, nb, bytes]; a Q8_0 rows [*, nb*32]; rows int64 [P]."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"grouped_linear needs Q4_0 or Q8_0 weights, got type {qtype}")
    check_tensor("stack", stack, torch.uint8, 4)
    check_tensor("rows", rows, torch.int64, 1)
    E, N, nb, bsz = stack.shape
    if bsz != BLOCK_BYTES[qtype] or a.q.shape[1] != nb or a.q.shape[2] != QK:
        raise ValueError(f"activations [*, {a.q.shape[1] * QK}] do not match the experts' [{E}, {N}, {nb * QK}]")
    P = rows.numel()
    y = torch.empty((P, N), dtype=torch.float32, device=stack.device)
    if P:
        grid = (tile_e.numel(), triton.cdiv(N, BN))
        _grouped[grid](a.q.contiguous(), a.d.contiguous(), rows.contiguous(), stack, tile_e, tile_r0, tile_r1, y, N,
                       nb, QTYPE=qtype, BSZ=bsz, BLOCK_M=BM, BLOCK_N=BN, KB=chunk_blocks(nb, 16),
                       enable_fp_fusion=False)
    return y
