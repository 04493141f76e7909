"""Write a .beton from an input/target folder pair: two RGBImageField(write_mode='smart') fields.

    python examples/paired_images/write_dataset.py pairs/input pairs/target dataset.beton

Pairs are matched by file name (``input/0007.png`` goes with ``target/0007.png``), in sorted
order. Every image is read with OpenCV and converted to RGB (grayscale is replicated, alpha is
dropped). With ``write_mode='smart'``, an image is stored as JPEG only when its raw size
(H x W x 3 bytes) exceeds ``smart_threshold``, raw otherwise. Raw keeps the pixels exact, which
a restoration target usually wants; large inputs are compressed.

This is the FFCV code with only its imports changed (``ffcv.writer`` -> ``beton_serve.writer``,
``ffcv.fields`` -> ``beton_serve.fields``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
from beton_serve.fields import RGBImageField
from beton_serve.writer import DatasetWriter

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".tif", ".tiff", ".webp"}


class PairedFolders:
    """An indexed dataset of ``(input, target)`` RGB uint8 HWC arrays, matched by file name."""

    def __init__(self, input_dir: Path, target_dir: Path) -> None:
        names = sorted(p.name for p in input_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        missing = [n for n in names if not (target_dir / n).is_file()]
        if not names:
            raise ValueError(f"no images in {input_dir}")
        if missing:
            raise ValueError(
                f"{len(missing)} inputs have no target, e.g. {target_dir / missing[0]}"
            )
        self.input_dir, self.target_dir, self.names = input_dir, target_dir, names

    def __len__(self) -> int:
        return len(self.names)

    @staticmethod
    def _read(path: Path) -> np.ndarray:
        img = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if img is None:
            raise ValueError(f"cannot read image {path}")
        return np.ascontiguousarray(img[..., ::-1])  # BGR -> RGB

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        name = self.names[i]
        return self._read(self.input_dir / name), self._read(self.target_dir / name)


def write(input_dir: Path, target_dir: Path, out: Path, smart_threshold: int, workers: int) -> int:
    """Write the pair dataset; returns the number of samples."""
    dataset = PairedFolders(input_dir, target_dir)
    writer = DatasetWriter(
        str(out),
        {
            "input": RGBImageField(write_mode="smart", smart_threshold=smart_threshold),
            "target": RGBImageField(write_mode="smart", smart_threshold=smart_threshold),
        },
        num_workers=workers,
    )
    writer.from_indexed_dataset(dataset)
    return len(dataset)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("input_dir", type=Path)
    p.add_argument("target_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument(
        "--smart-threshold",
        type=int,
        default=256 * 256 * 3,
        help="store as JPEG above this many raw bytes (H*W*3); raw below",
    )
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    n = write(args.input_dir, args.target_dir, args.out, args.smart_threshold, args.workers)
    sys.stdout.write(f"wrote {n} pairs to {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
