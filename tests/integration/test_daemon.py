# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""End to end with a real daemon subprocess on a Unix socket: orders, concurrency, bit-identity.

Every daemon is started by the ``daemon_factory`` fixture (tests/helpers/daemon.py), which always
stops it (SIGTERM, then kill) and waits for it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    FloatDecoder,
    IntDecoder,
    NDArrayDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import (
    Convert,
    NormalizeImage,
    RandomHorizontalFlip,
    Squeeze,
    ToDevice,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import daemon  # noqa: F401

pytestmark = pytest.mark.slow


def _epoch(loader: Loader) -> tuple[list[tuple], list[np.ndarray]]:
    batches, ids = [], []
    for b in loader:
        batches.append(tuple(x.clone() if isinstance(x, torch.Tensor) else np.array(x) for x in b))
        ids.append(loader.last_sample_ids.copy())
    return batches, ids


def test_distributed_world_two_gets_disjoint_complete_epochs(daemon, fixtures_dir: Path) -> None:
    expected = np.load(fixtures_dir / "mixed_fields.expected.npz")["int"]
    loaders = []
    for rank in range(2):
        import os

        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        try:
            loaders.append(
                Loader(
                    "mixed_fields",
                    batch_size=5,
                    order=OrderOption.RANDOM,
                    distributed=True,
                    seed=7,
                    drop_last=False,
                    pipelines={"int": [IntDecoder(), ToTensor()], "blob": None, "meta": None},
                    server=daemon.address,
                )
            )
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]
    try:
        assert [ld.rank for ld in loaders] == [0, 1]
        assert len(loaders[0]) == len(loaders[1]) == 5  # 25 samples per rank
        orders = []
        for _ in range(3):
            per_rank = []
            for ld in loaders:
                batches, ids = _epoch(ld)
                got = np.concatenate([b[0].numpy() for b in batches])
                flat = np.concatenate(ids)
                # each sample's decoded value is the one FFCV wrote for that sample id
                assert np.array_equal(got, expected[flat.astype(np.int64)])
                per_rank.append(flat)
            a, b = per_rank
            assert not set(a.tolist()) & set(b.tolist())
            assert sorted(np.concatenate(per_rank).tolist()) == list(range(50))
            orders.append(a)
        assert not np.array_equal(orders[0], orders[1])  # RANDOM reshuffles every epoch
    finally:
        for ld in loaders:
            ld.close()


def test_three_unrelated_clients_with_different_pipelines_at_once(daemon) -> None:
    specs = [
        ("mixed_fields", 4, {"array": [NDArrayDecoder(), ToTensor()], "blob": None, "meta": None}),
        (
            "image_pairs",
            3,
            {
                "input": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()],
                "target": [CenterCropRGBImageDecoder((16, 16), 1.0), ToTensor()],
            },
        ),
        ("images_smart", 5, {"image": [CenterCropRGBImageDecoder((20, 20), 0.5), ToTensor()]}),
    ]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        name, bs, pipes = specs[i]
        try:
            with Loader(name, batch_size=bs, pipelines=pipes, server=daemon.address, seed=i) as ld:
                shapes = set()
                count = 0
                for _ in range(2):
                    for b in ld:
                        shapes.add(tuple(tuple(x.shape[1:]) for x in b))
                        count += len(b[0])
                results[i] = (shapes, count, len(ld))
        except BaseException as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=run, args=(i,), name=f"beton-test-client-{i}") for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert all(not t.is_alive() for t in threads)
    for i, r in results.items():
        assert not isinstance(r, BaseException), f"client {i}: {r!r}"
    assert len(results) == 3
    (s0, n0, l0), (s1, n1, l1), (s2, n2, l2) = results[0], results[1], results[2]  # type: ignore[misc]
    assert s0 == {((1,), (1,), (3, 4))} and n0 == 2 * 4 * l0
    assert s1 == {((3, 24, 32), (16, 16, 3))} and l1 == 5 and n1 == 2 * 3 * 5  # drop_last
    assert {s[0] for s in s2} == {(20, 20, 3)} and n2 == 2 * 5 * l2
    stats = daemon.stats()
    assert stats.streams_opened >= 3 and not stats.streams  # all closed again
    assert daemon.segments() == []


