"""Would non-temporal stores take the ring's slot count out of the raw copy's cost? (issue 15 §3)

Session 24 found that the daemon's CIFAR kernels slow down with the number of ring slots a
stream cycles through (each slot they write is cold: its lines are read for ownership first).
This script measures, outside any Loader, the CIFAR batch's two passes (the raw decoder's
gather-copy of 512 images of 3,072 bytes into a slot, then the in-place flip of every other
image, the production loop) with the copy's stores plain or non-temporal (32-byte ``!nontemporal``
stores from a Numba intrinsic, then a fence), writing slots in round robin over 4, 8 or 16 slots,
on 1 or 2 threads (each with its own slots, as the daemon's two workers).

    python benchmarks/bench_nt_copy.py [--threads 2] [--rounds 3]

Prints CPU µs per batch per thread. Not used by the product: a measurement.
"""

from __future__ import annotations

import argparse
import mmap
import threading
import time
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

N, B, IMAGE = 50_000, 512, 3072
ROUNDS_BATCHES = 400


@intrinsic
def _nt_copy32(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """``n`` bytes (a multiple of 32; ``dst`` 32-byte aligned) with non-temporal stores."""
    sig = types.void(types.voidptr, types.voidptr, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d_raw, s_raw, nbytes = args
        vec = ir.VectorType(ir.IntType(64), 4)
        d = builder.bitcast(d_raw, vec.as_pointer())
        s = builder.bitcast(s_raw, vec.as_pointer())
        count = builder.udiv(nbytes, ir.Constant(nbytes.type, 32))
        md = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, count) as loop:
            v = builder.load(builder.gep(s, [loop.index]), align=1)
            builder.store(v, builder.gep(d, [loop.index]), align=32).set_metadata("nontemporal", md)
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True)
def copy_nt(src, dst, ids):  # type: ignore[no-untyped-def]
    for i in range(ids.shape[0]):
        _nt_copy32(dst[i].ctypes.data, src[ids[i]].ctypes.data, dst.shape[1])
    return dst


@njit(nogil=True)
def copy_plain(src, dst, ids):  # type: ignore[no-untyped-def]
    size = dst.shape[1]
    for i in range(ids.shape[0]):
        s = src[ids[i]]
        row = dst[i]
        for j in range(size):
            row[j] = s[j]
    return dst


@njit(nogil=True)
def flip_every_other(batch, h, w):  # type: ignore[no-untyped-def]
    """``transforms.flip``'s in-place row loop (RGB), on images 0, 2, 4, ..."""
    n = batch.shape[0]
    buf = batch.reshape(n * h, w * 3)
    tmp = np.empty(w * 3, buf.dtype)
    one, two = np.uint64(1), np.uint64(2)
    for i in range(0, n, 2):
        for y in range(h):
            row = buf[i * h + y]
            for j in range(w * 3):
                tmp[j] = row[j]
            for x in range(w):
                a = np.uint64((w - 1 - x) * 3)
                b = np.uint64(x * 3)
                row[b] = tmp[a]
                row[b + one] = tmp[a + one]
                row[b + two] = tmp[a + two]
    return batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    src = np.random.default_rng(0).integers(0, 256, (N, IMAGE), dtype=np.uint8)
    perm = np.random.default_rng(1).permutation(N)
    maps = [mmap.mmap(-1, 16 * B * IMAGE) for _ in range(args.threads)]
    rings = [np.frombuffer(m, np.uint8).reshape(16, B, IMAGE) for m in maps]
    for ring in rings:
        ring[:] = 1
    copies = {"plain": copy_plain, "nt": copy_nt}
    for f in copies.values():  # compile
        flip_every_other(f(src, rings[0][0], perm[:B]), 32, 32)

    def work(f: Any, ring: np.ndarray, nslots: int, k: int, out: list[float]) -> None:
        t0 = time.thread_time()
        for b in range(ROUNDS_BATCHES):
            ids = perm[((b * args.threads + k) * B) % (N - B) :][:B]
            flip_every_other(f(src, ring[b % nslots], ids), 32, 32)
        out.append((time.thread_time() - t0) / ROUNDS_BATCHES * 1e6)

    print(f"CPU us per batch (copy + flip), {args.threads} thread(s)")
    for rnd in range(args.rounds):
        for nslots in (4, 8, 16):
            for name, f in copies.items():
                out: list[float] = []
                threads = [
                    threading.Thread(target=work, args=(f, ring, nslots, k, out))
                    for k, ring in enumerate(rings)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                print(
                    f"round {rnd} slots {nslots:2d} {name:5s} " + " ".join(f"{x:6.1f}" for x in out)
                )


if __name__ == "__main__":
    main()
