"""Work sharing between identical streams, with fake produce/free callables."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
from beton_serve.engine.sharing import (
    BatchTimeoutError,
    Consumer,
    SharedBatch,
    SharedProducer,
    ShareKey,
    SharingRegistry,
)
from beton_serve.errors import BetonError, SpecError

BATCH = 8


@dataclass
class Slot:
    epoch: int
    index: int
    ids: np.ndarray  # the batch's sample ids: what a real slot's contents depend on
    freed: bool = False


def expected_ids(epoch: int, index: int, n_samples: int) -> np.ndarray:
    """A deterministic per-epoch permutation, as a seeded RANDOM order would give."""
    perm = np.random.default_rng(1234 + epoch).permutation(n_samples)
    return perm[index * BATCH : (index + 1) * BATCH]


@dataclass
class FakeEngine:
    """Produces batches into 'slots' and counts decoded samples, like the daemon's produce."""

    n_samples: int
    capacity: int | None = None  # a ring size, to check the group stays within it
    decoded: int = 0
    produced: list[tuple[int, int]] = field(default_factory=list)
    freed: list[Slot] = field(default_factory=list)
    live: int = 0
    peak_live: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def produce(self, epoch: int, index: int) -> Slot:
        ids = expected_ids(epoch, index, self.n_samples)
        with self.lock:
            self.decoded += len(ids)
            self.produced.append((epoch, index))
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)
            if self.capacity is not None and self.live > self.capacity:
                raise AssertionError(f"ring overflow: {self.live} slots in use")
        return Slot(epoch, index, ids)

    def free(self, slot: Slot) -> None:
        with self.lock:
            if slot.freed:
                raise AssertionError(f"slot {slot.epoch, slot.index} freed twice")
            slot.freed = True
            self.freed.append(slot)
            self.live -= 1


def drain(c: Consumer[Slot], got: list[tuple[int, int]], n_samples: int) -> None:
    """Read a consumer to its stop, checking each batch's contents and releasing it."""
    while (b := c.next(timeout=10)) is not None:
        h = b.handle
        if h.freed:
            raise AssertionError("got a freed slot")
        if (h.epoch, h.index) != (b.epoch, b.index):
            raise AssertionError("slot does not hold the batch asked for")
        if not np.array_equal(h.ids, expected_ids(b.epoch, b.index, n_samples)):
            raise AssertionError("wrong contents")
        got.append((b.epoch, b.index))
        c.release(b)


def run_threads(targets: list, names: str = "beton-test") -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t), name=f"{names}-{i}") for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]


def test_four_consumers_decode_one_epoch_once() -> None:
    n_samples, bpe = 80, 10
    eng = FakeEngine(n_samples)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=bpe, max_lag=1000
    )
    consumers = [group.attach(0, 0, stop=(1, 0)) for _ in range(4)]
    assert all(c.shared for c in consumers)
    got: list[list[tuple[int, int]]] = [[] for _ in consumers]
    run_threads(
        [lambda c=c, g=g: drain(c, g, n_samples) for c, g in zip(consumers, got, strict=True)]
    )
    every = [(0, i) for i in range(bpe)]
    assert got == [every] * 4  # every consumer, every batch, in order
    assert eng.decoded == n_samples  # 1x the epoch, not 4x
    assert sorted(eng.produced) == every
    assert len(eng.freed) == bpe and eng.live == 0  # each slot freed exactly once
    st = group.stats()
    assert (st.produced, st.freed, st.live, st.detached, st.produced_private) == (bpe, bpe, 0, 0, 0)
    for c in consumers:
        assert c.finished and c.next() is None
        c.close()
    assert group.stats().consumers == 0


def test_slot_is_freed_only_when_the_last_consumer_releases() -> None:
    eng = FakeEngine(80)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=10, max_lag=5
    )
    a, b, c = (group.attach() for _ in range(3))
    ba, bb = a.next(), b.next()
    assert ba is not None and bb is not None
    assert ba.handle is bb.handle and ba.shared and len(eng.produced) == 1
    a.release(ba)
    b.release(bb)
    assert not ba.handle.freed  # c has not read it yet
    bc = c.next()
    assert bc is not None and bc.handle is ba.handle
    c.release(bc)
    assert ba.handle.freed and eng.freed == [ba.handle]
    with pytest.raises(BetonError, match="not held"):
        c.release(bc)
    for x in (a, b, c):
        x.close()


