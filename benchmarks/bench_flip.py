"""RandomHorizontalFlip on a batch of large RGB images, on one thread and on two at once.

    python benchmarks/bench_flip.py [--batch 64] [--sides 160,224] [--reps 30]

Runs the op as a pipeline does (``generate_code()``; the compiled row loop for RGB), and, for
comparison, the per-image path it replaced: ``cv2.flip`` for the flipped images and
``np.copyto`` for the others, one call each. Reports microseconds per image: the CPU cost on
one thread, and the wall time per image with two threads flipping their own batches at once
(whether the path scales with threads; the per-image path takes the GIL for every image).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


def run_side(side: int, n: int, reps: int) -> None:
    """Time both paths on ``n`` images of ``side x side x 3`` and print one line each."""
    import cv2
    from beton_serve.pipeline import State
    from beton_serve.pipeline.rng import py_uniform
    from beton_serve.transforms import RandomHorizontalFlip

    cv2.setNumThreads(1)
    ids = np.arange(n, dtype=np.uint64)
    shape = (side, side, 3)
    op = RandomHorizontalFlip()
    op.declare_state_and_memory(State(jit_mode=True, device="cpu", shape=shape, dtype=np.uint8))
    fn = op.generate_code()
    mask = np.array([py_uniform(7, int(s), 0) < 0.5 for s in ids])

    def per_image(src: np.ndarray, dst: np.ndarray) -> None:
        for i in range(n):
            if mask[i]:
                cv2.flip(src[i], 1, dst=dst[i])
            else:
                np.copyto(dst[i], src[i])

    def op_path(src: np.ndarray, dst: np.ndarray) -> None:
        fn(src, dst, ids, 7)

    rng = np.random.default_rng(side)
    bufs = [
        (rng.integers(0, 256, (n, *shape), np.uint8), np.empty((n, *shape), np.uint8))
        for _ in range(2)
    ]
    # both paths give the same batch (the op draws the same mask)
    check = np.empty_like(bufs[0][1])
    op_path(*bufs[0])
    per_image(bufs[0][0], check)
    if not np.array_equal(bufs[0][1], check):
        raise SystemExit("the two flip paths disagree")

    def rate(f, threads: int) -> float:
        def loop(k: int) -> None:
            for _ in range(reps):
                f(*bufs[k])

        ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
        t = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        return (time.perf_counter() - t) / (reps * n) * 1e6

    for name, f in (("op (row loop)", op_path), ("per image (cv2.flip/copyto)", per_image)):
        one, two = rate(f, 1), rate(f, 2)
        print(
            f"{side}x{side}x3, batch {n}: {name}: {one:.1f} us/image on one thread; "
            f"two threads at once: {two:.1f} us wall per image each "
            f"({2 * one / two:.2f}x the one-thread rate)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sides", default="160,224")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    for side in (int(s) for s in args.sides.split(",")):
        run_side(side, args.batch, args.reps)


if __name__ == "__main__":
    main()
