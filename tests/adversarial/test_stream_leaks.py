# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §6: a closed stream frees its ring at once, not at the next garbage collection.

Before the fix, 800 short streams left 14-52 closed rings mapped in the daemon (only
``/proc/PID/fd`` and ``/proc/PID/maps`` showed them: the files were unlinked), because batch
views lived on in reference cycles (an engine task and its future, tracebacks whose frames held
slot views, callbacks that kept their future's state), and a stream closed by the client before
it started stayed open for 30 s. The real-daemon test runs 1,000 open/close cycles of every
short kind (one or two batches, a break mid-epoch, never started, dropped without ``close``, two
identical streams sharing decoding) over shm and grpc, checks every batch's contents, and then
wants the daemon's and this process's descriptors and ``beton-*`` mappings back at their
baseline exactly, the daemon's RSS within 40 MB of it, and no reference cycle of this process's
streams left for the garbage collector (a grpc stream's batch buffers used to wait for a full
collection: ``test_a_finished_stream_is_freed_without_the_garbage_collector``).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_client import Loader, PipelineError, RetryPolicy, ServeOptions, ServerUnavailable
from beton_serve.fields import IntField, NDArrayField
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, NDArrayDecoder
from beton_serve.transport.shm import ShmRing
from beton_serve.writer import DatasetWriter
from beton_wire.slots import slot_layout
from helpers.bad_samples import zero_samples
from helpers.cycles import assert_freed_by_refcount, cyclic_garbage
from helpers.daemon import daemon_factory, rss_mb, short_tmp  # noqa: F401

N = 48
BATCH = 4
CYCLES = 1000
WARMUP = 50
RSS_SLACK_MB = 40
#: Objects of one type in the daemon's cycles that mean a cycle per stream, not a one-off.
PER_STREAM = 10


class _TinyWriter(DatasetWriter):
    _MIN_PAGE_SIZE = 4096


class _Rows:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, np.ndarray]:
        return i, _pixels(i)


def _pixels(i: int) -> np.ndarray:
    return ((np.arange(48, dtype=np.int64).reshape(4, 4, 3) * 7 + i * 13) % 251).astype(np.uint8)


def _tiny(path: Path) -> Path:
    fields = {"label": IntField(), "pix": NDArrayField(np.dtype(np.uint8), (4, 4, 3))}
    _TinyWriter(path, fields, page_size=4096, num_workers=1).from_indexed_dataset(_Rows())
    return path


def _fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile (our own listdir's descriptor, for one)
            pass
    return sorted(out)


def _beton_maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "/dev/shm/beton-" in line]


def _check(batch: tuple, ids: np.ndarray, index: int) -> None:
    """Batch ``index`` of the SEQUENTIAL order: its labels, pixels and ids, row by row."""
    label, pix = (np.asarray(x) for x in batch)
    want = np.arange(index * BATCH, (index + 1) * BATCH)
    assert np.array_equal(np.asarray(ids, dtype=np.int64), want), (index, ids)
    assert np.array_equal(label.reshape(-1), want)
    assert np.array_equal(pix, np.stack([_pixels(int(i)) for i in want]))


def _loader(address: str, transport: str) -> Loader:
    return Loader("tiny", BATCH, server=address, transport=transport, batches_ahead=2, spawn=False)


def _read(loader: Loader, count: int) -> None:
    """Read ``count`` batches of a new epoch, then leave it (the iterator is dropped)."""
    it = iter(loader)
    for index in range(count):
        _check(next(it), loader.last_sample_ids, index)