def test_slow_consumer_is_detached_and_the_others_never_wait() -> None:
    n_samples, bpe, max_lag = 160, 20, 3
    eng = FakeEngine(n_samples, capacity=max_lag + 4)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=bpe, max_lag=max_lag
    )
    fast = [group.attach(0, 0, stop=(1, 0)) for _ in range(3)]
    slow = group.attach(0, 0, stop=(1, 0))
    first = slow.next()  # the slow trainer holds batch 0 while it "trains" for a long time
    assert first is not None and first.shared
    go = threading.Event()
    fast_got: list[list[tuple[int, int]]] = [[] for _ in fast]
    slow_got: list[tuple[int, int]] = [(first.epoch, first.index)]
    fast_done: list[bool] = []

    def fast_round_robin() -> None:
        # The fast trainers run in step (one thread, round robin), so only the slow one lags.
        while not all(c.finished for c in fast):
            for c, out in zip(fast, fast_got, strict=True):
                x = c.next(timeout=10)
                assert x is not None and not x.handle.freed
                assert np.array_equal(x.handle.ids, expected_ids(0, x.index, n_samples))
                out.append((x.epoch, x.index))
                c.release(x)

    def slow_run() -> None:
        if not go.wait(20):
            raise AssertionError("the fast consumers never finished: they waited for the slow one")
        fast_done.append(True)
        if first.handle.freed:
            raise AssertionError("a batch the slow consumer holds was freed under it")
        slow.release(first)
        drain(slow, slow_got, n_samples)

    def fast_all() -> None:
        fast_round_robin()
        go.set()

    run_threads([fast_all, slow_run])
    every = [(0, i) for i in range(bpe)]
    assert fast_done == [True]
    assert fast_got == [every] * 3
    assert slow_got == every  # the slow one still gets every batch, in order
    assert slow.detached and not slow.shared
    assert all(c.shared for c in fast)
    st = group.stats()
    assert st.detached == 1 and st.produced == bpe
    # Detached at position 1, the slow consumer produced the other batches itself.
    assert st.produced_private == bpe - 1
    assert eng.decoded == (2 * bpe - 1) * BATCH
    assert eng.live == 0 and st.live == 0
    assert eng.peak_live <= max_lag + 4  # the ring never overflowed
    for c in [*fast, slow]:
        c.close()


def test_lag_is_checked_deterministically() -> None:
    eng = FakeEngine(800)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=100, max_lag=2
    )
    lead, lag = group.attach(), group.attach()
    taken = []
    for _ in range(3):  # lead at 3, lag at 0: lag = 3 - 0 > 2 only after the third
        b = lead.next()
        assert b is not None
        taken.append(b)
        lead.release(b)
    assert lag.detached and group.stats().live == 0  # nobody holds batches 0..2 any more
    assert all(b.handle.freed for b in taken)
    b = lag.next()
    assert b is not None and (b.epoch, b.index) == (0, 0) and not b.shared
    lag.release(b)
    assert b.handle.freed
    assert lag.position == (0, 1)
    lead.close()
    lag.close()


