"""Where an RRC-224 sample's time goes, against a whole-image decode (issue 15), one thread.

    python benchmarks/bench_rrc_parts.py [--n 200] [--rounds 5] [--out 224]

``ImageNetLike`` JPEGs encoded as FFCV writes them (``bench_ops.make_images``), behind a fake
``.beton`` storage state. Per image, best of ``--rounds`` (CPU time of this thread, as
``bench_ops.best_of``; OpenCV on one thread, so everything runs on it): the RRC decoder op (TurboJPEG crop decode + resize, with and without DCT scaling),
a whole-image decode (simplejpeg fastdct, as ``bench_decode_limit.py``'s "full"; TurboJPEG), and
the RRC's two parts apart: the planned crop decode, and the resize of the decoded crops (split
into upscales, which go to ``cv2.resize``, and area downscales, ours; cv2's INTER_AREA and
INTER_LINEAR on the same downscales for reference).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=int, default=224)
    args = ap.parse_args()

    import cv2
    import simplejpeg
    from bench_ops import best_of, fake_storage, make_images
    from beton_serve import _tj3
    from beton_serve._kernels import resize as rz
    from beton_serve._kernels.crop import rrc_batch
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder
    from beton_serve.format import memory_read
    from beton_serve.pipeline import State
    from beton_serve.pipeline.rng import derive_seed_key

    cv2.setNumThreads(1)
    out = args.out
    blobs = make_images(args.n)
    md, storage = fake_storage(blobs)
    lib = _tj3.load()
    _tj3.batch_kernel(lib, wait=True)

    def make(**kw: object) -> Callable[..., object]:
        dec = RandomResizedCropRGBImageDecoder((out, out), jpeg_backend="tj3", **kw)  # type: ignore[arg-type]
        dec.accept_globals(md, memory_read)
        dec.declare_state_and_memory(State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8))
        return dec.generate_code()

    rrc, rrc_nodct = make(), make(dct_scale=False)
    ids = np.arange(len(blobs), dtype=np.uint64)
    dst = np.empty((len(blobs), out, out, 3), np.uint8)
    key = derive_seed_key(0, 0, 1)
    rrc(ids, dst, md, storage, key)
    buf = np.empty(4096 * 4096 * 3, np.uint8)
    tj = _tj3.Decompressor(lib)
    arrays = [np.frombuffer(b, np.uint8) for b in blobs]

    def tj_full() -> None:
        for d in arrays:
            hd = tj.header(d)
            tj.decode(d, buf[: hd.height * hd.width * 3].reshape(hd.height, hd.width, 3), 8, None)

    boxes = rrc_batch(
        np.uint64(key),
        ids,
        md["height"].astype(np.int64),
        md["width"].astype(np.int64),
        np.array([0.08, 1.0]),
        np.array([3 / 4, 4 / 3]),
    )
    plans = []
    for d, box in zip(arrays, boxes, strict=True):
        top, left, ch, cw = (int(v) for v in box)
        plans.append((d, _tj3.plan_crop(tj.header(d), top, left, ch, cw, out, out, True, False)))

    def crop_decode() -> None:
        for d, (m, region, rh, rw, *_rest) in plans:
            tj.header(d)
            tj.decode(d, buf[: rh * rw * 3].reshape(rh, rw, 3), m, region)

    crops = []
    for d, (m, region, rh, rw, t2, l2, c2, w2) in plans:
        img = np.empty((rh, rw, 3), np.uint8)
        tj.header(d)
        tj.decode(d, img, m, region)
        crops.append((img, t2, l2, c2, w2))
    up = [c for c in crops if c[3] < out or c[4] < out]
    down = [c for c in crops if not (c[3] < out or c[4] < out)]
    o = np.empty((out, out, 3), np.uint8)
    rbuf = np.zeros(rz.scratch_size(4096, out), np.float32)

    def resize(items: list[tuple[np.ndarray, int, int, int, int]]) -> Callable[[], None]:
        def run() -> None:
            for img, t, lft, h, w in items:
                rz.resize_crop(img, t, lft, h, w, o, rbuf, "area")

        return run

    def cv2_down(interp: int) -> Callable[[], None]:
        def run() -> None:
            for img, t, lft, h, w in down:
                cv2.resize(img[t : t + h, lft : lft + w], (out, out), dst=o, interpolation=interp)

        return run

    per_image = {
        "RRC op (defaults)": lambda: rrc(ids, dst, md, storage, key),
        "RRC op (dct_scale=False)": lambda: rrc_nodct(ids, dst, md, storage, key),
        "full decode, simplejpeg": lambda: [
            simplejpeg.decode_jpeg(b, fastdct=True, buffer=buf) for b in blobs
        ],
        "full decode, TurboJPEG": tj_full,
        "crop decode only": crop_decode,
        "resize only": resize(crops),
    }
    parts = {
        "upscales (cv2 INTER_AREA)": (resize(up), len(up)),
        "downscales (ours)": (resize(down), len(down)),
        "downscales (cv2 INTER_AREA)": (cv2_down(cv2.INTER_AREA), len(down)),
        "downscales (cv2 INTER_LINEAR)": (cv2_down(cv2.INTER_LINEAR), len(down)),
    }
    res = best_of(per_image, args.rounds)
    for k, v in res.items():
        print(f"{k:30s} {v / len(blobs) * 1e6:7.1f} us/img")
    res2 = best_of({k: fn for k, (fn, _) in parts.items()}, args.rounds)
    for k, v in res2.items():
        n = parts[k][1]
        print(f"{k:30s} {v / max(1, n) * 1e6:7.1f} us/img  ({n} images)")
    scales = {m: sum(1 for _, p in plans if p[0] == m) for m in range(1, 9)}
    print(f"upscales {len(up)} of {len(crops)}; DCT scales used {scales}")


if __name__ == "__main__":
    main()
