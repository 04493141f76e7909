"""Format benchmarks (issue 2): reader open+validate, writer throughput, JPEG decode per core.

    python benchmarks/bench_format.py open --samples 1000000      # open-and-validate time
    python benchmarks/bench_format.py write --n 500                 # writer images/s (jpg, raw; 1, 2 workers)
    python benchmarks/bench_format.py encode --n 200               # JPEG encode: threads vs processes
    python benchmarks/bench_format.py decode --n 500                # simplejpeg(fastdct) vs cv2.imdecode

``open`` builds the file directly with numpy (an IntField and an NDArrayField(uint8, (8,)), so
the allocation table has one entry per sample) and times ``BetonReader(path)`` (best of 3).
The writer and decoder benchmarks use ``benchmarks/synthetic.py``'s ImageNetLike images,
generated in memory first, so only the writer / decoder is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_synthetic(path: str, n: int, page_size: int = 1 << 23, shuffle: bool = False) -> None:
    """A valid .beton with fields label (IntField) and vec (NDArrayField uint8 (8,))."""
    from beton_serve.fields import IntField, NDArrayField
    from beton_serve.format import (
        ALLOC_ENTRY_DTYPE,
        FIELD_DESC_DTYPE,
        HEADER_DTYPE,
        align_up,
        record_dtype,
    )

    fields = [("label", IntField()), ("vec", NDArrayField(np.uint8, (8,)))]
    rec = record_dtype([f.metadata_type for _, f in fields])
    m = 24 + 1041 * len(fields)
    d = align_up(m + n * rec.itemsize, page_size)
    per_page = page_size // 8
    pages = -(-n // per_page)
    ids = np.arange(n, dtype=np.uint64)
    ptrs = (
        np.uint64(d)
        + (ids // np.uint64(per_page)) * np.uint64(page_size)
        + (ids % np.uint64(per_page)) * np.uint64(8)
    )
    meta = np.zeros(n, rec)
    meta["f0"] = np.arange(n) % 1000
    meta["f1"] = ptrs
    descs = np.zeros(len(fields), FIELD_DESC_DTYPE)
    for i, (name, f) in enumerate(fields):
        descs["type_id"][i] = 1 if i == 0 else 4
        descs["name"][i, : len(name)] = np.frombuffer(name.encode(), np.uint8)
        descs["arguments"][i] = f.to_binary()
    table = np.zeros(n, ALLOC_ENTRY_DTYPE)
    table["sample_id"], table["ptr"], table["size"] = ids, ptrs, 8
    if shuffle:  # FFCV with several workers: table order is unspecified
        table = table[np.random.default_rng(0).permutation(n)]
    a = d + pages * page_size
    hdr = np.zeros(1, HEADER_DTYPE)
    hdr[0] = (2, len(fields), page_size, n, a)
    with open(path, "wb") as f:
        f.write(hdr.tobytes())
        f.write(descs.tobytes())
        f.write(meta.tobytes())
        f.truncate(a)  # zero padding and zero data pages (sparse)
        f.seek(a)
        f.write(table.tobytes())


def bench_open(args: argparse.Namespace) -> None:
    from beton_serve.format import BetonReader

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.beton")
        t0 = time.perf_counter()
        build_synthetic(path, args.samples, shuffle=args.shuffle)
        build = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            with BetonReader(path) as r:
                assert r.num_samples == args.samples
            times.append(time.perf_counter() - t0)
        size = os.path.getsize(path)
    print(
        f"open+validate {args.samples:,} samples{' (shuffled table)' if args.shuffle else ''} ({size / 1e6:.0f} MB file, built in {build:.1f} s): "
        f"best {min(times):.3f} s, runs {', '.join(f'{t:.3f}' for t in times)}"
    )


def _images(n: int) -> list:
    from synthetic import ImageNetLike

    ds = ImageNetLike(n=n)
    return [ds[i] for i in range(n)]


def bench_write(args: argparse.Namespace) -> None:
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    items = _images(args.n)
    px = sum(im.shape[0] * im.shape[1] for im, _ in items) / len(items)
    print(f"{args.n} ImageNetLike images in memory, mean {px / 1e3:.0f} kpx")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("jpg", "raw"):
            for workers in (1, 2):
                out = os.path.join(tmp, f"{mode}{workers}.beton")
                fields = {
                    "image": RGBImageField(write_mode=mode, jpeg_quality=90),
                    "label": IntField(),
                }
                t0 = time.perf_counter()
                DatasetWriter(out, fields, num_workers=workers).from_indexed_dataset(
                    items, chunksize=16
                )
                dt = time.perf_counter() - t0
                print(
                    f"write mode={mode} workers={workers}: {args.n / dt:7.1f} images/s "
                    f"({os.path.getsize(out) / 1e6:.1f} MB)"
                )


def _encode(img: np.ndarray) -> int:
    from beton_serve.fields.rgb_image import encode_jpeg

    return int(encode_jpeg(img, 90).size)


def bench_encode(args: argparse.Namespace) -> None:
    imgs = [im for im, _ in _images(args.n)]
    t0 = time.perf_counter()
    for im in imgs:
        _encode(im)
    serial = time.perf_counter() - t0
    with ThreadPoolExecutor(2, thread_name_prefix="beton-bench") as pool:
        t0 = time.perf_counter()
        list(pool.map(_encode, imgs, chunksize=8))
        threads = time.perf_counter() - t0
    with ProcessPoolExecutor(2) as ppool:
        list(ppool.map(_encode, imgs[:4]))  # warm up the workers
        t0 = time.perf_counter()
        list(ppool.map(_encode, imgs, chunksize=8))
        procs = time.perf_counter() - t0
    print(
        f"JPEG encode {args.n} images: serial {args.n / serial:.1f}/s, 2 threads "
        f"{args.n / threads:.1f}/s ({serial / threads:.2f}x), 2 processes {args.n / procs:.1f}/s "
        f"({serial / procs:.2f}x; includes pickling the images)"
    )


def bench_decode(args: argparse.Namespace) -> None:
    import cv2
    import simplejpeg
    from beton_serve.fields.rgb_image import encode_jpeg

    jpegs = [encode_jpeg(im, 90).tobytes() for im, _ in _images(args.n)]
    arrs = [np.frombuffer(j, np.uint8) for j in jpegs]
    res = {}
    for name, fn in [
        (
            "simplejpeg fastdct",
            lambda j, a: simplejpeg.decode_jpeg(j, "RGB", fastdct=True, fastupsample=False),
        ),
        ("cv2.imdecode", lambda j, a: cv2.imdecode(a, cv2.IMREAD_COLOR)),
    ]:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for j, a in zip(jpegs, arrs, strict=True):
                fn(j, a)
            best = min(best, time.perf_counter() - t0)
        res[name] = args.n / best
        print(f"decode 1 thread, {name}: {res[name]:.1f} images/s ({1e3 / res[name]:.2f} ms/image)")
    print(f"ratio simplejpeg/cv2: {res['simplejpeg fastdct'] / res['cv2.imdecode']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("open")
    o.add_argument("--samples", type=int, default=1_000_000)
    o.add_argument("--shuffle", action="store_true", help="allocation table in random order")
    o.set_defaults(fn=bench_open)
    for name, fn, n in (
        ("write", bench_write, 500),
        ("encode", bench_encode, 200),
        ("decode", bench_decode, 500),
    ):
        q = sub.add_parser(name)
        q.add_argument("--n", type=int, default=n)
        q.set_defaults(fn=fn)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
