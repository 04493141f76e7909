"""What an epoch's start costs, in process against served, on the CIFAR-like file.

    python benchmarks/bench_epoch_start.py [--epochs 15] [--rounds 3] [--workers 2]

The CIFAR-like file of ``bench_loader.py`` (50,000 samples, batch 512, RANDOM, the pipeline of
``bench_served.py``), one in-process Loader and one served Loader (a daemon with ``--workers``
workers) taking turns. Per round and loader, after a warm-up epoch: the median time from
``iter(loader)`` to the first batch over ``--epochs`` epochs, and the median wall time per batch of
the rest of each epoch. A CIFAR epoch is ~100 batches of ~0.3 ms, so an epoch start of 1.5 ms
instead of one batch's 0.3 ms is ~4 % of the epoch (RESULTS, session 37).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from beton_client import Loader as ServedLoader
    from beton_client import OrderOption as ServedOrder
    from beton_client import ServeOptions
    from beton_serve.loader import Loader as LocalLoader
    from beton_serve.loader import OrderOption as LocalOrder
    from helpers.daemon import start_daemon

    path = build("cifar", 50000)
    common = {"batch_size": 512, "seed": 0}
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", str(args.workers)])
        try:
            # Each Loader gets its own op objects (a Loader takes the ops it is given).
            local = LocalLoader(
                str(path),
                order=LocalOrder.RANDOM,
                pipelines=pipelines("cifar"),
                num_workers=args.workers,
                **common,
            )
            served = ServedLoader(
                str(path),
                order=ServedOrder.RANDOM,
                pipelines=pipelines("cifar"),
                serve=ServeOptions(server=d.address),
                **common,
            )
            try:
                for _ in range(args.rounds):
                    for name, loader in (("in process", local), ("served", served)):
                        for _ in loader:  # warm-up epoch
                            pass
                        starts, per_batch = [], []
                        for _ in range(args.epochs):
                            t0 = time.perf_counter()
                            it = iter(loader)
                            next(it)
                            t1 = time.perf_counter()
                            for _ in it:
                                pass
                            t2 = time.perf_counter()
                            starts.append(1e3 * (t1 - t0))
                            per_batch.append(1e6 * (t2 - t1) / (len(loader) - 1))
                        print(
                            f"{name:10s} iter() to first batch {statistics.median(starts):.2f} ms "
                            f"(min {min(starts):.2f}); then {statistics.median(per_batch):.0f} "
                            "us per batch",
                            flush=True,
                        )
            finally:
                local.close()
                served.close()
        finally:
            d.stop()


if __name__ == "__main__":
    main()
