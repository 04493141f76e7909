"""Prefetched batches fill the pool: a consumer alone on many workers gets all of them.

Before, a prefetched batch ran as one task, so at most ``batches_ahead`` (a Loader) or the
credits (a daemon stream) of the workers ever worked at once: 3 of 16. Now each consumer
registers its in-flight batches with the engine and a prefetched batch runs in
``ceil(num_workers / total demand)`` slices; the output does not depend on the split.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from beton_serve.daemon._stream import Stream
from beton_serve.engine import Engine
from beton_serve.loader import Loader, OrderOption
from beton_serve.pipeline import PlanCache
from beton_serve.transport import ShmFactory, ShmNamer
from beton_wire.slots import slot_layout
from helpers.fake_pipeline import AddIndex, AddOne, FakeReader, fake_image

pytestmark = pytest.mark.timeout(60)

_CACHE = PlanCache()


def test_prefetch_slices_follow_the_registered_demand() -> None:
    with Engine(8) as eng:
        assert eng.prefetch_slices() == 1  # nobody registered: whole batches, as before
        a = eng.hold_demand(3)
        assert eng.prefetch_slices() == 3  # ceil(8 / 3)
        b = eng.hold_demand(3)
        assert eng.prefetch_slices() == 2  # ceil(8 / 6)
        b.update(5)
        assert eng.prefetch_slices() == 1  # 8 batches in flight cover 8 workers
        b.release()
        b.release()  # idempotent: must not drop a's count
        b.update(100)  # no effect once released
        assert eng.prefetch_slices() == 3
        a.release()
        assert eng.prefetch_slices() == 1
    with Engine(2) as eng:
        d = eng.hold_demand(3)
        assert eng.prefetch_slices() == 1  # the 2-core default keeps whole batches
        d.release()


class _Sleepy(AddOne):
    """A Python op run in the workers: sleeps, counts how many run at once, adds one."""

    lock = threading.Lock()
    active = 0
    peak = 0

    def generate_code(self):
        op = type(self)

        def sleepy(inp, dst):
            with op.lock:
                op.active += 1
                op.peak = max(op.peak, op.active)
            time.sleep(0.001 * inp.shape[0])  # work in proportion to the samples
            for i in range(inp.shape[0]):
                dst[i] = inp[i] + 1
            with op.lock:
                op.active -= 1
            return dst

        sleepy.python = True
        return sleepy


def _loader(workers: int, op: AddOne, seed: int, slices: int | None = None) -> Loader:
    """8 batches of 32 samples, 3 ahead, ``op`` on the images."""
    return Loader(
        FakeReader(n=256),
        batch_size=32,
        num_workers=workers,
        batches_ahead=3,
        order=OrderOption.RANDOM,
        seed=seed,
        slices=slices,
        pipelines={"image": [op], "label": [AddIndex()]},
        plan_cache=_CACHE,
    )


def _epoch(workers: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """One epoch's batches, and the most ops that ran at once after the first batch came (the
    first, waited for, is split over every worker anyway)."""
    ld = _loader(workers, _Sleepy(), seed=5)
    out = []
    with ld:
        for img, lab in ld:
            if not out:
                with _Sleepy.lock:
                    _Sleepy.peak = _Sleepy.active
            out.append((np.array(img), np.array(lab)))
    return out, _Sleepy.peak


def test_one_loader_on_eight_workers_keeps_them_busy_and_changes_no_output() -> None:
    ref, peak1 = _epoch(1)
    got, peak8 = _epoch(8)
    assert peak1 == 1
    # 3 batches ahead used to cap this at 3: whole prefetched batches, one worker each.
    assert peak8 >= 6, peak8
    assert len(got) == len(ref) == 8
    for (img, lab), (img_r, lab_r) in zip(got, ref, strict=True):
        np.testing.assert_array_equal(img, img_r)
        np.testing.assert_array_equal(lab, lab_r)


class _Recorder:
    """A stream's source that records the slices each submit asks for."""

    def __init__(self) -> None:
        self.slices: list[int | None] = []

    def submit(self, epoch, b, out, *, priority=1, slices=None, by_reference=False):
        self.slices.append(slices)
        return None

    def close(self) -> None:
        pass


def _stream(engine: Engine, source: _Recorder, factory: ShmFactory) -> Stream:
    layout = slot_layout([("label", (), "int64")], batch_size=4)
    ring = factory.create(layout, 6)
    return Stream(
        stream_id="s",
        dataset=None,  # type: ignore[arg-type]  # submit never touches it
        source=source,  # type: ignore[arg-type]
        ring=ring,
        layout=layout,
        outputs=[],
        engine=engine,
    )


def test_daemon_streams_register_their_credits_and_split_prefetch_by_them() -> None:
    with Engine(16) as eng:
        src_a, src_b = _Recorder(), _Recorder()
        factory = ShmFactory(ShmNamer())
        a, b = _stream(eng, src_a, factory), _stream(eng, src_b, factory)
        try:
            a.begin(4)
            a.submit(0, 0, 0, waiting=True)
            a.submit(0, 1, 1, waiting=False)
            assert src_a.slices == [None, 4]  # waited: the source's default; prefetch: 16 / 4
            b.begin(4)
            b.submit(0, 1, 1, waiting=False)
            assert src_b.slices == [2]  # two streams of 4 credits on 16 workers
            a.close()
            b.submit(0, 2, 2, waiting=False)
            assert src_b.slices == [2, 4]  # a's demand left with it
            b.begin(0)  # 0 credits: the whole ring (6 slots)
            b.submit(0, 3, 3, waiting=False)
            assert src_b.slices[-1] == 3  # ceil(16 / 6)
        finally:
            a.close()
            b.close()
        assert eng.prefetch_slices() == 1


