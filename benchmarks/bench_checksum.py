"""Checksum sidecars (issue 11 §11): how often a bit flip goes unnoticed, and what checking costs.

    python benchmarks/bench_checksum.py flips  [--n 2000] [--images 200] [--per-image 50]
    python benchmarks/bench_checksum.py verify [--n 2000]
    python benchmarks/bench_checksum.py rrc    [--n 2000] [--epochs 3] [--workers 2]
    python benchmarks/bench_checksum.py libs   # crc32c vs google-crc32c (pip install it first)

Dataset: ``synthetic.ImageNetLike`` (300-500 px sides) written as RGBImageField(jpg, q=90) +
IntField under benchmarks/_data/ (gitignored; built once, as ``bench_loader.py`` does).

* ``flips``: flips one random bit of the entropy-coded data of a JPEG, ``--per-image`` times for
  each of the first ``--images`` images, and decodes it strictly (``beton_serve.jpeg.decode_into``):
  counts flips that raise, that decode into *different pixels without an error* (what a
  checksum is for), and that change nothing.
* ``verify``: time to write the sidecar and to check every sample against it (MB/s of summed
  bytes, page cache warm), and the cost of ``ChecksumVerifier.check`` on one batch of 256
  samples (ms per batch).
* ``rrc``: the in-process Loader with the issue-3 RRC pipeline (RandomResizedCrop 224, flip,
  ToTensor, ToTorchImage; batch 256, RANDOM order), ``verify_checksums`` off and on in
  alternating epochs after a warm-up epoch; median ms per batch of each.
* ``libs``: the two CRC32C packages the choice was between, on 256 MiB of random bytes: one
  thread, two threads (does it release the GIL?), and a batch of 512 x (24 B + 110 KB).
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


def _dataset(n: int) -> Path:
    from bench_loader import build

    return build("imagenet", n)


def flips(n: int, images: int, per_image: int) -> dict:
    from beton_serve.format import BetonReader
    from beton_serve.jpeg import CorruptJPEGError, decode_into

    path = _dataset(n)
    rng = np.random.default_rng(11)
    counts = {"error": 0, "silent_different_pixels": 0, "identical": 0}
    with BetonReader(path) as r:
        meta = r.field_metadata("image")
        scratch = np.empty(int(meta["height"].max()) * int(meta["width"].max()) * 3, np.uint8)
        for j in range(min(images, n)):
            data = np.array(r.sample_bytes(j, "image"))
            raw = data.tobytes()
            sos = raw.find(b"\xff\xda")
            start, end = (
                sos + 2 + int.from_bytes(raw[sos + 2 : sos + 4], "big"),
                raw.rfind(b"\xff\xd9"),
            )
            ref = decode_into(data, scratch).copy()
            for _ in range(per_image):
                pos, bit = int(rng.integers(start, end)), int(rng.integers(8))
                bad = data.copy()
                bad[pos] ^= 1 << bit
                try:
                    out = decode_into(bad, scratch)
                except CorruptJPEGError:
                    counts["error"] += 1
                    continue
                same = out.shape == ref.shape and np.array_equal(out, ref)
                counts["identical" if same else "silent_different_pixels"] += 1
    total = sum(counts.values())
    return {
        "images": min(images, n),
        "flips": total,
        **counts,
        "silent_fraction": round(counts["silent_different_pixels"] / total, 3),
    }


def verify(n: int) -> dict:
    from beton_serve.format import BetonReader, ChecksumVerifier, write_sidecar
    from beton_serve.format._checksum import SampleRegions

    path = _dataset(n)
    with BetonReader(path) as r:
        summed = SampleRegions(r).summed_bytes()
        np.asarray(r.storage_state[0]).sum(dtype=np.uint64)  # warm the page cache
        t = time.perf_counter()
        write_sidecar(r)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        v = ChecksumVerifier([r])
        open_s = time.perf_counter() - t
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            bad = v.mismatches()
            runs.append(time.perf_counter() - t)
        assert bad.size == 0
        rng = np.random.default_rng(0)
        per_batch = []
        for _ in range(50):
            ids = rng.choice(r.num_samples, 256, replace=False).astype(np.uint64)
            t = time.perf_counter()
            v.check(ids)
            per_batch.append(time.perf_counter() - t)
    best = min(runs)
    return {
        "samples": n,
        "summed_MB": round(summed / 1e6, 1),
        "write_sidecar_s": round(write_s, 3),
        "open_verifier_s": round(open_s, 4),
        "verify_all_s": round(best, 3),
        "verify_MB_s": round(summed / 1e6 / best),
        "check_256_ms_median": round(1e3 * statistics.median(per_batch), 2),
        "check_256_bytes_MB": round(summed / n * 256 / 1e6, 1),
    }


def rrc(n: int, epochs: int, workers: int) -> dict:
    from bench_loader import pipelines
    from beton_serve.format import BetonReader, write_sidecar
    from beton_serve.loader import Loader, OrderOption
    from beton_serve.pipeline import PlanCache

    path = _dataset(n)
    with BetonReader(path) as r:
        write_sidecar(r)
    cache = PlanCache()
    batch = 256
    loaders = {
        on: Loader(
            path,
            batch_size=batch,
            num_workers=workers,
            order=OrderOption.RANDOM,
            seed=0,
            pipelines=pipelines("imagenet"),
            plan_cache=cache,
            verify_checksums=on,
        )
        for on in (False, True)
    }
    ms: dict[bool, list[float]] = {False: [], True: []}
    for e in range(epochs + 1):
        for on in (False, True) if e % 2 == 0 else (True, False):
            ld = loaders[on]
            t = time.perf_counter()
            for _ in ld:
                pass
            if e:
                ms[on].append(1e3 * (time.perf_counter() - t) / len(ld))
    for ld in loaders.values():
        ld.close()
    off, on_ = statistics.median(ms[False]), statistics.median(ms[True])
    return {
        "samples": n,
        "batch": batch,
        "workers": workers,
        "ms_per_batch_off": round(off, 1),
        "ms_per_batch_on": round(on_, 1),
        "overhead_ms_per_batch": round(on_ - off, 2),
        "overhead_pct": round(100 * (on_ - off) / off, 1),
        "epochs_off_ms": [round(x, 1) for x in ms[False]],
        "epochs_on_ms": [round(x, 1) for x in ms[True]],
    }


def libs() -> dict:
    import threading

    import crc32c

    impls = {"crc32c": lambda d, v=0: crc32c.crc32c(d, v)}
    try:
        import google_crc32c

        impls["google-crc32c"] = lambda d, v=0: google_crc32c.extend(v, d)
    except ImportError:
        print("google-crc32c is not installed: measuring crc32c only", file=sys.stderr)
    big = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    big.flags.writeable = False  # google-crc32c takes read-only numpy arrays only
    out: dict[str, dict] = {}
    for name, f in impls.items():
        t = time.perf_counter()
        for _ in range(3):
            f(big)
        one = 3 * 256 / 1024 / (time.perf_counter() - t)
        halves = [big[: 128 << 20], big[128 << 20 :]]
        t = time.perf_counter()
        ths = [threading.Thread(target=lambda h=h, f=f: [f(h) for _ in range(3)]) for h in halves]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        two = 3 * 256 / 1024 / (time.perf_counter() - t)
        recs = [big[i * 24 : (i + 1) * 24] for i in range(512)]
        imgs = [big[i * 110_000 : (i + 1) * 110_000] for i in range(512)]
        t = time.perf_counter()
        for _ in range(10):
            for r, m in zip(recs, imgs, strict=True):
                f(m, f(r))
        batch_ms = 1e3 * (time.perf_counter() - t) / 10
        out[name] = {
            "GiB_s_1_thread": round(one, 1),
            "GiB_s_2_threads": round(two, 1),
            "batch_512x110KB_ms": round(batch_ms, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["flips", "verify", "rrc", "libs"])
    ap.add_argument("--n", type=int, default=2000, help="samples of the dataset")
    ap.add_argument("--images", type=int, default=200, help="flips: images to corrupt")
    ap.add_argument("--per-image", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    if a.mode == "flips":
        out = flips(a.n, a.images, a.per_image)
    elif a.mode == "verify":
        out = verify(a.n)
    elif a.mode == "libs":
        out = libs()
    else:
        out = rrc(a.n, a.epochs, a.workers)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
