"""Served CIFAR-like streams with the client's coalesced waits on and off, one daemon, K clients.

    python benchmarks/bench_coalesce.py [--clients 1,4] [--epochs 5] [--rounds 2] [--cifar-n 20000]

One daemon (``--workers 2``) serves ``--clients`` client processes at once, each a
``beton_client.Loader`` over the CIFAR-like set of ``bench_loader.py`` (raw 32x32,
SimpleRGBImageDecoder + RandomHorizontalFlip + ToTensor, batch 512, order RANDOM, a different
seed per client so that no decode is shared). Each client runs a warm-up epoch, waits for the
others, then ``--epochs`` timed epochs. The two settings of ``BETON_CLIENT_COALESCE_WAITS``
take turns for ``--rounds`` rounds, on the same daemon.

Reported per setting and round: images/s over all clients (all images over the wall time until
the last finishes), the clients' CPU per batch (process CPU), the daemon's CPU per batch (every
thread, from ``/proc/<pid>/task/*/schedstat``, nanoseconds), and their sum.

Why: when the daemon is the bottleneck a client finds no batch ready almost every time, and each
wait is a sleep and a wake-up on both sides (``beton_client._stream._Stream.nap_for``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

_CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[5])
from bench_loader import pipelines
from beton_client import Loader, OrderOption, ServeOptions
ld = Loader(sys.argv[1], batch_size=512, order=OrderOption.RANDOM, seed=int(sys.argv[3]),
            pipelines=pipelines("cifar"), serve=ServeOptions(server=sys.argv[2]))
for _ in ld:
    pass
print("READY", flush=True)
sys.stdin.readline()
c0, t0, nb = time.process_time(), time.perf_counter(), 0
for _ in range(int(sys.argv[4])):
    for _ in ld:
        nb += 1
print(json.dumps({"nb": nb, "wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}),
      flush=True)
ld.close()
"""


def daemon_cpu(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` (schedstat: nanosecond resolution)."""
    total = 0
    for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            total += int(Path(task).read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            pass
    return total / 1e9


def run(path: Path, address: str, pid: int, clients: int, epochs: int, coalesce: str) -> dict:
    env = dict(os.environ, BETON_CLIENT_COALESCE_WAITS=coalesce)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, str(path), address, str(i), str(epochs), str(HERE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(clients)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "READY"
        d0, t0 = daemon_cpu(pid), time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        wall, dcpu = time.perf_counter() - t0, daemon_cpu(pid) - d0
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    nb = sum(r["nb"] for r in results)
    ccpu = sum(r["cpu"] for r in results)
    return {
        "coalesce": coalesce,
        "clients": clients,
        "images_per_s": nb * 512 / wall,
        "client_cpu_us_per_batch": 1e6 * ccpu / nb,
        "daemon_cpu_us_per_batch": 1e6 * dcpu / nb,
        "total_cpu_us_per_batch": 1e6 * (ccpu + dcpu) / nb,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cifar-n", type=int, default=20000)
    args = ap.parse_args()

    from bench_loader import build
    from helpers.daemon import start_daemon

    path = build("cifar", args.cifar_n)
    out = []
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", "2"])
        try:
            for k in (int(x) for x in args.clients.split(",")):
                for _ in range(args.rounds):
                    for coalesce in ("1", "0"):
                        r = run(path, d.address, d.pid, k, args.epochs, coalesce)
                        out.append(r)
                        print(
                            f"clients={k} coalesce={coalesce}  {r['images_per_s'] / 1e6:.3f} M img/s"
                            f"  client {r['client_cpu_us_per_batch']:.1f} us/b"
                            f"  daemon {r['daemon_cpu_us_per_batch']:.1f} us/b"
                            f"  total {r['total_cpu_us_per_batch']:.1f} us/b",
                            flush=True,
                        )
                        time.sleep(0.5)
        finally:
            d.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
