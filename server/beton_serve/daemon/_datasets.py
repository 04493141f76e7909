"""The datasets a daemon serves: names, files (shards), readers, and their descriptions.

A dataset is named by its file stem (``beton-serve /data/cifar.beton`` serves ``cifar``) or
explicitly (``--dataset imagenet=/data/train-*.beton``). Several files under one name are shards
with one schema, served as one index space in the given order.

A client opens a dataset by that name, or by naming a file (``Loader('/data/cifar.beton')``):
then the file it names is resolved by identity (:mod:`beton_wire.file_identity`: device, inode,
size and mtime on one host), never by its stem, and a file the daemon does not serve is an
error naming both paths (DESIGN.md §8). Every cache and sharing group is keyed by
:attr:`Dataset.key`, which covers the identity of every file, so two datasets of one schema
(train and val) can never be confused.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beton_wire.file_identity import FileIdentity
from beton_wire.limits import short_repr

from beton_serve.daemon._backend import Backend
from beton_serve.daemon._health import FileWatch
from beton_serve.daemon._on_demand import real_path
from beton_serve.errors import ConfigError, FormatError, SpecError, UnknownDataset

__all__ = ["Dataset", "DatasetTable", "Visible", "expand_dataset_args"]

#: Which datasets a peer may see: the others are neither found nor listed to it.
Visible = Callable[["Dataset"], bool]


@dataclass(kw_only=True)
class Dataset:
    """One served dataset.

    Attributes:
        name: what clients ask for.
        paths: its files, in index order.
        readers: one open reader per file.
        num_samples: total samples over all shards.
        fields: ``(name, type)`` pairs in file order.
        schema_key: the schema hash (equal for every shard).
        samples_decoded / batches_decoded: counters for stats (change them with :meth:`count`).
        bad_samples: distinct samples found bad (skipped under the bad-sample budget) over the
            daemon's life, whatever the streams or epochs that met them (:meth:`note_bad`).
        watch: guards against the files shrinking under the mmap (``_health``).
        files: the identity of each file when it was opened.
    """

    name: str
    paths: list[str]
    readers: list[Any]
    num_samples: int
    fields: list[tuple[str, str]]
    schema_key: str
    samples_decoded: int = 0
    batches_decoded: int = 0
    bad_samples: int = 0
    watch: FileWatch | None = None
    files: tuple[FileIdentity, ...] = ()
    #: Opened because a client named its file (closed again after an idle time).
    on_demand: bool = False
    #: The custom field classes it was opened with, as sorted ``name=module:qualname`` entries
    #: (``()``: the built-in classes only). Part of :attr:`key`.
    custom: tuple[str, ...] = ()
    #: When its last stream ended (monotonic seconds; ``None`` while it has streams).
    idle_since: float | None = None
    #: When it was last handed to a request (monotonic seconds; ``DatasetOpener``).
    handed_at: float = -float("inf")
    #: Where its files were when opened, symlinks resolved, from the mapped descriptors (what
    #: the data roots are checked against: ``FilePolicy.serve_refusal``).
    real_paths: tuple[str, ...] = ()
    #: Served to every peer that reaches the daemon: a dataset it was started with, or one
    #: read with custom field classes over such a dataset's files. A file opened on demand is
    #: served only to the peers that may open it (``FilePolicy``).
    open_to_all: bool = True
    _extra: dict[str, Any] = field(default_factory=dict)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    #: The reader the planner compiles against: the file's own, or the shards combined.
    combined: Any = None
    #: ``--verify-checksums``: the shards' CRC32C sidecar checker (``format.ChecksumVerifier``),
    #: whose ``check`` every plan of this dataset runs before decoding; ``None`` when off.
    checksums: Any = None

    @property
    def key(self) -> str:
        """What identifies this dataset in every cache, sharing group and stream: a hash of its
        name, schema and the identity (path, device, inode, size, mtime) of every file."""
        cached = self._extra.get("key")
        if cached is None:
            ids = [[f.path, f.device, f.inode, f.size, f.mtime_ns] for f in self.files]
            text = json.dumps([self.name, self.paths, self.schema_key, ids, list(self.custom)])
            cached = self._extra["key"] = hashlib.sha256(text.encode()).hexdigest()
        return str(cached)

    @property
    def digest(self) -> str:
        """Its files named by content, as a Loader's state names them
        (``beton_wire.file_identity.dataset_digest``; ``""`` for readers without a fingerprint)."""
        cached = self._extra.get("digest")
        if cached is None:
            from beton_serve.format import readers_digest

            cached = self._extra["digest"] = readers_digest(self.readers)
        return str(cached)

    @property
    def reader(self) -> Any:
        """The reader the planner compiles against (one index space over every shard)."""
        return self.combined if self.combined is not None else self.readers[0]

    def count(self, *, batches: int = 0, samples: int = 0, bad: int = 0) -> None:
        """Add to the counters (from any thread: streams publish from engine workers)."""
        with self._count_lock:
            self.batches_decoded += batches
            self.samples_decoded += samples
            self.bad_samples += bad

    def note_bad(self, sample_ids: Iterable[int]) -> None:
        """Record samples a stream skipped; :attr:`bad_samples` counts each id once (from any
        thread)."""
        with self._count_lock:
            seen: set[int] = self._extra.setdefault("bad_ids", set())
            seen.update(sample_ids)
            self.bad_samples = self._extra.get("bad_base", 0) + len(seen)

    def carry_counts(self, retired: tuple[int, int, int]) -> None:
        """Start the counters from ``(samples, batches, bad)`` of an earlier dataset served under
        this name (closed when idle, reopened since): exported counters never go down."""
        samples, batches, bad = retired
        with self._count_lock:
            self.samples_decoded += samples
            self.batches_decoded += batches
            self.bad_samples += bad
            self._extra["bad_base"] = self._extra.get("bad_base", 0) + bad

    def counts(self) -> tuple[int, int, int]:
        """``(samples_decoded, batches_decoded, bad_samples)``."""
        with self._count_lock:
            return self.samples_decoded, self.batches_decoded, self.bad_samples

    def check_files(self) -> None:
        """Raise ``FormatError`` if a file shrank while served (see ``_health``)."""
        if self.watch is not None:
            self.watch.check(self.name)

    @property
    def refused(self) -> bool:
        """Whether a file of it changed while served: refused until a restart (``_health``)."""
        return self.watch is not None and self.watch.broken is not None


def expand_dataset_args(files: Sequence[str], named: Sequence[str]) -> dict[str, list[str]]:
    """Map dataset names to files from positional files and ``NAME=GLOB[,GLOB...]`` arguments.

    Raises:
        ConfigError: a glob matches nothing, an argument is malformed, or two datasets get the
            same name (the message names both).
        FormatError: a named or matched file is missing, or not a regular file (exit status
            65, as for a damaged file: the reader's error).
    """
    table: dict[str, list[str]] = {}
    origin: dict[str, str] = {}

    def add(name: str, paths: list[str], what: str) -> None:
        if name in table:
            raise ConfigError(
                f"two datasets are named {name!r} ({origin[name]} and {what}); rename one with "
                f"--dataset OTHER={what}"
            )
        table[name] = paths
        origin[name] = what

    for f in files:
        p = Path(f)
        why = _not_a_dataset_file(p)
        if why is not None:
            raise FormatError(f, None, f"dataset file {why}")
        add(p.stem, [os.fspath(p)], f)
    for arg in named:
        name, sep, patterns = arg.partition("=")
        if not sep or not name or not patterns:
            raise ConfigError(
                f"--dataset {arg!r}: expected NAME=GLOB (e.g. imagenet=train-*.beton)"
            )
        paths: list[str] = []
        for pattern in patterns.split(","):
            matched = sorted(glob.glob(pattern))
            if not matched:
                raise ConfigError(f"--dataset {arg!r}: {pattern!r} matches no file")
            for m in matched:
                why = _not_a_dataset_file(Path(m))
                if why is not None:
                    raise FormatError(m, None, f"dataset file of --dataset {arg!r} {why}")
            paths.extend(matched)
        add(name, paths, patterns)
    return table


def _not_a_dataset_file(p: Path) -> str | None:
    """Why ``p`` cannot be served as a ``.beton`` file (``None``: it is a regular file).

    A directory, a FIFO or a device was reported as "does not exist"; a FIFO given as a glob's
    match blocked the daemon's start in ``open()``.
    """
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a .beton file"
    return "is not a regular file (a FIFO, a socket or a device): a .beton file is mapped"


class DatasetTable:
    """The daemon's datasets, opened and validated at start.

    Args:
        datasets: name -> files (see :func:`expand_dataset_args`).
        backend: opens readers.

    Raises:
        FormatError: a file is invalid (the reader's error, unchanged).
        ConfigError: shards of one dataset have different schemas (naming the first field that
            differs), or nothing is served.
    """

    def __init__(self, datasets: Mapping[str, Sequence[str]], backend: Backend) -> None:
        if not datasets:
            raise ConfigError("no dataset to serve: give at least one .beton file")
        self._backend = backend
        self._by_name: dict[str, Dataset] = {}
        #: An on-demand dataset's files (and custom classes) -> the name it was first served
        #: under, and the counters it had when it was last closed for idleness: served again,
        #: it goes on from them (``Dataset.carry_counts``; :meth:`adopt`).
        self._names: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
        self._retired: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[int, int, int]] = {}
        try:
            for name, paths in datasets.items():
                self._by_name[name] = self._open(name, list(paths))
        except BaseException:
            self.close()
            raise

    def _open(
        self, name: str, paths: list[str], custom_fields: Mapping[str, type] | None = None
    ) -> Dataset:
        """Open ``paths`` as one dataset whose mapped files, identities and watched files are
        the same files: a file replaced by rename while it is opened (each of them opens the
        path) is opened again, and after :data:`OPEN_TRIES` tries it is an error."""
        for _ in range(OPEN_TRIES - 1):
            ds = self._open_once(name, paths, custom_fields)
            if _consistent(ds):
                return ds
            _close_dataset(ds)
        ds = self._open_once(name, paths, custom_fields)
        if _consistent(ds):
            return ds
        _close_dataset(ds)
        raise SpecError(
            f"dataset {name!r}: {', '.join(paths)} kept being replaced while the daemon opened it "
            f"({OPEN_TRIES} tries); open it again once it is in place"
        )

    def _open_once(
        self, name: str, paths: list[str], custom_fields: Mapping[str, type] | None = None
    ) -> Dataset:
        b = self._backend
        readers: list[Any] = []
        try:
            for p in paths:
                readers.append(
                    b.open_dataset(p, custom_fields) if custom_fields else b.open_dataset(p)
                )
            first = readers[0]
            key = b.schema_key(first)
            fields = b.fields(first)
            for path, r in zip(paths[1:], readers[1:], strict=True):
                if b.schema_key(r) != key:
                    raise ConfigError(
                        f"dataset {name!r}: shard {path} has a different schema from {paths[0]}: "
                        f"{_schema_diff(b, first, r, fields)}"
                    )
            combined = b.combine(readers, name) if len(readers) > 1 else None
        except BaseException:
            for r in readers:
                r.close()
            raise
        return Dataset(
            name=name,
            paths=paths,
            readers=readers,
            num_samples=sum(b.num_samples(r) for r in readers),
            fields=fields,
            schema_key=key,
            combined=combined,
            watch=FileWatch(paths),
            files=tuple(_identity(p, r) for p, r in zip(paths, readers, strict=True)),
            custom=tuple(sorted(f"{k}={_class_path(v)}" for k, v in (custom_fields or {}).items())),
            real_paths=tuple(
                getattr(r, "real_path", None) or os.path.realpath(p)
                for p, r in zip(paths, readers, strict=True)
            ),
        )

    def find_file(
        self,
        file: FileIdentity,
        *,
        same_host: bool,
        custom: tuple[str, ...] = (),
        visible: Visible | None = None,
    ) -> Dataset | None:
        """The served dataset whose one file *is* ``file`` (by identity), opened with the custom
        field classes ``custom`` (sorted ``name=module:qualname``), or ``None``.

        Args:
            visible: the datasets this peer may see (``None``: all); the others are not found.

        Raises:
            SpecError: ``file`` is one shard of a sharded dataset (open it by name).
        """
        for ds in self._by_name.values():
            if ds.custom != custom or (visible is not None and not visible(ds)):
                continue
            for i, ident in enumerate(ds.files):
                if not ident.same_file(file, same_host=same_host):
                    continue
                if len(ds.files) > 1:
                    raise SpecError(
                        f"{_short(file.path)} is shard {i + 1} of {len(ds.files)} of dataset "
                        f"{ds.name!r}; open the whole dataset by its name, Loader({ds.name!r}, ...)"
                    )
                return ds
        return None

    def resolve(
        self,
        name: str,
        file: FileIdentity | None,
        *,
        same_host: bool,
        why_not_open: str = "",
        visible: Visible | None = None,
    ) -> Dataset:
        """The dataset a client asked for: by ``name``, or, when it named a file, the dataset
        whose file *is* that file (see the module docstring); never one with the same stem.

        Args:
            why_not_open: when the file is not served, why the daemon did not open it on demand
                (added to the message).
            visible: the datasets this peer may see (``None``: all); the others are neither
                found nor listed.

        Raises:
            SpecError: no served dataset has that name or file; the file is one shard of a
                dataset (open it by name); the daemon's file of that name is another file (the
                message names both paths).
        """
        if file is None:
            return self.get(name, visible)
        found = self.find_file(file, same_host=same_host, visible=visible)
        if found is not None:
            return found
        how = "device, inode, size and mtime" if same_host else "size and content fingerprint"
        note = f" ({why_not_open})" if why_not_open else ""
        other = self._by_name.get(name)
        if other is not None and (visible is None or visible(other)):
            theirs = ", ".join(f.describe() for f in other.files)
            skew = "" if same_host else other.files[0].scheme_note(file) if other.files else ""
            raise SpecError(
                f"this Loader names {file.describe()}, but the daemon's dataset {name!r} is another "
                f"file: {theirs} ({how} differ){note}. "
                + (
                    f"Perhaps it is a copy of it: {skew}"
                    if skew
                    else f"Serve the file you mean (beton-serve {_short(file.path)}), or open the "
                    "daemon's dataset by its name"
                )
            )
        served = "; ".join(
            f"{d.name!r}: {', '.join(d.paths)}"
            for d in self._by_name.values()
            if visible is None or visible(d)
        )
        raise SpecError(
            f"this daemon does not serve {file.describe()} (compared by {how}){note}; it serves "
            f"{served}. Serve the file (beton-serve {_short(file.path)}) or open a served "
            "dataset by name"
        )

    def open_file(
        self, path: str | Sequence[str], custom_fields: Mapping[str, type] | None = None
    ) -> Dataset:
        """Open ``path`` (or the shards ``path``) as a dataset *not yet served* (:meth:`adopt`
        serves it), reading the fields of ``custom_fields`` with those classes; may run on
        another thread than the table's users (it only reads the files).

        Raises:
            FormatError: a file is invalid (the reader's error).
        """
        paths = [path] if isinstance(path, str) else list(path)
        ds = self._open(Path(paths[0]).stem, paths, custom_fields)
        ds.on_demand = True
        ds.open_to_all = False  # the opener says otherwise for a variant of such a dataset
        return ds

    def find_variant(self, paths: Sequence[str], custom: tuple[str, ...]) -> Dataset | None:
        """The dataset over exactly ``paths`` opened with the custom classes ``custom``: its
        files, where they were when opened (:attr:`Dataset.real_paths`), are ``paths`` with
        symlinks resolved.

        Raises:
            SpecError: a path changed while it was resolved (``_on_demand.real_path``).
        """
        want = tuple(real_path(p) for p in paths)
        for ds in self._by_name.values():
            if ds.custom == custom and ds.real_paths == want:
                return ds
        return None

    def adopt(self, ds: Dataset) -> Dataset:
        """Serve ``ds`` (from :meth:`open_file`) under its stem, or ``stem@2``, ``stem@3``...
        when that name is taken.

        A name stays with the files it was first given to for the daemon's life: the same
        files opened again (closed when idle meanwhile) get it back, with their counts, and
        other files never get it. Before, ``ds@2`` closed when idle went to the next file with
        that stem, which also inherited the first one's counters (metrics mixed two files)."""
        key = (ds.real_paths, ds.custom)
        name = self._names.get(key)
        if name is not None and name not in self._by_name:
            ds.name = name
        else:
            taken = set(self._by_name) | set(self._names.values())
            stem, n = ds.name, 1
            while ds.name in taken:
                n += 1
                ds.name = f"{stem}@{n}"
            self._names.setdefault(key, ds.name)
        retired = self._retired.pop(key, None) if self._names.get(key) == ds.name else None
        if retired is not None:
            ds.carry_counts(retired)
        self._by_name[ds.name] = ds
        return ds

    def remove(self, ds: Dataset) -> None:
        """Stop serving ``ds`` and close its readers (its streams must be gone)."""
        if self._by_name.get(ds.name) is ds:
            del self._by_name[ds.name]
            key = (ds.real_paths, ds.custom)
            if self._names.get(key) == ds.name:
                self._retired[key] = ds.counts()
        _close_dataset(ds)

    def get(self, name: str, visible: Visible | None = None) -> Dataset:
        """The dataset called ``name``; raises ``UnknownDataset`` (a ``SpecError``) listing the
        served names (``visible``: the datasets this peer may see; ``None``: all)."""
        ds = self._by_name.get(name)
        if ds is not None and (visible is None or visible(ds)):
            return ds
        names = sorted(n for n, d in self._by_name.items() if visible is None or visible(d))
        raise UnknownDataset(f"unknown dataset {short_repr(name)}; this daemon serves {names}")

    def __iter__(self) -> Iterable[Dataset]:  # type: ignore[override]
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def close(self) -> None:
        """Close every reader (idempotent)."""
        for ds in self._by_name.values():
            _close_dataset(ds)
        self._by_name = {}


#: How many times a dataset whose files are replaced while it is opened is opened again.
OPEN_TRIES = 3


def _consistent(ds: Dataset) -> bool:
    """Whether the files ``ds`` maps, identifies and watches are one file each (a reader of a
    test backend without ``identity`` counts as consistent). An identity taken from the reader
    (:func:`_identity`) agrees with its mapping by construction; the watch, which opens
    each path after the readers did, tells a path replaced in between."""
    watched = ds.watch.watched() if ds.watch is not None else {}
    for p, r, ident in zip(ds.paths, ds.readers, ds.files, strict=True):
        mapped = getattr(r, "identity", None)
        if mapped is None:
            continue
        if tuple(mapped) != (ident.device, ident.inode, ident.size, ident.mtime_ns):
            return False
        w = watched.get(p)
        if w is not None and w != tuple(mapped):
            return False
    return True


def _close_dataset(ds: Dataset) -> None:
    if ds.watch is not None:
        ds.watch.close()
    if ds.combined is not None:
        ds.combined.close()
    for r in ds.readers:
        r.close()


def _identity(path: str, reader: Any) -> FileIdentity:
    """The identity of the file ``reader`` maps, opened from ``path``: from the reader's own
    ``stat`` and fingerprint when it has them (the file is not read a second time; that
    ``path`` still names it is the watch's check, in :func:`_consistent`), else from ``path``."""
    mapped, fingerprint = getattr(reader, "identity", None), getattr(reader, "fingerprint", "")
    if mapped is not None and fingerprint:
        device, inode, size, mtime_ns = mapped
        return FileIdentity(
            path=os.path.abspath(path),
            device=device,
            inode=inode,
            size=size,
            mtime_ns=mtime_ns,
            fingerprint=fingerprint,
        )
    try:
        return FileIdentity.of(path)
    except OSError:  # a test backend's name that is not a file: identified by its path alone
        return FileIdentity(
            path=os.path.abspath(path), device=0, inode=0, size=0, mtime_ns=0, fingerprint=""
        )


def _short(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _schema_diff(b: Backend, a: Any, other: Any, fields: list[tuple[str, str]]) -> str:
    names_a = [n for n, _ in fields]
    names_b = [n for n, _ in b.fields(other)]
    if names_a != names_b:
        only_a = [n for n in names_a if n not in names_b]
        only_b = [n for n in names_b if n not in names_a]
        if only_a or only_b:
            return f"fields only in the first: {only_a}, only in this one: {only_b}"
        return f"fields in a different order: {names_a} vs {names_b}"
    for n in names_a:
        sa, sb = b.field_signature(a, n), b.field_signature(other, n)
        if sa != sb:
            return f"field {n!r} differs: {sa} vs {sb}"
    return "the schema keys differ"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
