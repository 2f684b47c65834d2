"""The epoch order: a seeded permutation served in batches from blocks computed at once."""

import pytest
import torch

from dsa_train.data.order import BLOCK, Shuffle


def test_batches_from_blocks_equal_the_permutation_computed_position_by_position():
    n = 2 * BLOCK + 1234
    order, reference = Shuffle(n, 7), Shuffle(n, 7)
    batches = [order.slice(start, start + 1000) for start in range(0, n, 1000)]  # straddle every block edge
    whole = torch.cat(batches)
    assert torch.equal(whole, reference(torch.arange(n)))  # the network itself, no block
    assert torch.equal(whole.sort().values, torch.arange(n))  # a permutation of range(n)
    for start, stop in [
        (BLOCK - 5, BLOCK + 5),
        (10, 20),
        (n - 3, n + 50),
        (5, 5),
        (n + 10, n + 20),
    ]:  # out of order, past the end, empty, beyond the end
        assert torch.equal(order.slice(start, stop), reference(torch.arange(start, max(start, min(stop, n)))))


def test_a_callers_batch_is_its_own():
    order = Shuffle(5000, 3)
    first = order.slice(0, 100)
    expected = first.clone()
    first.fill_(-1)
    assert torch.equal(order.slice(0, 100), expected)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 1000, 4097])
def test_shuffle_is_a_seeded_permutation(n):
    order = Shuffle(n, 11).slice(0, n)
    assert sorted(order.tolist()) == list(range(n))
    assert torch.equal(order, Shuffle(n, 11).slice(0, n))
    assert torch.equal(Shuffle(n, 11).slice(n // 3, n), order[n // 3 :])  # any batch alone
    if n > 16:
        assert not torch.equal(order, Shuffle(n, 12).slice(0, n))


def test_shuffle_spreads_items_uniformly():
    n, seeds = 10, 4000
    where_zero = torch.tensor([int((Shuffle(n, s).slice(0, n) == 0).nonzero()) for s in range(seeds)])
    counts = torch.bincount(where_zero, minlength=n).double()
    chi2 = ((counts - seeds / n) ** 2 / (seeds / n)).sum()
    assert chi2 < 30  # 9 degrees of freedom: p ~ 0.0004
