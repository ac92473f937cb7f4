"""triton_attention through Triton's interpreter: every row of a step in one launch over a paged pool
with scattered blocks, against ``torch_attention.attend`` (the CPU kernel's arithmetic) on each row's
keys gathered in order - decode rows and prompt chunks, several chunks of keys, sliding windows, GQA
ratios, head sizes 64/128/256 - bit for bit (the interpreter's fma made exact: ``triton_interp_shim``).

Not collected by default: ``test_triton_interp`` runs this file with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weaved.kernels.torch_attention import attend

from tests.kernels.triton_interp_shim import require_interpreter

require_interpreter()

PB = 32  # positions per pool block (the torch backend's)


@pytest.fixture(scope="module")
def ta():
    from weaved.kernels import triton_attention

    return triton_attention


def _paged(rng, lengths: list[int], Hkv: int, D: int):
    """Sequences of the given key counts, their rows in a pool's blocks in scattered order: (pool float16
    [n_blocks, 2, Hkv, PB, D], tables int32 [S, max_blocks], each sequence's keys as [2, Hkv, L, D])."""
    need = [-(-n // PB) for n in lengths]
    n_blocks = sum(need) + 3
    order = rng.permutation(n_blocks)
    pool = torch.from_numpy(rng.standard_normal((n_blocks, 2, Hkv, PB, D)).astype(np.float16))
    tables = torch.zeros((len(lengths), max(need)), dtype=torch.int32)
    keys, at = [], 0
    for s, nb in enumerate(need):
        ids = order[at:at + nb]
        at += nb
        tables[s, :nb] = torch.from_numpy(ids.astype(np.int32))
        kv = pool[torch.from_numpy(ids.astype(np.int64))].permute(1, 2, 0, 3, 4).reshape(2, Hkv, nb * PB, D)
        keys.append(kv[:, :, :lengths[s]])
    return pool, tables, keys


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want), float(((got - want).abs() / (want.abs().amax() + 1e-30)).max())


@pytest.mark.parametrize("D,H,Hkv", [(64, 4, 2), (128, 4, 1), (256, 2, 2)])
def test_a_step_of_decode_rows_and_a_prompt_chunk_is_attend_per_sequence(ta, D, H, Hkv):
    rng = np.random.default_rng(D + H)
    lengths = [1, 37, 700, 9]  # a first token, a decode row, one past a 512-key chunk, a 5-token chunk
    new = [1, 1, 1, 5]  # rows this step: the last `new` positions of each sequence
    pool, tables, keys = _paged(rng, lengths, Hkv, D)
    scale = 1.0 / np.sqrt(D)
    T = sum(new)
    q = torch.from_numpy((rng.standard_normal((T, H, D)) * 2).astype(np.float32))
    seq = torch.tensor([s for s, n in enumerate(new) for _ in range(n)], dtype=torch.int32)
    pos = torch.tensor([lengths[s] - n + i for s, n in enumerate(new) for i in range(n)], dtype=torch.int32)
    got = ta.paged_attention(q, pool, tables, seq, pos, torch.zeros(T, dtype=torch.int32), scale)
    at = 0
    for s, n in enumerate(new):
        want = attend(q[at:at + n], keys[s][0], keys[s][1], lengths[s] - n, float(np.float32(scale)))[0]
        _check(got[at:at + n], want)
        at += n
    # a row alone gives the bits it gets in the step
    alone = ta.paged_attention(q[2:3], pool, tables, seq[2:3], pos[2:3], torch.zeros(1, dtype=torch.int32), scale)
    assert torch.equal(alone, got[2:3])
    # rows of one chunk each write their result without the merge (a step of short rows alone): the same bits
    short = [0, 1, 3, 4, 5, 6, 7]
    lo = torch.zeros(len(short), dtype=torch.int32)
    alone = ta.paged_attention(q[short], pool, tables, seq[short], pos[short], lo, scale)
    assert torch.equal(alone, got[short])
    # with the rows' Q8_0 for the output projection, on both paths (merged chunks, one chunk): quantize_act's
    from weaved.kernels.triton_rowwise import quantize_act

    for rows in (list(range(T)), short):
        out, a = ta.paged_attention_q8(q[rows], pool, tables, seq[rows], pos[rows],
                                       torch.zeros(len(rows), dtype=torch.int32), scale)
        want = quantize_act(got[rows].reshape(len(rows), H * D))
        assert torch.equal(out, got[rows]) and torch.equal(a.q, want.q) and torch.equal(a.d, want.d)


def test_sliding_window_rows_attend_their_last_keys_from_the_first_of_them(ta):
    rng = np.random.default_rng(5)
    D, H, Hkv, window = 64, 2, 1, 100
    lengths = [600, 60]
    pool, tables, keys = _paged(rng, lengths, Hkv, D)
    q = torch.from_numpy(rng.standard_normal((3, H, D)).astype(np.float32))
    seq = torch.tensor([0, 0, 1], dtype=torch.int32)
    pos = torch.tensor([598, 599, 59], dtype=torch.int32)
    lo = torch.clamp(pos + 1 - window, min=0).to(torch.int32)  # the third row is inside its window
    got = ta.paged_attention(q, pool, tables, seq, pos, lo, 0.125)
    for r in range(3):
        s, p, first = int(seq[r]), int(pos[r]), int(lo[r])
        k, v = keys[s][0][:, first:p + 1], keys[s][1][:, first:p + 1]
        _check(got[r:r + 1], attend(q[r:r + 1], k, v, p - first, 0.125)[0])


def test_argument_checks(ta):
    pool = torch.zeros((4, 2, 1, PB, 64), dtype=torch.float16)
    tables = torch.zeros((1, 2), dtype=torch.int32)
    one = torch.zeros(1, dtype=torch.int32)
    q = torch.zeros((1, 2, 64))
    with pytest.raises(ValueError, match="power of two"):
        ta.paged_attention(torch.zeros((1, 2, 48)), torch.zeros((4, 2, 1, PB, 48), dtype=torch.float16),
                           tables, one, one, one, 1.0)
    with pytest.raises(ValueError, match="past its block table"):
        ta.paged_attention(q, pool, tables, one, torch.tensor([64], dtype=torch.int32), one, 1.0)
    with pytest.raises(ValueError, match="first key"):
        ta.paged_attention(q, pool, tables, one, one, torch.tensor([3], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="int32"):
        ta.paged_attention(q, pool, tables, one.long(), one, one, 1.0)
    assert ta.paged_attention(torch.zeros((0, 2, 64)), pool, tables, one[:0], one[:0], one[:0], 1.0).shape == (0, 2, 64)