def _cycle(address: str, i: int) -> None:
    """One open/close cycle; ``i`` picks the transport and the way the stream ends."""
    transport = "grpc" if i % 3 == 2 else "shm"
    kind = (i // 3) % 6
    if kind == 5:  # two identical streams at once: they share decoding (zero-copy over shm)
        with _loader(address, transport) as a, _loader(address, transport) as b:
            ia, ib = iter(a), iter(b)
            for index in range(2):
                _check(next(ia), a.last_sample_ids, index)
                _check(next(ib), b.last_sample_ids, index)
        return
    loader = _loader(address, transport)
    if kind == 0:
        _read(loader, 1)
    elif kind == 1:
        _read(loader, 2)
    elif kind == 2:  # break mid-epoch, with batches decoded ahead
        for index, batch in enumerate(loader):
            _check(batch, loader.last_sample_ids, index)
            if index == 5:
                break
        del batch
    elif kind == 3:  # never started
        pass
    if kind == 4:  # never started, and dropped without close()
        del loader
        return
    loader.close()


def _settle(pid: int, want_fds: list[str], timeout: float = 10.0) -> tuple[list[str], list[str]]:
    """Wait until the daemon holds ``want_fds`` and no ring (closes are asynchronous: a
    connection's teardown, the liveness monitor's next tick); returns what it holds."""
    deadline = time.monotonic() + timeout
    while True:
        fds, maps = _fds(pid), _beton_maps(pid)
        if (fds == want_fds and not maps) or time.monotonic() > deadline:
            return fds, maps
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_thousand_short_streams_leave_no_ring_fd_or_memory_behind(
    daemon_factory, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and no reference cycle, in this process or in the daemon, whose collector is off
    (``helpers.cycles``): a client that hangs up with notices in flight used to leave its
    stream in cycles in the daemon, through the error that ended it (gRPC's abort, the pump's
    settled future, the stream's stored abort)."""
    monkeypatch.setenv("BETON_TEST_GC_REPORT", str(short_tmp / "gc-report"))
    d = daemon_factory([_tiny(short_tmp / "tiny.beton")])
    for i in range(WARMUP):
        _cycle(d.address, i)
    d.cyclic_garbage()  # the baseline: start-up and warm-up may leave some
    gc.collect()  # only for the baseline: the cycles below must not need it
    gc.disable()
    try:
        # Between streams the daemon holds no ring; its other descriptors are its baseline.
        deadline = time.monotonic() + 10
        while _beton_maps(d.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        base_fds, base_rss = _fds(d.pid), rss_mb(d.pid)
        assert not _beton_maps(d.pid)
        me = os.getpid()
        my_fds, my_maps = _fds(me), _beton_maps(me)
        for i in range(WARMUP, WARMUP + CYCLES):
            _cycle(d.address, i)
        fds, maps = _settle(d.pid, base_fds)
        rss = rss_mb(d.pid)
        assert not maps, f"closed rings still mapped in the daemon: {sorted(set(maps))}"
        assert fds == base_fds, (
            f"daemon descriptors: {len(base_fds)} before, {len(fds)} after; new: "
            f"{sorted(set(fds) - set(base_fds))}"
        )
        assert rss <= base_rss + RSS_SLACK_MB, f"daemon RSS {base_rss:.0f} -> {rss:.0f} MB"
        deadline = time.monotonic() + 10
        while _fds(me) != my_fds and time.monotonic() < deadline:  # grpc closes sockets late
            time.sleep(0.05)
        assert _beton_maps(me) == my_maps == []
        assert _fds(me) == my_fds, sorted(set(_fds(me)) ^ set(my_fds))
        cyclic = cyclic_garbage()
        assert not cyclic, f"this process's streams left reference cycles: {cyclic}"
    finally:
        gc.enable()
    assert not d.stats().streams  # nothing left open on the daemon either
    # Per stream, not once: a lazy import's frames (``import torch`` on a first compile) can
    # hold what their callers held, once per process.
    cyclic = {name: n for name, n in d.cyclic_garbage().items() if n >= PER_STREAM}
    assert not cyclic, f"the daemon's streams left reference cycles: {cyclic}"


def test_ring_close_unmaps_now_or_with_its_last_view(tmp_path: Path) -> None:
    """The mapping and its descriptor go at ``close``, or with the last view still held by
    someone (an engine worker), by reference counting: no garbage collection needed."""
    layout = slot_layout([("x", (4,), "uint8")], 2)

    def mapped() -> list[str]:
        with open(f"/proc/{os.getpid()}/maps") as f:
            return [line for line in f if str(tmp_path) in line]

    gc.disable()
    try:
        ring = ShmRing(layout, 2, "beton-0-ring-a", shm_dir=tmp_path)
        assert mapped()
        ring.close()
        assert not mapped() and not (tmp_path / "beton-0-ring-a").exists()

        ring = ShmRing(layout, 2, "beton-0-ring-b", shm_dir=tmp_path)
        view = ring.host_views(ring.acquire() or 0)[0]
        view[:] = 7
        ring.close()  # a worker still writes into a cancelled batch: the view stays valid
        assert view.sum() == 7 * view.size and mapped()
        del view
        assert not mapped()
    finally:
        gc.enable()


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (a grpc batch: a pool buffer; shm: the ring's view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("ending", ["close", "break", "drop"])
def test_a_finished_stream_is_freed_without_the_garbage_collector(
    daemon_factory, short_tmp: Path, transport: str, ending: str
) -> None:
    """A served Loader's stream, closed, left mid-epoch or dropped, is freed by reference
    counting: its batch buffers and its gRPC call do not wait for a collection.

    A grpc stream used to be two reference cycles: the stream and its decoder (through the
    decoder's ``allocate`` callback, a bound method of the stream), and the call's final
    ``RpcError`` (the call object itself) whose traceback's frames held the call. Each kept the
    stream's batch buffers (up to its credits + 1 whole batches) until the trainer's next full
    collection, which in a large process comes rarely.
    """
    d = daemon_factory([_tiny(short_tmp / "tiny.beton")])
    with _loader(d.address, transport) as warm:  # lazy imports, the daemon's plan
        _read(warm, 2)
    gc.collect()
    gc.disable()
    try:
        loader = Loader(  # numpy outputs (no ToTensor): a batch's memory can be followed
            "tiny",
            BATCH,
            server=d.address,
            transport=transport,
            batches_ahead=2,
            spawn=False,
            pipelines={"label": [IntDecoder()], "pix": [NDArrayDecoder()]},
        )
        it = iter(loader)
        for index in range(3):
            batch = next(it)
            _check(batch, loader.last_sample_ids, index)
        root = _root(batch[1])
        assert root.nbytes >= batch[1].nbytes  # the batch's own memory, not a copy of it
        buffer = weakref.ref(root)
        del root
        del batch
        if ending == "break":
            it = None  # the epoch is left mid-way (its iterator dropped), ...
        if ending != "drop":
            loader.close()  # ... then the Loader closed; "drop": neither, both dropped
        del it, loader
        time.sleep(0.3)  # the call's end reaches its reader thread
        assert buffer() is None, f"a {transport} batch buffer outlived its stream"
        ours = cyclic_garbage()
        assert not ours, f"freed only by the garbage collector: {ours}"
    finally:
        gc.enable()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_failed_epoch_leaves_no_cycle_in_the_client(
    daemon_factory, short_tmp: Path, fixtures_dir: Path, transport: str
) -> None:
    """An epoch that fails (a corrupt JPEG, the default budget of 0) and its closed Loader are
    freed by reference counting. The front end used to re-raise the final error from a frame
    that kept it as an argument: the error's traceback held that frame, the frame the error and
    the whole Loader (its stream, its ring or buffers), until a full garbage collection."""
    bad = short_tmp / "badjpg.beton"
    shutil.copy(fixtures_dir / "images_jpg.beton", bad)
    zero_samples(bad, [5])
    d = daemon_factory([bad])
    pipes = {"image": [CenterCropRGBImageDecoder((8, 8), 1.0)], "label": [IntDecoder()]}

    def failed_epoch() -> Loader:
        loader = Loader("badjpg", batch_size=8, pipelines=pipes, server=d.address,
                        transport=transport, spawn=False)  # fmt: skip
        with pytest.raises(PipelineError, match=r"sample 5\b"):
            for _ in loader:
                pass
        return loader

    # Warm-up: the first Loader of a process imports torch lazily, and that import leaves
    # cycles of its own that hold its frames, whose callers' frames held that Loader.
    failed_epoch().close()
    assert_freed_by_refcount(failed_epoch, "the Loader of a failed epoch")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_daemon_lost_for_good_leaves_no_cycle_in_the_client(
    daemon_factory, short_tmp: Path, transport: str
) -> None:
    """A daemon killed mid-epoch and never back: once the reconnection budget is spent, the
    Loader's ``ServerUnavailable`` and the closed Loader are freed by reference counting.

    The retry loop used to keep the last attempt's error in a local while raising its own:
    that error's traceback held the loop's frame (and the frames of the attempts), the frame
    held the error, and the pair held what those frames held until a collection."""
    policy = RetryPolicy(budget_s=0.5, initial_s=0.05, max_s=0.1)

    def lost_epoch(d: Any) -> Loader:
        loader = Loader("tiny", batch_size=BATCH,
                        serve=ServeOptions(server=d.address, transport=transport, spawn=False,
                                           reconnect=policy))  # fmt: skip
        with pytest.raises(ServerUnavailable, match="gave up after"):
            # Over shm, the rest of the epoch may be in the ring already: the next one fails.
            for epoch in range(3):
                for index, batch in enumerate(loader):
                    _check(batch, loader.last_sample_ids, index)
                    if epoch == 0 and index == 1:
                        d.stop(signal.SIGKILL)
        return loader

    data = _tiny(short_tmp / "tiny.beton")
    lost_epoch(daemon_factory([data])).close()  # warm-up (see the failed-epoch test)
    d = daemon_factory([data])
    assert_freed_by_refcount(lambda: lost_epoch(d), "the Loader of a lost daemon")
