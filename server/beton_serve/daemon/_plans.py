"""The daemon's plan registry: compiled plans by request, and the one compile thread.

A stream's plan is keyed by :meth:`PlanRegistry.spec_key`: the dataset's identity (a plan holds
its reader), its schema, the batch size, every pipeline's ops and whether the peer may make the
daemon import op modules (that decides which ops the plan holds). A second stream with the same
key reuses the plan, even while the first one still compiles (both await one future); a plan
whose compilation failed is compiled again by the next request.

The registry keeps at most :data:`MAX_CACHED_PLANS` plans, dropping the least recently asked for
first (never one still compiling). Every distinct spec (an RRC scale, an output size) is a new
plan: before the bound, a client sweeping parameters grew a long-lived daemon by ~0.35 MB per
spec, for good (+100 MB of RSS over 300 specs; with the bound, 400 and 800 specs both end at the
same ~+125 MB). A kept plan holds no batch workspaces once no stream of its layout is open
(``Plan.unhold``; plans of one layout share their free ones): before, each kept its workers'
sets, ~70 MB per plan for an ImageNet-sized RRC + flip + normalize job on 2 workers, up to the
64 plans. A dropped plan
stays alive for the streams that use it; the next stream with its spec compiles it again (from
the compile cache: milliseconds). The bound holds only because no built-in op compiles per
parameter value (their kernels take parameters as arguments, ``transforms._util.bind``): Numba
never frees machine code, so an op that captured ``RandomBrightness``'s magnitude grew the daemon
by ~1.7 MB per distinct value whatever this registry dropped (docs/custom-ops.md).

Compiling (seconds: Numba) runs on one helper thread, ``beton-compile``, which also opens files
on demand (``daemon._opener``) and runs the ``[[precompile]]`` entries at start
(``daemon._precompile``): one thread, so a client's plan queued behind a precompile finds every
kernel in the cache instead of compiling it concurrently.

Threads: :meth:`PlanRegistry.get` and everything else run on the event-loop thread, except
``_compile_sync``, which runs on the compile thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from beton_wire.limits import short_repr

from beton_serve.daemon._backend import Backend, OutputInfo, PlanLike
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._messages import PipelineRequest, StreamRequest
from beton_serve.daemon._on_demand import CLIENT_OP, IMPORT_OP, OpImportPolicy, resolve_ops
from beton_serve.errors import SpecError

__all__ = ["MAX_CACHED_PLANS", "PlanEntry", "PlanRegistry"]

#: Plans the registry keeps for reuse (see the module docstring).
MAX_CACHED_PLANS = 64

log = logging.getLogger("beton_serve.daemon")

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry:
    """A compiled plan and its daemon-side outputs (with the ops each leaves to the client)."""

    plan: PlanLike
    outputs: tuple[OutputInfo, ...]


def _branch_source(
    p: PipelineRequest,
    built: Mapping[str, list[Any]],
    local: Mapping[str, tuple[str, dict[str, Any]] | None],
) -> Any:
    """The op a branch continues from: op ``p.branch_op`` of pipeline ``p.branch_of`` as built
    here, which must run here (not a placeholder of an op the client runs).

    Raises:
        SpecError: no such pipeline or op, or that op runs in the client.
    """
    where = f"pipeline {short_repr(p.name)}: a branch from op #{p.branch_op} of"
    ops = built.get(p.branch_of)
    if p.branch_of == p.name or ops is None or p.branch_op >= len(ops):
        raise SpecError(f"{where} {short_repr(p.branch_of)}, which this request does not have")
    handed = local.get(p.branch_of)
    if getattr(ops[p.branch_op], "spec_name", None) == CLIENT_OP or (
        handed is not None and p.branch_op >= int(handed[1]["from"])
    ):
        raise SpecError(
            f"{where} {short_repr(p.branch_of)}, which runs in the client: the daemon branches "
            "only from an op that runs here"
        )
    return ops[p.branch_op]


def _check_branch_families(
    pipelines: Sequence[PipelineRequest], local: Mapping[str, tuple[str, dict[str, Any]] | None]
) -> None:
    """Refuse branches in a family (pipelines joined by branches) where the client runs ops.

    In process, an op that works on its input's buffer (``Poison``: no allocation of its own)
    changes what a branch from the op before it reads; run by the client, after the batch left
    the daemon, it cannot. Rather than serve other pixels than the in-process Loader, the daemon
    refuses such a family.

    Raises:
        SpecError: a family with a branch has a pipeline whose ops run in the client (route c).
    """
    family = {p.name: p.name for p in pipelines}

    def root(name: str) -> str:
        while family[name] != name:
            name = family[name]
        return name

    for p in pipelines:
        if p.branch_of in family:
            family[root(p.name)] = root(p.branch_of)
    for p in pipelines:
        if not p.branch_of:
            continue
        for q in pipelines:
            handed = local.get(q.name)
            if handed is not None and root(q.name) == root(p.name):
                raise SpecError(
                    f"pipeline {short_repr(p.name)} branches from pipeline "
                    f"{short_repr(p.branch_of)}, and ops of pipeline {short_repr(q.name)} run in "
                    f"the client (from #{handed[1]['from']}: {'; '.join(handed[1]['why'])}); "
                    "the daemon serves a branch only when its pipelines run every Numba-stage op "
                    "here. Make those ops importable by the daemon (docs/custom-ops.md), or use "
                    "the in-process Loader"
                )


class PlanRegistry:
    """Compiled plans by spec key, and the compile thread (see the module docstring).

    Args:
        backend: compiles the plans.
        op_imports: which peers may make the daemon import a user op's module.
    """

    def __init__(self, backend: Backend, op_imports: OpImportPolicy) -> None:
        self.backend = backend
        self.op_imports = op_imports
        #: Least recently asked for first.
        self._plans: OrderedDict[str, asyncio.Future[PlanEntry]] = OrderedDict()
        self.max_plans = MAX_CACHED_PLANS
        #: plan key -> the key of the dataset it was compiled over (to drop it with the dataset).
        self._owner: dict[str, str] = {}
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="beton-compile"
        )
        #: Set by :meth:`close`: long work on the compile thread (the ``[[precompile]]``
        #: entries) stops at its next check instead of holding up the daemon's exit.
        self.stopping = threading.Event()

    # -- the compile thread ------------------------------------------------------------------
    def on_compile_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on the compile thread; await the result on the event loop."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the compile thread from any thread (after
        :meth:`close`: right here, returning a done future)."""
        if self._pool is None:
            fut: Future[T] = Future()
            fut.set_result(fn(*args, **kwargs))
            return fut
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """Stop the compile thread, dropping the work not started and telling the running
        work to stop (:attr:`stopping`; a kernel being compiled still finishes). Idempotent."""
        self.stopping.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # -- plans -------------------------------------------------------------------------------
    def import_refusal(self, req: StreamRequest) -> str | None:
        """Why this request's peer may not make the daemon import op modules (or ``None``)."""
        return self.op_imports.refusal(owner_peer=req.owner_peer, peer_uid=req.offer.identity.uid)

    def spec_key(self, req: StreamRequest, ds: Dataset, rows: int) -> str:
        """The key of ``req``'s plan over ``ds`` for batches of at most ``rows`` samples (also
        its sharing groups' pipeline key)."""
        spec = [
            [
                p.name,
                p.field or p.name,
                p.skip,
                [[o.name, dict(o.params)] for o in p.ops],
                [p.branch_of, p.branch_op] if p.branch_of else None,
            ]
            for p in req.pipelines
        ]
        # Whether the peer may make the daemon import op modules decides which ops the plan holds.
        imports = any(o.name == IMPORT_OP for p in req.pipelines for o in p.ops)
        allowed = imports and self.import_refusal(req) is None
        # The plan holds the dataset's reader: keyed by the dataset's identity, not only its schema
        # (train and val files share a schema; issue 11).
        text = json.dumps([ds.key, ds.schema_key, rows, spec, allowed], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    async def get(self, req: StreamRequest, ds: Dataset, rows: int) -> tuple[PlanEntry, bool]:
        """``req``'s plan over ``ds`` for batches of at most ``rows`` samples
        (``beton_wire.loader_state.batch_rows``), and whether it was cached (compiled, or
        compiling).

        Raises:
            SpecError: an op cannot be built; PipelineError: the pipeline failed to compile.
        """
        key = self.spec_key(req, ds, rows)
        fut = self._plans.get(key)
        if fut is not None:
            if not fut.done() or fut.exception() is None:
                self._plans.move_to_end(key)
                return await asyncio.shield(fut), True
        fut = self.on_compile_thread(self._compile_sync, req, ds, rows)
        self._plans[key] = fut
        self._plans.move_to_end(key)
        self._owner[key] = ds.key
        self._trim()
        try:
            return await asyncio.shield(fut), False
        except BaseException:
            if self._plans.get(key) is fut:
                del self._plans[key]
            raise

    def _trim(self) -> None:
        """Drop the least recently asked-for compiled plans beyond :attr:`max_plans`."""
        excess = len(self._plans) - self.max_plans
        if excess <= 0:
            return
        for key in [k for k, f in self._plans.items() if f.done()][:excess]:
            del self._plans[key]
            self._owner.pop(key, None)

    def drop(self, ds: Dataset) -> None:
        """Forget the plans compiled over ``ds``'s reader (they would keep it mapped)."""
        for key in [k for k, owner in self._owner.items() if owner == ds.key]:
            self._plans.pop(key, None)
            del self._owner[key]

    def compiled(self) -> list[PlanLike]:
        """The plans compiled successfully (for stats)."""
        return [
            f.result().plan
            for f in self._plans.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]

    def _compile_sync(self, req: StreamRequest, ds: Dataset, rows: int) -> PlanEntry:
        pipelines: dict[str, Any] = {}  # ops, a PipelineSpec (another output), or None
        local: dict[str, tuple[str, dict[str, Any]] | None] = {}
        refusal = self.import_refusal(req)
        built: dict[str, list[Any]] = {}
        for p in req.pipelines:
            if p.skip:
                pipelines[p.name] = None
                continue
            # User ops: plugin, else imported here, else run by the client (_on_demand).
            ops, local[p.name] = resolve_ops(
                p.ops, build=self.backend.build_op, import_refusal=refusal
            )
            built[p.name] = ops
            # Another output of a field (FFCV's PipelineSpec(source=field)) keeps its name. (A
            # branch's field is a placeholder, beton_client._ops.BRANCH_FIELD: built below.)
            renamed = bool(p.field) and p.field != p.name and not p.branch_of
            pipelines[p.name] = self.backend.field_output(p.field, ops) if renamed else ops
            handed = local[p.name]
            if handed is not None:
                log.info(
                    "dataset=%s pipeline=%s: ops from #%d run in the client (%s)",
                    ds.name,
                    short_repr(p.name),
                    handed[1]["from"],
                    "; ".join(handed[1]["why"]),
                )
        for p in req.pipelines:  # branches, once every op they may branch from is built
            if p.branch_of and not p.skip:
                source = _branch_source(p, built, local)
                pipelines[p.name] = self.backend.branch_output(source, built[p.name])
        _check_branch_families(req.pipelines, local)
        check = {} if ds.checksums is None else {"sample_check": ds.checksums.check}
        plan = self.backend.compile(ds.reader, pipelines, rows, **check)
        tail = self.backend.client_tail(plan)
        outputs = []
        for o in self.backend.outputs(plan):
            ops = [t for t in tail.get(o.name, ()) if t[0] != CLIENT_OP]
            marker = local.get(o.name)
            outputs.append(
                dataclasses.replace(o, client_ops=tuple([marker, *ops] if marker else ops))
            )
        return PlanEntry(plan=plan, outputs=tuple(outputs))
