"""Issue 6: N identical jobs on one daemon against one job, and the daemon's decode cost.

    python benchmarks/bench_sharing.py [--kind imagenet] [--n 500] [--batch 64] [--clients 4]
                                       [--epochs 1] [--repeat 1] [--no-share]

One daemon (``--workers 2``) serves the issue-3 dataset of ``bench_loader.py`` (ImageNet-like JPEG
with RandomResizedCrop 224 + flip, or CIFAR-like raw 32x32 + flip), order RANDOM. Each job is a
separate client process (``beton_client.Loader``, the same seed, pipeline and batch size as the
others, i.e. an identical stream). Each job runs one warm-up epoch (compilation, caches), then
waits; all jobs then start ``--epochs`` timed epochs together.

Reported, for 1 job and for ``--clients`` jobs:
- aggregate delivered images/s: all images delivered over the wall time until the last job ends;
- decode cost: the growth of the daemon's ``samples_decoded`` (Stats RPC) over the timed epochs,
  divided by their samples (1.0 = every batch decoded once, N = no sharing);
- daemon and client CPU seconds over the timed epoch (from /proc).

``--no-share`` runs the same protocol with ``--clients`` jobs whose seeds differ (streams that
cannot share), for comparison.
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

CLK = os.sysconf("SC_CLK_TCK")

_CLIENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from bench_loader import pipelines
from beton_client import Loader, OrderOption, ServeOptions
path, kind, address, batch, seed = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
ld = Loader(path, batch_size=batch, order=OrderOption.RANDOM, seed=seed,
            pipelines=pipelines(kind), drop_last=False,
            serve=ServeOptions(server=address, spawn=False))
for _ in ld:  # warm-up epoch
    pass
print("READY", flush=True)
sys.stdin.readline()
t0 = time.perf_counter(); n = 0
for _ in range(int(sys.argv[7])):
    for b in ld:
        n += len(b[0])
print(json.dumps({"n": n, "wall": time.perf_counter() - t0}), flush=True)
ld.close()
"""


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def decoded(daemon, name: str) -> int:
    return int({d.name: d.samples_decoded for d in daemon.stats().datasets}[name])


def run_jobs(
    daemon, path: Path, kind: str, batch: int, jobs: int, same_seed: bool, epochs: int = 1
) -> dict:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CLIENT,
                str(HERE),
                str(path),
                kind,
                daemon.address,
                str(batch),
                str(0 if same_seed else i),
                str(epochs),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(jobs)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "READY":
                raise RuntimeError(f"client failed to warm up: {line!r}\n{daemon.log()[-3000:]}")
        name = path.stem
        dec0 = decoded(daemon, name)
        cpu0 = [proc_cpu(p.pid) for p in procs]
        d0 = proc_cpu(daemon.pid)
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results, cpu1 = [], []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
            cpu1.append(proc_cpu(p.pid))
        wall = time.perf_counter() - t0
        d1 = proc_cpu(daemon.pid)
        dec1 = decoded(daemon, name)
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    per_epoch = results[0]["n"] // epochs
    images = sum(r["n"] for r in results)
    return {
        "jobs": jobs,
        "images": images,
        "wall_s": round(wall, 3),
        "images_per_s": round(images / wall, 1),
        "decode_cost": round((dec1 - dec0) / (per_epoch * epochs), 3),
        "daemon_cpu_s": round(d1 - d0, 2),
        "client_cpu_s": round(sum(b - a for a, b in zip(cpu0, cpu1, strict=True)), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="imagenet", choices=["imagenet", "cifar"])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1, help="timed epochs per job")
    ap.add_argument("--repeat", type=int, default=1, help="alternating (1 job, N jobs) pairs")
    ap.add_argument("--no-share", action="store_true", help="also run N jobs with distinct seeds")
    ap.add_argument(
        "--daemon-arg", action="append", default=[], help="extra daemon flag (repeatable)"
    )
    args = ap.parse_args()

    from bench_loader import build
    from helpers.daemon import start_daemon

    path = build(args.kind, args.n)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", "2", *args.daemon_arg])
        try:
            for r in range(args.repeat):
                # Alternate, so that load from elsewhere on the machine hits both alike.
                report[f"one#{r}"] = run_jobs(d, path, args.kind, args.batch, 1, True, args.epochs)
                print("one", json.dumps(report[f"one#{r}"]), flush=True)
                report[f"shared#{r}"] = run_jobs(
                    d, path, args.kind, args.batch, args.clients, True, args.epochs
                )
                print("shared", json.dumps(report[f"shared#{r}"]), flush=True)
            if args.no_share:
                report["distinct"] = run_jobs(
                    d, path, args.kind, args.batch, args.clients, False, args.epochs
                )
                print("distinct", json.dumps(report["distinct"]), flush=True)
        finally:
            d.stop(signal.SIGTERM)
    ones = [v["images_per_s"] for k, v in report.items() if k.startswith("one#")]
    one = statistics.median(ones)
    ratios = [
        report[f"shared#{r}"]["images_per_s"] / report[f"one#{r}"]["images_per_s"]
        for r in range(args.repeat)
    ]
    summary = {
        "one_job_images_per_s_median": round(one, 1),
        "shared_vs_one_per_pair": [round(x, 2) for x in ratios],
        "shared_vs_one_median": round(statistics.median(ratios), 2),
        "decode_cost": {k: v["decode_cost"] for k, v in report.items()},
    }
    if "distinct" in report:
        summary["distinct_vs_one"] = round(report["distinct"]["images_per_s"] / one, 2)
    print(json.dumps({"report": report, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
