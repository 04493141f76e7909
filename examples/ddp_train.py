"""DDP training on CPU (gloo): several ranks share ONE beton-serve daemon.

Every rank opens a ``beton_client.Loader(distributed=True)`` on the same daemon. The daemon
decodes each rank's share of every epoch on its one worker pool; rank r receives the samples
FFCV's distributed rule gives it (``DistributedSampler`` order), and the ranks' shares are disjoint.

Run it (a daemon must serve the dataset, or the client auto-spawns one)::

    beton-serve data.beton &                        # or let the client spawn it
    python examples/ddp_train.py data.beton --nproc 2 --epochs 1

or under torchrun, which sets RANK / WORLD_SIZE / MASTER_ADDR itself::

    torchrun --nproc-per-node 2 examples/ddp_train.py data.beton

The dataset needs an ``RGBImageField`` named ``image`` and an ``IntField`` named ``label``
(``beton-serve demo --write-only PATH`` writes one). Each rank prints one JSON line at the end:
``{"rank": r, "world_size": w, "samples": n, "batches": b, "loss": x, "stall_s": s, "wall_s": t}``.

``--eval-server`` adds an evaluation pass per epoch on rank 0 through another daemon or a list of
daemons (a remote decode pool, e.g. ``host1:7700,host2:7700``) over gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("dataset", help="path of the .beton file the daemon serves")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--res", type=int, default=32, help="training crop size")
    p.add_argument("--classes", type=int, default=10, help="number of label values")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server",
        default=None,
        help="daemon address (unix:///path.sock or host:port); default: $BETON_SERVE_ADDRESS, "
        "then the per-user default socket",
    )
    p.add_argument(
        "--eval-server",
        default=None,
        help="comma-separated daemon addresses for an evaluation pass on rank 0 (gRPC)",
    )
    p.add_argument(
        "--eval-token-file",
        default=None,
        help="file holding the bearer token of the --eval-server daemons",
    )
    p.add_argument("--backend", default="gloo", help="torch.distributed backend")
    return p.parse_args(argv)


def build_pipelines(res: int) -> dict[str, list[Any]]:
    """An FFCV-style training pipeline: only the imports differ from FFCV's."""
    import numpy as np
    import torch
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.transforms import (
        Convert,
        NormalizeImage,
        RandomHorizontalFlip,
        Squeeze,
        ToDevice,
        ToTensor,
        ToTorchImage,
    )

    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255
    device = torch.device("cpu")
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((res, res)),
            RandomHorizontalFlip(),
            ToTensor(),
            ToDevice(device, non_blocking=True),
            ToTorchImage(),
            NormalizeImage(mean, std, np.float32),
        ],
        "label": [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device), Convert(torch.int64)],
    }


def make_model(classes: int) -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, classes),
    )


def evaluate(model: Any, args: argparse.Namespace) -> float:
    """One pass over the dataset through the remote daemons; returns the accuracy."""
    import torch
    from beton_client import Loader, OrderOption, ServeOptions

    servers = [s for s in args.eval_server.split(",") if s]
    token = None
    if args.eval_token_file:
        with open(args.eval_token_file) as f:
            token = f.read().strip()
    loader = Loader(
        args.dataset,
        batch_size=args.batch_size,
        order=OrderOption.SEQUENTIAL,
        pipelines=build_pipelines(args.res),
        serve=ServeOptions(
            server=servers if len(servers) > 1 else servers[0], transport="grpc", token=token
        ),
    )
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            correct += int((model(images).argmax(1) == labels).sum())
            total += int(labels.numel())
    model.train()
    return correct / max(total, 1)


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank; returns the summary that is printed as JSON."""
    import torch
    import torch.distributed as dist
    from beton_client import Loader, OrderOption, ServeOptions
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # the daemon does the decoding; leave the cores to it
    torch.manual_seed(args.seed)
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)
    try:
        # The process group exists, so the Loader takes rank and world size from it.
        loader = Loader(
            args.dataset,
            batch_size=args.batch_size,
            num_workers=1,  # a hint only: the daemon owns the worker pool
            order=OrderOption.RANDOM,
            distributed=True,
            seed=args.seed,
            pipelines=build_pipelines(args.res),
            drop_last=True,
            serve=ServeOptions(server=args.server),
        )
        model = DistributedDataParallel(make_model(args.classes))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        samples = batches = 0
        stall = 0.0
        loss = torch.zeros(())
        accuracy = None
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
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(images), labels % args.classes)
                loss.backward()
                opt.step()
                samples += int(labels.numel())
                batches += 1
            if args.eval_server and rank == 0:
                accuracy = evaluate(model.module, args)
        wall = time.perf_counter() - start
        summary: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "samples": samples,
            "batches": batches,
            "batches_per_epoch": len(loader),
            "loss": float(loss.detach()),
            "stall_s": round(stall, 4),
            "wall_s": round(wall, 4),
        }
        if accuracy is not None:
            summary["eval_accuracy"] = accuracy
        return summary
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    summary = train(rank, world_size, args)
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    mp.spawn(_worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
