"""Make a small input/target folder pair to try the paired-image example on.

``target/NNNN.png`` are generated clean images and ``input/NNNN.png`` the same images with
Gaussian noise, so the example trains a tiny denoiser. Bring your own pair of folders instead:
the writer only needs files with the same names in both.

    python examples/paired_images/make_folders.py pairs/ --count 64 --size 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np


def clean_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """A smooth RGB image with a few flat discs: ``(size, size, 3)`` uint8."""
    y, x = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    img = np.stack([rng.uniform(40, 215) + rng.uniform(-80, 80) * (x - y) for _ in range(3)], -1)
    for _ in range(3):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.1, 0.3)
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_pairs(root: Path, count: int, size: int, noise: float = 20.0, seed: int = 0) -> None:
    """Write ``count`` pairs as PNG under ``root/input`` and ``root/target``."""
    rng = np.random.default_rng(seed)
    (root / "input").mkdir(parents=True, exist_ok=True)
    (root / "target").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        clean = clean_image(rng, size)
        noisy = np.clip(clean + rng.normal(0.0, noise, clean.shape), 0, 255).astype(np.uint8)
        # OpenCV writes BGR: flip the channel order of the RGB arrays.
        cv2.imwrite(str(root / "target" / f"{i:04d}.png"), clean[..., ::-1])
        cv2.imwrite(str(root / "input" / f"{i:04d}.png"), noisy[..., ::-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("root", type=Path)
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--size", type=int, default=48)
    args = p.parse_args(argv)
    make_pairs(args.root, args.count, args.size)
    sys.stdout.write(f"wrote {args.count} pairs under {args.root}/input and {args.root}/target\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