def test_loaders_on_a_shared_engine_give_their_demand_back() -> None:
    """Epochs that end, are abandoned mid-way or are closed leave no demand behind on a
    shared engine, so later consumers are not starved of slices (120 cycles)."""
    import gc

    with Engine(8) as eng:
        for i in range(120):
            ld = Loader(
                FakeReader(n=64),
                batch_size=8,
                batches_ahead=3,
                engine=eng,
                pipelines={"image": [AddOne()], "label": [AddIndex()]},
                plan_cache=_CACHE,
            )
            it = iter(ld)
            next(it)
            if i % 3 == 0:
                ld.close()
            elif i % 3 == 1:
                del it
                gc.collect()
                ld.close()
            else:
                for _ in it:
                    pass
                ld.close()
        assert eng.prefetch_slices() == 1
        assert len(eng._demand) == 0


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_the_batch_a_consumer_still_holds_is_never_overwritten(ahead: int) -> None:
    """``next()`` hands batch ``b - 2``'s slot to batch ``b + ahead`` before it waits for ``b``:
    the previous batch (``b - 1``), which the consumer may still hold, keeps its contents
    while the loader runs ahead (slow consumer: the workers fill every free slot)."""
    ld = Loader(
        FakeReader(n=96),
        batch_size=4,
        num_workers=2,
        batches_ahead=ahead,
        order=OrderOption.RANDOM,
        seed=3,
        pipelines={"image": [AddOne()], "label": [AddIndex()]},
        plan_cache=_CACHE,
    )
    with ld:
        ids = ld.sample_order(0)
        prev = None
        for b, (img, lab) in enumerate(ld):
            want = ids[b * 4 : b * 4 + 4].astype(np.int64)
            np.testing.assert_array_equal(lab[:, 0], want * 1010)
            time.sleep(0.002)  # let the workers run ahead into every slot they may take
            if prev is not None:
                p_img, p_lab, p_want = prev
                np.testing.assert_array_equal(p_lab[:, 0], p_want * 1010)
                for i, sid in enumerate(p_want.tolist()):
                    np.testing.assert_array_equal(p_img[i], fake_image(sid) + 1)
            prev = (img, lab, want)


def test_tail_slices_split_the_last_batches_of_a_lone_consumer_of_long_tasks() -> None:
    """The end of an epoch: ``ceil(4 * workers / left)`` parts, at most ``4 * workers``, only
    where a worker would otherwise idle and a task is long enough to be worth splitting."""
    with Engine(2) as eng:
        d = eng.hold_demand(3)
        assert eng.tail_slices(1) == 1  # no task has run: nothing to judge their length by
        eng.tasks_done, eng.busy_s = 10, 1.0  # 100 ms a task (a RandomResizedCrop batch)
        got = [eng.tail_slices(k) for k in (1, 2, 3, 4, 7, 8, 9, 100)]
        assert got == [8, 4, 3, 2, 2, 1, 1, 1]
        assert eng.tail_slices(0) == 1
        eng.busy_s = 0.01  # 1 ms a task (a CIFAR batch): a part's fixed cost would dominate
        assert eng.tail_slices(1) == 1
        eng.busy_s = 1.0
        other = eng.hold_demand(3)  # another consumer's batches keep the workers busy
        assert eng.tail_slices(1) == 1
        other.release()
        assert eng.tail_slices(1) == 8
        d.release()
    with Engine(1) as eng:
        d = eng.hold_demand(3)
        eng.tasks_done, eng.busy_s = 10, 1.0
        assert eng.tail_slices(1) == 1  # one worker never idles while another works
        d.release()


class _PartSizes(AddOne):
    """A Python op that sleeps 1 ms per sample (tasks long enough for the tail split) and
    records how many samples each call got."""

    sizes: list[int] = []

    def generate_code(self):
        op = type(self)

        def parts(inp, dst):
            op.sizes.append(inp.shape[0])
            time.sleep(0.001 * inp.shape[0])
            for i in range(inp.shape[0]):
                dst[i] = inp[i] + 1
            return dst

        parts.python = True
        return parts


def _tail_run(workers: int, slices: int | None) -> tuple[list[tuple[np.ndarray, np.ndarray]], list]:
    """Two epochs of 8 batches of 32; the batches and each epoch's part sizes."""
    ld = _loader(workers, _PartSizes(), seed=11, slices=slices)
    out, sizes = [], []
    with ld:
        for _ in range(2):
            _PartSizes.sizes = []
            for img, lab in ld:
                out.append((np.array(img), np.array(lab)))
            sizes.append(list(_PartSizes.sizes))
    return out, sizes


def test_the_last_batches_of_an_epoch_run_in_parts_and_change_no_output() -> None:
    ref, ref_sizes = _tail_run(1, None)
    assert all(set(s) == {32} for s in ref_sizes)  # one worker: whole batches throughout
    got, sizes = _tail_run(2, None)
    whole, _ = _tail_run(2, 1)
    # The second epoch knows the tasks' length: its last batch runs in 8 parts of 4 samples.
    assert sizes[1].count(4) == 8, sizes[1]
    assert sum(sizes[1]) == 256
    assert len(got) == len(ref) == len(whole) == 16
    for (img, lab), (img_w, lab_w), (img_r, lab_r) in zip(got, whole, ref, strict=True):
        np.testing.assert_array_equal(img, img_r)
        np.testing.assert_array_equal(lab, lab_r)
        np.testing.assert_array_equal(img_w, img_r)
        np.testing.assert_array_equal(lab_w, lab_r)


def test_slices_1_keeps_whole_batches_at_the_end_of_an_epoch() -> None:
    _, sizes = _tail_run(2, 1)
    assert all(set(s) == {32} for s in sizes), sizes