def test_positions_span_epochs() -> None:
    eng = FakeEngine(24)  # 3 batches per epoch
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=3, max_lag=10
    )
    a, b = group.attach(1, 2), group.attach(1, 2, stop=(3, 0))
    got_a, got_b = [], []
    for _ in range(5):
        x = a.next()
        assert x is not None
        got_a.append((x.epoch, x.index))
        a.release(x)
    drain(b, got_b, 24)
    assert got_a == [(1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert got_b == [(1, 2), (2, 0), (2, 1), (2, 2)]
    assert eng.produced == got_a  # shared: produced once each
    a.close()
    b.close()
    assert eng.live == 0


def test_late_joiner_policy() -> None:
    eng = FakeEngine(800)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=100, max_lag=4
    )
    lead = group.attach()
    held = []
    for _ in range(6):  # lead at 6; it keeps batches 3..5 unreleased
        b = lead.next()
        assert b is not None
        if b.index < 3:
            lead.release(b)
        else:
            held.append(b)
    # Within max_lag behind the leader: shares from its own position.
    j = group.attach(0, 3)
    assert j.shared
    got = [j.next() for _ in range(3)]
    assert all(x is not None and x.shared for x in got)
    assert [x.handle for x in got if x] == [h.handle for h in held]  # the live slots, not copies
    # Batches the group had freed are produced again for a joiner that needs them.
    k = group.attach(0, 2)
    assert k.shared
    kb = k.next()
    assert kb is not None and kb.index == 2 and kb.shared
    assert eng.produced.count((0, 2)) == 2
    # Too far behind: a private stream from its position; the group is unaffected.
    far = group.attach(0, 0)
    assert not far.shared and not far.detached
    # Ahead of the slowest member by more than max_lag: private too (it would detach others).
    ahead = group.attach(0, 9)
    assert not ahead.shared
    fb = far.next()
    assert fb is not None and fb.index == 0 and not fb.shared
    far.release(fb)
    assert group.stats().joined_private == 2 and group.stats().detached == 0
    # A joiner whose range is empty is finished at once.
    done = group.attach(0, 5, stop=(0, 5))
    assert done.finished and done.next() is None
    for c in (lead, j, k, far, ahead, done):
        c.close()
    assert eng.live == 0


def test_produce_failure_reaches_every_consumer_then_retries() -> None:
    calls = {"n": 0}
    eng = FakeEngine(80)

    def flaky(epoch: int, index: int) -> Slot:
        calls["n"] += 1
        if index == 1 and calls["n"] == 2:
            raise OSError("disk went away")
        return eng.produce(epoch, index)

    group: SharedProducer[Slot] = SharedProducer(flaky, eng.free, batches_per_epoch=10, max_lag=5)
    a, b = group.attach(), group.attach()
    for c in (a, b):
        x = c.next()
        assert x is not None
        c.release(x)
    with pytest.raises(OSError, match="disk"):
        a.next()
    assert a.position == (0, 1)  # not advanced
    with pytest.raises(OSError, match="disk"):
        b.next()  # the same failure for every consumer that reaches the batch
    assert b.position == (0, 1)
    x = a.next()  # the failed entry is gone: a retries
    assert x is not None and x.index == 1
    y = b.next()
    assert y is not None and y.handle is x.handle
    a.release(x)
    b.release(y)
    a.close()
    b.close()
    assert eng.live == 0 and eng.produced.count((0, 1)) == 1


def test_waiting_for_another_threads_produce_times_out_cleanly() -> None:
    eng = FakeEngine(80)
    entered, unblock = threading.Event(), threading.Event()

    def slow_produce(epoch: int, index: int) -> Slot:
        entered.set()
        if not unblock.wait(10):
            raise AssertionError("never unblocked")
        return eng.produce(epoch, index)

    group: SharedProducer[Slot] = SharedProducer(
        slow_produce, eng.free, batches_per_epoch=10, max_lag=5
    )
    a, b = group.attach(), group.attach()
    out: list[SharedBatch[Slot] | None] = []
    t = threading.Thread(target=lambda: out.append(a.next()), name="beton-test-producer")
    t.start()
    assert entered.wait(10)
    with pytest.raises(BatchTimeoutError):
        b.next(timeout=0.05)
    assert b.position == (0, 0)
    unblock.set()
    t.join(10)
    bb = b.next(timeout=5)
    assert out[0] is not None and bb is not None and bb.handle is out[0].handle
    assert eng.produced == [(0, 0)]
    a.close()
    b.close()  # close releases what b still holds
    assert eng.live == 0


def test_close_releases_everything_and_registry_drops_group() -> None:
    eng = FakeEngine(800)
    reg: SharingRegistry[Slot] = SharingRegistry(max_lag=2)
    key = ShareKey.build(
        dataset="d", pipeline={"img": [{"op": "Decode"}]}, seed=0, order="RANDOM",
        batch_size=BATCH, drop_last=True,
    )  # fmt: skip
    kw = {"produce": eng.produce, "free": eng.free, "batches_per_epoch": 100}
    a = reg.attach(key, **kw)
    b = reg.attach(key, **kw)
    assert a._group is b._group and len(reg.groups()) == 1
    xs = [a.next() for _ in range(2)]
    assert b.next() is not None
    for _ in range(3):  # a runs ahead: b (at 1, holding batch 0) gets detached
        x = a.next()
        assert x is not None
        a.release(x)
    assert b.detached
    p = b.next()  # a private batch
    assert p is not None and not p.shared
    a.close()  # releases xs; the group is empty and leaves the registry
    assert reg.groups() == {}
    assert all(x is not None and not x.handle.freed for x in xs[:1])  # b still holds batch 0
    b.close()  # releases its shared batch 0 and its private batch 1
    assert eng.live == 0
    b.close()  # idempotent
    with pytest.raises(BetonError, match="closed"):
        b.next()
    c = reg.attach(key, **kw)  # a fresh group
    assert c._group is not a._group and c.shared
    with pytest.raises(SpecError, match="batches per epoch"):
        reg.attach(key, produce=eng.produce, free=eng.free, batches_per_epoch=99)
    c.close()
    assert reg.groups() == {}


def test_share_key() -> None:
    base = {
        "dataset": "imagenet",
        "seed": 3,
        "order": "RANDOM",
        "batch_size": 256,
        "drop_last": True,
    }
    k1 = ShareKey.build(pipeline={"b": [1], "a": {"x": 1, "y": 2}}, **base)
    k2 = ShareKey.build(pipeline={"a": {"y": 2, "x": 1}, "b": [1]}, **base)
    assert k1 == k2 and hash(k1) == hash(k2)  # key order does not matter
    assert k1 != ShareKey.build(pipeline={"b": [2], "a": {"x": 1, "y": 2}}, **base)
    assert k1 != ShareKey.build(pipeline=k1.pipeline, **{**base, "seed": 4})
    assert k1 != ShareKey.build(pipeline=k1.pipeline, **{**base, "drop_last": False})
    # A budget-0 producer fails a batch in the worker for the whole group.
    assert k1 != ShareKey.build(pipeline=k1.pipeline, bad_sample_budget=3, **base)
    d0 = ShareKey.build(pipeline=k1.pipeline, distributed=True, rank=0, world_size=2, **base)
    d1 = ShareKey.build(pipeline=k1.pipeline, distributed=True, rank=1, world_size=2, **base)
    assert d0 != d1 and d0 != k1
    # rank/world are irrelevant when not distributed
    assert k1 == ShareKey.build(pipeline=k1.pipeline, rank=5, world_size=9, **base)
    i1 = ShareKey.build(pipeline=k1.pipeline, indices=[1, 2, 3], **base)
    assert i1 == ShareKey.build(pipeline=k1.pipeline, indices=np.array([1, 2, 3]), **base)
    assert i1 != ShareKey.build(pipeline=k1.pipeline, indices=[1, 2, 4], **base)
    assert i1 != k1
    with pytest.raises(SpecError, match="JSON"):
        ShareKey.build(pipeline={"a": object()}, **base)


def test_validation() -> None:
    eng = FakeEngine(80)
    with pytest.raises(SpecError):
        SharedProducer(eng.produce, eng.free, batches_per_epoch=0, max_lag=1)
    with pytest.raises(SpecError):
        SharedProducer(eng.produce, eng.free, batches_per_epoch=5, max_lag=-1)
    with pytest.raises(SpecError):
        SharingRegistry(max_lag=-1)
    g: SharedProducer[Slot] = SharedProducer(eng.produce, eng.free, batches_per_epoch=5, max_lag=1)
    with pytest.raises(SpecError, match="out of range"):
        g.attach(0, 5)
    with pytest.raises(SpecError, match="out of range"):
        g.attach(-1, 0)
    with pytest.raises(SpecError, match="before the start"):
        g.attach(2, 0, stop=(1, 4))
    assert g.attach(0, 0, stop=(1, 0)).shared  # (epoch, 0) is a valid end


def test_many_consumers_many_epochs_stress() -> None:
    """8 consumers x 3 epochs on threads: exact order, each slot freed once, nothing leaks."""
    n_samples, bpe = 64, 8
    eng = FakeEngine(n_samples)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=bpe, max_lag=4
    )
    consumers = [group.attach(0, 0, stop=(3, 0)) for _ in range(8)]
    got: list[list[tuple[int, int]]] = [[] for _ in consumers]
    run_threads(
        [lambda c=c, g=g: drain(c, g, n_samples) for c, g in zip(consumers, got, strict=True)]
    )
    every = [(e, i) for e in range(3) for i in range(bpe)]
    assert got == [every] * 8
    st = group.stats()
    # Whatever the scheduling did, shared + private production covers exactly what was read.
    assert st.produced + st.produced_private == len(eng.produced)
    assert st.produced >= len(every)
    assert eng.live == 0 and st.live == 0
    for c in consumers:
        c.close()


