"""The Loader backends of the conformance suite, and bit-exact comparison of their outputs.

A *backend* is how a test gets a Loader with FFCV's signature:

* ``inproc``: ``beton_serve.loader.Loader`` (one worker thread, a module-wide plan cache);
* ``shm``, ``grpc``: ``beton_client.Loader(..., server=daemon, transport=...)``;
* ``cuda_ipc``: the same with ``transport="cuda_ipc"``; every pipeline with a ``ToTensor`` then
  ends with ``ToDevice('cuda:0')`` (the transport needs a GPU pipeline) and outputs are compared
  on the CPU.

Every test compares a backend with a fresh in-process Loader built from the same arguments, the
oracle. A batch is snapshotted as :class:`Out` values (kind, dtype, shape, strides and raw bytes),
so equality is bit equality: ``-0.0 != 0.0`` and NaNs compare by payload.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.daemon import DaemonProcess, start_daemon

#: Parameters for ``@pytest.mark.parametrize("backend", BACKENDS)``.
BACKENDS = [
    "inproc",
    "shm",
    "grpc",
    pytest.param("cuda_ipc", marks=pytest.mark.gpu),
]
#: The served backends only (for tests whose subject is served-vs-in-process).
SERVED = [b for b in BACKENDS if not (isinstance(b, str) and b == "inproc")]

Pipelines = Callable[[], Mapping[str, Any]]


@contextmanager
def module_daemon(files: Sequence[Path], args: Sequence[str] = ()) -> Iterator[DaemonProcess]:
    """A daemon serving ``files`` on a socket in a short private directory, stopped at the end
    (for a module-scoped fixture: one daemon per test module)."""
    d_dir = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    os.chmod(d_dir, 0o700)
    d = start_daemon(files, d_dir, args=args)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d_dir, ignore_errors=True)


_PLAN_CACHE: Any = None


def _plan_cache() -> Any:
    """One in-process plan cache for the whole session: a second in-process Loader over the same
    file and pipelines starts without compiling (the suite's runtime is mostly Numba)."""
    global _PLAN_CACHE
    if _PLAN_CACHE is None:
        from beton_serve.pipeline import PlanCache

        _PLAN_CACHE = PlanCache()
    return _PLAN_CACHE


def _on_cuda(pipelines: Mapping[str, Any]) -> dict[str, Any]:
    """Every pipeline that reaches torch (has a ``ToTensor``) ends with ``ToDevice('cuda:0')``."""
    from beton_serve.transforms import ToDevice, ToTensor

    out: dict[str, Any] = {}
    for name, ops in pipelines.items():
        if isinstance(ops, list | tuple) and any(isinstance(op, ToTensor) for op in ops):
            out[name] = [*ops, ToDevice("cuda:0")]
        else:
            out[name] = ops
    return out


def make_loader(
    backend: str,
    path: str | Path,
    pipelines: Mapping[str, Any],
    *,
    address: str | None = None,
    order: str = "SEQUENTIAL",
    **kw: Any,
) -> Any:
    """A Loader of ``backend`` over ``path`` (see the module docstring); ``order`` by name.

    ``pipelines`` must be fresh op objects (a Loader owns them: progressive resizing mutates
    its decoder). ``address`` is the daemon's, for the served backends.
    """
    if backend == "inproc":
        from beton_serve.loader import Loader, OrderOption

        kw.setdefault("num_workers", 1)
        return Loader(
            str(path),
            pipelines=dict(pipelines),
            order=OrderOption[order],
            plan_cache=_plan_cache(),
            **kw,
        )
    from beton_client import Loader as ClientLoader
    from beton_client import OrderOption as ClientOrder

    if address is None:
        raise ValueError("a served backend needs the daemon's address")
    pipes = _on_cuda(pipelines) if backend == "cuda_ipc" else dict(pipelines)
    return ClientLoader(
        str(path), pipelines=pipes, order=ClientOrder[order], **serving(address, backend), **kw
    )


def serving(address: str, transport: str) -> dict[str, Any]:
    """The served Loader's keywords for this daemon and transport, never spawning one:
    ``serve=ServeOptions(...)`` (issue 12 §8), or the flat keywords of a client without it."""
    try:
        from beton_client import ServeOptions  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return {"server": address, "transport": transport, "spawn": False}
    return {"serve": ServeOptions(server=address, transport=transport, spawn=False)}


@dataclass(frozen=True, slots=True)
class Out:
    """One output of one batch, as bits: ``kind`` is ``tensor`` or ``ndarray``."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    data: bytes

    def array(self) -> np.ndarray:
        """The values as a C-contiguous numpy array (bfloat16 is not handled)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def snap_one(x: Any) -> Out:
    """Snapshot one output (a torch tensor on any device, or a numpy array)."""
    if hasattr(x, "detach"):
        t = x.detach()
        strides = tuple(int(s) * t.element_size() for s in t.stride())
        c = t.cpu().contiguous()
        return Out("tensor", _dtype_name(t), tuple(t.shape), strides, c.numpy().tobytes())
    a = np.asarray(x)
    return Out("ndarray", a.dtype.name, a.shape, a.strides, np.ascontiguousarray(a).tobytes())


def snap(batch: Any) -> tuple[Out, ...]:
    """Snapshot a batch (the tuple a Loader yields)."""
    items = batch if isinstance(batch, tuple | list) else (batch,)
    return tuple(snap_one(x) for x in items)


def epoch(it: Iterable[Any], n: int | None = None) -> list[tuple[Out, ...]]:
    """Snapshot the batches of ``it`` (the first ``n`` of them when ``n`` is given)."""
    out = []
    for b in it:
        out.append(snap(b))
        if n is not None and len(out) == n:
            break
    return out


def epochs(loader: Any, n: int) -> list[list[tuple[Out, ...]]]:
    """``n`` whole epochs of ``loader``, snapshotted."""
    return [epoch(loader) for _ in range(n)]


def resumed(
    make: Callable[[], Any], make_again: Callable[[], Any], at: int
) -> tuple[list, int, int, list] | BaseException:
    """Batches ``0..at-1`` of epoch 0 of ``make()``, a checkpoint, then two epochs on
    ``make_again()`` from it (or the exception either raised):
    ``(first, epoch, batch, [resumed epoch, the epoch after])``. The checkpoint names the next
    batch to yield; after an epoch's last batch, that is the next epoch's first."""
    try:
        with make() as ld:
            first = epoch(iter(ld), at) if at else []
            state = ld.state_dict()
        with make_again() as ld:
            ld.load_state_dict(state)
            return first, int(state["epoch"]), int(state["batch"]), [epoch(ld), epoch(ld)]
    except Exception as exc:
        return exc


def _first_difference(a: Out, b: Out) -> str:
    for attr in ("kind", "dtype", "shape"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} != {getattr(b, attr)}"
    if a.strides != b.strides:
        same = "equal" if a.data == b.data else "different"
        return f"strides {a.strides} != {b.strides} (the values are {same})"
    x, y = a.array().reshape(-1), b.array().reshape(-1)
    if not x.size:
        return "the bytes differ"
    xb, yb = x.view(np.uint8).reshape(x.size, -1), y.view(np.uint8).reshape(y.size, -1)
    bad = np.flatnonzero((xb != yb).any(axis=1))
    i = int(bad[0])
    pos = np.unravel_index(i, a.shape)
    return f"{len(bad)} of {x.size} elements differ; first at {tuple(map(int, pos))}: {x[i]!r} != {y[i]!r}"


def assert_same_batches(
    got: list[tuple[Out, ...]],
    want: list[tuple[Out, ...]],
    what: str,
    *,
    strides: bool = True,
) -> None:
    """Bit equality of two snapshotted batch lists; the message names the first difference.

    ``strides=False`` compares values, dtypes and shapes but not the memory layout.
    """
    assert len(got) == len(want), f"{what}: {len(got)} batches, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), f"{what}: batch {i} has {len(g)} outputs, expected {len(w)}"
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            if not strides:
                a = Out(a.kind, a.dtype, a.shape, b.strides, a.data)
            if a != b:
                pytest.fail(f"{what}: batch {i} output {j}: {_first_difference(a, b)}")


def assert_same_epochs(
    got: list[list[tuple[Out, ...]]],
    want: list[list[tuple[Out, ...]]],
    what: str,
    *,
    strides: bool = True,
) -> None:
    """:func:`assert_same_batches` for each epoch."""
    assert len(got) == len(want), f"{what}: {len(got)} epochs, expected {len(want)}"
    for e, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batches(g, w, f"{what}, epoch {e}", strides=strides)


def column(batches: list[tuple[Out, ...]], j: int) -> np.ndarray:
    """Output ``j`` of every batch, concatenated along the batch axis."""
    return np.concatenate([b[j].array() for b in batches]) if batches else np.empty(0)


def attempt(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` (build a Loader, take a batch); the exception it raised, if any."""
    try:
        fn()
    except Exception as exc:  # the subject of the test: any error is compared
        return exc
    return None


def assert_same_error(
    got: BaseException | None, want: BaseException | None, pattern: str, what: str
) -> None:
    """Both raised, with the same class name (``beton_serve.errors.X`` ~ ``beton_client.errors.X``),
    and both messages match ``pattern`` (an equivalent message: it names the same thing)."""
    assert want is not None, f"{what}: the in-process Loader accepted it"
    assert got is not None, f"{what}: accepted, but in-process raises {type(want).__name__}: {want}"
    assert type(got).__name__ == type(want).__name__, (
        f"{what}: {type(got).__module__}.{type(got).__name__}: {got} -- in-process raises "
        f"{type(want).__module__}.{type(want).__name__}: {want}"
    )
    for exc in (want, got):
        assert re.search(pattern, str(exc), re.I | re.S), (
            f"{what}: {type(exc).__name__} message {str(exc)!r} does not match {pattern!r}"
        )


#: One step of an epoch schedule: ``(next_epoch or None, batches to read or None: all)``.
Step = tuple[int | None, int | None]


def epoch_schedule(r: random.Random) -> list[Step]:
    """3 to 7 steps for :func:`run_schedule`: epochs read again, out of order and back in
    time (``next_epoch``), some left after 0 to 3 batches. The same batch of the same epoch read
    again in the same slot once served another batch's rows (a release word's stale token,
    session 34). ``test_fuzz.py`` also gives each member of a sharing group its own schedule."""
    steps: list[Step] = []
    for _ in range(r.randint(3, 7)):
        epoch_no = r.choice([None, None, r.randrange(4), r.randrange(4)])
        stop = r.choice([None, None, None, r.randint(0, 3)])
        steps.append((epoch_no, stop))
    return steps


def run_schedule(make: Callable[[], Any], steps: list[Step]) -> list | BaseException:
    """Follow ``steps`` on one Loader from ``make()``: the batches of every step, in order, or
    the exception that stopped it (compared by type with the other backend's)."""
    got = run_interleaved([make], [steps], random.Random(0))
    return got if isinstance(got, BaseException) else got[0]


def shared_schedules(r: random.Random, n: int) -> list[list[Step]]:
    """``n`` schedules from :func:`epoch_schedule` for Loaders read together; the later ones
    often begin with the first one's steps (a sharing group then decodes those batches once)."""
    schedules = [epoch_schedule(r) for _ in range(n)]
    for steps in schedules[1:]:
        if r.random() < 0.6:
            steps[: r.randint(1, 2)] = schedules[0][:2]
    return schedules


def _member(ld: Any, steps: list[Step], held: dict[int, Any], out: list[list]) -> Iterator[None]:
    """Follow ``steps`` on ``ld`` (as :func:`run_schedule` does, each step's snapshots appended
    to ``out``), yielding after each batch so that other Loaders can be stepped in between.
    While its iterator is open, the newest batch as yielded and its snapshot are in
    ``held[id(out)]``: the batch must stay as it was until this Loader is asked for the next."""
    me = id(out)
    for epoch_no, stop in steps:
        if epoch_no is not None:
            ld.next_epoch = epoch_no
        it = iter(ld)
        got: list = []
        out.append(got)
        for x in it:
            got.append(snap(x))
            held[me] = (x, got[-1], len(out) - 1, len(got) - 1)
            yield
            if stop is not None and len(got) >= stop:
                break
        held.pop(me, None)
        it.close()
        yield


def run_interleaved(
    makes: Sequence[Callable[[], Any]],
    schedules: Sequence[list[Step]],
    r: random.Random,
    before_close: Callable[[], None] | None = None,
) -> list | BaseException:
    """Loaders from ``makes`` (identical served ones form one sharing group on the daemon), each
    on its own epoch schedule (:func:`epoch_schedule`), stepped one batch at a time in a random
    interleaving; ``before_close`` runs once every schedule is done, before the Loaders close.

    After every step, each other Loader's newest batch must still hold what it held when it was
    yielded (``AssertionError`` otherwise): a shared buffer is never reused for another batch
    while a member may still read it.

    Returns:
        Every Loader's steps (batch snapshots, as :func:`run_schedule` returns them), or the
        first exception a Loader raised (compared by type with the other backend's).
    """
    loaders: list[Any] = []
    held: dict[int, Any] = {}
    outs: list[list[list]] = [[] for _ in makes]
    try:
        for make in makes:
            loaders.append(make())
        live = {
            m: _member(ld, s, held, out)
            for m, (ld, s, out) in enumerate(zip(loaders, schedules, outs, strict=True))
        }
        while live:
            m = r.choice(sorted(live))
            try:
                next(live[m])
            except StopIteration:
                del live[m]
            for other in live:
                got = held.get(id(outs[other])) if other != m else None
                if got is not None:
                    x, was, step, b = got
                    assert snap(x) == was, (
                        f"Loader {other}'s batch {b} of step {step} changed while {m} read"
                    )
        if before_close is not None:
            before_close()
        return outs
    except AssertionError:
        raise
    except Exception as exc:
        return exc
    finally:
        for ld in loaders:
            ld.close()


def assert_same_schedules(got: list | BaseException, want: list | BaseException, what: str) -> bool:
    """Two :func:`run_schedule` results agree: the same error type on both sides, or every
    step's batches bit for bit. Returns whether batches were compared (not only errors)."""
    if isinstance(want, BaseException) or isinstance(got, BaseException):
        assert type(got).__name__ == type(want).__name__, f"{what}: {got!r} != {want!r}"
        return False
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batches(g, w, f"{what}, step {i}")
    return True
