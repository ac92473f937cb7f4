"""The mixture-of-experts kernels: the router's fixed-order sums, its ties, the CPU and torch routers
giving the same experts and weights bit for bit, and the wrappers' checks."""

from __future__ import annotations

import numpy as np
import pytest
from weaved.kernels import matmul
from weaved.kernels.moe import ExpertWeights, moe_ffn, route
from weaved.kernels.threads import on_kernel_thread

torch = pytest.importorskip("torch")
from weaved.kernels import torch_moe  # noqa: E402


def test_the_router_logits_are_a_float32_dot_in_sixteen_lanes():
    """The CPU's logits are torch's, and within float32 rounding of the exact dot products."""
    rng = np.random.default_rng(1)
    h = rng.standard_normal((5, 2048), dtype=np.float32)
    w = rng.standard_normal((32, 2048), dtype=np.float32) * 2048 ** -0.5
    ex = _experts(rng, E=32, d=2048, ff=32, router=w)
    t_logits = torch_moe.router_logits(torch.from_numpy(h), torch.from_numpy(w)).numpy()
    exact = h.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(t_logits - exact).max() < 1e-5 * np.abs(exact).max()
    ids, _ = route(h, ex, 32)  # every expert, ordered by its probability: the CPU's logits' order
    t_ids, _ = torch_moe.route(torch.from_numpy(h), torch.from_numpy(w), 32)
    assert np.array_equal(ids, t_ids.numpy())


@pytest.mark.parametrize("E", [4, 27])
def test_the_grouped_logits_are_the_one_by_one_lanes_bit_for_bit(E):
    """Four experts a call (vector lanes in registers) and the rest one by one give each logit the
    scalar lane recipe's bits, and torch's."""
    from weaved.kernels import moe as kmoe

    rng = np.random.default_rng(7)
    h = rng.standard_normal((3, 512), dtype=np.float32)
    w = rng.standard_normal((E, 512), dtype=np.float32) * 512 ** -0.5
    h[1, 5], w[2, 5] = -0.0, 3e-39  # a signed zero and a subnormal product change nothing
    lanes = np.empty(16, np.float32)
    for t in range(3):
        z = np.full(E, np.nan, np.float32)
        kmoe._logits(h[t], w, 0, E, z, lanes)
        one = np.array([kmoe._logit(h[t], w[e], lanes) for e in range(E)], np.float32)
        assert z.tobytes() == one.tobytes()
        part = np.full(E, np.nan, np.float32)
        kmoe._logits(h[t], w, 1, E, part, lanes)  # groups starting off a multiple of four
        assert np.isnan(part[0]) and part[1:].tobytes() == one[1:].tobytes()
    t_logits = torch_moe.router_logits(torch.from_numpy(h), torch.from_numpy(w)).numpy()
    full = np.empty((3, E), np.float32)
    for t in range(3):
        kmoe._logits(h[t], w, 0, E, full[t], lanes)
    assert full.tobytes() == t_logits.tobytes()


def _experts(rng, E=8, d=64, ff=32, router=None) -> ExpertWeights:
    def packed(n_out, n_in):
        from gguf import GGMLQuantizationType as Q
        from gguf import quants

        w = rng.standard_normal((n_out, n_in), dtype=np.float32) * n_in ** -0.5
        return matmul.pack_weight(quants.quantize(w, Q.Q4_0), Q.Q4_0, n_out, n_in)

    router = router if router is not None else rng.standard_normal((E, d), dtype=np.float32) * d ** -0.5
    return ExpertWeights(router, [packed(2 * ff, d) for _ in range(E)], [packed(d, ff) for _ in range(E)])


@pytest.mark.parametrize("k", [1, 2, 8])
def test_the_cpu_and_torch_routers_agree_bit_for_bit(k):
    rng = np.random.default_rng(k)
    router = rng.standard_normal((24, 128), dtype=np.float32) * 128 ** -0.5
    router[7] = router[3]  # two experts always tie: the lower index goes first
    ex = _experts(rng, E=24, d=128, router=router)
    h = rng.standard_normal((37, 128), dtype=np.float32)
    ids, wts = route(h, ex, k)
    t_ids, t_wts = torch_moe.route(torch.from_numpy(h), torch.from_numpy(router), k)
    assert np.array_equal(ids, t_ids.numpy()) and np.array_equal(wts, t_wts.numpy())
    assert np.allclose(wts.sum(-1), 1.0, atol=1e-6) and (np.diff(wts, axis=-1) <= 0).all()  # most probable first
    both = (ids == 3).any(-1) & (ids == 7).any(-1)
    for t in np.nonzero(both)[0]:
        assert list(ids[t]).index(3) < list(ids[t]).index(7)  # equal probabilities: the lower index first
    alone = [route(h[t:t + 1], ex, k) for t in range(0, 37, 5)]  # a token's routing is its own
    for j, t in enumerate(range(0, 37, 5)):
        assert np.array_equal(alone[j][0][0], ids[t]) and np.array_equal(alone[j][1][0], wts[t])


def test_a_large_router_split_over_threads_routes_as_one_thread_does():
    """A decode step's one token on a real-size router (128 experts of 2,048) splits the experts over the
    threads; its bits are those of the serial path and of the same token among many."""
    from weaved.kernels import moe as kmoe

    rng = np.random.default_rng(5)
    E, d, k = 128, 2048, 8
    w = rng.standard_normal((E, d), dtype=np.float32) * d ** -0.5
    w[90] = w[17]  # a tie across the two threads' shares: the lower index still goes first
    h = rng.standard_normal((9, d), dtype=np.float32)
    assert E * d >= kmoe.PAR_MIN_ROUTER_WEIGHTS
    many = np.empty((9, k), np.int32), np.empty((9, k), np.float32)
    drive = on_kernel_thread(kmoe.route_drive)  # (where the kernels start their regions: one team of threads)
    drive(h, w, k, *many, 2)  # 9 tokens: split by token
    for t0, t1 in ((0, 1), (3, 5), (6, 9)):  # 1-3 tokens: split by expert (2 threads) or serial (1)
        for threads in (1, 2):
            ids, wts = np.empty((t1 - t0, k), np.int32), np.empty((t1 - t0, k), np.float32)
            drive(h[t0:t1], w, k, ids, wts, threads)
            assert np.array_equal(ids, many[0][t0:t1]) and np.array_equal(wts, many[1][t0:t1])


def test_the_wrappers_check_their_inputs():
    rng = np.random.default_rng(0)
    ex = _experts(rng)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        moe_ffn(np.zeros((3, 64), np.float64), ex, 2)
    with pytest.raises(ValueError, match="k must be in"):
        route(np.zeros((3, 64), np.float32), ex, 9)
    assert moe_ffn(np.zeros((0, 64), np.float32), ex, 2).shape == (0, 64)
    with pytest.raises(ValueError, match="float32 \\[E, d\\] router and E gate"):
        ExpertWeights(ex.router[:4], ex.gate_up, ex.down)
    with pytest.raises(ValueError, match="do not fit a router"):
        ExpertWeights(ex.router, ex.down, ex.gate_up)
    with pytest.raises(ValueError, match="route"):
        torch_moe.route(torch.zeros(3, 64), torch.zeros(8, 32), 2)