# ------------------------------------------------------------------------------------------------
# SharedSource: the BatchSource look-alike the daemon's streams use
# ------------------------------------------------------------------------------------------------


@dataclass
class _Out:
    shape: tuple[int, ...]
    dtype: str


@dataclass
class _Plan:
    outputs: list[_Out]


class FakeSource:
    """A BatchSource stand-in: 'decodes' on a thread pool, writes ids into ``out``, counts."""

    def __init__(self, n_samples: int, batch_size: int, pool, counter: list[int]) -> None:
        self.n_samples, self.batch_size, self.pool, self.counter = (
            n_samples,
            batch_size,
            pool,
            counter,
        )
        self.plan = _Plan([_Out((2,), "int64")])
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n_samples // self.batch_size

    def close(self) -> None:
        self.closed = True

    def batch_ids(self, epoch: int, b: int) -> np.ndarray:
        perm = np.random.default_rng(99 + epoch).permutation(self.n_samples)
        return perm[b * self.batch_size : (b + 1) * self.batch_size]

    def submit(self, epoch, b, out, priority=1, *, slices=None):
        ids = self.batch_ids(epoch, b)
        with self.lock:
            self.counter[0] += len(ids)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if out is None:
            out = [np.empty((len(ids), 2), np.int64)]

        def run():
            out[0][: len(ids), 0] = ids
            out[0][: len(ids), 1] = epoch
            with self.lock:
                self.in_flight -= 1
            return [out[0][: len(ids)]]

        return self.pool.submit(run)


