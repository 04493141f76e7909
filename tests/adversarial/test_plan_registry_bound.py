# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Clients that ask for ever new pipeline specs cannot grow a long-lived daemon without bound.

Every distinct spec (an RRC ``scale`` of a parameter sweep, an output size) is a plan of its own.
The daemon keeps at most ``MAX_CACHED_PLANS`` of them, the least recently asked-for going first;
a stream whose plan was dropped keeps it, and the next stream with that spec compiles it again
(from the compile cache), with the same batches. A kept plan with no open stream holds no batch
workspaces (they went with its last stream), and the bound is worth something only because no op
compiles per parameter value (the last two tests).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from beton_client import Loader, OrderOption
from beton_serve.daemon._plans import MAX_CACHED_PLANS
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from helpers.daemon import daemon_factory, rss_mb, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _loader(address: str, i: int) -> Loader:
    return Loader(
        "images_jpg",
        batch_size=4,
        order=OrderOption.RANDOM,
        seed=3,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((24, 24), scale=(0.08 + i / 1e4, 1.0))],
            "label": [IntDecoder()],
        },
        server=address,
        spawn=False,
    )


def _growth(pid: int, job: Callable[[int], object], *, warm: range, measured: range) -> float:
    """MB the daemon ``pid`` grew over the ``measured`` jobs, run after the ``warm`` ones."""
    for i in warm:
        job(i)
    before = rss_mb(pid)
    for i in measured:
        job(i)
    return rss_mb(pid) - before


def _first_two(address: str, i: int) -> list[tuple[np.ndarray, ...]]:
    with _loader(address, i) as ld:
        it = iter(ld)
        return [tuple(np.array(t) for t in next(it)) for _ in range(2)]


def test_a_parameter_sweep_keeps_at_most_the_bound_of_plans(daemon_factory, fixtures_dir) -> None:
    d = daemon_factory([fixtures_dir / "images_jpg.beton"])
    first = _first_two(d.address, 0)
    held = _loader(d.address, 1)  # a stream that stays open while its plan is dropped
    it = iter(held)
    head = next(it)
    for i in range(2, MAX_CACHED_PLANS + 20):
        _first_two(d.address, i)
    assert d.stats().compiled_plans == MAX_CACHED_PLANS
    rest = list(it)  # the open stream is unharmed by its plan leaving the registry
    held.close()
    assert len(rest) == len(held) - 1 and all(np.array(b[0]).any() for b in rest)
    assert np.array(head[0]).shape == (4, 24, 24, 3)
    again = _first_two(d.address, 0)  # dropped long ago: compiled again, the same batches
    for a, b in zip(first, again, strict=True):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert d.stats().compiled_plans == MAX_CACHED_PLANS


def test_a_sweep_over_op_parameters_does_not_grow_the_daemon(daemon_factory, fixtures_dir) -> None:
    """Numba never frees machine code: when the built-in ops captured their parameters, every
    job of a sweep over them (a new brightness, flip probability, Cutout size) compiled its own
    kernels and grew the daemon by 1.5-2 MB per op for good, whatever the plan bound dropped. 80
    such jobs grew it by 245 MB; with the parameters as arguments, by a few MB at most."""
    from beton_serve.transforms import Cutout, RandomBrightness, RandomHorizontalFlip, ToTensor

    d = daemon_factory([fixtures_dir / "images_jpg.beton"])

    def job(i: int) -> None:
        with Loader(
            "images_jpg",
            batch_size=4,
            order=OrderOption.RANDOM,
            seed=3,
            pipelines={
                "image": [
                    RandomResizedCropRGBImageDecoder((24, 24)),
                    RandomBrightness(0.1 + i / 200, p=0.9),
                    RandomHorizontalFlip(0.2 + i / 200),
                    Cutout(2 + i % 9),
                    ToTensor(),
                ],
                "label": [IntDecoder()],
            },
            server=d.address,
            spawn=False,
        ) as ld:
            assert np.array(next(iter(ld))[0]).any()

    # the first 8 compile (or load) the kernels once, and fill the allocators
    grown = _growth(d.pid, job, warm=range(8), measured=range(8, 88))
    assert grown < 40, f"80 jobs of distinct op parameters grew the daemon by {grown:.1f} MB"


def test_plans_kept_for_reuse_hold_no_batch_memory(daemon_factory, fixtures_dir) -> None:
    """A sweep of ImageNet-style jobs (RRC + flip + normalize: the decoder's output is scratch
    memory, ~4.8 MB per worker at 32 x 224 px) used to leave every finished job's workspaces in
    the plan the daemon keeps for reuse: +9.6 MB per job here, ~70 MB per job at batch 256,
    up to 64 plans. The workspaces now go with a plan's last stream; a kept plan asked for again
    allocates them anew, with the same batches."""
    from beton_serve.transforms import NormalizeImage, RandomHorizontalFlip, ToTensor

    d = daemon_factory([fixtures_dir / "images_jpg.beton"], args=["--workers", "2"])
    mean, std = np.array([120.0, 110.0, 100.0]), np.array([60.0, 60.0, 60.0])

    def job(i: int) -> list[np.ndarray]:
        with Loader(
            "images_jpg",
            batch_size=32,
            order=OrderOption.RANDOM,
            seed=3,
            pipelines={
                "image": [
                    RandomResizedCropRGBImageDecoder((224, 224), scale=(0.08 + i / 1e4, 1.0)),
                    RandomHorizontalFlip(),
                    NormalizeImage(mean, std, np.float16),
                    ToTensor(),
                ],
                "label": [IntDecoder()],
            },
            server=d.address,
            spawn=False,
        ) as ld:
            return [np.array(b[0]) for b in ld]  # both batches: both workers' workspaces

    first = job(0)
    grown = _growth(d.pid, job, warm=range(1, 4), measured=range(4, 28))
    assert grown < 60, f"24 finished jobs left {grown:.1f} MB in the daemon's kept plans"
    again = job(0)  # a kept plan: its workspaces allocated anew
    assert len(again) == len(first) == 2
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert all(np.isfinite(a.astype(np.float32)).all() and a.any() for a in again)
