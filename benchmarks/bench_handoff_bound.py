"""How far 1 -> 2 workers can scale on CIFAR-like batches on this machine (issue 15 §4).

    python benchmarks/bench_handoff_bound.py [--n 50000] [--epochs 5] [--rounds 2]
        [--modes loader,minimal,pairs,kernel]
        [--batch 512] [--tree LABEL=PATH] [--json]

Issue 15 asks for >= 1.9x going from 1 to 2 workers. On CIFAR-like data (raw 32x32 images,
SimpleRGBImageDecoder + RandomHorizontalFlip + ToTensor, batch 512) a batch is ~0.4 ms of decode,
and the consumer thread's share of each batch is not small. This script measures, each
configuration in its own child process and alternated over ``--rounds``:

* ``loader``: our in-process Loader, as ``bench_decode_limit.py`` runs it.
* ``minimal``: the smallest hand-off Python allows, on the same compiled plan
  (``BatchSource._run``). The workers claim batch numbers from a shared counter and write a
  ring of slots guarded by raw locks, and the consumer takes each batch as cached tensors. It
  keeps no futures, no credit, no ids, no resume state, no bad-sample budget and no timeouts,
  so it is a bound, not a product path.
* ``pairs``: ``minimal`` with two batches per claim (two plan calls into a double slot, three
  double slots): whether fewer, larger hand-offs would lift the scaling.
* ``kernel``: no hand-off and no consumer at all. The workers claim batch numbers from a shared
  counter and run the same compiled plan into two private buffers each, which nobody reads.
  What the decode alone scales to on this machine: the ceiling of every mode above.

``--tree LABEL=PATH`` adds the Loader of another checkout (``git worktree add PATH COMMIT``),
run with ``PATH``'s ``server``, ``client`` and ``proto`` first on ``PYTHONPATH`` and alternated
with this tree's in every round: an A/B of two commits in one window. ``--batch 16`` makes the
per-batch fixed cost (futures, submit, hand-off) most of a batch, where a change to it shows
through this machine's noise.

For each it reports images/s, process CPU and consumer-thread CPU per batch, and the scaling
from 1 to 2 workers. ``packing bound`` is the best 2-worker time that the 2-worker run's own CPU
allows on two cores, ``(process CPU per batch) / 2``. It gives ``T1 / that``: the scaling if
every microsecond of both cores were used, which no scheduler achieves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

_CHILD = r"""
import itertools, json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from bench_loader import build
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.loader import Loader, OrderOption
from beton_serve.transforms import RandomHorizontalFlip, ToTensor

mode, workers, n, epochs = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
BATCH = int(sys.argv[6])
pipes = {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(), ToTensor()],
         "label": [IntDecoder(), ToTensor()]}
ld = Loader(str(build("cifar", n)), batch_size=BATCH, order=OrderOption.RANDOM, seed=0,
            num_workers=workers, pipelines=pipes)
for _ in ld:  # compile, warm the page cache
    pass

if mode.startswith("loader"):
    def run_epoch(epoch):
        k = 0
        for _ in ld:
            k += 1
        return k
