"""Issue 6: the daemon's resident memory over 10 epochs of one client (does it stay flat?).

    python benchmarks/bench_daemon_rss.py [--kind imagenet] [--n 500] [--batch 64] [--epochs 10]

One daemon (``--workers 2``) serves the issue-3 dataset of ``bench_loader.py``; one
``beton_client.Loader`` (RANDOM order, the kind's pipeline) reads ``--epochs`` epochs. After each
epoch the daemon's ``VmRSS`` and ``RssShmem`` are read from ``/proc/<pid>/status`` (RSS includes
the stream's shared-memory ring once it is touched). Prints one JSON line per epoch, then a
summary: the curve, growth from epoch 1 to the last, and the largest epoch-to-epoch step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))


def status_kib(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssShmem`` and ``VmHWM`` of ``pid`` in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="imagenet", choices=["imagenet", "cifar"])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from beton_client import Loader, OrderOption, ServeOptions
    from helpers.daemon import start_daemon

    path = build(args.kind, args.n)
    curve = []
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", "2"])
        try:
            start = status_kib(d.pid)
            print(json.dumps({"epoch": "start", **start}), flush=True)
            with Loader(
                str(path),
                batch_size=args.batch,
                order=OrderOption.RANDOM,
                seed=0,
                pipelines=pipelines(args.kind),
                drop_last=False,
                serve=ServeOptions(server=d.address, spawn=False),
            ) as ld:
                for e in range(args.epochs):
                    t0 = time.perf_counter()
                    n = sum(len(b[0]) for b in ld)
                    row = {
                        "epoch": e + 1,
                        "images": n,
                        "wall_s": round(time.perf_counter() - t0, 3),
                        **status_kib(d.pid),
                    }
                    curve.append(row)
                    print(json.dumps(row), flush=True)
            after_close = status_kib(d.pid)
        finally:
            d.stop(signal.SIGTERM)
    rss = [r["VmRSS"] for r in curve]
    steps = [b - a for a, b in itertools.pairwise(rss)]
    summary = {
        "rss_mib": [round(x / 1024, 1) for x in rss],
        "start_mib": round(start["VmRSS"] / 1024, 1),
        "after_close_mib": round(after_close["VmRSS"] / 1024, 1),
        "growth_epoch1_to_last_mib": round((rss[-1] - rss[0]) / 1024, 1),
        "growth_epoch2_to_last_mib": round((rss[-1] - rss[1]) / 1024, 1) if len(rss) > 1 else 0,
        "max_step_mib": round(max(steps, default=0) / 1024, 1),
    }
    print(json.dumps({"summary": summary}, indent=1))


if __name__ == "__main__":
    main()
