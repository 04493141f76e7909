"""The grpc transport served by a real daemon against the bare grpcio ceiling (issue 5 §2).

    python benchmarks/bench_grpc_served.py [--samples 1024] [--rounds 3] [--epochs 2]

A dataset of ``--samples`` 224x224x3 uint8 arrays (``NDArrayField``; the images of
``bench_grpc_transport.py``'s cached batch, repeated) is served by a daemon subprocess
(``--workers 2 --no-share``, ``--listen 127.0.0.1:PORT``). Batches of 256 (38.5 MB), order
SEQUENTIAL; "decoding" is a copy, so the transport dominates. In the same run, interleaved:

* ``raw-2M``: the ceiling: ``bench_grpc_transport.serve("threaded")`` streaming preallocated
  ``bytes`` chunks of 2 MiB through a pass-through handler; the client only counts them;
* ``served-grpc``: ``beton_client.Loader(server="127.0.0.1:PORT", transport="grpc")``, epochs
  over the daemon's batch method (decode into the ring, framing, pooled client buffers);
* ``served-shm``: the same Loader over the Unix socket and shm, for reference.

Reported per configuration: median GB/s (1 GB = 1e9 bytes of batch), client and server CPU
seconds per GB (client: this process; server: the daemon from /proc, or the raw server's rusage).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
DATA = HERE / "_data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(samples: int) -> Path:
    from bench_grpc_transport import make_batch
    from beton_serve.fields import IntField, NDArrayField
    from beton_serve.writer import DatasetWriter

    path = DATA / f"ndarray224_{samples}.beton"
    if path.exists():
        return path
    batch = make_batch(DATA)

    class Images:
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int):
            return batch[i % len(batch)], i

    fields = {"image": NDArrayField(np.dtype("uint8"), (224, 224, 3)), "label": IntField()}
    DatasetWriter(path, fields, num_workers=1).from_indexed_dataset(Images())
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    from bench_grpc_transport import MiB, cpu_now, run_raw, serve, server_cpu
    from bench_served import proc_cpu
    from beton_client import Loader, ServeOptions
    from beton_client._transport.grpc_codec import CHANNEL_OPTIONS
    from helpers.daemon import start_daemon

    path = build(args.samples)
    batch_bytes = 256 * 224 * 224 * 3
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    raw_proc = ctx.Process(target=serve, args=("threaded", str(DATA), b), daemon=True)
    raw_proc.start()
    raw_ch = grpc.insecure_channel(f"127.0.0.1:{a.recv()}", options=CHANNEL_OPTIONS)
    results: dict[str, list[tuple[float, float, float]]] = {
        "raw-2M": [],
        "served-grpc": [],
        "served-shm": [],
    }
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        port = free_port()
        d = start_daemon(
            [path],
            Path(tmp),
            args=["--workers", "2", "--no-share", "--listen", f"127.0.0.1:{port}"],
        )
        kw: dict = dict(batch_size=256, seed=0, drop_last=True)
        grpc_ld = Loader(
            path.stem,
            serve=ServeOptions(server=f"127.0.0.1:{port}", transport="grpc", spawn=False),
            **kw,
        )
        shm_ld = Loader(
            path.stem, serve=ServeOptions(server=d.address, transport="shm", spawn=False), **kw
        )
        n_batches = len(grpc_ld)

        def epochs(ld) -> int:
            total = 0
            for _ in range(args.epochs):
                for x in ld:
                    total += int(x[0].nbytes)
            return total

        try:
            run_raw(raw_ch, 1, 2 * MiB)
            epochs(grpc_ld)
            epochs(shm_ld)
            for _ in range(args.rounds):
                for name in results:
                    c0, t0 = cpu_now(), time.perf_counter()
                    if name == "raw-2M":
                        s0 = server_cpu(raw_ch)
                        nbytes = run_raw(raw_ch, args.epochs * n_batches, 2 * MiB)
                        dt = time.perf_counter() - t0
                        s1 = server_cpu(raw_ch)
                    else:
                        s0 = proc_cpu(d.pid)
                        nbytes = epochs(grpc_ld if name == "served-grpc" else shm_ld)
                        dt = time.perf_counter() - t0
                        s1 = proc_cpu(d.pid)
                    c1 = cpu_now()
                    gb = nbytes / 1e9
                    results[name].append((gb / dt, (s1 - s0) / gb, (c1 - c0) / gb))
        finally:
            grpc_ld.close()
            shm_ld.close()
            d.stop()
            a.send("stop")
            raw_proc.join(10)
            raw_ch.close()
    ceiling = statistics.median(r[0] for r in results["raw-2M"])
    for name, rs in results.items():
        gbs = statistics.median(r[0] for r in rs)
        print(
            json.dumps(
                {
                    "config": name,
                    "gb_s": round(gbs, 3),
                    "min": round(min(r[0] for r in rs), 3),
                    "max": round(max(r[0] for r in rs), 3),
                    "vs_raw": round(gbs / ceiling, 2),
                    "server_cpu_s_per_gb": round(statistics.median(r[1] for r in rs), 3),
                    "client_cpu_s_per_gb": round(statistics.median(r[2] for r in rs), 3),
                    "batch_mb": round(batch_bytes / 1e6, 1),
                    "batches": args.epochs * n_batches,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
