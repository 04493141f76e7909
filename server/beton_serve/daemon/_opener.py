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
import os
from collections.abc import Mapping, Sequence

from beton_serve.daemon._backend import Backend
from beton_serve.daemon._datasets import Dataset, DatasetTable
from beton_serve.daemon._messages import StreamRequest
from beton_serve.daemon._on_demand import FilePolicy, resolve_field_classes
from beton_serve.daemon._plans import PlanRegistry
from beton_serve.errors import SpecError

__all__ = ["DatasetOpener"]

log = logging.getLogger("beton_serve.daemon")


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
    ) -> None:
        self.datasets = datasets
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
        if req.custom_fields:
            return await self._custom_dataset_for(req, same_host)
        f = req.file
        if f is None:
            return self.datasets.resolve(req.dataset, None, same_host=same_host)
        found = self.datasets.find_file(f, same_host=same_host)
        if found is not None:
            return found
        why = self.files.refusal(f, owner_peer=req.owner_peer)
        if why is not None:
            return self.datasets.resolve(req.dataset, f, same_host=same_host, why_not_open=why)
        real = os.path.realpath(f.path)
        fut = self._opening.get(real)
        if fut is None:
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
        return ds

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
        if f is None:
            paths = list(self.datasets.get(req.dataset).paths)
        else:
            served = self.datasets.find_file(f, same_host=same_host)
            if served is not None:
                paths = list(served.paths)
            else:
                why = self.files.refusal(f, owner_peer=req.owner_peer)
                if why is not None:
                    raise SpecError(
                        f"this daemon does not serve {f.describe()} and does not open it for this "
                        f"client ({why})"
                    )
                paths = [os.path.realpath(f.path)]
        found = self.datasets.find_variant(paths, custom)
        if found is None:
            key = json.dumps([[os.path.realpath(p) for p in paths], list(custom)])
            fut = self._opening.get(key)
            if fut is None:
                fut = self.plans.on_compile_thread(self._open_sync, paths, classes)
                self._opening[key] = fut
                try:
                    opened = await asyncio.shield(fut)
                finally:
                    if self._opening.get(key) is fut:
                        del self._opening[key]
                found = self.datasets.find_variant(paths, custom)
                if found is None:
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
                self.plans.drop(ds)
                self.datasets.remove(ds)
                log.info("dataset %s closed after %.0f s unused", ds.name, now - ds.idle_since)
