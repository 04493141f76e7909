"""Served (shm) against in-process throughput, client CPU per batch, and 4 clients on one daemon.

    python benchmarks/bench_served.py [--imagenet-n 500] [--cifar-n 5000] [--epochs 2] [--rounds 3]
                                      [--clients 4 (0: skip part 3)]

Uses the issue-3 datasets and pipelines of ``bench_loader.py`` (ImageNet-like JPEG with
RandomResizedCrop 224 + flip, batch 256; CIFAR-like raw 32x32 + flip, batch 512), order RANDOM.

1. Throughput: one in-process ``beton_serve.loader.Loader`` (2 workers) and one
   ``beton_client.Loader`` against a daemon subprocess (``--workers 2``), taking turns for
   ``--rounds`` rounds: each turn is a warm-up epoch, then ``--epochs`` timed epochs back to back
   (see :func:`time_blocks`); the median epoch of each; the ratio served / in-process.
   Also the ratio of each round's two blocks and their median (less exposed to the load's
   drift), and the daemon's CPU per batch (from /proc around each served block).
2. Client-side CPU per batch: the trainer process's own CPU time (user + system) for a served
   epoch divided by its batches: the cost of receiving a batch (control messages + tensor views);
   with the daemon's, ``cpu_ratio`` = served (client + daemon) CPU / in-process CPU per batch.
3. ``--clients`` processes sharing one daemon against as many processes each running an
   in-process Loader, all started together, one epoch each after a warm-up epoch (compilation):
   total images/s (all images over the wall time until the last finishes) and total CPU seconds
   (clients + daemon, from /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

BATCH = {"imagenet": 256, "cifar": 512}
CLK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / CLK


def time_blocks(
    loaders: list, epochs: int, rounds: int, pids: list[int | None] | None = None
) -> list[dict]:
    """Time each loader in blocks of back-to-back epochs, the loaders taking turns.

    A block is one untimed epoch, then ``epochs`` timed epochs run back to back, as a training
    loop runs them: the served stream's look-ahead into the next epoch (``daemon._pump``) is
    then earned inside the block, in the tail of the epoch before, exactly as in steady state.
    After every block the machine is left idle for a moment, so that work a loader started for
    an epoch nobody will read (the look-ahead after its last block) never runs inside another
    loader's timed block. The machine is shared and its load drifts, hence the turns and the
    ``rounds``.

    ``pids[i]``: another process whose CPU time the timed epochs of loader ``i`` also cost (the
    daemon, for a served loader), read from /proc around each block.

    Returns, per loader: ``wall`` (the median wall time of an epoch), ``cpu`` (the mean CPU time
    of this process per epoch), ``other_cpu`` (the mean CPU time of ``pids[i]`` per epoch, 0
    without one), ``n`` (the samples of an epoch) and ``block_walls`` (the median epoch of each
    round's block, in round order: blocks of one round ran minutes apart at most, so the ratio
    of two loaders' blocks in the same round is less exposed to the load's drift than the ratio
    of the overall medians).
    """
    pids = pids or [None] * len(loaders)
    walls: list[list[float]] = [[] for _ in loaders]
    blocks: list[list[float]] = [[] for _ in loaders]
    cpus: list[list[float]] = [[] for _ in loaders]
    others: list[list[float]] = [[] for _ in loaders]
    counts = [0] * len(loaders)
    for _ in range(rounds):
        for i, ld in enumerate(loaders):
            for _ in ld:  # untimed: compilation (first round), then the steady state's start
                pass
            pid = pids[i]
            o0 = proc_cpu(pid) if pid else 0.0
            block: list[float] = []
            for _ in range(epochs):
                c0, t0 = time.process_time(), time.perf_counter()
                n = 0
                for b in ld:
                    n += len(b[0])
                block.append(time.perf_counter() - t0)
                cpus[i].append(time.process_time() - c0)
                counts[i] = n
            others[i].append(((proc_cpu(pid) if pid else 0.0) - o0) / epochs)
            walls[i] += block
            blocks[i].append(statistics.median(block))
            time.sleep(0.3)
    return [
        {
            "wall": statistics.median(w),
            "cpu": statistics.mean(c),
            "other_cpu": statistics.mean(o),
            "n": n,
            "block_walls": bl,
        }
        for w, c, o, n, bl in zip(walls, cpus, others, counts, blocks, strict=True)
    ]


_CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
from bench_loader import pipelines
mode, path, kind = sys.argv[1], sys.argv[2], sys.argv[3]
batch = {"imagenet": 256, "cifar": 512}[kind]
if mode == "served":
    from beton_client import Loader, OrderOption, ServeOptions
    ld = Loader(path, batch_size=batch, order=OrderOption.RANDOM, seed=int(sys.argv[6]),
                pipelines=pipelines(kind), serve=ServeOptions(server=sys.argv[5], spawn=False))
else:
    from beton_serve.loader import Loader, OrderOption
    ld = Loader(path, batch_size=batch, order=OrderOption.RANDOM, seed=int(sys.argv[6]),
                pipelines=pipelines(kind), num_workers=2)
for _ in ld:  # warm-up epoch: compiles the pipelines (in-process) or warms the daemon's cache
    pass
print("READY", flush=True)
sys.stdin.readline()
t0 = time.perf_counter(); n = 0
for b in ld:
    n += len(b[0])
print(json.dumps({"n": n, "wall": time.perf_counter() - t0}), flush=True)
ld.close()
"""


