"""Which file a ``.beton`` path names: the identity a client sends and a daemon checks.

A dataset is a file, never a stem (DESIGN.md §8). ``Loader('other/train.beton')`` against a daemon
that serves ``./train.beton`` must either get that very file or fail, naming both paths. Both
sides compute a :class:`FileIdentity` with :meth:`FileIdentity.of`, the same way:

* ``device``, ``inode``, ``size`` and ``mtime_ns`` from ``stat``: on one host (same boot id),
  two paths name the same file exactly when these four agree;
* ``fingerprint``: SHA-256 over the file's size, its first and its last
  :data:`FINGERPRINT_SPAN` bytes, and :data:`INTERIOR_SPANS` spans of :data:`INTERIOR_SPAN`
  bytes spread evenly between them. A ``.beton`` keeps its header and field table at the start
  and its allocation table at the end, and its samples' data in between, so a copy of the file
  on another host has the same fingerprint, and a different dataset of the same schema does
  not, even one that agrees with it in both ends (raw pixels rewritten with the same sizes,
  labels and order: version 1 of the fingerprint hashed the ends only, and took such a file for
  the same dataset). Across hosts, where device and inode numbers mean nothing, size and
  fingerprint are compared instead.

The fingerprint samples the file, it does not hash all of it: a file that differs from another
only in bytes between the sampled spans (a few samples edited in place) has its fingerprint. A
dataset regenerated with other contents throughout differs in every span.

Fingerprints and dataset digests start with their scheme, :data:`SCHEME` (``"v2:"``); version 1's
had no prefix. Two of different schemes say nothing about each other
(:func:`compare_digests` returns ``None``): a Loader state saved by an older beton-serve, or a
daemon of another version.

Reading the spans costs two ``pread`` calls of 64 KiB and 64 of 4 KiB, once per Loader and once
per served file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "FINGERPRINT_SPAN",
    "INTERIOR_SPAN",
    "INTERIOR_SPANS",
    "NOT_REGULAR",
    "SCHEME",
    "FileIdentity",
    "compare_digests",
    "content_fingerprint",
    "dataset_digest",
    "interior_spans",
    "mapping_problem",
    "unmappable",
]

#: Bytes hashed at each end of the file.
FINGERPRINT_SPAN = 64 << 10
#: How many spans between the two ends are hashed, and the bytes of each.
INTERIOR_SPANS = 64
INTERIOR_SPAN = 4 << 10
#: The scheme of this version's fingerprints and digests: the prefix, before a ``:``, of both.
SCHEME = "v2"
#: Why a path that is not a regular file is refused (the reader's and the client's words).
NOT_REGULAR = "not a regular file (a directory, a FIFO, a socket or a device)"


def unmappable(reason: object) -> str:
    """Why a ``.beton`` path cannot be read: ``reason`` is the ``OSError`` or :data:`NOT_REGULAR`.
    The reader's ``FormatError`` and the served Loader's give the same words (conformance)."""
    if reason == NOT_REGULAR:
        return f"{NOT_REGULAR}: a .beton file is mapped"
    return f"cannot open or map the file: {reason}"


def mapping_problem(path: str) -> str | None:
    """``"<path>: <why>"`` (:func:`unmappable`) when ``path`` is no regular file on this host,
    else ``None`` (one ``stat``)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {unmappable(exc)}"
    return None if stat.S_ISREG(st.st_mode) else f"{path}: {unmappable(NOT_REGULAR)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class FileIdentity:
    """One file as a path resolved to it (see the module docstring).

    Attributes:
        path: the absolute path it was resolved from (for messages only; never compared).
        device, inode, size, mtime_ns: from ``stat``.
        fingerprint: ``"v2:"`` and the hex SHA-256 of the size, both ends of the file and the
            spans between them (see the module docstring).
    """

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    fingerprint: str

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileIdentity:
        """Stat and fingerprint ``path`` (symlinks followed: the file is what it names).

        Raises:
            OSError: it cannot be opened or read.
        """
        text = os.path.abspath(os.fspath(path))
        # A file object, not a bare descriptor: a Ctrl-C right after a bare ``os.open`` (in a
        # Loader's construction) leaked the descriptor.
        with open(text, "rb", buffering=0) as f:
            fd = f.fileno()
            st = os.fstat(fd)
            return cls(
                path=text,
                device=st.st_dev,
                inode=st.st_ino,
                size=st.st_size,
                mtime_ns=st.st_mtime_ns,
                fingerprint=_fingerprint(fd, st.st_size),
            )

    def same_file(self, other: FileIdentity, *, same_host: bool) -> bool:
        """Whether ``other`` names this file: (device, inode, size, mtime) on one host; size
        and fingerprint across hosts (never for fingerprints of two schemes: see
        :meth:`scheme_note`)."""
        if same_host:
            return (self.device, self.inode, self.size, self.mtime_ns) == (
                other.device,
                other.inode,
                other.size,
                other.mtime_ns,
            )
        return (self.size, self.fingerprint) == (other.size, other.fingerprint)

    def scheme_note(self, other: FileIdentity) -> str:
        """Why ``other``'s fingerprint cannot be compared with this one, ``""`` when it can:
        the two were computed by beton-serve versions that fingerprint files differently."""
        mine, theirs = _scheme(self.fingerprint), _scheme(other.fingerprint)
        if mine == theirs:
            return ""
        return (
            f"the two sides fingerprint files differently (scheme {theirs} against {mine}: "
            "beton-serve versions differ), so a copy of the file cannot be recognised across "
            "hosts; run the same beton-serve version on both"
        )

    def describe(self) -> str:
        """``path (device:inode, N bytes, mtime T)`` for error messages."""
        return (
            f"{self.path} (device {self.device} inode {self.inode}, {self.size} bytes, "
            f"mtime_ns {self.mtime_ns})"
        )