@pytest.mark.parametrize("order", ["SEQUENTIAL", "RANDOM", "QUASI_RANDOM"])
def test_served_output_equals_in_process_bit_for_bit(
    daemon, fixtures_dir: Path, order: str
) -> None:
    def pipelines():
        return {
            "input": [
                SimpleRGBImageDecoder(),
                RandomHorizontalFlip(0.5),
                ToTensor(),
                ToTorchImage(),
                Convert(torch.float16),
            ],
            "target": [
                CenterCropRGBImageDecoder((20, 20), 0.75),
                NormalizeImage(
                    np.array([120.0, 110.0, 100.0]), np.array([60.0, 55.0, 50.0]), np.float32
                ),
                ToTensor(),
            ],
        }

    kw = dict(batch_size=5, seed=1234, drop_last=False)
    served = Loader(
        "image_pairs", order=OrderOption[order], pipelines=pipelines(), server=daemon.address, **kw
    )
    local = InProcessLoader(
        str(fixtures_dir / "image_pairs.beton"),
        order=InProcessOrder[order],
        pipelines=pipelines(),
        num_workers=1,
        **kw,
    )
    try:
        assert len(served) == len(local) == 4
        for _ in range(2):
            a = [tuple(x.clone() for x in b) for b in served]
            b = [tuple(x.clone() for x in bb) for bb in local]
            assert len(a) == len(b) == 4
            for x, y in zip(a, b, strict=True):
                assert len(x) == len(y) == 2
                for u, v in zip(x, y, strict=True):
                    assert u.dtype == v.dtype and u.shape == v.shape
                    assert torch.equal(u, v)
    finally:
        served.close()
        local.close()


def test_floats_and_default_pipelines_match_the_fixture(daemon, fixtures_dir: Path) -> None:
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    with Loader(
        "mixed_fields",
        batch_size=16,
        drop_last=False,
        pipelines={"float": [FloatDecoder(), ToTensor(), Squeeze(1)], "blob": None, "meta": None},
        server=daemon.address,
    ) as ld:
        assert ld.reader_outputs == ["int", "float", "array"]
        batches, _ = _epoch(ld)
    ints = np.concatenate([b[0].numpy() for b in batches])
    floats = np.concatenate([b[1].numpy() for b in batches])
    arrays = np.concatenate([b[2].numpy() for b in batches])
    assert np.array_equal(ints, exp["int"])
    assert floats.shape == (50,) and np.array_equal(floats, exp["float"][:, 0], equal_nan=True)
    assert np.array_equal(arrays, exp["array"], equal_nan=True)


def test_output_size_change_between_epochs_takes_effect(daemon) -> None:
    dec = CenterCropRGBImageDecoder((16, 16), 1.0)
    with Loader(
        "image_pairs",
        batch_size=8,
        pipelines={"input": [dec, ToTensor()], "target": None},
        server=daemon.address,
    ) as ld:
        first = {tuple(b[0].shape) for b in ld}
        dec.output_size = (8, 12)
        second = {tuple(b[0].shape) for b in ld}
    assert first == {(8, 16, 16, 3)}
    assert second == {(8, 8, 12, 3)}


def test_copy_false_batches_are_views_until_the_next_batch_and_copy_true_survives(daemon) -> None:
    pipes = {
        "int": [IntDecoder(), ToTensor()],
        "blob": None,
        "meta": None,
        "float": None,
        "array": None,
    }
    with Loader(
        "mixed_fields", batch_size=5, pipelines=pipes, server=daemon.address, copy=True
    ) as ld:
        kept = [b[0] for b in ld]
    flat = torch.cat(kept).numpy().reshape(-1)
    with Loader("mixed_fields", batch_size=5, pipelines=pipes, server=daemon.address) as ld:
        fresh = torch.cat([b[0].clone() for b in ld]).numpy().reshape(-1)
    assert np.array_equal(flat, fresh)
    assert len(np.unique(flat)) > 40  # copies did not alias one slot


def test_to_device_cpu_and_normalize_after_to_torch_image_on_cpu(
    daemon, fixtures_dir: Path
) -> None:
    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255
    with Loader(
        "image_pairs",
        batch_size=4,
        pipelines={
            "input": [
                SimpleRGBImageDecoder(),
                ToTensor(),
                ToDevice("cpu"),
                ToTorchImage(),
                NormalizeImage(mean, std, np.float16),
            ],
            "target": None,
        },
        server=daemon.address,
    ) as ld:
        (x,) = next(iter(ld))
        ids = ld.last_sample_ids.astype(np.int64)
    raw = np.load(fixtures_dir / "image_pairs.expected.npz")["input"][ids]  # (B, H, W, C) uint8
    ref = ((raw.astype(np.float64) - mean) / std).astype(np.float16).transpose(0, 3, 1, 2)
    assert x.dtype == torch.float16 and tuple(x.shape) == (4, 3, 24, 32)
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(x.numpy(), ref)
