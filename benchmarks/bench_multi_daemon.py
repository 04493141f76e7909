"""Several daemons against one, on loopback TCP over the grpc transport (issue 5).

    python benchmarks/bench_multi_daemon.py [--kind imagenet|cifar] [--n 500] [--batch 64]
                                            [--epochs 3]

Configurations (each a ``beton_client.Loader`` with ``transport="grpc"`` over 127.0.0.1, order
RANDOM, the pipelines of ``bench_loader.py``):

* ``1 daemon x 1 worker``;
* ``2 daemons x 1 worker`` (``server=[a, b]``: batch b from daemon b mod 2);
* ``1 daemon x 2 workers`` (the same decode threads as two daemons, in one process).

After a warm-up epoch each (compilation), ``--epochs`` timed epochs of every configuration are
interleaved (the machine is shared); the median epoch gives images/s. The client's CPU per batch
and each daemon's CPU per image (from /proc) are reported too. One JSON line per configuration.
Daemons run with ``--no-share``: two configurations read daemon ``a1`` with identical streams,
which work sharing (issue 6) would otherwise decode once for both.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="imagenet", choices=["imagenet", "cifar"])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from bench_served import proc_cpu
    from beton_client import Loader, OrderOption, ServeOptions
    from helpers.daemon import start_daemon

    path = build(args.kind, args.n)
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        daemons = {}
        for name, workers in (("a1", 1), ("b1", 1), ("c2", 2)):
            port = free_port()
            d = start_daemon(
                [path],
                Path(tmp),
                socket=str(Path(tmp) / f"{name}.sock"),
                # --no-share: "1 daemon x 1 worker" and "2 daemons" both read daemon a1 with the
                # same stream parameters, which work sharing would otherwise decode once
                args=["--workers", str(workers), "--listen", f"127.0.0.1:{port}", "--no-share"],
            )
            daemons[name] = (d, f"127.0.0.1:{port}")
        try:
            configs = {
                "1 daemon x 1 worker": ["a1"],
                "2 daemons x 1 worker": ["a1", "b1"],
                "1 daemon x 2 workers": ["c2"],
            }
            loaders = {
                label: Loader(
                    str(path),
                    batch_size=args.batch,
                    order=OrderOption.RANDOM,
                    seed=0,
                    pipelines=pipelines(args.kind),
                    serve=ServeOptions(
                        server=[daemons[n][1] for n in names], transport="grpc", spawn=False
                    ),
                )
                for label, names in configs.items()
            }
            for ld in loaders.values():  # warm-up: compile
                for _ in ld:
                    pass
            walls: dict[str, list[float]] = {k: [] for k in loaders}
            client_cpu: dict[str, list[float]] = {k: [] for k in loaders}
            daemon_cpu: dict[str, list[float]] = {k: [] for k in loaders}
            samples = 0
            for _ in range(args.epochs):
                for label, ld in loaders.items():
                    pids = [daemons[n][0].pid for n in configs[label]]
                    d0 = sum(proc_cpu(p) for p in pids)
                    c0, t0 = time.process_time(), time.perf_counter()
                    samples = sum(len(b[0]) for b in ld)
                    walls[label].append(time.perf_counter() - t0)
                    client_cpu[label].append(time.process_time() - c0)
                    daemon_cpu[label].append(sum(proc_cpu(p) for p in pids) - d0)
            base = samples / statistics.median(walls["1 daemon x 1 worker"])
            for label, ld in loaders.items():
                img_s = samples / statistics.median(walls[label])
                print(
                    json.dumps(
                        {
                            "config": label,
                            "kind": args.kind,
                            "batch": args.batch,
                            "samples": samples,
                            "img_s": round(img_s, 1),
                            "vs_1x1": round(img_s / base, 2),
                            "epochs_s": [round(w, 2) for w in walls[label]],
                            "client_cpu_ms_per_batch": round(
                                1000 * statistics.mean(client_cpu[label]) / len(ld), 2
                            ),
                            "daemon_cpu_ms_per_img": round(
                                1000 * statistics.mean(daemon_cpu[label]) / samples, 3
                            ),
                        }
                    ),
                    flush=True,
                )
            for ld in loaders.values():
                ld.close()
        finally:
            for d, _ in daemons.values():
                d.stop()


if __name__ == "__main__":
    main()
