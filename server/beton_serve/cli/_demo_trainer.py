"""The demo's trainer: a small user program that reads batches from a daemon.

``beton-serve demo`` runs this module as a separate process (``python -m
beton_serve.cli._demo_trainer DATASET --server unix:///... --trainer I``). It stands for a user's
training script: it talks to the daemon only through ``beton_client`` and is never imported by
the daemon or the rest of ``beton_serve``.

Every trainer uses the same pipeline (decode) with its own seed, so the daemon compiles the
pipeline once and serves two different streams (two random orders) from one worker pool. With torch installed it trains a tiny
convolutional model on the batches; without torch it receives numpy arrays and reduces them.

It prints one JSON line: ``{"trainer", "images", "batches", "open_s", "wall_s", "stall_s",
"first_batch_s", "pipeline"}``: ``open_s`` is the Loader's construction (the daemon validates and
plans the pipeline), ``wall_s`` the training loop, ``stall_s`` the part of it spent inside
``next(loader)`` waiting for data, and ``first_batch_s`` the wait for the very first batch (it
includes compiling the pipeline in the daemon, and is part of ``stall_s``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Any


def _pipelines(trainer: int, with_torch: bool) -> tuple[dict[str, list[Any]], str]:
    from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder

    image: list[Any] = [SimpleRGBImageDecoder()]
    name = f"decode, seed {trainer}"
    label: list[Any] = [IntDecoder()]
    if with_torch:
        import torch

        from beton_serve.transforms import Convert, Squeeze, ToDevice, ToTensor, ToTorchImage

        image += [ToTensor(), ToDevice(torch.device("cpu")), ToTorchImage(), Convert(torch.float32)]
        label += [ToTensor(), Squeeze(), ToDevice(torch.device("cpu"))]
        name += " -> torch"
    return {"image": image, "label": label}, name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="beton-serve demo trainer")
    p.add_argument("dataset")
    p.add_argument("--server", required=True)
    p.add_argument("--trainer", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)

    from beton_client import Loader, OrderOption, ServeOptions

    with_torch = importlib.util.find_spec("torch") is not None
    pipelines, pipeline_name = _pipelines(args.trainer, with_torch)
    t_open = time.perf_counter()
    loader = Loader(
        args.dataset,
        batch_size=args.batch_size,
        order=OrderOption.RANDOM,
        seed=args.trainer,
        pipelines=pipelines,
        drop_last=False,
        serve=ServeOptions(server=args.server),
    )
    open_s = time.perf_counter() - t_open
    step: Any
    if with_torch:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(args.trainer)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 10),
        )
        loss_fn = torch.nn.CrossEntropyLoss()
        params = list(model.parameters())

        def step(images: Any, labels: Any) -> None:
            # Plain SGD by hand: torch.optim's first step imports torch._dynamo (seconds).
            loss = loss_fn(model(images / 255.0), labels.long() % 10)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param.sub_(grad, alpha=0.01)

    else:

        def step(images: Any, labels: Any) -> None:
            images.mean()

    images_seen = batches = 0
    stall = 0.0
    first_batch = None
    start = time.perf_counter()
    for _ in range(args.epochs):
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                images, labels = next(it)
            except StopIteration:
                break
            waited = time.perf_counter() - t0
            stall += waited
            if first_batch is None:
                first_batch = waited
            step(images, labels)
            images_seen += len(labels)
            batches += 1
    wall = time.perf_counter() - start
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    result = {
        "trainer": args.trainer,
        "images": images_seen,
        "batches": batches,
        "open_s": round(open_s, 4),
        "wall_s": round(wall, 4),
        "stall_s": round(stall, 4),
        "first_batch_s": round(first_batch or 0.0, 4),
        "pipeline": pipeline_name,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
