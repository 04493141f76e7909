"""Scratch memory the crop decoders hold on one worker thread (daemon memory with many pipelines).

    python benchmarks/bench_decoder_scratch.py [--decoders 16] [--batch 64] [--step 8]

Builds ``--decoders`` crop decoders (RandomResizedCrop and CenterCrop, outputs 128,
128 + step, ... px; ``--step 0``: all 128 px) over the ImageNet-like file of ``bench_loader.py`` (500 samples), runs one batch of each on
this thread twice, and reports what they hold afterwards (``tracemalloc``: numpy's allocations
are traced): the decoded pixels or regions, the TurboJPEG kernel's region grid, the resize
scratch and the upscale arena. One set per worker thread is the design (``_WorkerBuffers``);
one set per decoder would grow with ``--decoders``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step", type=int, default=8, help="output side added per decoder")
    args = ap.parse_args()

    from bench_loader import build
    from beton_serve.fields.decoders import (
        CenterCropRGBImageDecoder,
        RandomResizedCropRGBImageDecoder,
    )
    from beton_serve.format import BetonReader, memory_read
    from beton_serve.pipeline import State

    reader = BetonReader(build("imagenet", 500))
    md = reader.field_metadata("image")
    initial = State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8)
    ids = np.arange(args.batch, dtype=np.uint64)
    runs = []
    for k in range(args.decoders):
        side = 128 + args.step * k
        op = (
            RandomResizedCropRGBImageDecoder((side, side))
            if k % 2
            else CenterCropRGBImageDecoder((side, side), 0.875)
        )
        op.accept_globals(md, memory_read)
        st, _ = op.declare_state_and_memory(initial)
        fn = op.generate_code()
        dst = np.empty((args.batch, *st.shape), np.uint8)
        extra = [np.uint64(1)] if getattr(fn, "with_seed", False) else []
        runs.append((fn, [ids, dst, md, reader.storage_state, *extra]))
    fn0, a0 = runs[0]
    fn0(*a0)  # load the kernels before measuring
    fn0(*a0)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(2):
        for fn, a in runs:
            fn(*a)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    print(
        f"{args.decoders} crop decoders on one thread: scratch held after their batches "
        f"{held / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
