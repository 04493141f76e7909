"""Traversal orders: which sample ids an epoch visits, and in what order.

An order is a pure function of ``(indices, seed, epoch, rank, world_size)``. That is what makes a
stream's position just ``(epoch, batch index)`` (DESIGN.md §5.5): any process can recompute the
sample ids of any batch without replaying the epoch.

* ``SEQUENTIAL``: ``indices`` as given, every epoch.
* ``RANDOM``: ``numpy.random.default_rng(seed + epoch).permutation(indices)``, FFCV's permutation
  bit for bit (ffcv-format.md §6.2).
* ``QUASI_RANDOM``: page-aware shuffling. The samples of each page are shuffled, the pages are
  shuffled, and the resulting sequence is shuffled again inside windows of ``2 * batch_size``
  samples, so a batch touches only a few pages. Unlike FFCV it is a pure function of
  ``(seed, epoch)`` (no numba RNG), supports duplicated ``indices`` and works with
  ``distributed``. It does not reproduce FFCV's QUASI_RANDOM sequence (FFCV's depends on numba's
  internal RNG and is only "quasi" random anyway).
* ``distributed``: torch's ``DistributedSampler`` (``drop_last=False``): ``num_samples =
  ceil(n / world)``; the list (``torch.randperm(n, generator=manual_seed((seed + epoch) mod
  2**64))`` when shuffling, else ``range(n)``) is padded by wrapping to ``num_samples * world``
  and rank ``r`` takes ``list[r::world]``, mapped through ``indices``. Without torch an exact NumPy port of
  torch's CPU randperm (MT19937, forward Fisher-Yates, ``u32 % (n - i)``) is used. With
  QUASI_RANDOM each rank takes a *contiguous* chunk of the padded global order instead, so that
  ranks read disjoint pages.
"""

from __future__ import annotations

import enum
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.errors import SpecError

__all__ = [
    "OrderOption",
    "OrderConfig",
    "TraversalOrder",
    "make_order",
    "epoch_length",
    "torch_randperm",
    "distributed_rank_world",
]


#: Seeds are uint64 (the wire's type); ``seed + epoch`` of a distributed RANDOM order wraps here.
_U64_END = 1 << 64


class OrderOption(enum.Enum):
    """The built-in orders, with FFCV's enum values."""

    SEQUENTIAL = 1
    RANDOM = 2
    QUASI_RANDOM = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class OrderConfig:
    """Everything an order needs besides the epoch.

    Attributes:
        indices: the sample ids to visit (``uint64``); duplicates are allowed.
        seed: the order seed (``seed + epoch`` seeds RANDOM, as in FFCV).
        batch_size: used by QUASI_RANDOM for its window size.
        distributed: emulate ``DistributedSampler``.
        rank, world_size: this process's rank and the number of ranks.
        sample_pages: page of every sample of the file (``int64``, ``-1`` for none), needed by
            QUASI_RANDOM only.
    """

    indices: NDArray[np.uint64]
    seed: int
    batch_size: int
    distributed: bool = False
    rank: int = 0
    world_size: int = 1
    sample_pages: NDArray[np.int64] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise SpecError(
                f"rank {self.rank} / world_size {self.world_size}: need 0 <= rank < world_size"
            )
        if self.batch_size < 1:
            raise SpecError(f"batch_size must be >= 1, got {self.batch_size}")


class TraversalOrder(ABC):
    """Base class of orders (FFCV's ``TraversalOrder``).

    Custom orders subclass it and implement :meth:`sample_order`. It must be a pure function of
    the epoch (and of what the constructor received) for ``state_dict`` resumption to be exact.
    The constructor receives an object with ``indices``, ``seed``, ``distributed``, ``rank``,
    ``world_size`` and ``batch_size`` attributes (the Loader itself, or an :class:`OrderConfig`).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.indices: NDArray[np.uint64] = np.asarray(loader.indices, dtype=np.uint64)
        self.seed: int = int(loader.seed)
        self.distributed: bool = bool(loader.distributed)

    @abstractmethod
    def sample_order(self, epoch: int) -> NDArray[np.uint64]:
        """The sample ids of ``epoch`` for this rank, in order."""


def _dist_positions(n: int, cfg: OrderConfig, perm: NDArray[np.int64] | None) -> NDArray[np.int64]:
    num = math.ceil(n / cfg.world_size) if n else 0
    total = num * cfg.world_size
    base = np.arange(n, dtype=np.int64) if perm is None else perm
    if total > n and n:
        base = np.resize(base, total)  # np.resize repeats from the start, as the sampler does
    return base[cfg.rank : total : cfg.world_size]


def torch_randperm(n: int, seed: int) -> NDArray[np.int64]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` as int64.

    Uses torch when it is importable; otherwise an exact NumPy port (MT19937 seeded like
    ``manual_seed``, forward Fisher-Yates with ``u32 % (n - i)``), valid for ``n < 2**31``.
    """
    try:
        import torch
    except ImportError:
        return _randperm_mt(n, seed)
    g = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=g).numpy().astype(np.int64)