elif mode == "kernel":
    src = ld._feed.source
    plan, nb = src.plan, len(src)

    def run_epoch(epoch):
        counter = itertools.count()
        keys, order = src.seed_keys(epoch), src.sample_order(epoch)

        def work():
            bufs = [[np.empty((BATCH, *o.shape), o.dtype) for o in plan.outputs] for _ in range(2)]
            i = 0
            while (h := next(counter)) < nb:
                ids = order[h * BATCH:(h + 1) * BATCH]
                src._run(epoch, ids, 0, len(ids), [o[:len(ids)] for o in bufs[i & 1]], keys, None)
                i += 1

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return nb
else:
    # "minimal": one batch per claim, 4 slots. "pairs": a worker claims K = 2 batches at a
    # time (two plan calls into a double slot, 3 double slots): half the claims and hand-offs.
    src = ld._feed.source
    K, S = (2, 3) if mode == "pairs" else (1, 4)
    plan, nb = src.plan, len(src)
    slots = [[np.empty((K * BATCH, *o.shape), o.dtype) for o in plan.outputs] for _ in range(S)]
    views = [[tuple(torch.from_numpy(a[h * BATCH:(h + 1) * BATCH]) for a in s) for h in range(K)]
             for s in slots]
    nclaims = (nb + K - 1) // K

    def run_epoch(epoch):
        ready = [threading.Lock() for _ in range(S)]
        free = [threading.Lock() for _ in range(S)]
        for lock in ready:
            lock.acquire()
        counter = itertools.count()
        keys, order = src.seed_keys(epoch), src.sample_order(epoch)

        def work():
            while (q := next(counter)) < nclaims:
                s = q % S
                free[s].acquire()
                for h in range(K * q, min(K * q + K, nb)):  # the plan is sized to one batch
                    ids = order[h * BATCH:(h + 1) * BATCH]
                    r = (h % K) * BATCH
                    src._run(epoch, ids, 0, len(ids), [o[r:r + len(ids)] for o in slots[s]],
                             keys, None)
                ready[s].release()

        threads = [threading.Thread(target=work) for _ in range(workers)]
        for t in threads:
            t.start()
        prev = None
        for b in range(nb):
            s = (b // K) % S
            if b % K == 0:
                if prev is not None:
                    free[prev].release()
                ready[s].acquire()
                prev = s
            out = views[s][b % K]  # what a consumer gets: the slot's tensors
        free[prev].release()
        for t in threads:
            t.join()
        return nb

batches = 0
w0, p0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
for e in range(1, epochs + 1):
    batches += run_epoch(e)
w1, p1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
ld.close()
print(json.dumps({"img_s": batches * BATCH / (w1 - w0), "wall_us": 1e6 * (w1 - w0) / batches,
                  "cpu_us": 1e6 * (p1 - p0) / batches, "main_us": 1e6 * (m1 - m0) / batches}))
"""


def _child(mode: str, workers: int, n: int, epochs: int, batch: int, tree: str | None) -> dict:
    env = dict(os.environ)
    if tree is not None:  # another checkout's packages ahead of this tree's editable install
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(tree) / d) for d in ("server", "client", "proto")]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(HERE),
            mode,
            str(workers),
            str(n),
            str(epochs),
            str(batch),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="loader,minimal")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[tuple[str, int], list[dict]] = {}
    modes = args.modes.split(",")
    trees: dict[str, str | None] = {m: None for m in modes}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        if not path:
            ap.error(f"--tree wants LABEL=PATH, got {spec!r}")
        trees[f"loader@{label}"] = path
    for _ in range(args.rounds):
        for mode, tree in trees.items():
            for w in (1, 2):
                runs.setdefault((mode, w), []).append(
                    _child(mode, w, args.n, args.epochs, args.batch, tree)
                )
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    report = {}
    for mode in trees:
        one, two = med[(mode, 1)], med[(mode, 2)]
        report[mode] = {
            "img_s_1": round(one["img_s"]),
            "img_s_2": round(two["img_s"]),
            "scaling": round(two["img_s"] / one["img_s"], 2),
            "cpu_us_per_batch_2": round(two["cpu_us"], 1),
            "consumer_us_per_batch_2": round(two["main_us"], 1),
            "packing_bound": round(one["wall_us"] / (two["cpu_us"] / 2), 2),
        }
    if args.json:
        print(json.dumps({"n": args.n, "batch": args.batch, "epochs": args.epochs,
                          "rounds": args.rounds, **report}))  # fmt: skip
        return
    print(
        f"CIFAR-like, n={args.n}, batch {args.batch}, {args.epochs} epochs x {args.rounds} rounds"
    )
    print(f"{'':14} {'1 worker':>10} {'2 workers':>10} {'scaling':>8} {'CPU/b @2':>9} "
          f"{'consumer/b @2':>14} {'packing bound':>14}")  # fmt: skip
    for mode, r in report.items():
        print(
            f"{mode:14} {r['img_s_1']:>10} {r['img_s_2']:>10} {r['scaling']:>8} "
            f"{r['cpu_us_per_batch_2']:>7} us {r['consumer_us_per_batch_2']:>11} us "
            f"{r['packing_bound']:>14}"
        )


if __name__ == "__main__":
    main()
