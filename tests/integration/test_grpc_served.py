# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The grpc transport end to end through a real daemon: TCP and Unix socket, compression, choice.

Batches served over grpc must equal the in-process Loader's bit for bit, as over shm.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_client.errors import ServerUnavailable, SpecError
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, SimpleRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import (
    Convert,
    NormalizeImage,
    RandomHorizontalFlip,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow


def _pipelines() -> dict:
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


def _epoch(loader) -> tuple[list[tuple], list[np.ndarray]]:
    out, ids = [], []
    for b in loader:
        out.append(tuple(x.clone() if isinstance(x, torch.Tensor) else np.array(x) for x in b))
        ids.append(np.array(getattr(loader, "last_sample_ids", np.empty(0))))
    return out, ids


def _same(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            assert torch.equal(torch.as_tensor(u), torch.as_tensor(v))


@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_grpc_equals_in_process_bit_for_bit(daemon_factory, fixtures_dir: Path, via: str) -> None:
    port = free_port()
    d = daemon_factory([fixtures_dir / "image_pairs.beton"], args=["--listen", f"127.0.0.1:{port}"])
    server = f"127.0.0.1:{port}" if via == "tcp" else d.address
    kw: dict = dict(batch_size=5, seed=1234, drop_last=False)
    served = Loader(
        "image_pairs",
        order=OrderOption.RANDOM,
        pipelines=_pipelines(),
        server=server,
        transport="grpc",
        **kw,
    )
    local = InProcessLoader(
        str(fixtures_dir / "image_pairs.beton"),
        order=InProcessOrder.RANDOM,
        pipelines=_pipelines(),
        num_workers=1,
        **kw,
    )
    try:
        assert served.chosen_transport == "grpc"
        assert len(served) == len(local) == 4
        for _ in range(2):
            a, ids = _epoch(served)
            b, _ = _epoch(local)
            _same(a, b)
            # every sample exactly once per epoch, ids travel with the batches
            assert sorted(np.concatenate(ids).tolist()) == list(range(sum(len(x[0]) for x in a)))
        stats = d.stats()
        assert [s.transport for s in stats.streams] == ["grpc"]
    finally:
        served.close()
        local.close()


@pytest.mark.parametrize("compression", ["lz4", "zstd:3"])
def test_compressed_stream_equals_uncompressed(
    daemon_factory, fixtures_dir: Path, compression: str
) -> None:
    d = daemon_factory([fixtures_dir / "image_pairs.beton"])
    kw: dict = dict(batch_size=4, seed=7, server=d.address, transport="grpc", drop_last=False)
    pipes = {  # uint8 images: what compression is for
        "input": [SimpleRGBImageDecoder()],
        "target": [CenterCropRGBImageDecoder((20, 20), 0.75)],
    }
    with (
        Loader("image_pairs", compression=compression, pipelines=pipes, **kw) as a,
        Loader("image_pairs", pipelines=pipes, **kw) as b,
    ):
        x, _ = _epoch(a)
        y, _ = _epoch(b)
        assert len(x) == len(a) > 0
        _same(x, y)


def test_compression_outside_the_daemons_allow_list_is_refused(
    daemon_factory, fixtures_dir: Path
) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], args=["--grpc-compression", "lz4"])
    with pytest.raises(SpecError, match="not enabled"):
        Loader("mixed_fields", 4, server=d.address, transport="grpc", compression="zstd")
    with Loader("mixed_fields", 4, server=d.address, transport="grpc", compression="lz4") as ld:
        assert len(_epoch(ld)[0]) == len(ld)


def test_auto_picks_grpc_for_another_host(daemon_factory, fixtures_dir: Path, monkeypatch) -> None:
    """A client whose identity says another host gets grpc, with shm's rejection reason."""
    from beton_client._transport import identity

    real = identity.host_identity

    def elsewhere(*a, **k):
        return dataclasses.replace(real(*a, **k), boot_id="another-boot", hostname="h2")

    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    monkeypatch.setattr(identity, "host_identity", elsewhere)
    with Loader("mixed_fields", 16, server=d.address, drop_last=False) as ld:
        assert ld.chosen_transport == "grpc"
        assert ("shm", "different_host") in [(t, c) for t, c, _ in ld.transport_rejections]
        got, ids = _epoch(ld)
        assert sorted(np.concatenate(ids).tolist()) == list(range(sum(len(b[0]) for b in got)))
    assert "fallback" in d.log()


def test_closing_the_loader_frees_the_grpc_stream(daemon_factory, fixtures_dir: Path) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    ld = Loader("mixed_fields", 8, server=d.address, transport="grpc")
    it = iter(ld)
    next(it)  # stop mid-epoch
    assert [s.transport for s in d.stats().streams] == ["grpc"]
    ld.close()
    deadline = time.monotonic() + 10
    while d.stats().streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(d.stats().streams) == []


def test_daemon_shutdown_ends_a_grpc_stream_with_server_unavailable(
    daemon_factory, fixtures_dir: Path
) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    with Loader("mixed_fields", 2, server=d.address, transport="grpc", batches_ahead=1) as ld:
        it = iter(ld)
        next(it)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the daemon drains; at most the few prefetched batches still arrive
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 30
    assert d.stop() == 0


@pytest.mark.parametrize("how", ["for", "islice"])
def test_many_epochs_on_one_grpc_stream_give_every_batch_buffer_back(
    daemon_factory, fixtures_dir: Path, how: str
) -> None:
    """Each epoch's last batch goes back to the client's buffer pool (credits + 2 buffers): when
    the loop asks past the end, or when an epoch read to its end without that is dropped. Nine
    epochs outlast the pool; a leaked buffer per epoch failed the 6th."""
    import itertools

    port = free_port()
    d = daemon_factory([fixtures_dir / "image_pairs.beton"], args=["--listen", f"127.0.0.1:{port}"])
    kw: dict = dict(batch_size=5, seed=7, drop_last=False, pipelines=_pipelines())
    served = Loader("image_pairs", server=d.address, transport="grpc", spawn=False, **kw)
    local = InProcessLoader(fixtures_dir / "image_pairs.beton", num_workers=1, **kw)
    try:
        for _ in range(9):
            want, _ = _epoch(local)
            if how == "for":
                got, _ = _epoch(served)
            else:
                it = iter(served)
                got, _ = _epoch(itertools.islice(it, len(served)))
                del it
            _same(got, want)
    finally:
        served.close()
        local.close()