def _stream(src, epochs: int, ahead: int, got: list, started=None) -> None:
    """What a daemon stream does: submit in order into its own slots, keep `ahead` in flight."""
    from collections import deque

    slots = [[np.full((8, 2), -1, np.int64)] for _ in range(ahead)]
    for e in range(epochs):
        pending: deque = deque()
        for b in range(len(src)):
            if started is not None and (e, b) == (0, 1):
                started.wait(10)  # every stream has attached before anyone goes past batch 0
            if len(pending) == ahead:
                got.append(_take(pending.popleft()))
            slot = slots[b % ahead]
            pending.append((e, b, src.submit(e, b, slot), slot))
        while pending:
            got.append(_take(pending.popleft()))


def _take(p):
    e, b, fut, slot = p
    (arr,) = fut.result(10)
    assert arr.base is slot[0] or arr.base is slot[0].base or np.shares_memory(arr, slot[0])
    return e, b, arr[:, 0].copy(), bool(fut.decoded_here)


def test_shared_source_decodes_once_for_four_streams() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from beton_serve.engine.shared_source import SharedSource

    counter = [0]
    # Streams attach when they first submit; retain=2 keeps batch 0 for those that start later.
    reg = SharingRegistry(max_lag=1000, retain=2)
    key = ShareKey.build(
        dataset="d", pipeline={}, seed=1, order="RANDOM", batch_size=8, drop_last=True
    )
    started = threading.Barrier(4)
    with ThreadPoolExecutor(2, thread_name_prefix="beton-test-pool") as pool:
        sources = [FakeSource(96, 8, pool, counter) for _ in range(4)]
        shared = [SharedSource(s, reg, key) for s in sources]
        got: list[list] = [[] for _ in shared]
        run_threads(
            [
                lambda s=s, g=g: _stream(s, 2, 3, g, started)
                for s, g in zip(shared, got, strict=True)
            ]
        )
        for s in shared:
            s.close()
    ref = FakeSource(96, 8, None, [0])
    for g in got:
        assert [(e, b) for e, b, _, _ in g] == [(e, b) for e in range(2) for b in range(12)]
        for e, b, ids, _ in g:
            np.testing.assert_array_equal(ids, ref.batch_ids(e, b))
    # decoded once: the sources together decoded 2 epochs, and decoded_here marks each once
    assert counter[0] == 2 * 96
    assert sum(d for g in got for *_, d in g) == 2 * 12
    assert reg.groups() == {}
    assert all(s.max_in_flight <= 3 for s in sources)  # each source's own credit bound holds