def many_clients(
    mode: str, path: Path, kind: str, clients: int, address: str, daemon_pid: int | None
) -> dict:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, mode, str(path), kind, str(HERE), address, str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(clients)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    cpu0 = [proc_cpu(p.pid) for p in procs]
    d0 = proc_cpu(daemon_pid) if daemon_pid else 0.0
    t0 = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    cpu1 = []
    for p in procs:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
        cpu1.append(proc_cpu(p.pid))
    wall = time.perf_counter() - t0
    d1 = proc_cpu(daemon_pid) if daemon_pid else 0.0
    for p in procs:
        p.wait(60)
    images = sum(r["n"] for r in results)
    client_cpu = sum(b - a for a, b in zip(cpu0, cpu1, strict=True))
    return {
        "images_per_s": images / wall,
        "wall_s": wall,
        "client_cpu_s": client_cpu,
        "daemon_cpu_s": d1 - d0,
        "total_cpu_s": client_cpu + d1 - d0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--imagenet-n", type=int, default=500)
    ap.add_argument("--cifar-n", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kinds", default="cifar,imagenet")
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from beton_client import Loader as ServedLoader
    from beton_client import OrderOption as ServedOrder
    from beton_client import ServeOptions
    from beton_serve.loader import Loader as LocalLoader
    from beton_serve.loader import OrderOption as LocalOrder
    from helpers.daemon import start_daemon

    kinds = args.kinds.split(",")
    paths = {k: build(k, args.imagenet_n if k == "imagenet" else args.cifar_n) for k in kinds}
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon(list(paths.values()), Path(tmp), args=["--workers", "2"])
        try:
            for kind, path in paths.items():
                bs = BATCH[kind]
                local = LocalLoader(
                    str(path),
                    batch_size=bs,
                    order=LocalOrder.RANDOM,
                    seed=0,
                    pipelines=pipelines(kind),
                    num_workers=2,
                )
                served = ServedLoader(
                    str(path),
                    batch_size=bs,
                    order=ServedOrder.RANDOM,
                    seed=0,
                    pipelines=pipelines(kind),
                    serve=ServeOptions(server=d.address),
                )
                loc, srv = time_blocks([local, served], args.epochs, args.rounds, [None, d.pid])
                batches = len(served)
                local.close()
                served.close()
                n, n2 = loc["n"], srv["n"]
                per_round = [
                    lw / sw for lw, sw in zip(loc["block_walls"], srv["block_walls"], strict=True)
                ]
                served_cpu = srv["cpu"] + srv["other_cpu"]
                report[kind] = {
                    "samples": n,
                    "in_process_img_s": n / loc["wall"],
                    "served_img_s": n2 / srv["wall"],
                    "ratio": (n2 / srv["wall"]) / (n / loc["wall"]),
                    # served / in-process of the two blocks of each round (same samples per
                    # epoch: the ratio of epoch times), and their median
                    "ratio_per_round": per_round,
                    "ratio_median_of_rounds": statistics.median(per_round),
                    "client_cpu_ms_per_batch": 1000 * srv["cpu"] / batches,
                    "daemon_cpu_ms_per_batch": 1000 * srv["other_cpu"] / batches,
                    "in_process_cpu_ms_per_batch": 1000 * loc["cpu"] / batches,
                    # CPU time per batch, served (client + daemon) / in-process: the share of
                    # the cost that a loaded machine's noise moves least
                    "cpu_ratio": served_cpu / loc["cpu"] if loc["cpu"] else float("nan"),
                }
                print(kind, json.dumps(report[kind]), flush=True)
                if args.clients < 1:  # --clients 0: the throughput part only
                    continue
                served_many = many_clients("served", path, kind, args.clients, d.address, d.pid)
                local_many = many_clients("local", path, kind, args.clients, d.address, None)
                report[kind]["many_served"] = served_many
                report[kind]["many_in_process"] = local_many
                print(
                    kind,
                    "clients",
                    json.dumps({"served": served_many, "in_process": local_many}),
                    flush=True,
                )
        finally:
            d.stop(signal.SIGTERM)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
