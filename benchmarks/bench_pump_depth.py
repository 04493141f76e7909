"""The notice pump's depth (issue 15 §3): served ÷ in-process on CIFAR-like data, per depth.

    python benchmarks/bench_pump_depth.py [--depths default,0] [--cifar-n 20000] [--epochs 30]
                                          [--rounds 5]

One daemon per depth (``--workers 2``, started with ``BETON_SERVE_PUMP_DEPTH`` set to it;
``default``: unset, i.e. workers + 2; ``0``: every free slot, the rule before session 17), one
served client on each, and one in-process Loader (2 workers), all in this process, taking turns
in blocks of ``--epochs`` epochs for ``--rounds`` rounds (``bench_served.time_blocks``): only
one of them runs at a time. Pipelines and dataset as ``bench_served.py``'s CIFAR-like (raw
32x32 + flip, batch 512, order RANDOM).

Prints, per depth: served ÷ in-process images/s (median epochs), the median of the rounds'
ratios and each round's, the client's and the daemon's CPU per batch (/proc, 10 ms ticks, over
each block).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="default,0")
    ap.add_argument("--cifar-n", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from bench_served import time_blocks
    from beton_client import Loader as ServedLoader
    from beton_client import OrderOption as ServedOrder
    from beton_client import ServeOptions
    from beton_serve.daemon._pump import DEPTH_ENV
    from beton_serve.loader import Loader as LocalLoader
    from beton_serve.loader import OrderOption as LocalOrder
    from helpers.daemon import start_daemon

    depths = args.depths.split(",")
    path = build("cifar", args.cifar_n)
    kw = dict(batch_size=512, seed=0, pipelines=pipelines("cifar"))
    with tempfile.TemporaryDirectory(prefix="bpd-", dir="/tmp") as tmp:
        daemons = []
        try:
            for depth in depths:
                if depth == "default":
                    os.environ.pop(DEPTH_ENV, None)
                else:
                    os.environ[DEPTH_ENV] = depth
                work = Path(tmp) / f"d{len(daemons)}"
                work.mkdir()
                daemons.append(start_daemon([path], work, args=["--workers", "2"]))
            os.environ.pop(DEPTH_ENV, None)
            local = LocalLoader(str(path), order=LocalOrder.RANDOM, num_workers=2, **kw)
            served = [
                ServedLoader(
                    str(path),
                    order=ServedOrder.RANDOM,
                    serve=ServeOptions(server=d.address, spawn=False),
                    **kw,
                )
                for d in daemons
            ]
            res = time_blocks(
                [local, *served], args.epochs, args.rounds, [None, *[d.pid for d in daemons]]
            )
            batches = len(local)
            loc = res[0]
            print(
                "in-process",
                json.dumps(
                    {
                        "img_s": round(loc["n"] / loc["wall"]),
                        "cpu_us_per_batch": round(1e6 * loc["cpu"] / batches, 1),
                    }
                ),
            )
            for depth, r in zip(depths, res[1:], strict=True):
                rounds = [a / b for a, b in zip(loc["block_walls"], r["block_walls"], strict=True)]
                print(
                    f"depth={depth}",
                    json.dumps(
                        {
                            "served_over_in_process": round(loc["wall"] / r["wall"], 3),
                            "median_of_rounds": round(statistics.median(rounds), 3),
                            "per_round": [round(x, 3) for x in rounds],
                            "client_cpu_us_per_batch": round(1e6 * r["cpu"] / batches, 1),
                            "daemon_cpu_us_per_batch": round(1e6 * r["other_cpu"] / batches, 1),
                        }
                    ),
                    flush=True,
                )
            local.close()
            for s in served:
                s.close()
        finally:
            for d in daemons:
                d.stop()


if __name__ == "__main__":
    main()