def test_shared_source_detached_stream_keeps_its_position() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from beton_serve.engine.shared_source import SharedSource

    counter = [0]
    reg = SharingRegistry(max_lag=2)
    key = ShareKey.build(
        dataset="d", pipeline={}, seed=1, order="RANDOM", batch_size=8, drop_last=True
    )
    with ThreadPoolExecutor(2, thread_name_prefix="beton-test-pool") as pool:
        fast = SharedSource(FakeSource(96, 8, pool, counter), reg, key)
        slow = SharedSource(FakeSource(96, 8, pool, counter), reg, key)
        slot = [np.zeros((8, 2), np.int64)]
        first = slow.submit(0, 0, slot).result(10)
        got_fast: list = []
        _stream(fast, 1, 2, got_fast)  # the fast one runs the whole epoch without waiting
        assert slow.detached and fast.shared
        got_slow = [(0, 0, first[0][:, 0].copy(), True)]
        for b in range(1, 12):
            (arr,) = slow.submit(0, b, slot).result(10)
            got_slow.append((0, b, arr[:, 0].copy(), True))
        # alone now: the stream leaves the group and decodes straight into its slot
        fast.close()
        assert slow.solo
        before = counter[0]
        (arr,) = slow.submit(1, 0, slot).result(10)
        assert arr[0, 1] == 1 and np.shares_memory(arr, slot[0])
        assert counter[0] == before + 8 and not slow.shared
        slow.close()
    ref = FakeSource(96, 8, None, [0])
    for g in (got_fast, got_slow):
        assert [b for _, b, _, _ in g] == list(range(12))
        for e, b, ids, _ in g:
            np.testing.assert_array_equal(ids, ref.batch_ids(e, b))
    assert reg.groups() == {}
    with pytest.raises(BetonError, match="closed"):
        slow.submit(1, 1, slot)


def _real_sources(n: int):
    """A compiled fake-image plan over ``n`` samples, ``make(engine) -> BatchSource`` (batch 8,
    RANDOM, seed 5, 3 ahead) and the share key of such sources."""
    from beton_serve.engine import BatchSource, OrderOption
    from beton_serve.pipeline import compile_pipelines
    from helpers.fake_pipeline import AddIndex, AddOne, FakeImageDecoder, FakeReader

    plan = compile_pipelines(
        FakeReader(n=n),
        {"image": [FakeImageDecoder(), AddOne()], "label": [AddIndex()]},
        batch_size=8,
    )

    def make(eng):
        return BatchSource(
            engine=eng, plan=plan, order=OrderOption.RANDOM, batch_size=8, seed=5,
            drop_last=False, batches_ahead=3,
        )  # fmt: skip

    key = ShareKey.build(
        dataset="fake", pipeline={"p": 1}, seed=5, order="RANDOM", batch_size=8, drop_last=False
    )
    return plan, make, key


