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
