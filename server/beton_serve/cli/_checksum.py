"""``beton-serve checksum FILE [...] [--verify]``: write or check per-sample CRC32C sidecars.

Without ``--verify``, each FILE is opened (and validated) and ``FILE.crc32c`` is written
atomically (a temporary file renamed into place), replacing any older sidecar. With
``--verify``, every sample of each FILE is checked against its existing sidecar: the ids of the
samples that do not match are printed (``FILE: bad sample ids: 3 17``) and the exit status is 1
if any sample, in any file, is bad. A missing, stale or damaged sidecar is an error (exit 1).
The sidecar's layout and what is summed are in ``beton_serve.format._checksum``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from beton_serve.cli._plugins import add_custom_field_option, load_field_classes

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``checksum`` subcommand."""
    p = subparsers.add_parser(
        "checksum",
        help="write (or --verify) FILE.crc32c: a CRC32C of every sample, to detect corruption",
        description="Write FILE.crc32c, a sidecar with a CRC32C of every sample of FILE (the "
        ".beton is not changed), or check every sample against it with --verify. Loaders "
        "check samples against it with verify_checksums=True, the daemon with "
        "--verify-checksums.",
    )
    p.add_argument("files", nargs="+", metavar="FILE.beton")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every sample against the existing sidecar; print bad sample ids, exit 1 "
        "if there are any",
    )
    add_custom_field_option(p)
    p.set_defaults(func=run)


def _progress(total: int, label: str) -> Any:
    """A tqdm bar on a terminal, else nothing (``None``)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="sample", unit_scale=True, leave=False)


def run(args: argparse.Namespace) -> int:
    """Write or verify the sidecar of each file; returns 0, or 1 if a sample is bad or a file
    could not be read (each file is tried: one bad file does not stop the others)."""
    from beton_serve.errors import BetonError

    custom = load_field_classes(args.custom_field)
    status = 0
    for path in args.files:
        try:
            status = max(status, _one(path, args.verify, custom))
        except BetonError as exc:  # the next files are still checked (or written)
            print(f"error: {exc}", file=sys.stderr)
            status = 1
    return status


def _one(path: str, verify: bool, custom_fields: dict[str, type]) -> int:
    """Write or verify ``path``'s sidecar; 1 if a sample is bad, else 0."""
    # The pipeline package registers the per-user compile cache (`beton-serve cache`) for
    # the reader's SIGBUS guard, which went to ~/.cache/numba, or nowhere, without it.
    import beton_serve.pipeline  # noqa: F401
    from beton_serve.format import BetonReader, ChecksumVerifier, write_sidecar

    with BetonReader(path, custom_fields=custom_fields or None) as reader:
        t0 = time.perf_counter()
        if verify:
            bad = ChecksumVerifier([reader]).mismatches()
            took = time.perf_counter() - t0
            if bad.size:
                ids = " ".join(str(int(i)) for i in bad)
                print(f"{path}: bad sample ids: {ids}")
                print(
                    f"{path}: {bad.size} of {reader.num_samples} samples do not match "
                    f"their checksum",
                    file=sys.stderr,
                )
                return 1
            print(
                f"{path}: all {reader.num_samples} samples match "
                f"({reader.file_size / 1e6:.1f} MB file, {took:.2f} s)"
            )
            return 0
        bar = _progress(reader.num_samples, path)
        try:
            dest = write_sidecar(reader, progress=None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()
        took = time.perf_counter() - t0
        print(
            f"wrote {dest}: {reader.num_samples} samples, "
            f"{reader.file_size / 1e6:.1f} MB in {took:.2f} s"
        )
    return 0
