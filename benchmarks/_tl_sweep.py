"""Issue 16: a 4-job sweep whose pipelines differ, with decode groups on and off.

    python benchmarks/bench_sweep.py [--n 2000] [--batch 64] [--epochs 1] [--workers 2]
                                     [--sizes 160,176,192,224] [--unshared-full] [--json]
                                     [--share-min-side S] [--quality]

One daemon (``--workers``) serves the ImageNet-like JPEG dataset of ``bench_loader.py``. Each job
is a separate client process (``beton_client.Loader``), as the jobs of a real sweep are: the same
dataset, order RANDOM and seed, and its own pipeline, RandomResizedCropRGBImageDecoder to one of
``--sizes`` + RandomHorizontalFlip + ToTensor. Identical-stream sharing (issue 6) cannot apply:
no two streams are alike. Each job runs one warm-up epoch (compilation), then all start
``--epochs`` timed epochs together.

Configurations:
- ``shared``: the decoders have ``share_decode=True`` (one decode per sample, shared by the
  group; each job crops and resizes for itself). The shared decode is the full image, or with
  ``--share-min-side S`` (the decoders' ``share_min_side``) the image at the smallest DCT scale
  of 1/8, 1/4, 1/2 whose shorter side stays >= S;
- ``unshared``: the same jobs with the decoders' defaults (each job decodes for itself, with
  DCT-scaled decodes where the crop allows: the fastest unshared configuration);
- ``unshared_full`` (``--unshared-full``): ``dct_scale=False``, the same pixels as ``shared``.

Reported: aggregate images/s (all images delivered over the wall time until the last job ends),
``decoded_epochs_per_epoch`` (the group's JPEG decodes over the timed epochs, from the Stats
RPC's ``decode_groups``, per epoch of samples; 1.0 = each sample decoded once per epoch; an
unshared run decodes ``len(sizes)``), ``aggregate_vs_unshared``, and daemon and client CPU
seconds over the timed epochs (when the clients and the daemon together need more than the
cores, the wall-clock ratio understates the decode saved: compare ``daemon_cpu_s``).
``--json`` prints one JSON line. ``--quality`` adds, per size, how far the shared pipeline's
pixels are from full-size sharing (``dct_scale=False``'s pixels) and how far the unshared
default's are, on the first 512 samples in process: mean absolute difference in grey levels and
PSNR in dB. Targets (issue 16): decode <= 1.3 epochs per epoch, aggregate
>= 2x unshared.

The daemon decodes the first batches of the next epoch while the jobs wait at the start line
(look-ahead), in both configurations; those decodes are not counted, so use epochs much longer
than a few batches (``--n 2000 --epochs 2`` for a recorded run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
from beton_client import Loader, OrderOption, ServeOptions
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
path, address, batch, seed, epochs, size, mode, min_side = sys.argv[1:9]
size = int(size)
share = {"share_decode": True, "share_min_side": int(min_side)}
kw = {"share": share, "default": {}, "full": {"dct_scale": False}}[mode]
pipes = {
    "image": [RandomResizedCropRGBImageDecoder((size, size), **kw), RandomHorizontalFlip(),
              ToTensor()],
    "label": [IntDecoder(), ToTensor()],
}
ld = Loader(path, batch_size=int(batch), order=OrderOption.RANDOM, seed=int(seed),
            pipelines=pipes, drop_last=False,
            serve=ServeOptions(server=address, spawn=False))
for _ in ld:  # warm-up epoch
    pass
print("READY", flush=True)
sys.stdin.readline()
t0 = time.perf_counter(); n = 0
for _ in range(int(epochs)):
    for b in ld:
        n += len(b[0])
print(json.dumps({"n": n, "wall": time.perf_counter() - t0}), flush=True)
sys.stdin.readline()  # stay in the group until the daemon's counters are read
ld.close()
"""


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def counters(daemon, name: str) -> tuple[int, int, dict]:
    """(samples in batches produced for ``name``, JPEG decodes of its decode groups, the
    groups' other counters)."""
    st = daemon.stats()
    produced = int({d.name: d.samples_decoded for d in st.datasets}[name])
    group = sum(int(g.decoded) for g in st.decode_groups)
    extra = {
        k: sum(int(getattr(g, k)) for g in st.decode_groups)
        for k in ("members", "detached", "hits", "waits", "evicted")
    }
    return produced, group, extra


