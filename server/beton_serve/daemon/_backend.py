"""The daemon's seam to the decoding layers: reader, op registry, planner and engine.

The daemon does not import the format, pipeline or engine modules directly; it goes through a
:class:`Backend`, so that it can be tested with a small fake and so that heavy imports (numba)
happen only when a daemon actually starts. :class:`EngineBackend` is the real one, built on the
contracts of ``docs/internal/CONTRACTS.md``.

Threading: ``open_dataset`` and ``compile`` are called from a helper thread (they can take
seconds); ``make_source`` and everything on the returned source from the daemon's event-loop
thread, except that ``BatchSource.submit``'s work runs on the engine's own workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from beton_serve._batchmem import memory_limit_bytes

if TYPE_CHECKING:
    from beton_serve.engine import SourceCaps

__all__ = [
    "Backend",
    "BatchSourceLike",
    "DemandLike",
    "EngineBackend",
    "EngineLike",
    "OutputInfo",
    "PlanLike",
    "SourceParams",
]


@dataclass(frozen=True, slots=True)
class OutputInfo:
    """One daemon-side output: name, per-sample shape, numpy dtype name, and the ops the client
    must run after it (``(spec name, params)``, e.g. a default pipeline's ``ToTensor``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    client_ops: tuple[tuple[str, dict[str, Any]], ...] = ()


class PlanLike(Protocol):
    """A compiled plan (``beton_serve.pipeline.compile_pipelines``'s result)."""

    @property
    def outputs(self) -> Sequence[Any]:
        """``OutputSpec(name, shape, dtype)`` of each daemon-side output."""
        ...

    def op_times(self) -> Mapping[str, tuple[float, int]]:
        """``op -> (seconds, runs)`` summed over every run of the plan (for stats)."""
        ...

    @property
    def client_tail(self) -> Mapping[str, Sequence[Any]]:
        """The ops of each output after its jit prefix (``ToTensor`` onwards), which the client
        runs on the received tensors."""
        ...


class EngineLike(Protocol):
    """The shared worker pool (``beton_serve.engine.Engine``), as the daemon's stats read it."""

    @property
    def queue_depth(self) -> int:
        """Batches queued, not yet started (approximate)."""
        ...

    #: Worker threads.
    num_workers: int
    #: Workers that died and were replaced.
    workers_replaced: int
    #: Seconds the workers spent running tasks, summed.
    busy_s: float

    def hold_demand(self, batches: int) -> DemandLike:
        """Register a stream that keeps ``batches`` batches in flight."""
        ...

    def prefetch_slices(self) -> int:
        """Units of work for one prefetched batch, so the streams present fill the workers."""
        ...


class DemandLike(Protocol):
    """A stream's registered in-flight batches (``beton_serve.engine.Demand``)."""

    def update(self, batches: int) -> None: ...

    def release(self) -> None: ...


class BatchSourceLike(Protocol):
    """One stream's batches (``beton_serve.engine.BatchSource``, or a ``SharedSource`` around
    one). What it can do beyond the basics is declared in :attr:`caps`, never probed for."""

    def __len__(self) -> int: ...

    def batch_ids(self, epoch: int, b: int) -> np.ndarray: ...

    def submit(
        self,
        epoch: int,
        b: int,
        out: list[np.ndarray] | None,
        priority: int = 1,
        *,
        slices: int | None = None,
        by_reference: bool = False,
    ) -> Future[list[np.ndarray]]:
        """Start batch ``(epoch, b)`` into ``out``; the future is a ``BatchFuture`` (its
        ``sample_ids``, ``decoded_here`` and ``shared_ref`` are read by the publishers)."""
        ...

    @property
    def caps(self) -> SourceCaps:
        """By reference (zero-copy sharing) or not; may look ahead or not."""
        ...

    def skipped(self) -> Sequence[Any]:
        """The samples skipped under the bad-sample budget so far (``BadSample``), oldest first."""
        ...

    def charge(self, epoch: int, fut: Future[Any]) -> None:
        """Charge what the delivered batch ``fut`` skipped to the bad-sample budget, in batch
        order (``BatchSource.charge``); raises ``PipelineError`` when it runs out."""
        ...

    def promote(self, fut: Future[Any]) -> None:
        """Move the decode behind ``fut`` ahead of prefetch work (its client waits)."""
        ...

    def close(self) -> None:
        """Release what the source holds (a shared source leaves its group); idempotent."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceParams:
    """A stream's order parameters, as :class:`BatchSource` takes them."""

    order: str  # "SEQUENTIAL" | "RANDOM" | "QUASI_RANDOM"
    batch_size: int
    seed: int
    indices: np.ndarray | None
    drop_last: bool
    distributed: bool
    rank: int
    world_size: int
    #: In-flight bound handed to the source (the ring size, so ``submit`` never blocks the loop).
    batches_ahead: int = 8
    #: Split each batch into this many units of work (when the plan allows), for latency.
    slices: int = 1
    #: Failing samples a stream may skip (0: the first one fails the stream, naming it).
    bad_sample_budget: int = 0
    #: Run by a worker right before it reads the files (the daemon re-checks their size).
    pre_run: Callable[[], None] | None = None


#: A plan whose buffers for one batch (:attr:`beton_serve.pipeline.Plan.workspace_bytes`) take
#: more than this share of the host's memory is refused when a stream opens: a client cannot
#: make the daemon allocate absurd scratch memory (a ``RandomTranslate(padding=10**7)`` asked
#: for 4.8 PB and failed inside a worker; one of 3,000 px took 433 MB per worker).
WORKSPACE_SHARE_OF_MEMORY = 8


def max_workspace_bytes() -> int:
    """The largest :attr:`Plan.workspace_bytes` the daemon accepts (see
    :data:`WORKSPACE_SHARE_OF_MEMORY`): a share of the host's memory, or of the daemon's cgroup
    limit when that is lower (a container's ``memory.max``, cgroup v2)."""
    return memory_limit_bytes() // WORKSPACE_SHARE_OF_MEMORY


class Backend(Protocol):
    """What the daemon needs from the decoding layers."""

    def open_dataset(self, path: str, custom_fields: Mapping[str, type] | None = None) -> Any:
        """Open and validate one ``.beton`` file, reading the fields named in ``custom_fields``
        with those classes (FFCV's ``custom_fields``); raises ``FormatError``."""
        ...

    def num_samples(self, reader: Any) -> int: ...

    def is_field_class(self, cls: type) -> bool:
        """Whether ``cls`` is a ``Field`` subclass (a ``custom_fields`` value)."""
        ...

    def field_output(self, field: str, ops: list[Any]) -> Any:
        """An output named other than its field: ``PipelineSpec(field, transforms=ops)``."""
        ...

    def branch_output(self, source: Any, ops: list[Any]) -> Any:
        """A branch from op ``source`` of another pipeline: ``PipelineSpec(source, ops)``."""
        ...

    def fields(self, reader: Any) -> list[tuple[str, str]]:
        """``(field name, field class name)`` in file order."""
        ...

    def schema_key(self, reader: Any) -> str: ...

    def field_signature(self, reader: Any, name: str) -> str:
        """A printable description of one field's type and arguments (to explain schema diffs)."""
        ...

    def build_op(self, name: str, params: Mapping[str, Any]) -> Any:
        """Rebuild an op from its spec; raises ``SpecError`` naming what is wrong."""
        ...

    def combine(self, readers: Sequence[Any], name: str) -> Any:
        """One reader over shards with one schema (one index space, shards in order)."""
        ...

    def compile(
        self,
        reader: Any,
        pipelines: Mapping[str, Any],
        batch_size: int,
        *,
        sample_check: Any = None,
    ) -> PlanLike:
        """Plan and compile; raises ``SpecError`` / ``PipelineError``. ``sample_check`` (from
        :meth:`open_checksums`; only passed when set) runs on each batch's ids before decoding."""
        ...

    def open_checksums(self, readers: Sequence[Any]) -> Any:
        """A checker of the readers' CRC32C sidecars (``--verify-checksums``), whose ``check``
        is a ``sample_check``; raises ``FormatError`` for a missing or stale sidecar."""
        ...

    def outputs(self, plan: PlanLike) -> list[OutputInfo]: ...

    def make_engine(self, num_workers: int | None) -> EngineLike: ...

    def make_source(self, engine: Any, plan: PlanLike, params: SourceParams) -> BatchSourceLike: ...

    def close_engine(self, engine: Any) -> None: ...

    def client_tail(self, plan: PlanLike) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """Ops of ``plan`` after its jit prefix, per output, as ``(spec name, params)``."""
        ...


class EngineBackend:
    """The real backend: ``BetonReader``, ``op_from_spec``, ``compile_pipelines``, ``Engine``."""

    def open_dataset(self, path: str, custom_fields: Mapping[str, type] | None = None) -> Any:
        from beton_serve.format import BetonReader

        return BetonReader(os.fspath(path), custom_fields=dict(custom_fields or {}) or None)

    def num_samples(self, reader: Any) -> int:
        return int(reader.num_samples)

    def is_field_class(self, cls: type) -> bool:
        from beton_serve.fields.base import Field

        return issubclass(cls, Field)

    def field_output(self, field: str, ops: list[Any]) -> Any:
        from beton_serve.pipeline import PipelineSpec

        # decoder=None: the planner takes ops[0] as the decoder when it fits the field, exactly
        # as for PipelineSpec(field, decoder=ops[0], transforms=ops[1:]) in process.
        return PipelineSpec(field, transforms=list(ops))

    def branch_output(self, source: Any, ops: list[Any]) -> Any:
        from beton_serve.pipeline import PipelineSpec

        return PipelineSpec(source, transforms=list(ops))

    def fields(self, reader: Any) -> list[tuple[str, str]]:
        return [(n, type(reader.handlers[n]).__name__) for n in reader.field_names]

    def schema_key(self, reader: Any) -> str:
        return str(reader.schema_key())

    def field_signature(self, reader: Any, name: str) -> str:
        handler = reader.handlers.get(name)
        if handler is None:
            return "<absent>"
        blob = bytes(np.asarray(handler.to_binary()).tobytes())  # Field.to_binary is abstract
        return f"{type(handler).__name__}({blob.rstrip(bytes(1)).hex() or '-'})"

    def combine(self, readers: Sequence[Any], name: str) -> Any:
        from beton_serve.daemon._shards import ShardedReader

        return ShardedReader(readers, name)

    def build_op(self, name: str, params: Mapping[str, Any]) -> Any:
        from beton_serve.pipeline.registry import op_from_spec

        return op_from_spec(name, dict(params))

    def compile(
        self,
        reader: Any,
        pipelines: Mapping[str, Any],
        batch_size: int,
        *,
        sample_check: Any = None,
    ) -> PlanLike:
        from beton_serve.errors import SpecError
        from beton_serve.pipeline import compile_pipelines  # type: ignore[attr-defined]

        plan = compile_pipelines(
            reader, dict(pipelines), batch_size=batch_size, sample_check=sample_check
        )
        need, limit = plan.workspace_bytes, max_workspace_bytes()
        if need > limit:
            raise SpecError(
                f"the ops' buffers for one batch of {batch_size} would take {need:,} bytes of "
                f"the daemon's memory (each of its workers holds one set), over its limit of "
                f"{limit:,} (an eighth of its memory): use a smaller batch_size or "
                "smaller sizes (a RandomTranslate padding, an output size)"
            )
        return plan  # type: ignore[no-any-return]

    def open_checksums(self, readers: Sequence[Any]) -> Any:
        from beton_serve.format import ChecksumVerifier

        return ChecksumVerifier(readers)

    def outputs(self, plan: PlanLike) -> list[OutputInfo]:
        out = []
        for spec in plan.outputs:
            shape = tuple(int(d) for d in spec.shape)
            out.append(OutputInfo(str(spec.name), shape, np.dtype(spec.dtype).name))
        return out

    def make_engine(self, num_workers: int | None) -> EngineLike:
        from beton_serve.engine import Engine  # type: ignore[attr-defined]

        # The daemon's worker threads are its parallelism: OpenCV's own thread pool (used by
        # cv2.resize/cv2.flip inside ops) would oversubscribe the cores. Process-wide, which is
        # fine in the daemon's own process (the in-process Loader leaves it alone).
        try:
            import cv2

            cv2.setNumThreads(1)
        except ImportError:  # pragma: no cover - cv2 is a hard dependency
            pass
        return Engine(num_workers=num_workers)

    def make_source(self, engine: Any, plan: PlanLike, params: SourceParams) -> BatchSourceLike:
        from beton_serve.engine import BatchSource, OrderOption  # type: ignore[attr-defined]

        source = BatchSource(
            engine=engine,
            plan=plan,  # type: ignore[arg-type]
            order=OrderOption[params.order],
            batch_size=params.batch_size,
            seed=params.seed,
            indices=params.indices,
            drop_last=params.drop_last,
            distributed=params.distributed,
            rank=params.rank,
            world_size=params.world_size,
            batches_ahead=params.batches_ahead,
            slices=params.slices,
            bad_sample_budget=params.bad_sample_budget,
        )
        source.pre_run = params.pre_run
        return source  # type: ignore[no-any-return]

    def close_engine(self, engine: Any) -> None:
        engine.close()

    def client_tail(self, plan: PlanLike) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """The plan's ops after the jit prefix, per output, as ``(spec name, params)``.

        Raises:
            SpecError: such an op has no wire description (the client could not run it).
        """
        from beton_serve.errors import SpecError

        out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for name, ops in plan.client_tail.items():
            specs = []
            for op in ops:
                spec = op.spec_name or type(op).__name__  # Operation.spec_name: None unless set
                try:
                    params = dict(op.spec_params())
                except NotImplementedError:
                    raise SpecError(
                        f"output {name!r}: {type(op).__name__} runs on torch tensors but has no "
                        "wire description; send it as part of the client's pipeline instead"
                    ) from None
                specs.append((str(spec), params))
            if specs:
                out[str(name)] = specs
        return out
