"""Train a tiny image-to-image model on the paired .beton, served by beton-serve.

    beton-serve dataset.beton &        # or let the Loader start a daemon itself
    python examples/paired_images/train.py dataset.beton --epochs 2

The Loader call is the user's FFCV snippet with only the imports changed (issue 4, section 6):
both fields are decoded by the daemon (``SimpleRGBImageDecoder``: every image of a field must
have one size), and everything after the decoder runs in this process on the received tensor.
The second ``ToTensor()`` after ``ToTorchImage()`` is in the user's original code; on a tensor it
changes nothing. ``torchvision.transforms.Normalize`` is used when torchvision is installed; an
equivalent module otherwise. ``cuda:0`` is used when CUDA is available, else the CPU.

Prints one JSON line at the end: ``{"batches", "samples", "first_loss", "last_loss"}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from beton_client import Loader, OrderOption, ServeOptions  # was: from ffcv.loader import ...
from beton_serve.fields.decoders import SimpleRGBImageDecoder  # was: ffcv.fields.decoders
from beton_serve.transforms import Convert, ToDevice, ToTensor, ToTorchImage  # was: ffcv.transforms

MEAN = [0.5 * 255, 0.5 * 255, 0.5 * 255]
STD = [0.25 * 255, 0.25 * 255, 0.25 * 255]


def normalize_module(mean: list[float], std: list[float]) -> torch.nn.Module:
    """``torchvision.transforms.Normalize(mean, std)``, or the same computation without torchvision."""
    try:
        import torchvision
    except ImportError:

        class Normalize(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
                self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (x - self.mean.to(x.device)) / self.std.to(x.device)

        return Normalize()
    return torchvision.transforms.Normalize(mean, std)


def make_loader(path: str, batch_size: int, server: str | None) -> Loader:
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    # The user's snippet, verbatim apart from `device`, `server` and the Normalize fallback.
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=4,
        order=OrderOption.RANDOM,
        pipelines={
            "input": [
                SimpleRGBImageDecoder(),
                ToTensor(),
                ToTorchImage(),
                ToTensor(),
                Convert(torch.float32),
                normalize_module(MEAN, STD),
                ToDevice(device),
            ],
            "target": [
                SimpleRGBImageDecoder(),
                ToTensor(),
                ToTorchImage(),
                Convert(torch.float32),
                normalize_module(MEAN, STD),
                ToDevice(device),
            ],
        },
        drop_last=True,
        serve=ServeOptions(server=server),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("dataset")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--server", default=None, help="daemon address; default: auto")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = make_loader(args.dataset, args.batch_size, args.server)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 3, 3, padding=1),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[float] = []
    samples = 0
    for _ in range(args.epochs):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(inputs + model(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            samples += inputs.shape[0]
    result = {
        "batches": len(losses),
        "samples": samples,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
