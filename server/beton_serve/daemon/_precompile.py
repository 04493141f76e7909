"""Pre-compiling the pipelines operators expect, when the daemon starts (issue 14).

The daemon's TOML config lists them as ``[[precompile]]`` tables::

    [[precompile]]
    dataset = "imagenet"          # a served dataset name, or: file = "/data/train.beton"
    batch_size = 256
    [precompile.pipelines]        # FFCV's pipelines: field -> ops ({op, params}); false = skip
    image = [
      { op = "RandomResizedCropRGBImageDecoder", params = { output_size = [224, 224] } },
      { op = "RandomHorizontalFlip" },
      { op = "ToTensor" },
    ]
    label = [{ op = "IntDecoder" }, { op = "ToTensor" }]

For each entry :func:`precompile` plans the pipelines over the dataset (ops built with the
daemon's registry, as a client's would be), then runs the first few samples through the plan's
jit prefix: Numba compiles lazily, per argument types, so only a run compiles every kernel. The
machine code lands in the persistent compile cache (``pipeline.compile_cache``) and the
module-level kernels stay compiled in the daemon, so the first client of that pipeline plans in
milliseconds, and so does every client after a daemon restart.

A failing entry is logged and skipped: pre-compiling never stops the daemon from serving. A
daemon told to stop (SIGTERM) stops pre-compiling at the next entry, or between an entry's plan
and its run (``PlanRegistry.stopping``): it waits for the kernel being compiled only, not for
the whole list (a cold entry takes 10-15 s on 2 cores, and the deploy files allow 30 s).
:func:`start_precompile` runs the entries on the daemon's compile thread, so a client's plan
compiled meanwhile waits for them instead of compiling the same kernels concurrently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from beton_serve.daemon._backend import Backend
from beton_serve.daemon._datasets import DatasetTable
from beton_serve.daemon._plans import PlanRegistry
from beton_serve.errors import BetonError, ConfigError

__all__ = [
    "PrecompileHost",
    "PrecompileOp",
    "PrecompileResult",
    "PrecompileSpec",
    "parse_precompile",
    "precompile",
    "start_precompile",
]

log = logging.getLogger("beton_serve.daemon")

#: Samples run through each plan: enough to meet every kernel, few enough to be quick.
_SAMPLES = 4
_MAX_BATCH = 65536


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecompileOp:
    """One op of a pre-compiled pipeline: its wire name and constructor parameters."""

    op: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecompileSpec:
    """One ``[[precompile]]`` entry.

    Attributes:
        dataset: a served dataset's name ("" when ``file`` is given).
        file: a ``.beton`` path ("" when ``dataset`` is given); opened for the run and closed.
        batch_size: the clients' batch size (the plan's buffers; compiled code does not depend
            on it, but the plan is made exactly as a client's would be).
        pipelines: ``field -> ops``, or ``None`` to skip the field; fields not named get their
            default pipeline (FFCV's rule).
    """

    dataset: str = ""
    file: str = ""
    batch_size: int = 256
    pipelines: Mapping[str, tuple[PrecompileOp, ...] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if bool(self.dataset) == bool(self.file):
            raise ConfigError("a [[precompile]] entry names exactly one of dataset or file")
        if not 1 <= self.batch_size <= _MAX_BATCH:
            raise ConfigError(
                f"precompile batch_size must be 1..{_MAX_BATCH}, not {self.batch_size}"
            )
        if not self.pipelines:
            raise ConfigError("a [[precompile]] entry needs a [precompile.pipelines] table")

    @property
    def target(self) -> str:
        return self.dataset or self.file


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecompileResult:
    """What pre-compiling one entry did: ``error`` is "" when it worked."""

    target: str
    seconds: float
    error: str = ""


def _op(value: Any, where: str) -> PrecompileOp:
    if not isinstance(value, Mapping) or "op" not in value:
        raise ConfigError(f"{where}: each op is a table {{ op = NAME, params = {{...}} }}")
    unknown = sorted(set(value) - {"op", "params"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} in an op (op, params)")
    name, params = value["op"], value.get("params", {})
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: op must be a non-empty string")
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}: params of {name} must be a table")
    return PrecompileOp(op=name, params=dict(params))


def parse_precompile(value: Any, where: str = "config") -> tuple[PrecompileSpec, ...]:
    """Validate the TOML ``precompile`` value (a list of tables) into specs.

    Raises:
        ConfigError: naming the entry and what to change.
    """
    if not isinstance(value, list):
        raise ConfigError(f"{where}: precompile must be a list of tables ([[precompile]])")
    specs = []
    for i, entry in enumerate(value):
        at = f"{where}: precompile[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at} must be a table")
        unknown = sorted(set(entry) - {"dataset", "file", "batch_size", "pipelines"})
        if unknown:
            raise ConfigError(
                f"{at}: unknown key(s) {unknown} (dataset, file, batch_size, pipelines)"
            )
        pipes_raw = entry.get("pipelines", {})
        if not isinstance(pipes_raw, Mapping):
            raise ConfigError(f"{at}: pipelines must be a table of field = [ops]")
        pipes: dict[str, tuple[PrecompileOp, ...] | None] = {}
        for name, ops in pipes_raw.items():
            if ops is False:
                pipes[name] = None
            elif isinstance(ops, list):
                pipes[name] = tuple(_op(o, f"{at}.pipelines.{name}") for o in ops)
            else:
                raise ConfigError(f"{at}.pipelines.{name} must be a list of ops, or false to skip")
        batch = entry.get("batch_size", 256)
        if not isinstance(batch, int) or isinstance(batch, bool):
            raise ConfigError(f"{at}: batch_size must be an integer")
        for key in ("dataset", "file"):
            if not isinstance(entry.get(key, ""), str):
                raise ConfigError(f"{at}: {key} must be a string")
        try:
            specs.append(
                PrecompileSpec(
                    dataset=entry.get("dataset", ""),
                    file=entry.get("file", ""),
                    batch_size=batch,
                    pipelines=pipes,
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"{at}: {exc}") from None
    return tuple(specs)


#: The error of the entries a stopping daemon did not pre-compile.
STOPPED = "not pre-compiled: the daemon is stopping"


def _run_one(spec: PrecompileSpec, datasets: Any, backend: Any, stopping: threading.Event) -> bool:
    """Plan and run ``spec``; whether it ran (``False``: ``stopping`` was set meanwhile)."""
    opened = None
    if spec.dataset:
        reader = datasets.get(spec.dataset).reader
    else:
        reader = opened = backend.open_dataset(spec.file)
    try:
        pipelines: dict[str, list[Any] | None] = {}
        for name, ops in spec.pipelines.items():
            pipelines[name] = (
                None if ops is None else [backend.build_op(o.op, dict(o.params)) for o in ops]
            )
        plan = backend.compile(reader, pipelines, spec.batch_size)
        if stopping.is_set():
            return False
        n = min(_SAMPLES, spec.batch_size, int(backend.num_samples(reader)))
        if n == 0:
            return True
        ws = plan.acquire_workspace()
        try:
            plan.run(ws, np.arange(n, dtype=np.uint64), plan.seed_keys(0, 0))
        finally:
            plan.release_workspace(ws)
            plan.drop_workspaces()  # the plan waits in the registry: keep no batch memory
        return True
    finally:
        if opened is not None:  # a reader of the backend: closed as DatasetTable closes its own
            opened.close()


def precompile(
    specs: Sequence[PrecompileSpec],
    *,
    datasets: Any,
    backend: Any,
    stopping: threading.Event | None = None,
) -> list[PrecompileResult]:
    """Plan and run every entry once (see the module docstring); never raises for an entry.

    Args:
        specs: from :func:`parse_precompile` (``ServeConfig.precompile``).
        datasets: the daemon's ``DatasetTable`` (``get(name).reader``).
        backend: the daemon's ``Backend`` (``open_dataset``, ``build_op``, ``compile``).
        stopping: once set, the entries not yet run are skipped, with the error
            :data:`STOPPED` (the daemon's ``PlanRegistry.stopping``).

    Returns:
        One result per entry, in order; each is logged.
    """
    stopping = threading.Event() if stopping is None else stopping
    results: list[PrecompileResult] = []
    for i, spec in enumerate(specs):
        if stopping.is_set():
            log.info("precompile stopped: the daemon is stopping (%d entries left)", len(specs) - i)
            results.extend(
                PrecompileResult(target=s.target, seconds=0.0, error=STOPPED) for s in specs[i:]
            )
            break
        t0 = time.perf_counter()
        error = ""
        try:
            if not _run_one(spec, datasets, backend, stopping):
                error = STOPPED
        except BetonError as exc:
            error = str(exc)
        except Exception as exc:  # an op's own failure: log it, keep serving
            error = f"{type(exc).__name__}: {exc}"
        dt = time.perf_counter() - t0
        if error == STOPPED:
            log.info("precompile stopped target=%s: the daemon is stopping", spec.target)
        elif error:
            log.warning("precompile failed target=%s error=%s", spec.target, error)
        else:
            log.info("precompiled target=%s seconds=%.2f", spec.target, dt)
        results.append(PrecompileResult(target=spec.target, seconds=dt, error=error))
    return results


class PrecompileHost(Protocol):
    """What :func:`start_precompile` needs of a daemon (``beton_serve.daemon.Daemon`` is one)."""

    #: The served datasets (an entry's ``dataset`` names one).
    datasets: DatasetTable
    #: Builds ops, opens files and compiles plans.
    backend: Backend
    #: Its compile thread (``PlanRegistry.submit``).
    plans: PlanRegistry


def start_precompile(
    daemon: PrecompileHost, specs: Sequence[PrecompileSpec]
) -> Future[list[PrecompileResult]] | None:
    """Run :func:`precompile` for ``daemon`` on its compile thread (``None`` without specs;
    after ``Daemon.close``, right here).

    Call it right after ``Daemon.create``; the daemon serves meanwhile, and a client's plan
    queued behind it then finds every kernel in the cache.
    """
    if not specs:
        return None
    return daemon.plans.submit(
        precompile,
        specs,
        datasets=daemon.datasets,
        backend=daemon.backend,
        stopping=daemon.plans.stopping,
    )
