"""The promotion's host-side gather: a session's rows copied into a staging buffer by several threads."""

import numpy as np
import pytest

from weaved.backends import torch_transfer


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("positions", [5, 4096])  # under and over the size below which one thread copies
def test_gather_equals_the_rows(monkeypatch, threads, positions):
    monkeypatch.setattr(torch_transfer, "GATHER_THREADS", threads)
    rng = np.random.default_rng(threads)
    kv = rng.standard_normal((3, 2, 4, positions + 64, 64)).astype(np.float16)  # [L, 2, Hkv, cap, D]
    src = kv[1:3, :, :, 7:7 + positions]  # a chunk of layers, rows from the middle: a strided view
    dst = np.zeros(src.shape, np.float16)
    torch_transfer.gather(dst, src)
    assert np.array_equal(dst, src)


def test_gather_refuses_another_shape():
    with pytest.raises(ValueError, match="shapes differ"):
        torch_transfer.gather(np.zeros((2, 3, 4)), np.zeros((2, 3, 5)))
