"""The demo's trainer: a small user program that reads batches from a daemon.

``beton-serve demo`` runs this module as a separate process (``python -m
beton_serve.cli._demo_trainer DATASET --server unix:///... --trainer I``). It stands for a user's
training script: it talks to the daemon only through ``beton_client`` and is never imported by
the daemon or the rest of ``beton_serve``.

Trainer ``I`` uses its own pipeline and seed (even: random flips, odd: plain decode), so the
daemon serves two different streams from one worker pool. With torch installed it trains a tiny
convolutional model on the batches; without torch it receives numpy arrays and reduces them.

It prints one JSON line: ``{"trainer", "images", "batches", "wall_s", "stall_s", "pipeline"}``,
where ``stall_s`` is the time spent inside ``next(loader)`` waiting for data.
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
    from beton_serve.transforms import RandomHorizontalFlip

    image: list[Any] = [SimpleRGBImageDecoder()]
    name = "decode"
    if trainer % 2 == 0:
        image.append(RandomHorizontalFlip())
        name = "decode+flip"
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

    from beton_client import Loader, OrderOption

    with_torch = importlib.util.find_spec("torch") is not None
    pipelines, pipeline_name = _pipelines(args.trainer, with_torch)
    loader = Loader(
        args.dataset,
        batch_size=args.batch_size,
        order=OrderOption.RANDOM,
        seed=args.trainer,
        pipelines=pipelines,
        drop_last=False,
        server=args.server,
    )
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
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step(images: Any, labels: Any) -> None:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(images / 255.0), labels.long() % 10)
            loss.backward()
            opt.step()

    else:

        def step(images: Any, labels: Any) -> None:
            images.mean()

    images_seen = batches = 0
    stall = 0.0
    start = time.perf_counter()
    for _ in range(args.epochs):
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                images, labels = next(it)
            except StopIteration:
                break
            stall += time.perf_counter() - t0
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
        "wall_s": round(wall, 4),
        "stall_s": round(stall, 4),
        "pipeline": pipeline_name,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
