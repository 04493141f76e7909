# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The cuda_ipc transport through a real daemon and the Loader (GPU machine only).

A Loader whose pipeline ends in ``ToDevice('cuda:0')`` on the daemon's host gets ``cuda_ipc``
(unless the probe refuses, which skips with the reason) and yields the same tensors as over shm.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (torch.cuda.is_available() is False)")
    pytest.importorskip("cupy", reason="CuPy is needed for CUDA IPC")
    return torch


def _pipelines(torch) -> dict:
    from beton_serve.fields.decoders import SimpleRGBImageDecoder
    from beton_serve.transforms import Convert, ToDevice, ToTensor, ToTorchImage

    return {
        "input": [
            SimpleRGBImageDecoder(),
            ToTensor(),
            ToDevice("cuda:0"),
            ToTorchImage(),
            Convert(torch.float16),
        ],
        "target": None,
    }


def test_served_cuda_ipc_equals_shm(torch, daemon_factory, fixtures_dir: Path) -> None:
    from beton_client import Loader

    d = daemon_factory([fixtures_dir / "image_pairs.beton"])
    kw: dict = dict(batch_size=4, seed=3, drop_last=False, server=d.address)
    with Loader("image_pairs", pipelines=_pipelines(torch), **kw) as ipc:
        if ipc.chosen_transport != "cuda_ipc":
            pytest.skip(f"cuda_ipc not chosen: {ipc.transport_rejections}")
        with Loader("image_pairs", pipelines=_pipelines(torch), transport="shm", **kw) as shm:
            for _ in range(2):
                t0 = time.perf_counter()
                got = [tuple(x.clone() for x in b) for b in ipc]
                dt = time.perf_counter() - t0
                want = [tuple(x.clone() for x in b) for b in shm]
                assert len(got) == len(want) == len(ipc) > 0
                for a, b in zip(got, want, strict=True):
                    assert a[0].device.type == "cuda" and a[0].dtype == torch.float16
                    assert torch.equal(a[0].cpu(), b[0].cpu())
    record = {"figure": "served_cuda_ipc_epoch_s", "value": round(dt, 4), "unit": "s"}
    print("FIGURE", json.dumps(record))
    path = os.environ.get("BETON_GPU_FIGURES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    assert "transport cuda_ipc" in d.log()


def test_a_slow_cuda_ipc_client_gets_the_batch_published_before_the_error(
    torch, daemon_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuda_ipc client opens a slot's slab the first time it reads that slot. When it
    looks for its first batch only after the daemon published batch 0 and the bad-sample budget
    ran out at batch 1, the daemon must not have freed the ring yet: the client gets batch 0,
    equal to the in-process Loader's, then the same error (``Stream.hold_until_released``)."""
    import numpy as np
    from beton_client import Loader
    from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
    from beton_serve.loader import Loader as InProcessLoader
    from beton_serve.loader import OrderOption
    from beton_serve.transforms import ToDevice, ToTensor
    from helpers.bad_samples import SlowFirstRead, write_big_then_small

    path = tmp_path / "bigsmall.beton"
    write_big_then_small(path, [1, 5, 9, 10])

    def pipes(device: bool) -> dict:
        tail = [ToDevice("cuda:0")] if device else []
        return {
            "image": [CenterCropRGBImageDecoder((16, 16), 1.0), ToTensor(), *tail],
            "label": [IntDecoder(), ToTensor()],
        }

    kw: dict = dict(num_workers=2, order=OrderOption.RANDOM, seed=3)
    want: list = []
    want_error = None
    try:
        with InProcessLoader(
            str(path), 4, pipelines=pipes(False), bad_sample_budget=2, **kw
        ) as in_process:
            for image, label in in_process:
                want.append((np.asarray(image).copy(), np.asarray(label).copy()))
    except Exception as exc:
        want_error = f"{type(exc).__name__}: {exc}"
    assert len(want) == 1 and want_error is not None
    d = daemon_factory([path], args=["--bad-sample-budget", "2", "--workers", "2"])
    got: list = []
    error = None
    with Loader(str(path), 4, pipelines=pipes(True), server=d.address, spawn=False, **kw) as ld:
        if ld.chosen_transport != "cuda_ipc":
            pytest.skip(f"cuda_ipc not chosen: {ld.transport_rejections}")
        SlowFirstRead(monkeypatch, 1.5, then_fail=False)
        try:
            for image, label in ld:
                got.append((image.cpu().numpy().copy(), np.asarray(label).copy()))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    assert len(got) == len(want), error
    for (image, label), (w_image, w_label) in zip(got, want, strict=True):
        np.testing.assert_array_equal(image, w_image)
        np.testing.assert_array_equal(label, w_label)
    assert error == want_error
