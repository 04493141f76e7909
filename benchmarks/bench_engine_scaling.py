"""Engine scaling: 1 vs 2 worker threads on a decode-heavy pipeline (DESIGN.md §5.1 decision).

    python benchmarks/bench_engine_scaling.py [--dataset imagenet_5000] [--batches 12]

Runs ``BatchSource`` batches straight on the ``Engine`` (no consumer, no client tail) with the
pipeline RandomResizedCropRGBImageDecoder((224, 224)) + RandomHorizontalFlip, batch 256, order
RANDOM, after a warm-up batch per worker count. It prints images/s for 1 and 2 workers, the
ratio, the process CPU time per wall second (about 2 with 2 workers when nothing serialises
on the GIL) and the CPU time per image.

Threads versus processes: every op runs as Numba ``nogil`` code or calls a decoder that releases
the GIL, so if the ratio is close to the core count, threads lose nothing to processes, and they
keep writing into the destination buffer with no pickling or extra copy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="imagenet_5000")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()

    from beton_serve.engine import BatchSource, Engine, OrderOption
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder
    from beton_serve.format import BetonReader
    from beton_serve.pipeline import compile_pipelines
    from beton_serve.transforms import RandomHorizontalFlip

    reader = BetonReader(HERE / "_data" / f"{args.dataset}.beton")
    plan = compile_pipelines(
        reader,
        {
            "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip()],
            "label": None,
        },
        batch_size=args.batch_size,
    )
    bs, nb = args.batch_size, args.batches
    res: dict[str, float] = {}
    for workers in (1, 2):
        with Engine(workers) as eng:
            src = BatchSource(
                engine=eng,
                plan=plan,
                order=OrderOption.RANDOM,
                batch_size=bs,
                seed=0,
                batches_ahead=2 * workers,
            )
            outs = [
                [np.empty((bs, *o.shape), o.dtype) for o in plan.outputs]
                for _ in range(2 * workers)
            ]
            for w in range(workers):  # warm-up: compile + one workspace per worker
                src.submit(1, w, outs[w]).result()
            t, c = time.perf_counter(), time.process_time()
            pending = []
            for b in range(nb):
                if len(pending) == 2 * workers:
                    pending.pop(0).result()
                pending.append(src.submit(0, b % len(src), outs[b % (2 * workers)]))
            for f in pending:
                f.result()
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            res[f"{workers}_worker_img_s"] = round(nb * bs / wall, 1)
            # CPU-seconds per wall-second of this process: ~workers when threads run in parallel,
            # <= 1 when they serialise on the GIL. On a loaded machine the ratio above drops but
            # this one shows whether the GIL is the limit.
            res[f"{workers}_worker_cpu_per_wall"] = round(cpu / wall, 2)
            res[f"{workers}_worker_cpu_ms_per_img"] = round(1e3 * cpu / (nb * bs), 3)
    res["scaling_1_to_2"] = round(res["2_worker_img_s"] / res["1_worker_img_s"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
