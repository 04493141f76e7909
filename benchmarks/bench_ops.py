"""Per-image cost of the ImageNet-like crop path: decode, crop sampling, resize (issue 3 ops).

Single thread, in-process, no loader: this isolates the ops. Images are ``ImageNetLike``
(benchmarks/synthetic.py, 300-500 px sides) encoded as FFCV writes them (OpenCV, q=90, 4:2:0),
held in memory behind a fake ``.beton`` storage state, so the decoder op runs exactly as in a
pipeline (``RandomResizedCropRGBImageDecoder((224, 224))``, crops from the counter RNG).

Timing: the CPU time of this thread (``time.thread_time``: everything here runs on the calling
thread, OpenCV is set to 1 thread), every variant run over the same images in interleaved rounds,
best round kept. The machine is shared and noisy: report ratios from one run.

    python benchmarks/bench_ops.py [--n 120] [--rounds 5] [--out 224]
    python benchmarks/bench_ops.py --cifar      # SimpleRGBImageDecoder + RandomHorizontalFlip
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_images(n: int) -> list[bytes]:
    import cv2
    from synthetic import ImageNetLike

    ds = ImageNetLike(n=n)
    out = []
    for i in range(n):
        img, _ = ds[i]
        ok, enc = cv2.imencode(".jpg", img[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])
        if not ok:
            raise RuntimeError("encode failed")
        out.append(enc.tobytes())
    return out


def fake_storage(blobs: list[bytes]) -> tuple[np.ndarray, tuple[Any, ...]]:
    import simplejpeg

    data = np.frombuffer(b"".join(blobs), np.uint8)
    sizes = np.array([len(b) for b in blobs], np.uint64)
    ptrs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    md = np.zeros(
        len(blobs),
        dtype=np.dtype([("mode", "u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]),
    )
    for i, b in enumerate(blobs):
        h, w, _, _ = simplejpeg.decode_jpeg_header(b)
        md[i] = (0, w, h, ptrs[i])
    return md, (data, ptrs, sizes)


def best_of(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.thread_time()
            fn()
            best[k] = min(best[k], time.thread_time() - t)
    return best


def cifar(rounds: int) -> None:
    """50,000 raw 32x32 images, batches of 512 in random order: decode and flip, one core."""
    from beton_serve.fields.decoders import SimpleRGBImageDecoder
    from beton_serve.format import memory_read
    from beton_serve.pipeline import Compiler, State
    from beton_serve.pipeline.rng import derive_seed_key
    from beton_serve.transforms import RandomHorizontalFlip

    n, bs = 50_000, 512
    data = np.random.default_rng(0).integers(0, 256, n * 3072, dtype=np.uint8)
    ptrs = (np.arange(n) * 3072).astype(np.uint64)
    storage = (data, ptrs, np.full(n, 3072, np.uint64))
    md = np.zeros(
        n,
        dtype=np.dtype([("mode", "u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]),
    )
    md["mode"], md["width"], md["height"], md["data_ptr"] = 1, 32, 32, ptrs
    dec = SimpleRGBImageDecoder()
    dec.accept_globals(md, memory_read)
    s1, _ = dec.declare_state_and_memory(
        State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8)
    )
    decode = Compiler.compile(dec.generate_code())
    flip_op = RandomHorizontalFlip()
    flip_op.declare_state_and_memory(s1)
    flip = flip_op.generate_code()
    if not getattr(flip, "python", False):
        flip = Compiler.compile(flip)
    a = np.empty((bs, 32, 32, 3), np.uint8)
    b = np.empty_like(a)
    key = derive_seed_key(0, 0, 1)
    perm = np.random.default_rng(1).permutation(n).astype(np.uint64)
    batches = [perm[i : i + bs] for i in range(0, n - bs + 1, bs)]
    decode(batches[0], a, md, storage)
    flip(a, b, batches[0], key)
    best = best_of(
        {
            "decode": lambda: [decode(ids, a, md, storage) for ids in batches],
            "flip": lambda: [flip(a, b, ids, key) for ids in batches],
        },
        rounds,
    )
    total = len(batches) * bs
    both = best["decode"] + best["flip"]
    print(
        f"CIFAR-like raw 32x32, batch {bs}: decode {total / best['decode']:.0f} img/s, "
        f"flip {total / best['flip']:.0f} img/s, both {total / both:.0f} img/s (one core)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=int, default=224)
    ap.add_argument("--cifar", action="store_true")
    args = ap.parse_args()
    if args.cifar:
        cifar(args.rounds)
        return

    import cv2
    import simplejpeg
    from beton_serve._kernels.crop import rrc_batch
    from beton_serve._kernels.resize import resize_crop, scratch_size
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder
    from beton_serve.format import memory_read
    from beton_serve.jpeg import decode_into
    from beton_serve.pipeline import State
    from beton_serve.pipeline.rng import derive_seed_key

    cv2.setNumThreads(1)
    blobs = make_images(args.n)
    md, storage = fake_storage(blobs)
    n, o = args.n, args.out
    ids = np.arange(n, dtype=np.uint64)
    key = derive_seed_key(0, 0, 0)
    heights = md["height"].astype(np.int64)
    widths = md["width"].astype(np.int64)
    boxes = rrc_batch(key, ids, heights, widths, np.array([0.08, 1.0]), np.array([3 / 4, 4 / 3]))
    scratch = np.empty(int(heights.max() * widths.max() * 3), np.uint8)
    full = [decode_into(b, scratch).copy() for b in blobs]
    rbuf = np.empty(scratch_size(int(widths.max()), o), np.float32)
    dst = np.empty((o, o, 3), np.uint8)

    # -- resize only: the sampled crops of full decodes --------------------------------------
    def resize_all(method: str) -> None:
        for i in range(n):
            t, l_, h, w = (int(v) for v in boxes[i])
            resize_crop(full[i], t, l_, h, w, dst, rbuf, method)

    def cv2_all() -> None:
        for i in range(n):
            t, l_, h, w = (int(v) for v in boxes[i])
            cv2.resize(
                full[i][t : t + h, l_ : l_ + w], (o, o), dst=dst, interpolation=cv2.INTER_AREA
            )

    def decode_full() -> None:
        for b in blobs:
            simplejpeg.decode_jpeg(b, fastdct=True, fastupsample=False, buffer=scratch)

    def decode_scaled() -> None:
        for i, b in enumerate(blobs):
            _, _, h, w = (int(v) for v in boxes[i])
            hh, ww = int(heights[i]), int(widths[i])
            if h >= 2 * o and w >= 2 * o:
                decode_into(b, scratch, -((-hh * o) // h), -((-ww * o) // w))
            else:
                decode_into(b, scratch)

    ops = {
        name: RandomResizedCropRGBImageDecoder((o, o), resize=rs, dct_scale=dct)
        for name, rs, dct in [
            ("op cv2 resize, full decode (FFCV pixels)", "cv2", False),
            ("op area resize, full decode", "area", False),
            ("op area resize, DCT-scaled decode (default)", "area", True),
        ]
    }
    ops["op area resize, DCT-scaled, fast_upsample"] = RandomResizedCropRGBImageDecoder(
        (o, o), fast_upsample=True
    )
    fns: dict[str, Any] = {}
    outs: dict[str, np.ndarray] = {}
    for name, op in ops.items():
        op.accept_globals(md, memory_read)
        op.declare_state_and_memory(State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8))
        fn = op.generate_code()
        buf = np.empty((n, o, o, 3), np.uint8)
        outs[name] = buf
        fns[name] = lambda fn=fn, buf=buf: fn(ids, buf, md, storage, key)
        fns[name]()  # warm (compile)

    # -- + RandomHorizontalFlip on the 224 batch (FFCV flips with a Numba reversed-slice copy) --
    import numba

    @numba.njit(nogil=True)
    def numba_slice_flip(images, dst, mask):  # FFCV's way: dst[i] = images[i][:, ::-1]
        for i in range(images.shape[0]):
            if mask[i]:
                dst[i] = images[i][:, ::-1]
            else:
                dst[i] = images[i]
        return dst

    from beton_serve.transforms import RandomHorizontalFlip

    flip_op = RandomHorizontalFlip()
    flip_op.declare_state_and_memory(
        State(jit_mode=True, device="cpu", shape=(o, o, 3), dtype=np.uint8)
    )
    flip_fn = flip_op.generate_code()
    batch_out = outs["op area resize, DCT-scaled decode (default)"]
    flipped = np.empty_like(batch_out)
    mask = np.arange(n) % 2 == 0
    numba_slice_flip(batch_out, flipped, mask)
    fns["flip: FFCV-like Numba slice copy"] = lambda: numba_slice_flip(batch_out, flipped, mask)
    fns["flip: RandomHorizontalFlip (cv2.flip)"] = lambda: flip_fn(batch_out, flipped, ids, key)

    def ffcv_like() -> None:
        for i in range(n):
            img = simplejpeg.decode_jpeg(blobs[i], fastdct=True, fastupsample=False, buffer=scratch)
            t, l_, h, w = (int(v) for v in boxes[i])
            cv2.resize(img[t : t + h, l_ : l_ + w], (o, o), dst=dst, interpolation=cv2.INTER_AREA)

    resize_all("area")
    timed = {
        "decode: full (fastdct)": decode_full,
        "decode: DCT-scaled when crop >= 2x output": decode_scaled,
        "resize: cv2 INTER_AREA": cv2_all,
        "resize: compiled area filter": lambda: resize_all("area"),
        "FFCV-like loop: full decode + cv2 INTER_AREA": ffcv_like,
        **fns,
    }
    best = best_of(timed, args.rounds)
    ffcv_flip = (
        best["FFCV-like loop: full decode + cv2 INTER_AREA"]
        + best["flip: FFCV-like Numba slice copy"]
    )
    ours_flip = (
        best["op area resize, DCT-scaled decode (default)"]
        + best["flip: RandomHorizontalFlip (cv2.flip)"]
    )
    scaled_frac = float(np.mean((boxes[:, 2] >= 2 * o) & (boxes[:, 3] >= 2 * o)))
    print(f"{n} ImageNetLike JPEGs (q=90), RRC -> {o}x{o}, best of {args.rounds} rounds")
    print(f"crops >= 2x output (DCT-scalable): {scaled_frac:.1%}")
    base = best["FFCV-like loop: full decode + cv2 INTER_AREA"]
    print(f"{'variant':50s} {'us/image':>9s} {'img/s':>7s} {'vs FFCV-like':>12s}")
    for k, v in best.items():
        us = v / n * 1e6
        print(f"{k:50s} {us:9.0f} {n / v:7.0f} {base / v:11.2f}x")
    print(
        f"decode+crop+resize+flip per image: FFCV-like {ffcv_flip / n * 1e6:.0f} us, "
        f"ours (defaults) {ours_flip / n * 1e6:.0f} us: {ffcv_flip / ours_flip:.2f}x"
    )
    ref = outs["op cv2 resize, full decode (FFCV pixels)"].astype(np.int16)
    for name in list(ops)[1:]:
        d = np.abs(outs[name].astype(np.int16) - ref)
        print(
            f"pixels vs FFCV ({name}): max |diff| {d.max()}, mean {d.mean():.3f}, "
            f"exact {np.mean(d == 0):.2%}, PSNR {10 * np.log10(255**2 / max(np.mean(d.astype(float) ** 2), 1e-12)):.1f} dB"
        )


if __name__ == "__main__":
    main()