@pytest.mark.slow
def test_shared_source_on_the_real_engine() -> None:
    """Four streams over the real Engine/BatchSource: bit-identical to an unshared stream, 1x decode."""
    from beton_serve.engine import Engine
    from beton_serve.engine.shared_source import SharedSource

    plan, make, key = _real_sources(48)
    reg = SharingRegistry(max_lag=1000, retain=12)  # streams start at slightly different times
    with Engine(2) as eng:
        ref = make(eng)
        expected = [
            [a.copy() for a in ref.submit(e, b).result(90)] for e in range(2) for b in range(6)
        ]
        shared = [SharedSource(make(eng), reg, key) for _ in range(4)]
        outs: list[list] = [[] for _ in shared]

        def stream(src, out):
            slot = [np.zeros((8, *o.shape), o.dtype) for o in plan.outputs]
            for e in range(2):
                for b in range(len(src)):
                    fut = src.submit(e, b, slot, priority=0)
                    arrays = fut.result(60)
                    out.append(([a.copy() for a in arrays], fut.decoded_here))

        run_threads([lambda s=s, o=o: stream(s, o) for s, o in zip(shared, outs, strict=True)])
        for s in shared:
            s.close()
    for out in outs:
        assert len(out) == len(expected)
        for (arrays, _), exp in zip(out, expected, strict=True):
            for a, x in zip(arrays, exp, strict=True):
                np.testing.assert_array_equal(a, x)
    assert sum(d for out in outs for _, d in out) == len(expected)  # each batch decoded once
    assert reg.groups() == {}


def test_retained_batches_serve_late_joiners_without_decoding_again() -> None:
    eng = FakeEngine(800)
    group: SharedProducer[Slot] = SharedProducer(
        eng.produce, eng.free, batches_per_epoch=100, max_lag=10, retain=2
    )
    a = group.attach()
    bs = [a.next() for _ in range(4)]
    for b in bs:
        assert b is not None
        a.release(b)
    # Batches 2 and 3 are retained, 0 and 1 (the oldest) were freed.
    assert [b.handle.freed for b in bs if b] == [True, True, False, False]
    st = group.stats()
    assert (st.retained, st.live, st.freed) == (2, 2, 2)
    late = group.attach(0, 2)
    assert late.shared and group.stats().retained == 0  # it holds them now
    x = late.next()
    assert x is not None and x.handle is bs[2].handle  # reused, not decoded again
    late.release(x)  # retained again: the leader is past it, nobody needs it
    assert group.stats().retained == 1 and not x.handle.freed
    assert eng.produced == [(0, i) for i in range(4)]
    a.close()
    late.close()  # the last consumer leaves: retained batches are freed
    assert eng.live == 0 and group.stats().live == 0
    with pytest.raises(SpecError):
        SharedProducer(eng.produce, eng.free, batches_per_epoch=5, max_lag=1, retain=-1)
    with pytest.raises(SpecError):
        SharingRegistry(max_lag=1, retain=-1)


def test_read_ahead_does_not_count_as_lag() -> None:
    """A stream that filled its read-ahead is level with an identical one just starting."""
    eng = FakeEngine(800)
    reg: SharingRegistry[Slot] = SharingRegistry(max_lag=2)
    key = ShareKey.build(
        dataset="d", pipeline={}, seed=0, order="RANDOM", batch_size=BATCH, drop_last=True
    )
    kw = {"produce": eng.produce, "free": eng.free, "batches_per_epoch": 100, "ahead": 8}
    a = reg.attach(key, **kw)
    held = [a.next() for _ in range(8)]  # its reader has consumed nothing yet
    b = reg.attach(key, **kw)
    assert b.shared  # position 8 - ahead 8 = progress 0: level with a joiner at 0
    got = [b.next() for _ in range(8)]
    assert [x.handle for x in got if x] == [x.handle for x in held if x]  # shared, not redone
    assert not a.detached and not b.detached
    # Without read-ahead, the same positions are 8 apart: the joiner is refused.
    c = reg.attach(key, produce=eng.produce, free=eng.free, batches_per_epoch=100)
    assert c.shared  # b and a have progress 0, so c at 0 is level too
    d_eng = FakeEngine(800)
    g: SharedProducer[Slot] = SharedProducer(
        d_eng.produce, d_eng.free, batches_per_epoch=100, max_lag=2
    )
    lead = g.attach()
    for _ in range(8):
        assert lead.next() is not None
    assert not g.attach().shared
    for x in (a, b, c, lead):
        x.close()


