"""How close the crop decoders come to the decode limit: ours (TurboJPEG 3, and the simplejpeg
fallback), FFCV 1.0.2 and a whole-image decode of the same files, side by side in one run (issue 15).

    python benchmarks/bench_decode_limit.py [--imagenet-n 2000] [--cifar-n 50000] [--subset N]
        [--epochs 2] [--cifar-epochs 20] [--rounds 2] [--workers 1,2] [--only rrc,center,cifar]
        [--smoke] [--json] [--systems tj3,simplejpeg,ffcv,full] [--baseline-src DIR]
        [--ffcv-python ../peers/ffcv-venv/bin/python] [--skip-ffcv]
    python benchmarks/bench_decode_limit.py --scale-table     # the cost table of beton_serve._tj3

Cases (datasets of ../shared/bench/synthetic.py, built once under benchmarks/_data/):

* ``rrc``: ImageNetLike JPEGs, RandomResizedCropRGBImageDecoder((224, 224)) + RandomHorizontalFlip
  + ToTensor + ToTorchImage, batch 256;
* ``center``: the same files, CenterCropRGBImageDecoder((224, 224), 224 / 256) + ToTensor +
  ToTorchImage (the validation pipeline);
* ``cifar``: CifarLike raw 32x32, SimpleRGBImageDecoder + RandomHorizontalFlip + ToTensor, batch 512.

Systems, each in its own child process (so that each starts cold and none shares a GIL), run in
turn for ``--rounds`` rounds (round-robin evens out the other load on a shared machine):
``tj3`` and ``simplejpeg`` (our in-process Loader with ``jpeg_backend=...``), ``ffcv`` (FFCV's
Loader, its own venv), and ``full`` (simplejpeg decoding every JPEG whole, on as many threads as
the Loaders have workers: the rate of "decode the whole file", the bar a crop decoder must beat).
Every child warms up one epoch (compilation), then times ``--epochs`` epochs; a system's figure is
the median over all its timed epochs, with the best one alongside. ``--systems`` runs only the
ones named.

``--baseline-src DIR`` adds ``tj3-base``: the ``tj3`` child run on another checkout of this project
(``git worktree add DIR <commit>``; its ``proto/``, ``server/`` and ``client/`` first on
``PYTHONPATH``), in the same rounds, so that a change is measured against the code before it in
one run and not against a figure from another day (`tj3 / base` is printed per case).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT.parent / "shared" / "bench"))

_CHILD = r"""
import json, sys, time
mode, case, path, batch, workers, epochs, subset = sys.argv[1:8]
batch, workers, epochs, subset = int(batch), int(workers), int(epochs), int(subset)
import numpy as np
if mode == "full":
    from concurrent.futures import ThreadPoolExecutor
    import simplejpeg
    from beton_serve.format import BetonReader
    with BetonReader(path) as r:
        n = min(subset, r.num_samples) if subset else r.num_samples
        blobs = [bytes(r.sample_bytes(i, "image")) for i in range(n)]
    chunks = [blobs[k::workers] for k in range(workers)]
    def work(chunk):
        buf = np.empty(1024 * 1024 * 3, np.uint8)
        for b in chunk:
            simplejpeg.decode_jpeg(b, fastdct=True, buffer=buf)
    rates = []
    with ThreadPoolExecutor(workers) as pool:
        for e in range(epochs + 1):
            t = time.perf_counter()
            list(pool.map(work, chunks))
            if e:
                rates.append(n / (time.perf_counter() - t))
    print(json.dumps({"rates": rates}), flush=True)
    sys.exit(0)
if mode == "ffcv":
    from ffcv.fields import decoders as dec
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    kw, dkw = {"os_cache": True}, {}
else:
    from beton_serve.fields import decoders as dec
    from beton_serve.loader import Loader, OrderOption
    from beton_serve.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
    kw, dkw = {}, {"jpeg_backend": mode}
if case == "rrc":
    img = [dec.RandomResizedCropRGBImageDecoder((224, 224), **dkw), RandomHorizontalFlip(),
           ToTensor(), ToTorchImage()]
elif case == "center":
    img = [dec.CenterCropRGBImageDecoder((224, 224), 224 / 256, **dkw), ToTensor(),
           ToTorchImage()]
else:
    img = [dec.SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()]
