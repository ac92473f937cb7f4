"""``kernels.topk``: the k largest by position, equal to a stable sort of the whole row."""

from __future__ import annotations

import numpy as np
import pytest
from weaved.kernels.topk import top_k_positions


def _sorted(vals: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-vals, kind="stable")[:k]  # descending, ties by ascending position


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_top_k_positions_equal_a_stable_sort_of_the_row(dtype):
    rng = np.random.default_rng(7)
    for trial in range(120):
        n = int(rng.choice([1, 7, 63, 64, 65, 1000, 49152, 49159, 131072]))
        x = rng.standard_normal(n) * 3
        if trial % 3 == 0:
            x = np.round(x)  # many ties, at the k-th value too
        if trial % 4 == 0:
            x[rng.integers(0, n, max(1, n // 2))] = -np.inf  # masked tokens
        if trial % 7 == 0:
            x[:] = 1.0  # every value tied
        x = x.astype(dtype)
        k = int(rng.choice([1, 2, 40, 100, n, n + 5]))
        got = top_k_positions(x, k)
        np.testing.assert_array_equal(got, _sorted(x, k), err_msg=f"n={n} k={k} trial={trial}")


def test_the_lowest_positions_win_ties_at_the_boundary():
    x = np.zeros(50_000, np.float32)
    x[[30_000, 10, 40_000]] = 2.0
    x[[5, 20_000]] = 1.0
    assert top_k_positions(x, 4).tolist() == [10, 30_000, 40_000, 5]
    assert top_k_positions(x, 7).tolist() == [10, 30_000, 40_000, 5, 20_000, 0, 1]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_positions(np.zeros(4, np.float32), 0)
    with pytest.raises(ValueError, match="float32/float64"):
        top_k_positions(np.zeros(4, np.int32), 2)
