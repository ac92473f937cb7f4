"""Work stealing in parallel regions: every item is taken exactly once, whoever takes it."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange
from weaved.kernels import _steal
from weaved.kernels.threads import on_kernel_thread


@njit(parallel=True, cache=False)
def _take_all_here(n, nth, own, stall):
    """Every thread walks its own range (own items at a time), then steals from the others' backs.
    With ``stall``, thread 0 stops after its first item until its range's back has moved (another
    thread stole from it; bounded).  Returns (times each item was taken, which thread took it)."""
    st = _steal.ranges(n, nth)
    back0 = _steal.atomic_load(st, 0) >> 32
    taken = np.zeros(n, np.int64)
    by = np.full(n, -1, np.int64)
    for k in prange(nth):
        first = True
        j = 0
        while True:
            i0, i1, j = _steal.take(st, k, own, j)
            if i1 == 0:
                break
            for i in range(i0, i1):
                taken[i] += 1
                by[i] = k
            if stall and k == 0 and first:
                for _ in range(2_000_000_000):
                    if (_steal.atomic_load(st, 0) >> 32) < back0:
                        break
            first = False
    return taken, by


# on the kernel thread, as the kernels run: a region started here would make a second team of threads,
# whose spinning on the same cores can delay thread 0 past the moment the test needs it to start at
_take_all = on_kernel_thread(_take_all_here)


@pytest.mark.parametrize("n,nth,own", [(0, 2, 1), (1, 2, 1), (7, 2, 4), (100, 2, 1), (1000, 3, 4), (5, 8, 2)])
def test_every_item_is_taken_exactly_once(n, nth, own):
    taken, by = _take_all(n, nth, own, False)
    assert taken.tolist() == [1] * n
    assert (by >= 0).all() and (by < nth).all()


def test_ranges_split_the_items_into_near_equal_contiguous_ranges():
    st = _steal.ranges(10, 3)
    spans = [(int(st[k * _steal.STRIDE]) & 0xFFFFFFFF, int(st[k * _steal.STRIDE]) >> 32) for k in range(3)]
    assert spans == [(0, 3), (3, 6), (6, 10)]


@pytest.mark.skipif(numba.get_num_threads() < 2, reason="needs two threads in numba's pool")
def test_a_stalled_owner_has_its_items_taken_by_the_others():
    taken, by = _take_all(4000, 2, 1, True)
    assert taken.tolist() == [1] * 4000
    # thread 0 stalls after its first item until thread 1, done with its own half, steals from it
    assert by[0] == 0 and (by[1:2000] == 1).any() and (by[2000:] == 1).all()