pipes = {"image": img, "label": [dec.IntDecoder(), ToTensor()]}
if subset:
    kw["indices"] = list(range(subset))
ld = Loader(path, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, seed=0,
            pipelines=pipes, drop_last=True, **kw)
n_img = len(ld) * batch
rates = []
for e in range(epochs + 1):
    t = time.perf_counter()
    for _ in ld:
        pass
    if e:
        rates.append(n_img / (time.perf_counter() - t))
print(json.dumps({"rates": rates}), flush=True)
sys.stdout.close()
import os
os._exit(0)  # the figures are taken; do not time (or hang in) worker shutdown
"""


def _child(
    python: str,
    mode: str,
    case: str,
    path: Path,
    batch: int,
    workers: int,
    epochs: int,
    args,
    pythonpath: str = "",
) -> list:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [
            python,
            "-c",
            _CHILD,
            mode,
            case,
            str(path),
            str(batch),
            str(workers),
            str(epochs),
            str(args.subset or 0),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd="/tmp",  # nothing of the checkout shadows the installed packages
        timeout=1800,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(
            f"{mode}/{case} child failed (rc {proc.returncode}): {proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])["rates"]  # type: ignore[no-any-return]


def scale_table(n: int = 12) -> dict:
    """Decode cost per scale M/8 (whole image), and an area resize to 224, of 448-500 px JPEGs."""
    import numpy as np
    import simplejpeg
    from beton_serve import _tj3
    from beton_serve._kernels import resize as rz
    from synthetic import synth_image

    tj = _tj3.Decompressor(_tj3.load())
    rng = np.random.default_rng(1)
    js = [
        np.frombuffer(
            simplejpeg.encode_jpeg(
                synth_image(k, *rng.integers(448, 501, 2)), 90, colorsubsampling="420"
            ),
            np.uint8,
        )
        for k in range(n)
    ]
    buf = np.empty(600 * 600 * 3, np.uint8)
    dst = np.empty((224, 224, 3), np.uint8)
    scratch = np.empty(rz.scratch_size(600, 224), np.float32)
    dec = {m: float("inf") for m in range(1, 9)}
    res = {m: float("inf") for m in range(1, 9)}
    for _ in range(5):
        for m in range(8, 0, -1):
            td = tr = 0.0
            for j in js:
                hd = tj.header(j)
                sh, sw = _tj3.scaled(hd.height, m), _tj3.scaled(hd.width, m)
                out = buf[: sh * sw * 3].reshape(sh, sw, 3)
                t0 = time.thread_time()
                tj.decode(j, out, m)
                t1 = time.thread_time()
                if sh >= 224 and sw >= 224:
                    rz.resize_crop(out, 0, 0, sh, sw, dst, scratch, "area")
                td += t1 - t0
                tr += time.thread_time() - t1
            dec[m] = min(dec[m], td / n * 1e6)
            res[m] = min(res[m], tr / n * 1e6)
    return {
        "decode_us": {m: round(dec[m]) for m in dec},
        "decode_rel": {m: round(dec[m] / dec[8], 2) for m in dec},
        # only scales whose image still covers 224x224 are resized
        "resize_224_us": {m: round(res[m]) for m in res if _tj3.scaled(448, m) >= 224},
        "resize_rel_8": round(res[8] / dec[8], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imagenet-n", type=int, default=2000)
    ap.add_argument("--cifar-n", type=int, default=50000)
    ap.add_argument("--subset", type=int, default=0, help="epochs over the first N samples")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument(
        "--cifar-epochs",
        type=int,
        default=20,
        help="timed epochs per child for cifar (default 20: an epoch is ~40 ms, 2 were too few "
        "to take a median from on a noisy machine)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--only", default="rrc,center,cifar")
    ap.add_argument(
        "--ffcv-python", default=str(ROOT.parent / "peers" / "ffcv-venv" / "bin" / "python")
    )
    ap.add_argument("--skip-ffcv", action="store_true")
    ap.add_argument(
        "--systems", default="", help="run only these (comma-separated; default: every one)"
    )
    ap.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="another checkout of this project, run as the system tj3-base",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny data, one epoch, one round")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    ap.add_argument("--scale-table", action="store_true")
    args = ap.parse_args()
    if args.scale_table:
        print(json.dumps(scale_table()))
        return 0
    from bench_loader import build

    if args.smoke:
        args.imagenet_n, args.cifar_n, args.epochs, args.rounds = 64, 2048, 1, 1
        args.cifar_epochs = 1
        args.subset = 0
    workers = [int(w) for w in args.workers.split(",")]
    base_path = ""
    if args.baseline_src is not None:
        src = args.baseline_src.resolve()
        if not (src / "server" / "beton_serve").is_dir():
            ap.error(f"--baseline-src {src}: no server/beton_serve there")
        base_path = os.pathsep.join(
            str(src / d) for d in ("proto", "server", "client") if (src / d).is_dir()
        )
    only = {s for s in args.systems.split(",") if s}
    cases = [c for c in args.only.split(",") if c]
    ffcv = None if args.skip_ffcv or not Path(args.ffcv_python).exists() else args.ffcv_python
    paths = {}
    if {"rrc", "center"} & set(cases):
        paths["imagenet"] = build("imagenet", args.imagenet_n)
    if "cifar" in cases:
        paths["cifar"] = build("cifar", args.cifar_n)
    jobs = []  # (case, workers, system, python)
    for case in cases:
        systems = ["tj3", "simplejpeg"] if case != "cifar" else ["tj3"]
        systems += ["ffcv"] if ffcv else []
        systems += ["full"] if case != "cifar" else []
        systems += ["tj3-base"] if base_path else []
        systems = [s for s in systems if not only or s in only]
        for w in workers:
            for s in systems:
                jobs.append((case, w, s, ffcv if s == "ffcv" else sys.executable))
    rates: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for case, w, system, python in jobs:
            path = paths["cifar" if case == "cifar" else "imagenet"]
            batch = 512 if case == "cifar" else 256
            if args.smoke:
                batch = 16 if case != "cifar" else 256
            epochs = args.cifar_epochs if case == "cifar" else args.epochs
            if system == "tj3-base":
                got = _child(python, "tj3", case, path, batch, w, epochs, args, base_path)
            else:
                got = _child(python, system, case, path, batch, w, epochs, args)
            rates.setdefault((case, w, system), []).extend(got)
    out: dict = {
        "machine_cpus": os.cpu_count(),
        "imagenet_n": args.imagenet_n,
        "cifar_n": args.cifar_n,
        "subset": args.subset,
        "cases": {},
    }
    for (case, w, system), rs in rates.items():
        c = out["cases"].setdefault(case, {})
        c.setdefault(f"{w}w", {})[system] = {
            "median_img_s": round(statistics.median(rs)),
            "best_img_s": round(max(rs)),
        }
    for c in out["cases"].values():
        for r in c.values():
            med = {s: v["median_img_s"] for s, v in r.items()}
            for s in ("tj3", "simplejpeg", "tj3-base"):
                if s in med and "ffcv" in med:
                    r[s]["x_ffcv"] = round(med[s] / med["ffcv"], 2)
                if s in med and "full" in med:
                    r[s]["x_full_decode"] = round(med[s] / med["full"], 2)
            if "tj3" in med and "tj3-base" in med:
                r["tj3"]["x_base"] = round(med["tj3"] / med["tj3-base"], 3)
        if "1w" in c and "2w" in c:
            c["scaling_1_to_2"] = {
                s: round(c["2w"][s]["median_img_s"] / c["1w"][s]["median_img_s"], 2)
                for s in c["2w"]
                if s in c["1w"]
            }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{'case':8} {'workers':7} {'system':11} {'img/s':>8} {'best':>8} {'x FFCV':>7} {'x full':>7}"
    )
    for case, c in out["cases"].items():
        for wk, r in c.items():
            if wk == "scaling_1_to_2":
                continue
            for s, v in r.items():
                xf = v.get("x_ffcv", "")
                xd = v.get("x_full_decode", "")
                xb = f"  tj3 / base {v['x_base']}" if "x_base" in v else ""
                print(
                    f"{case:8} {wk:7} {s:11} {v['median_img_s']:8} {v['best_img_s']:8} {xf!s:>7} {xd!s:>7}{xb}"
                )
        if "scaling_1_to_2" in c:
            print(f"{case:8} scaling 1 -> 2 workers: {c['scaling_1_to_2']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
