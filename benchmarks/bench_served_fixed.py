"""Where the served CIFAR path's extra cost comes from: one pipeline, in process against served.

    python benchmarks/bench_served_fixed.py {labels,noflip,full} [--epochs 10] [--rounds 3]

The CIFAR-like file of ``bench_loader.py`` (50,000 samples, batch 512, RANDOM, 2 workers in
process and in the daemon), with one of three pipelines: ``labels`` (the label only: the fixed
cost of a batch), ``noflip`` (the raw image copied, no flip) and ``full`` (``bench_served.py``'s
pipeline: the image copied and flipped). The two loaders take turns, a warm-up epoch then
``--epochs`` timed ones each turn. Prints, per round, wall and CPU µs per batch (served: client
+ daemon), then the medians and served ÷ in-process (issue 15 §3; RESULTS, session 35). Set
``BETON_SERVE_FUSE_MIRROR=0`` to run the flip as its own pass, in both loaders.
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
    ap.add_argument("kind", choices=["labels", "noflip", "full"])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from bench_loader import build, pipelines
    from bench_served import proc_cpu
    from beton_client import Loader as ServedLoader
    from beton_client import OrderOption as ServedOrder
    from beton_client import ServeOptions
    from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from beton_serve.loader import Loader as LocalLoader
    from beton_serve.loader import OrderOption as LocalOrder
    from beton_serve.transforms import ToTensor
    from helpers.daemon import start_daemon

    def pipes() -> dict:
        label = [IntDecoder(), ToTensor()]
        if args.kind == "labels":
            return {"image": None, "label": label}
        if args.kind == "noflip":
            return {"image": [SimpleRGBImageDecoder(), ToTensor()], "label": label}
        return pipelines("cifar")

    path = build("cifar", 50000)
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as tmp:
        d = start_daemon([path], Path(tmp), args=["--workers", "2"])
        try:
            common = {"batch_size": 512, "seed": 0}
            local = LocalLoader(
                str(path), order=LocalOrder.RANDOM, pipelines=pipes(), num_workers=2, **common
            )
            served = ServedLoader(
                str(path),
                order=ServedOrder.RANDOM,
                pipelines=pipes(),
                serve=ServeOptions(server=d.address),
                **common,
            )
            batches = args.epochs * len(local)
            rows: dict[str, list[tuple[float, float]]] = {"in process": [], "served": []}
            for _ in range(args.rounds):
                for name, loader, pid in (("in process", local, None), ("served", served, d.pid)):
                    for _ in loader:  # warm-up epoch
                        pass
                    c0, p0, t0 = time.process_time(), proc_cpu(pid) if pid else 0.0, time.time()
                    for _ in range(args.epochs):
                        for _ in loader:
                            pass
                    wall = time.time() - t0
                    cpu = time.process_time() - c0 + ((proc_cpu(pid) - p0) if pid else 0.0)
                    rows[name].append((1e6 * wall / batches, 1e6 * cpu / batches))
            local.close()
            served.close()
        finally:
            d.stop()
    for name, got in rows.items():
        print(f"{name:10s}", " | ".join(f"wall {w:.1f} cpu {c:.1f} us/batch" for w, c in got))
    lw, sw = (statistics.median(w for w, _ in rows[k]) for k in ("in process", "served"))
    lc, sc = (statistics.median(c for _, c in rows[k]) for k in ("in process", "served"))
    print(
        f"median wall {lw:.1f} / {sw:.1f} us (served / in process {lw / sw:.3f}); "
        f"CPU {lc:.1f} / {sc:.1f} us (served {sc - lc:+.1f})"
    )


if __name__ == "__main__":
    main()