def test_each_consumer_produces_and_frees_with_its_own_callables() -> None:
    """The registry's group uses the producing consumer's callables, not the first attacher's."""
    e1, e2 = FakeEngine(800), FakeEngine(800)
    reg: SharingRegistry[Slot] = SharingRegistry(max_lag=1)
    key = ShareKey.build(
        dataset="d", pipeline={}, seed=0, order="RANDOM", batch_size=BATCH, drop_last=True
    )
    a = reg.attach(key, produce=e1.produce, free=e1.free, batches_per_epoch=100)
    b = reg.attach(key, produce=e2.produce, free=e2.free, batches_per_epoch=100)
    for _ in range(3):
        x = a.next()
        assert x is not None
        a.release(x)
    assert b.detached  # 3 behind with max_lag 1
    y = b.next()  # private: b's own engine decodes it
    assert y is not None and not y.shared
    assert e1.produced == [(0, 0), (0, 1), (0, 2)] and e2.produced == [(0, 0)]
    b.release(y)
    assert e2.freed == [y.handle] and e2.live == 0
    a.close()
    b.close()
    assert e1.live == 0


def test_a_lone_stream_decodes_straight_into_its_slot() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from beton_serve.engine.shared_source import SharedSource

    counter = [0]
    reg = SharingRegistry(max_lag=8, retain=4)
    key = ShareKey.build(
        dataset="d", pipeline={}, seed=1, order="RANDOM", batch_size=8, drop_last=True
    )
    with ThreadPoolExecutor(2, thread_name_prefix="beton-test-pool") as pool:
        src = FakeSource(96, 8, pool, counter)
        alone = SharedSource(src, reg, key)
        slot = [np.zeros((8, 2), np.int64)]
        fut = alone.submit(0, 0, slot)
        (arr,) = fut.result(10)
        assert alone.solo and reg.groups() == {}  # no group, no copy: the source's own future
        assert getattr(fut, "decoded_here", True) and np.shares_memory(arr, slot[0])
        # An identical stream opens: both move to the group at their next submit.
        other = SharedSource(FakeSource(96, 8, pool, counter), reg, key)
        assert not alone.solo and reg.members(key) == 2
        a1 = alone.submit(0, 1, slot)
        a1.result(10)
        assert alone.shared and len(reg.groups()) == 1
        other_slot = [np.zeros((8, 2), np.int64)]
        o1 = other.submit(0, 1, other_slot)  # joins at its own position and reuses batch 1
        o1.result(10)
        assert a1.decoded_here and not o1.decoded_here
        other.close()
        assert reg.members(key) == 1
        alone.submit(0, 2, slot).result(10)  # alone again: back to solo
        assert reg.groups() == {} and not alone.shared
        alone.close()
        assert reg.members(key) == 0
    assert counter[0] == 3 * 8


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_member_that_discards_a_shared_batch_never_cancels_it_for_the_others() -> None:
    """A stream that closes (its client killed) or resumes elsewhere cancels the batches it
    submitted and will not publish: the tasks its futures expose. The group's batch is another
    member's too, so that must not cancel its decode: the other member's stream failed with
    'internal error: CancelledError' (session 23's flaky SIGKILL test)."""
    from beton_serve.engine import Engine
    from beton_serve.engine.shared_source import SharedSource

    plan, make, key = _real_sources(32)
    reg = SharingRegistry(max_lag=8, retain=0)
    gate = threading.Event()
    with Engine(1) as eng:
        expected = [a.copy() for a in make(eng).submit(0, 0).result(60)]
        gate_task = eng.submit(gate.wait, 30, priority=0)  # nothing runs until the gate opens
        leaver, stayer = SharedSource(make(eng), reg, key), SharedSource(make(eng), reg, key)
        slots = [[np.zeros((8, *o.shape), o.dtype) for o in plan.outputs] for _ in range(2)]
        mine = leaver.submit(0, 0, slots[0])  # produced for the group, queued behind the gate
        theirs = stayer.submit(0, 0, slots[1])  # the same group batch
        assert mine.decoded_here and not theirs.decoded_here
        # What a stream does with a batch it will not publish (Stream.abandon_when_done):
        for task in getattr(mine, "tasks", ()):
            task.future.cancel()
        mine.cancel()
        leaver.close()
        gate.set()
        gate_task.future.result(30)
        arrays = theirs.result(60)  # was: CancelledError
        for a, x in zip(arrays, expected, strict=True):
            np.testing.assert_array_equal(a, x)
        stayer.promote(theirs)  # promoting a shared batch still reaches the group's tasks
        stayer.close()
    assert reg.groups() == {}
