"""Engine scaling: 1 vs 2 worker threads (DESIGN.md §5.1 decision: threads or processes).

    python benchmarks/bench_engine_scaling.py [--pipeline imagenet|cifar] [--batches 8] [--rounds 4]

Runs ``BatchSource`` batches straight on the ``Engine`` (no consumer, no client tail), order
RANDOM, after a warm-up batch per worker. ``imagenet``: RandomResizedCropRGBImageDecoder((224,
224)) + RandomHorizontalFlip, batch 256 on ``_data/imagenet_5000.beton``; ``cifar``:
SimpleRGBImageDecoder + RandomHorizontalFlip, batch 512 on ``_data/cifar_50000.beton`` (both built
by ``bench_loader.py``). 1-worker and 2-worker rounds are **interleaved** and the best round of
each is reported with the median, so that a burst of load from other processes hits both.

Control: in the same rounds, a pure Numba ``nogil`` kernel (no GIL, no memory traffic) runs on
1 and 2 plain threads for ~1 s each. Its 2-vs-1 ratio is the parallelism the machine gives this
process right now; ``scaling_vs_control`` = our ratio / the control's ratio is the part of the
scaling the engine itself is responsible for (1.0 = as parallel as GIL-free code can be here).

Also printed: the process CPU time per wall second (about 2 with 2 workers when nothing
serialises on the GIL and two cores are free) and the CPU time per image.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _control(threads: int, seconds: float = 1.0) -> float:
    """Iterations per second of a pure nogil Numba kernel on ``threads`` threads."""
    import threading

    import numba

    @numba.njit(nogil=True, cache=False)
    def spin(n):  # pragma: no cover - compiled
        x = 0.0
        for i in range(n):
            x += (i % 7) * 0.5
        return x

    spin(10)
    counts = [0] * threads
    stop = threading.Event()

    def run(k: int) -> None:
        while not stop.is_set():
            spin(1_000_000)
            counts[k] += 1

    ts = [
        threading.Thread(target=run, args=(k,), name=f"beton-control-{k}") for k in range(threads)
    ]
    t = time.perf_counter()
    for th in ts:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in ts:
        th.join()
    return sum(counts) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", choices=["imagenet", "cifar"], default="imagenet")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    from beton_serve.engine import BatchSource, Engine, OrderOption
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from beton_serve.format import BetonReader
    from beton_serve.pipeline import compile_pipelines
    from beton_serve.transforms import RandomHorizontalFlip

    if args.pipeline == "imagenet":
        path, bs = HERE / "_data" / "imagenet_5000.beton", 256
        decoder = RandomResizedCropRGBImageDecoder((224, 224))
    else:
        path, bs = HERE / "_data" / "cifar_50000.beton", 512
        decoder = SimpleRGBImageDecoder()
    reader = BetonReader(path)
    plan = compile_pipelines(
        reader, {"image": [decoder, RandomHorizontalFlip()], "label": None}, batch_size=bs
    )
    nb = args.batches
    rates: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    control: dict[int, list[float]] = {1: [], 2: []}
    for rnd in range(args.rounds):
        for w in (1, 2):
            control[w].append(_control(w))
        for workers in (1, 2):
            with Engine(workers) as eng:
                src = BatchSource(
                    engine=eng,
                    plan=plan,
                    order=OrderOption.RANDOM,
                    batch_size=bs,
                    seed=rnd,
                    batches_ahead=2 * workers,
                )
                slots = [
                    [np.empty((bs, *o.shape), o.dtype) for o in plan.outputs]
                    for _ in range(2 * workers)
                ]
                for w in range(workers):  # warm-up: compile + one workspace per worker
                    src.submit(1, w, slots[w]).result()
                t, c = time.perf_counter(), time.process_time()
                pending = []
                for b in range(nb):
                    if len(pending) == 2 * workers:
                        pending.pop(0).result()
                    pending.append(src.submit(0, b % len(src), slots[b % (2 * workers)]))
                for f in pending:
                    f.result()
                wall, used = time.perf_counter() - t, time.process_time() - c
                rates[workers].append(nb * bs / wall)
                cpu[workers].append(used / wall)
    out = {"pipeline": args.pipeline, "batch": bs, "batches_per_round": nb, "rounds": args.rounds}
    for w in (1, 2):
        out[f"{w}w_best_img_s"] = round(max(rates[w]))
        out[f"{w}w_median_img_s"] = round(statistics.median(rates[w]))
        out[f"{w}w_cpu_per_wall_median"] = round(statistics.median(cpu[w]), 2)
    out["scaling_best"] = round(max(rates[2]) / max(rates[1]), 2)
    out["scaling_median"] = round(statistics.median(rates[2]) / statistics.median(rates[1]), 2)
    ctl = statistics.median(control[2]) / statistics.median(control[1])
    out["control_nogil_scaling_median"] = round(ctl, 2)
    out["scaling_vs_control"] = round(out["scaling_median"] / ctl, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
