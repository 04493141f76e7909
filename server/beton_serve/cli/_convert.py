"""``beton-serve convert imagefolder DIR OUT.beton``: an ImageFolder tree to an image+label .beton.

``DIR`` has one sub-directory per class, as torchvision's ``ImageFolder`` expects; classes are
the sorted sub-directory names and labels their positions. Every file with an image extension
(``.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp``, any case) becomes one sample, in sorted
order. Images are read with ``cv2.imdecode`` (colour, so grayscale is replicated and alpha
dropped) and converted BGR -> RGB. An unreadable image fails the write with its path.

The file has the fields ``image`` (RGBImageField) and ``label`` (IntField).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["ImageFolder", "register", "run"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageFolder:
    """An indexed dataset over an ImageFolder tree: ``ds[i] -> (uint8 HWC RGB, label)``.

    Raises:
        ConfigError: ``root`` has no class directories or no images.
    """

    def __init__(self, root: str) -> None:
        from beton_serve.errors import ConfigError

        if not os.path.isdir(root):
            raise ConfigError(f"{root} is not a directory")
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise ConfigError(f"{root} has no class sub-directories (expected DIR/<class>/<img>)")
        self.samples: list[tuple[str, int]] = []
        for label, cls in enumerate(self.classes):
            for dirpath, dirnames, files in os.walk(os.path.join(root, cls), followlinks=True):
                dirnames.sort()
                for fname in sorted(files):
                    if fname.lower().endswith(IMG_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, fname), label))
        if not self.samples:
            raise ConfigError(f"{root} contains no images with extensions {IMG_EXTENSIONS}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import cv2
        import numpy as np

        path, label = self.samples[i]
        data = np.fromfile(path, dtype=np.uint8)
        img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
        if img is None:
            raise ValueError(f"cannot decode image {path}")
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB), label


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("convert", help="write a .beton from another dataset format")
    kinds = p.add_subparsers(dest="source", metavar="SOURCE", required=True)
    q = kinds.add_parser("imagefolder", help="a torchvision ImageFolder tree (DIR/<class>/<img>)")
    q.add_argument("dir", help="root directory, one sub-directory per class")
    q.add_argument("out", help="output .beton path")
    q.add_argument("--max-resolution", type=int, default=None, help="max side after resizing")
    q.add_argument(
        "--write-mode",
        default="jpg",
        choices=["raw", "jpg", "smart", "proportion"],
        help="image storage mode (default: jpg)",
    )
    q.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality (default 90)")
    q.add_argument("--smart-threshold", type=int, default=None, help="smart: JPEG iff H*W*3 > this")
    q.add_argument("--compress-probability", type=float, default=0.5, help="proportion mode")
    q.add_argument("--workers", type=int, default=-1, help="worker threads (default: all CPUs)")
    q.add_argument("--page-size", type=int, default=1 << 23, help="page size (default 8 MiB)")
    q.add_argument("--seed", type=int, default=None, help="seed for proportion mode")
    q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beton_serve.errors import ConfigError
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    dataset = ImageFolder(args.dir)
    try:
        image = RGBImageField(
            write_mode=args.write_mode,
            max_resolution=args.max_resolution,
            smart_threshold=args.smart_threshold,
            jpeg_quality=args.jpeg_quality,
            compress_probability=args.compress_probability,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    writer = DatasetWriter(
        args.out,
        {"image": image, "label": IntField()},
        page_size=args.page_size,
        num_workers=args.workers,
        seed=args.seed,
    )
    writer.from_indexed_dataset(dataset)
    print(
        f"wrote {len(dataset)} images in {len(dataset.classes)} classes to {args.out}",
        file=sys.stderr,
    )
    return 0