def _fingerprint(fd: int, size: int) -> str:
    return content_fingerprint(lambda n, off: os.pread(fd, n, off), size)


def content_fingerprint(read: Callable[[int, int], bytes], size: int) -> str:
    """:attr:`FileIdentity.fingerprint` of a file of ``size`` bytes that ``read(n, offset)``
    reads (a descriptor's ``pread``, or a slice of its mapping).

    What is hashed, in order: ``size`` (8 bytes, little-endian); the first
    ``min(size, FINGERPRINT_SPAN)`` bytes; the spans of :func:`interior_spans`; the bytes from
    ``max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN)`` to the end.
    """
    h = hashlib.sha256(size.to_bytes(8, "little"))
    h.update(read(min(size, FINGERPRINT_SPAN), 0))
    for offset, n in interior_spans(size):
        h.update(read(n, offset))
    if size > FINGERPRINT_SPAN:
        tail = max(FINGERPRINT_SPAN, size - FINGERPRINT_SPAN)
        h.update(read(size - tail, tail))
    return f"{SCHEME}:{h.hexdigest()}"


def interior_spans(size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the spans hashed between a file's two ends: all of the bytes
    between them when they are at most ``INTERIOR_SPANS * INTERIOR_SPAN``, else
    :data:`INTERIOR_SPANS` spans of :data:`INTERIOR_SPAN` bytes, the first at the start of that
    region, the last at its end, the others evenly between."""
    start, stop = FINGERPRINT_SPAN, size - FINGERPRINT_SPAN
    if stop <= start:
        return []
    length = stop - start
    if length <= INTERIOR_SPANS * INTERIOR_SPAN:
        return [(start, length)]
    room = length - INTERIOR_SPAN
    return [
        (start + room * k // (INTERIOR_SPANS - 1), INTERIOR_SPAN) for k in range(INTERIOR_SPANS)
    ]


def _scheme(text: str) -> str:
    """The scheme of a fingerprint or digest: its prefix before ``:``; ``"v1"`` without one."""
    head, sep, _ = text.partition(":")
    return head if sep else "v1"


def compare_digests(a: str | None, b: str | None) -> bool | None:
    """Whether two dataset digests (:func:`dataset_digest`) name the same files: ``True`` or
    ``False``, or ``None`` when that cannot be told: one is unknown (``""`` or ``None``), or the
    two are of different schemes (one was made by an older beton-serve, see the module
    docstring)."""
    if not a or not b or _scheme(a) != _scheme(b):
        return None
    return a == b


def dataset_digest(files: Sequence[tuple[int, str]]) -> str:
    """What a Loader's state and a daemon's stream name a dataset by: ``"v2:"`` and the
    BLAKE2b-128 (hex) of each file's ``(size, fingerprint)``, in shard order (``""`` when a
    fingerprint is unknown). Compare two with :func:`compare_digests`.

    Equal for copies of the same files on any host; different for another dataset of the same
    size and schema, also one that agrees with it in its first and last 64 KiB (header, field
    table, the first samples' metadata, the end of the allocation table), e.g. raw pixels
    rewritten with the same sizes, labels and order, unless the two differ only between the
    sampled spans (see the module docstring).
    """
    if not files or any(not fp for _, fp in files):
        return ""
    h = hashlib.blake2b(digest_size=16)
    for size, fp in files:
        h.update(f"{int(size)}:{fp};".encode())
    return f"{SCHEME}:{h.hexdigest()}"