def run_jobs(daemon, path: Path, args, mode: str) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CLIENT,
                str(path),
                daemon.address,
                str(args.batch),
                str(args.seed),
                str(args.epochs),
                str(size),
                mode,
                str(args.share_min_side),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for size in sizes
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "READY":
                raise RuntimeError(f"client failed to warm up: {line!r}\n{daemon.log()[-3000:]}")
        produced0, group0, _ = counters(daemon, path.stem)
        d0 = proc_cpu(daemon.pid)
        c0 = [proc_cpu(p.pid) for p in procs]
        import threading
        tl = []
        stop_tl = threading.Event()
        def sampler():
            last = (time.perf_counter(), proc_cpu(daemon.pid))
            while not stop_tl.wait(0.1):
                now = (time.perf_counter(), proc_cpu(daemon.pid))
                tl.append(round((now[1] - last[1]) / (now[0] - last[0]), 2))
                last = now
        th = threading.Thread(target=sampler, daemon=True)
        t0 = time.perf_counter()
        th.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results, c1 = [], []
        for p in procs:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline()))
            c1.append(proc_cpu(p.pid))
        wall = time.perf_counter() - t0
        stop_tl.set()
        print(mode, "daemon cores per 0.1 s:", tl, file=sys.stderr)
        d1 = proc_cpu(daemon.pid)
        produced1, group1, groups = counters(daemon, path.stem)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("done\n")
            p.stdin.flush()
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    per_epoch = results[0]["n"] // args.epochs
    images = sum(r["n"] for r in results)
    # Unshared jobs decode every sample they produce; shared ones only what their group decoded.
    decodes = group1 - group0 if mode == "share" else produced1 - produced0
    return {
        "mode": mode,
        "jobs": len(sizes),
        "images": images,
        "wall_s": round(wall, 3),
        "images_per_s": round(images / wall, 1),
        "decoded_epochs_per_epoch": round(decodes / (per_epoch * args.epochs), 3),
        "daemon_cpu_s": round(d1 - d0, 2),
        "client_cpu_s": round(sum(b - a for a, b in zip(c0, c1, strict=True)), 2),
        # each job's own wall time (in --sizes order): the spread is the tail one job runs alone
        "job_wall_s": [round(r["wall"], 3) for r in results],
        **({"groups": groups} if mode == "share" else {}),
    }


def quality(path: Path, args) -> dict:
    """Per output size: mean |diff| (grey levels) and PSNR (dB) against full-size sharing's
    pixels (= ``dct_scale=False``), of the shared configuration and of the unshared default,
    over the first 512 samples (in process, 2 workers, the benchmark's seed and order)."""
    import numpy as np
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.loader import Loader, OrderOption

    def images(size: int, **kw) -> np.ndarray:
        pipes = {
            "image": [RandomResizedCropRGBImageDecoder((size, size), **kw)],
            "label": [IntDecoder()],
        }
        ld = Loader(
            path,
            batch_size=args.batch,
            order=OrderOption.RANDOM,
            seed=args.seed,
            pipelines=pipes,
            num_workers=2,
            indices=list(range(min(512, args.n))),
        )
        try:
            return np.concatenate([np.array(b[0]) for b in ld]).astype(np.int16)
        finally:
            ld.close()

    def diff(a: np.ndarray, b: np.ndarray) -> dict:
        d = np.abs(a - b).astype(np.float64)
        mse = float((d**2).mean())
        psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
        return {"mad": round(float(d.mean()), 3), "psnr_db": round(psnr, 1)}

    out = {}
    for size in (int(s) for s in args.sizes.split(",")):
        ref = images(size, share_decode=True)
        shared = images(size, share_decode=True, share_min_side=args.share_min_side)
        out[str(size)] = {"shared": diff(shared, ref), "unshared_default": diff(images(size), ref)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="samples of the ImageNet-like dataset")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1, help="timed epochs per job")
    ap.add_argument("--workers", type=int, default=2, help="daemon worker threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="160,176,192,224", help="one RRC output size per job")
    ap.add_argument("--unshared-full", action="store_true", help="also run dct_scale=False jobs")
    ap.add_argument(
        "--share-min-side",
        type=int,
        default=0,
        help="share_min_side of the shared jobs' decoders (0: share full-size decodes)",
    )
    ap.add_argument("--quality", action="store_true", help="also report pixel differences")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--daemon-arg", action="append", default=[], help="extra daemon flag (repeatable)"
    )
    args = ap.parse_args()

    from bench_loader import build
    from helpers.daemon import start_daemon
    import helpers.daemon as hd
    if os.environ.get("SWITCH"):
        hd._LAUNCH = ("import sys; sys.setswitchinterval(" + os.environ["SWITCH"] + "); "
                      "from beton_serve.cli import main; sys.exit(main())")

    path = build("imagenet", args.n)
    modes = ["share", "default", *(["full"] if args.unshared_full else [])]
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", str(args.workers), *args.daemon_arg])
        try:
            for mode in modes:
                report[mode] = run_jobs(d, path, args, mode)
                if not args.json:
                    print(mode, json.dumps(report[mode]), flush=True)
        finally:
            d.stop(signal.SIGTERM)
    shared, unshared = report["share"], report["default"]
    summary = {
        "decoded_epochs_per_epoch": shared["decoded_epochs_per_epoch"],
        "aggregate_vs_unshared": round(shared["images_per_s"] / unshared["images_per_s"], 2),
        **(
            {
                "aggregate_vs_unshared_full": round(
                    shared["images_per_s"] / report["full"]["images_per_s"], 2
                )
            }
            if "full" in report
            else {}
        ),
        "config": {
            "n": args.n,
            "batch": args.batch,
            "epochs": args.epochs,
            "workers": args.workers,
            "sizes": args.sizes,
            "share_min_side": args.share_min_side,
            "jobs": "separate client processes, one daemon",
        },
        "runs": report,
        **({"quality": quality(path, args)} if args.quality else {}),
    }
    print(
        json.dumps(summary, separators=(",", ":")) if args.json else json.dumps(summary, indent=1)
    )


if __name__ == "__main__":
    main()
