"""triton_router through Triton's interpreter: a mixture of experts' router gives the torch path's experts
and weights bit for bit (the CPU kernel's recipe), with ties, odd expert counts and a token alone.

Not collected by default: ``test_triton_interp`` runs this file in a fresh interpreter with
TRITON_INTERPRET=1 (see ``triton_interp_cases``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from weaved.kernels import torch_moe

from tests.kernels.triton_interp_shim import require_interpreter

require_interpreter()


@pytest.fixture(scope="module")
def tr():
    from weaved.kernels import triton_router

    return triton_router


def _case(rng, T: int, E: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.from_numpy((rng.standard_normal((T, d)) * 2).astype(np.float32))
    w = torch.from_numpy((rng.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32))
    return h, w


@pytest.mark.parametrize(("T", "E", "d", "k"), [(1, 8, 64, 2), (5, 60, 128, 4), (3, 128, 2048, 8), (4, 17, 32, 17)])
def test_route_is_the_torch_paths(tr, T, E, d, k):
    h, w = _case(np.random.default_rng(E + d + k), T, E, d)
    ids, wts = tr.route(h, w, k)
    want_ids, want_wts = torch_moe.route(h, w, k)
    assert torch.equal(ids, want_ids) and torch.equal(wts, want_wts)
    one_ids, one_wts = tr.route(h[-1:], w, k)  # a token alone: its own bits
    assert torch.equal(one_ids, ids[-1:]) and torch.equal(one_wts, wts[-1:])


def test_equal_probabilities_go_to_the_lower_expert(tr):
    rng = np.random.default_rng(3)
    h, w = _case(rng, 4, 32, 64)
    w[9], w[20], w[31] = w[4], w[4], w[4]  # four experts with one router row: equal logits, equal probabilities
    h[2] = 0.0  # every logit 0: all 32 experts tie
    ids, wts = tr.route(h, w, 6)
    want_ids, want_wts = torch_moe.route(h, w, 6)
    assert torch.equal(ids, want_ids) and torch.equal(wts, want_wts)
    assert ids[2].tolist() == [0, 1, 2, 3, 4, 5]


def test_argument_checks(tr):
    h, w = _case(np.random.default_rng(0), 2, 8, 64)
    with pytest.raises(ValueError, match="route"):
        tr.route(h[:, :48], w, 2)
    with pytest.raises(ValueError, match="route"):
        tr.route(h, w, 9)
    with pytest.raises(ValueError, match="float32"):
        tr.route(h.double(), w, 2)
    ids, wts = tr.route(h[:0], w, 2)
    assert ids.shape == (0, 2) and wts.shape == (0, 2)
