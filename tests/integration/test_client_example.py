# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The seed's example (issue 4 §6) against a real daemon, with only its ffcv imports changed.

Two substitutions, as the issue allows: torchvision's ``Normalize`` (torchvision is not
installable here) is replaced by an equivalent ``nn.Module``, and ``cuda:0`` by ``cpu``. The
fixture holds 16 pairs, so the batch size is 8 instead of 32. The second ``ToTensor()`` after
``ToTorchImage()`` (the user's own code) is a no-op on a tensor, as in FFCV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.daemon import daemon  # noqa: F401

pytestmark = pytest.mark.slow

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


class Normalize(torch.nn.Module):
    """What torchvision.transforms.Normalize computes on an (N, C, H, W) float tensor."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def test_seed_example_runs_served(
    daemon, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BETON_SERVE_ADDRESS", daemon.address)
    # --- the user's code; only these imports differ from FFCV's -----------------------------
    from beton_client import Loader, OrderOption
    from beton_serve.fields.decoders import SimpleRGBImageDecoder
    from beton_serve.transforms import Convert, ToDevice, ToTensor, ToTorchImage

    loader = Loader(
        str(fixtures_dir / "image_pairs.beton"),
        batch_size=8,
        num_workers=4,
        order=OrderOption.RANDOM,
        pipelines={
            "input": [
                SimpleRGBImageDecoder(),
                ToTensor(),
                ToTorchImage(),
                ToTensor(),
                Convert(torch.float32),
                Normalize(MEAN, STD),
                ToDevice(torch.device("cpu")),
            ],
            "target": [
                SimpleRGBImageDecoder(),
                ToTensor(),
                ToTorchImage(),
                Convert(torch.float32),
                Normalize(MEAN, STD),
                ToDevice(torch.device("cpu")),
            ],
        },
        drop_last=True,
    )
    # ---------------------------------------------------------------------------------------
    expected = np.load(fixtures_dir / "image_pairs.expected.npz")
    norm = Normalize(MEAN, STD)
    try:
        assert len(loader) == 2
        seen = []
        for _epoch in range(2):
            for x, y in loader:
                ids = loader.last_sample_ids.astype(np.int64)
                seen.append(ids)
                assert x.shape == (8, 3, 24, 32) and y.shape == (8, 3, 48, 64)
                assert x.dtype == y.dtype == torch.float32
                ref_x = norm(torch.from_numpy(expected["input"][ids]).permute(0, 3, 1, 2).float())
                ref_y = norm(torch.from_numpy(expected["target"][ids]).permute(0, 3, 1, 2).float())
                assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
        assert sorted(np.concatenate(seen[:2]).tolist()) == list(range(16))
        assert not np.array_equal(np.concatenate(seen[:2]), np.concatenate(seen[2:]))
    finally:
        loader.close()
