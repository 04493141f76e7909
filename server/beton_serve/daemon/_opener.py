"""Finding the dataset an OpenStream request names, opening files on demand, closing idle ones.

A request names a served dataset, or a file (by path and identity), and optionally
``custom_fields`` classes. :meth:`DatasetOpener.dataset_for` answers with:

* the served dataset of that name or file;
* else the named file opened on demand, when the peer may make the daemon open it
  (``_on_demand.FilePolicy``), checked afterwards to *be* the file the client named;
* with ``custom_fields``: a variant of those files opened with those classes, shared by every
  stream that asks for the same files and classes.

Opening runs on the daemon's compile thread (``PlanRegistry.on_compile_thread``); concurrent
opens of one file (or one variant) share one. Datasets opened on demand are closed again by
:meth:`DatasetOpener.close_idle` after ``FilePolicy.idle_close_s`` seconds without a stream,
with the plans compiled over them.

Threads: event-loop thread, except ``_open_sync`` (compile thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from beton_serve.daemon._backend import Backend
from beton_serve.daemon._datasets import Dataset, DatasetTable, Visible
from beton_serve.daemon._messages import StreamRequest
from beton_serve.daemon._on_demand import FilePolicy, real_path, resolve_field_classes
from beton_serve.daemon._plans import PlanRegistry
from beton_serve.errors import SpecError

__all__ = ["DatasetOpener"]

log = logging.getLogger("beton_serve.daemon")

#: A dataset handed to a request is not closed to make room for this long: its stream is
#: registered (and counted as busy) only once its plan is built.
HANDOUT_GRACE_S = 10.0


class DatasetOpener:
    """Resolves requests to datasets (see the module docstring).

    Args:
        datasets: the daemon's datasets (served and opened on demand).
        backend: opens checksum sidecars and tells field classes.
        files: which files a client may make the daemon open.
        plans: the compile thread, the import policy and the plans to drop with a dataset.
        verify_checksums: files opened on demand need a current sidecar too.
    """

    def __init__(
        self,
        datasets: DatasetTable,
        backend: Backend,
        files: FilePolicy,
        plans: PlanRegistry,
        *,
        verify_checksums: bool = False,
        busy: Callable[[], set[int]] = set,
    ) -> None:
        self.datasets = datasets
        #: The ``id`` of every dataset a stream reads now (the daemon's streams).
        self.busy = busy
        self.backend = backend
        self.files = files
        self.plans = plans
        self.verify_checksums = verify_checksums
        #: Opens in progress, by real path or variant key (concurrent opens share one).
        self._opening: dict[str, asyncio.Future[Dataset]] = {}

    async def dataset_for(self, req: StreamRequest, same_host: bool) -> Dataset:
        """The dataset ``req`` names: served, or the file it names opened on demand when the
        peer may (``_on_demand``); never another file than the one named.

        Raises:
            SpecError: unknown dataset, a file the peer may not open, or a replaced file.
            FormatError: the file is invalid.
        """
        ds = await self._dataset_for(req, same_host)
        # Its stream is not registered yet: _make_room leaves it open for a while.
        ds.handed_at = time.monotonic()
        return ds

    async def _dataset_for(self, req: StreamRequest, same_host: bool) -> Dataset:
        if req.custom_fields:
            variant = await self._custom_dataset_for(req, same_host)
            return self._served_to(variant, req)
        f = req.file
        visible = self.visible_to(req.owner_peer)
        if f is None:
            return self.datasets.resolve(req.dataset, None, same_host=same_host, visible=visible)
        found = self.datasets.find_file(f, same_host=same_host, visible=visible)
        if found is not None:
            return found
        why = self.files.refusal(f, owner_peer=req.owner_peer)
        if why is not None:
            return self.datasets.resolve(
                req.dataset, f, same_host=same_host, why_not_open=why, visible=visible
            )
        real = real_path(f.path)
        fut = self._opening.get(real)
        if fut is None:
            self._make_room()
            fut = self.plans.on_compile_thread(self._open_sync, real)
            self._opening[real] = fut
            try:
                opened = await asyncio.shield(fut)
            finally:
                if self._opening.get(real) is fut:
                    del self._opening[real]
            ds = self.datasets.find_file(opened.files[0], same_host=True)
            if ds is None:
                ds = self.datasets.adopt(opened)
                log.info(
                    "dataset %s opened on demand: %s (%d samples)",
                    ds.name,
                    real,
                    ds.num_samples,
                )
            elif ds is not opened:  # two opens of one file raced: keep the first
                self.datasets.remove(opened)
        else:
            opened = await asyncio.shield(fut)
            ds = self.datasets.find_file(opened.files[0], same_host=True) or opened
        if not any(i.same_file(f, same_host=same_host) for i in ds.files):
            raise SpecError(
                f"this Loader names {f.describe()}, but the file at that path is now "
                f"{ds.files[0].describe()} (it was replaced); open it again"
            )
        return self._served_to(ds, req)

    def visible_to(self, owner_peer: bool) -> Visible | None:
        """The datasets a peer may see (``None``: all, for the daemon's own user)."""
        if owner_peer:
            return None
        files = self.files
        return lambda ds: files.serve_refusal(ds, owner_peer=False) is None

    def _served_to(self, ds: Dataset, req: StreamRequest) -> Dataset:
        """``ds``, when this peer may read it: checked on where its files were when opened
        (from the descriptors), so a path that named a file inside a data root when checked
        but another one when opened (a directory swapped for a symlink) is refused."""
        why = self.files.serve_refusal(ds, owner_peer=req.owner_peer)
        if why is not None:
            log.warning(
                "refused dataset %s to a peer that may not read it: %s (was a path under a "
                "data root changed while it was opened?)",
                ds.name,
                why,
            )
            raise SpecError(f"this daemon does not serve that file to this client ({why})")
        return ds

    def _make_room(self) -> None:
        """Before opening another file on demand: close the ones idle longest while
        :attr:`FilePolicy.max_open` are open; refuse when every one has a stream.

        Raises:
            SpecError: ``max_open`` files opened on demand, each with a stream.
        """
        opened = [ds for ds in self.datasets if ds.on_demand]  # type: ignore[attr-defined]
        excess = len(opened) + len(self._opening) - self.files.max_open + 1
        if excess <= 0:
            return
        busy = self.busy()
        now = time.monotonic()
        idle = sorted(
            (ds for ds in opened if id(ds) not in busy and now - ds.handed_at >= HANDOUT_GRACE_S),
            key=lambda d: (d.idle_since is None, d.idle_since or 0.0),
        )
        for ds in idle[:excess]:
            self._close(
                ds, f"({self.files.max_open} files are open on demand, the most this daemon keeps)"
            )
        if len(idle) < excess:
            raise SpecError(
                f"this daemon already has {len(opened)} files opened on demand, each read by a "
                f"stream or just handed to one (at most {self.files.max_open}); open this file "
                "when one of them is done, or serve it by name from the start"
            )

    async def _custom_dataset_for(self, req: StreamRequest, same_host: bool) -> Dataset:
        """The dataset ``req`` names, read with its ``custom_fields`` classes: a variant of the
        file(s) opened with those classes (on demand, closed when idle like any on-demand file),
        shared by every stream asking for the same files and classes.

        The files are the served dataset's (by name or by identity), or the file the client
        named when the peer may open it (``_on_demand.FilePolicy``). The classes come from the
        daemon's plugins or are imported from its own disk (``resolve_field_classes``)."""
        classes = resolve_field_classes(
            req.custom_fields,
            import_refusal=self.plans.import_refusal(req),
            is_field=self.backend.is_field_class,
        )
        custom = tuple(sorted(f"{k}={c.__module__}:{c.__qualname__}" for k, c in classes.items()))
        f = req.file
        visible = self.visible_to(req.owner_peer)
        open_to_all = False
        if f is None:
            base = self.datasets.get(req.dataset, visible)
            paths, open_to_all = list(base.paths), base.open_to_all
        else:
            served = self.datasets.find_file(f, same_host=same_host, visible=visible)
            if served is not None:
                paths, open_to_all = list(served.paths), served.open_to_all
            else:
                why = self.files.refusal(f, owner_peer=req.owner_peer)
                if why is not None:
                    raise SpecError(
                        f"this daemon does not serve {f.describe()} and does not open it for this "
                        f"client ({why})"
                    )
                paths = [real_path(f.path)]
        found = self.datasets.find_variant(paths, custom)
        if found is None:
            key = json.dumps([[real_path(p) for p in paths], list(custom)])
            fut = self._opening.get(key)
            if fut is None:
                self._make_room()
                fut = self.plans.on_compile_thread(self._open_sync, paths, classes)
                self._opening[key] = fut
                try:
                    opened = await asyncio.shield(fut)
                finally:
                    if self._opening.get(key) is fut:
                        del self._opening[key]
                found = self.datasets.find_variant(paths, custom)
                if found is None:
                    opened.open_to_all = open_to_all  # a variant of a dataset every peer reads
                    found = self.datasets.adopt(opened)
                    log.info(
                        "dataset %s opened with custom fields %s: %s",
                        found.name,
                        ",".join(custom),
                        ",".join(paths),
                    )
                elif found is not opened:
                    self.datasets.remove(opened)
            else:
                opened = await asyncio.shield(fut)
                found = self.datasets.find_variant(paths, custom) or opened
        if f is not None and not any(i.same_file(f, same_host=same_host) for i in found.files):
            raise SpecError(
                f"this Loader names {f.describe()}, but the file at that path is now "
                f"{found.files[0].describe()} (it was replaced); open it again"
            )
        return found

    def _open_sync(
        self, path: str | Sequence[str], custom_fields: Mapping[str, type] | None = None
    ) -> Dataset:
        ds = self.datasets.open_file(path, custom_fields)
        try:
            if self.verify_checksums:
                ds.checksums = self.backend.open_checksums(ds.readers)
        except BaseException:
            self.datasets.remove(ds)
            raise
        return ds

    def close_idle(self, now: float, busy: set[int]) -> None:
        """Close datasets opened on demand that had no stream for ``files.idle_close_s``
        (``busy``: the ``id`` of every dataset a stream reads now)."""
        for ds in list(self.datasets):  # type: ignore[call-overload]
            if not ds.on_demand:
                continue
            if id(ds) in busy:
                ds.idle_since = None
                continue
            if ds.idle_since is None:
                ds.idle_since = now
            elif now - ds.idle_since >= self.files.idle_close_s:
                self._close(ds, f"after {now - ds.idle_since:.0f} s unused")

    def _close(self, ds: Dataset, why: str) -> None:
        """Close ``ds``, opened on demand, and its plans; log ``why``."""
        self.plans.drop(ds)
        self.datasets.remove(ds)
        log.info("dataset %s closed %s", ds.name, why)
