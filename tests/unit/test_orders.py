"""Traversal orders: FFCV's RANDOM permutation, DistributedSampler semantics, QUASI_RANDOM."""

from __future__ import annotations

import math

import numpy as np
import pytest
from beton_serve.engine.orders import (
    OrderConfig,
    OrderOption,
    TraversalOrder,
    _randperm_mt,
    distributed_rank_world,
    epoch_length,
    make_order,
    torch_randperm,
)
from beton_serve.errors import SpecError


def _cfg(n: int = 64, **kw) -> OrderConfig:
    kw.setdefault("seed", 0)
    kw.setdefault("batch_size", 8)
    return OrderConfig(indices=np.arange(n, dtype=np.uint64), **kw)


@pytest.mark.parametrize("name", ["images_raw", "images_jpg", "images_smart"])
def test_random_matches_ffcv(fixtures_dir, name):
    exp = np.load(fixtures_dir / f"{name}.expected.npz")
    for epoch in range(3):
        got = make_order(OrderOption.RANDOM, _cfg(64), epoch)
        assert got.dtype == np.uint64
        np.testing.assert_array_equal(got, exp[f"random_order_seed0_epoch{epoch}"])


def test_sequential_keeps_indices_and_duplicates():
    cfg = OrderConfig(indices=np.array([5, 3, 3, 9], np.uint64), seed=1, batch_size=2)
    np.testing.assert_array_equal(make_order(OrderOption.SEQUENTIAL, cfg, 4), [5, 3, 3, 9])


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
@pytest.mark.parametrize("seed", [0, 17, 2**32 + 5])
def test_numpy_randperm_equals_torch(n, seed):
    torch = pytest.importorskip("torch")
    ref = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    np.testing.assert_array_equal(_randperm_mt(n, seed), ref)
    np.testing.assert_array_equal(torch_randperm(n, seed), ref)


@pytest.mark.parametrize("order", [OrderOption.SEQUENTIAL, OrderOption.RANDOM])
@pytest.mark.parametrize("n,world", [(10, 3), (2, 4), (64, 2)])
def test_distributed_matches_sampler(order, n, world):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    idx = np.arange(100, 100 + n, dtype=np.uint64)
    seen = []
    for rank in range(world):
        sampler = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=order is OrderOption.RANDOM, seed=3
        )
        sampler.set_epoch(2)
        cfg = OrderConfig(
            indices=idx, seed=3, batch_size=2, distributed=True, rank=rank, world_size=world
        )
        got = make_order(order, cfg, 2)
        np.testing.assert_array_equal(got, idx[list(sampler)])
        assert len(got) == math.ceil(n / world)
        seen.extend(got.tolist())
    assert set(seen) == set(idx.tolist())
    del torch


def _pages(n: int, per_page: int) -> np.ndarray:
    return (np.arange(n) // per_page).astype(np.int64)


def test_quasi_random_is_a_permutation_deterministic_and_page_local():
    n, bs = 400, 8
    cfg = _cfg(n, batch_size=bs, seed=5, sample_pages=_pages(n, 20))
    a = make_order(OrderOption.QUASI_RANDOM, cfg, 0)
    np.testing.assert_array_equal(np.sort(a), np.arange(n))
    np.testing.assert_array_equal(a, make_order(OrderOption.QUASI_RANDOM, cfg, 0))
    assert not np.array_equal(a, make_order(OrderOption.QUASI_RANDOM, cfg, 1))
    assert not np.array_equal(a, np.arange(n))
    # a batch touches few pages (a full shuffle would touch ~8 of the 20 pages per batch)
    pages_per_batch = [len(set((a[i : i + bs] // 20).tolist())) for i in range(0, n, bs)]
    assert np.mean(pages_per_batch) <= 3


def test_quasi_random_distributed_covers_everything_and_duplicates():
    n, world = 101, 4
    pages = _pages(n, 10)
    allids = []
    for rank in range(world):
        cfg = _cfg(n, sample_pages=pages, distributed=True, rank=rank, world_size=world)
        got = make_order(OrderOption.QUASI_RANDOM, cfg, 3)
        assert len(got) == math.ceil(n / world)
        allids.extend(got.tolist())
    assert set(allids) == set(range(n))
    dup = OrderConfig(
        indices=np.array([1, 1, 2, 30], np.uint64), seed=0, batch_size=2, sample_pages=pages
    )
    assert sorted(make_order(OrderOption.QUASI_RANDOM, dup, 0).tolist()) == [1, 1, 2, 30]


def test_quasi_random_errors():
    with pytest.raises(SpecError, match="sample_pages"):
        make_order(OrderOption.QUASI_RANDOM, _cfg(4), 0)
    cfg = _cfg(4, sample_pages=np.full(4, -1, np.int64))
    with pytest.raises(SpecError, match="empty"):
        make_order(OrderOption.QUASI_RANDOM, cfg, 0)


def test_custom_order_and_lengths():
    class Reverse(TraversalOrder):
        def sample_order(self, epoch):
            return self.indices[::-1]

    cfg = _cfg(5)
    np.testing.assert_array_equal(make_order(Reverse(cfg), cfg, 0), [4, 3, 2, 1, 0])
    assert epoch_length(10, 3, True) == 3
    assert epoch_length(10, 3, False) == 4
    assert epoch_length(9, 3, False) == 3
    with pytest.raises(SpecError):
        OrderConfig(
            indices=np.arange(3, dtype=np.uint64), seed=0, batch_size=1, rank=2, world_size=2
        )


def test_rank_world_from_env():
    assert distributed_rank_world([("RANK", "2"), ("WORLD_SIZE", "4")]) == (2, 4)
    assert distributed_rank_world([]) == (0, 1)
