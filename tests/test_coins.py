"""Per-request coins (engine/coins.py): the Python-integer path of small calls gives the NumPy path's bits; a
request's coins depend on its own (seed, counter, role, index) only; the coins are uniform on [0, 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specadapt.engine.coins import ACCEPT, DRAFT, FINAL, request_coins


@pytest.mark.parametrize("batch,width", [(1, 1), (3, 5), (7, 9), (16, 4)])
def test_small_calls_equal_the_numpy_path_bit_for_bit(batch, width):
    g = torch.Generator().manual_seed(batch * 100 + width)
    for role in (ACCEPT, FINAL, DRAFT):
        seeds = torch.randint(-(2**62), 2**62, (batch,), generator=g)
        counters = torch.randint(0, 2**40, (batch,), generator=g)
        index = torch.randint(0, 2**20, (batch, width), generator=g)
        for idx in (width, index):
            small = request_coins(seeds, counters, role, idx, small_call=10**9)
            large = request_coins(seeds, counters, role, idx, small_call=0)
            assert small.dtype == large.dtype == torch.float64 and small.shape == (batch, width)
            assert torch.equal(small, large)


def test_a_requests_coins_do_not_depend_on_the_batch():
    seeds, counters = torch.tensor([5, -9, 123456789]), torch.tensor([10, 77, 3])
    full = request_coins(seeds, counters, ACCEPT, 4)
    for b in range(3):
        assert torch.equal(request_coins(seeds[b : b + 1], counters[b : b + 1], ACCEPT, 4)[0], full[b])
    assert not torch.equal(request_coins(seeds, counters + 1, ACCEPT, 4), full)  # next round, new coins
    assert not torch.equal(request_coins(seeds, counters, FINAL, 4), full)  # another role, new coins


def test_coins_are_uniform():
    n = 20000
    coins = request_coins(torch.arange(n), torch.full((n,), 17), ACCEPT, 1)[:, 0].numpy()
    assert coins.min() >= 0.0 and coins.max() < 1.0
    assert stats.kstest(coins, "uniform").pvalue > 1e-4
    small = np.concatenate([request_coins(torch.tensor([s]), torch.tensor([3]), DRAFT, 8)[0].numpy()
                            for s in range(500)])
    assert stats.kstest(small, "uniform").pvalue > 1e-4


@pytest.mark.parametrize("batch", [1, 6])
def test_a_slots_coin_does_not_depend_on_the_rounds_width(batch):
    """The loop trims a verify chunk to its widest real draft; that is exact only because slot i's coin is the
    same whatever the width asked for (small-call and NumPy paths alike)."""
    seeds, counters = torch.arange(batch) * 7 + 3, torch.arange(batch) + 100
    for role in (ACCEPT, DRAFT):
        wide = request_coins(seeds, counters, role, 40, small_call=0)  # the NumPy path
        for width in (0, 1, 3, 17, 40):
            for small_call in (0, 10_000):
                narrow = request_coins(seeds, counters, role, width, small_call=small_call)
                assert torch.equal(narrow, wide[:, :width])
