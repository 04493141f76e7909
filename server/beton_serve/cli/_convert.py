"""``beton-serve convert imagefolder DIR OUT.beton``: an ImageFolder tree to an image+label .beton.

``DIR`` has one sub-directory per class, as torchvision's ``ImageFolder`` expects; classes are
the sorted sub-directory names and labels their positions. Every file with an image extension
(``.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp``, any case) becomes one sample, in sorted
order. Symbolic links to directories are followed, each directory once per class; a link to a
directory that contains it (a loop) is skipped and named on stderr. A class directory without images is refused, as
torchvision refuses it. Images are read with ``cv2.imdecode`` (colour, so grayscale is
replicated and alpha dropped; EXIF orientation is ignored, as torchvision's PIL loader ignores it,
so pixels are stored as the file holds them) and converted BGR -> RGB. An unreadable image fails
the write with its path.

The file has the fields ``image`` (RGBImageField) and ``label`` (IntField).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
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
        #: Links skipped because they lead to a directory that contains them.
        self.loops: list[str] = []
        empty: list[str] = []
        for label, cls in enumerate(self.classes):
            before = len(self.samples)
            seen: set[tuple[int, int]] = set()  # (device, inode) of the directories walked
            # torchvision's order: sorted(os.walk(...)), i.e. by directory path ("x-z" before
            # "x/y"), then file names; a walk visited each directory's children right after it.
            found: list[tuple[str, list[str]]] = []
            for dirpath, dirnames, files in os.walk(os.path.join(root, cls), followlinks=True):
                st = os.stat(dirpath)
                if (st.st_dev, st.st_ino) in seen:  # reached again through another link
                    dirnames.clear()
                    continue
                seen.add((st.st_dev, st.st_ino))
                here = os.path.realpath(dirpath)
                for name in list(dirnames):
                    target = os.path.realpath(os.path.join(dirpath, name))
                    if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
                        dirnames.remove(name)  # a link to a directory that contains it: a loop
                        self.loops.append(os.path.join(dirpath, name))
                dirnames.sort()  # which of two links to one directory is kept: the first
                found.append(
                    (dirpath, [f for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)])
                )
            for dirpath, fnames in sorted(found, key=lambda t: t[0]):
                self.samples.extend((os.path.join(dirpath, f), label) for f in fnames)
            if len(self.samples) == before:
                empty.append(cls)
        if not self.samples:
            raise ConfigError(f"{root} contains no images with extensions {IMG_EXTENSIONS}")
        if empty:
            raise ConfigError(
                f"class directories without images in {root}: {', '.join(empty[:10])}"
                + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
                + " (torchvision's ImageFolder refuses them too; remove them, or add images)"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import cv2
        import numpy as np

        path, label = self.samples[i]
        data = np.fromfile(path, dtype=np.uint8)
        flags = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
        img = cv2.imdecode(data, flags) if data.size else None
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
    from beton_serve.errors import ConfigError, WriterError
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    dataset = ImageFolder(args.dir)
    for link in dataset.loops:
        print(f"skipped {link}: a link to a directory that contains it", file=sys.stderr)
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
        concurrent_reads=True,  # ImageFolder.__getitem__ keeps no state: thread-safe
    )
    try:
        with _terminate_as_interrupt():
            writer.from_indexed_dataset(dataset)
    except WriterError as exc:
        raise _naming_the_file(exc, dataset, args.page_size) from exc
    except _Terminated as exc:
        print(f"terminated by {exc.name}: nothing written to {args.out}", file=sys.stderr)
        return 128 + exc.signum
    print(
        f"wrote {len(dataset)} images in {len(dataset.classes)} classes to {args.out}",
        file=sys.stderr,
    )
    return 0


class _Terminated(BaseException):
    """SIGTERM or SIGHUP while writing: unwinds the writer, which removes its temporary file
    (left behind, it was a hidden file the size of the dataset that nothing removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise _Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _naming_the_file(exc: Any, dataset: ImageFolder, page_size: int) -> Any:
    """``exc`` (a ``WriterError`` naming a sample index) naming that sample's image file too,
    and ``--page-size`` where the writer says to raise the page size."""
    from beton_serve.errors import WriterError

    i = exc.index
    if i is None or not 0 <= i < len(dataset.samples):
        return exc
    path = dataset.samples[i][0]
    text = str(exc).removeprefix(f"sample {i}: ")
    if path in text:
        return exc
    if "raise page_size" in text:
        text += f" (--page-size, now {page_size}; a power of two)"
    return WriterError(f"{path}: {text}", i)
