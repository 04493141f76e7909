"""Where the in-process Loader's consuming thread spends its CPU per CIFAR-like batch.

    python benchmarks/bench_consumer_calls.py [--workers 2] [--epochs 20] [--cifar-n 50000]

The CIFAR-like dataset and pipeline of ``bench_loader.py`` (raw 32x32 + flip, batch 512, RANDOM),
one in-process ``beton_serve.loader.Loader``: after one untimed epoch, ``--epochs`` epochs are
read, and the thread that iterates (the training loop's) is timed with ``time.thread_time_ns``,
as a whole and inside a few calls (each wrapper adds ~1 us): ``EngineEpochFeed.next`` (take the
next batch: submit the one ``batches_ahead`` later, wait, charge), ``EngineEpochFeed._submit_one``
and ``BatchSource.submit`` within it, and ``BatchSource.charge``. What the
thread spends outside ``EngineEpochFeed.next`` is the front end's (tensors, bookkeeping).
The garbage collections of the timed epochs are counted too, with their wall time per
generation (``gc.callbacks``): a collection runs on whichever thread allocates, and its cost
lands in whatever call that thread was making (session 56: one generation-1 collection of
~150 ms, the objects of the Loader's start, showed as 60-90 us a batch in ``submit``).

Issue 15 §4: with 2 workers on 2 vCPUs this thread's CPU per batch, C, is taken from the
workers, so going from 1 to 2 workers speeds CIFAR up by at most 2W / (W + C) (W: a worker's
CPU per batch); issue 15 §3 divides the served rate by this Loader's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--cifar-n", type=int, default=50000)
    args = ap.parse_args()

    import beton_serve.loader._loader as loader_module
    from bench_loader import build, pipelines
    from beton_serve.engine._source import BatchSource
    from beton_serve.loader import Loader, OrderOption

    cpu_ns: dict[str, int] = collections.defaultdict(int)
    calls: dict[str, int] = collections.defaultdict(int)
    clock = time.thread_time_ns

    def wrap(owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                cpu_ns[key] += clock() - t
                calls[key] += 1

        setattr(owner, name, timed)

    wrap(loader_module.EngineEpochFeed, "next", "EngineEpochFeed.next")
    wrap(loader_module.EngineEpochFeed, "_submit_one", "EngineEpochFeed._submit_one")
    wrap(BatchSource, "submit", "BatchSource.submit")
    wrap(BatchSource, "charge", "BatchSource.charge")

    import gc
    import threading

    gc_ms: dict[int, float] = collections.defaultdict(float)
    gc_n: dict[int, int] = collections.defaultdict(int)
    gc_t0: dict[int, int] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        key = threading.get_ident()
        if phase == "start":
            gc_t0[key] = time.perf_counter_ns()
        elif key in gc_t0:
            gen = info["generation"]
            gc_ms[gen] += (time.perf_counter_ns() - gc_t0.pop(key)) / 1e6
            gc_n[gen] += 1

    gc.callbacks.append(on_gc)
    path = build("cifar", args.cifar_n)
    loader = Loader(
        str(path),
        batch_size=512,
        order=OrderOption.RANDOM,
        seed=0,
        pipelines=pipelines("cifar"),
        num_workers=args.workers,
    )
    try:
        for _ in loader:  # compile, warm up
            pass
        cpu_ns.clear()
        calls.clear()
        gc_ms.clear()
        gc_n.clear()
        batches = 0
        t0, w0 = clock(), time.perf_counter()
        for _ in range(args.epochs):
            for _batch in loader:
                batches += 1
        total, wall = clock() - t0, time.perf_counter() - w0
    finally:
        loader.close()
        gc.callbacks.remove(on_gc)
    print(
        f"workers {args.workers}: {batches} batches, {512 * batches / wall:,.0f} img/s, "
        f"consuming thread {total / batches / 1e3:.1f} us CPU per batch"
    )
    for key, ns in cpu_ns.items():
        print(
            f"  {key:30s} {ns / batches / 1e3:6.1f} us per batch ({calls[key] / batches:.2f} calls)"
        )

    for gen in sorted(gc_n):
        print(f"  gc generation {gen}: {gc_n[gen]} collections, {gc_ms[gen]:.1f} ms in all")


if __name__ == "__main__":
    main()