def _randperm_mt(n: int, seed: int) -> NDArray[np.int64]:
    if n >= 2**31:
        raise SpecError("distributed orders over more than 2**31 samples need torch installed")
    bg = np.random.MT19937()
    bg._legacy_seeding(int(seed) & 0xFFFFFFFF)  # init_genrand(seed), what torch's mt19937 does
    draws = bg.random_raw(max(n - 1, 0)).astype(np.uint64)
    out = np.arange(n, dtype=np.int64)
    mods = np.arange(n, 1, -1, dtype=np.uint64)  # n - i for i = 0 .. n-2
    zs = (draws % mods).astype(np.int64) + np.arange(n - 1, dtype=np.int64)
    for i, z in enumerate(zs.tolist()):
        out[i], out[z] = out[z], out[i]
    return out


def _quasi_random(cfg: OrderConfig, epoch: int) -> NDArray[np.uint64]:
    if cfg.sample_pages is None:
        raise SpecError("QUASI_RANDOM needs the reader's sample_pages")
    idx = cfg.indices
    if len(idx) == 0:
        return idx
    rng = np.random.default_rng([int(cfg.seed) & 0xFFFFFFFFFFFFFFFF, epoch, 0x51A5])
    pages = cfg.sample_pages[idx.astype(np.int64)]
    if (pages < 0).all():
        raise SpecError("QUASI_RANDOM needs samples with data; every selected sample is empty")
    # Random key per sample, then a random rank per page: sorting by (page rank, key) shuffles
    # the samples inside each page and the pages themselves in one lexsort.
    uniq, inverse = np.unique(pages, return_inverse=True)
    page_rank = rng.permutation(len(uniq))[inverse]
    key = rng.random(len(idx))
    seq = idx[np.lexsort((key, page_rank))]
    window = 2 * cfg.batch_size
    out = seq.copy()
    for start in range(0, len(seq), window):
        out[start : start + window] = rng.permutation(seq[start : start + window])
    return out


def make_order(
    order: OrderOption | TraversalOrder, cfg: OrderConfig, epoch: int
) -> NDArray[np.uint64]:
    """The sample ids (``uint64``) this rank visits in ``epoch``, before batching.

    Raises:
        SpecError: the order cannot be computed (see the message).
    """
    if isinstance(order, TraversalOrder):
        return np.asarray(order.sample_order(epoch), dtype=np.uint64)
    idx = cfg.indices
    n = len(idx)
    if order is OrderOption.SEQUENTIAL:
        if not cfg.distributed:
            return idx.copy()
        return idx[_dist_positions(n, cfg, None)]
    if order is OrderOption.RANDOM:
        if not cfg.distributed:
            return np.random.default_rng(cfg.seed + epoch).permutation(idx)
        # seed + epoch wraps at 2**64 (torch's manual_seed range): seed 2**64 - 1 works at every
        # epoch, where torch's DistributedSampler would raise at epoch 1 (issue 11).
        perm = torch_randperm(n, (cfg.seed + epoch) % _U64_END)
        return idx[_dist_positions(n, cfg, perm)]
    if order is OrderOption.QUASI_RANDOM:
        full = _quasi_random(cfg, epoch)
        if not cfg.distributed:
            return full
        num = math.ceil(n / cfg.world_size)
        padded = np.resize(full, num * cfg.world_size)
        return padded[cfg.rank * num : (cfg.rank + 1) * num]
    raise SpecError(f"unknown order {order!r}; use OrderOption or a TraversalOrder subclass")


def epoch_length(num_ordered: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch from the length of an epoch's order (FFCV's ``len(loader)``)."""
    if drop_last:
        return num_ordered // batch_size
    return -(-num_ordered // batch_size)


def distributed_rank_world(environ: Sequence[tuple[str, str]] | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` if initialised, else ``RANK``/``WORLD_SIZE``.

    Called when a Loader is constructed, never at import.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except ImportError:
        pass
    env = dict(environ) if environ is not None else os.environ
    try:
        return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise SpecError(f"RANK/WORLD_SIZE must be integers: {exc}") from None
