"""The in-process Loader on the fake reader: FFCV semantics, epochs, closing, resumption."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from beton_serve.engine import Engine
from beton_serve.errors import PipelineError, SpecError
from beton_serve.loader import Loader, OrderOption, TraversalOrder
from beton_serve.pipeline import PlanCache
from helpers.fake_pipeline import (
    AddIndex,
    AddOne,
    FakeImageDecoder,
    FakeReader,
    NumpyToTorch,
    fake_image,
)
from helpers.resumability import run_test_save_load_state

#: Compiled once for the whole module: the tests are about the Loader, not about numba.
CACHE = PlanCache()


def _loader(reader=None, **kw):
    kw.setdefault("plan_cache", CACHE)
    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    kw.setdefault("pipelines", {"image": [AddOne()], "label": [AddIndex()]})
    return Loader(reader or FakeReader(n=22), **kw)


def _beton_threads():
    return {t for t in threading.enumerate() if t.name.startswith("beton-") and t.is_alive()}


def test_epochs_order_and_len():
    with _loader(order=OrderOption.RANDOM, seed=1) as ld:
        assert len(ld) == 5  # 22 // 4, drop_last
        for epoch in range(2):
            ids = ld.sample_order(epoch)
            # Copies: a batch is valid until the next one is asked for (FFCV's contract).
            batches = [(np.array(img), np.array(lab)) for img, lab in ld]
            assert ld.next_epoch == epoch + 1
            assert len(batches) == 5
            for b, (img, lab) in enumerate(batches):
                want = ids[b * 4 : b * 4 + 4]
                np.testing.assert_array_equal(lab[:, 0], want.astype(np.int64) * 1010)
                for i, sid in enumerate(want):
                    np.testing.assert_array_equal(img[i], fake_image(int(sid)) + 1)
    assert not _beton_threads()


def test_drop_last_false_and_indices():
    with _loader(drop_last=False, indices=[3, 1, 4, 1, 5, 9]) as ld:
        assert len(ld) == 2
        (img0, lab0), (img1, lab1) = [(np.array(a), np.array(b)) for a, b in ld]
        np.testing.assert_array_equal(lab0[:, 0], np.array([3, 1, 4, 1]) * 1010)
        np.testing.assert_array_equal(lab1[:, 0], np.array([5, 9]) * 1010)
        np.testing.assert_array_equal(img0[0], fake_image(3) + 1)
        assert img1.shape == (2, 4, 5, 3)


def test_workers_live_with_the_loader_across_epochs():
    """The owned workers start with the first epoch and serve every later one (no start and
    join per epoch); an abandoned iterator cancels its queued batches but keeps them; closing
    the Loader stops them."""
    ld = _loader(batches_ahead=2)
    it = iter(ld)
    next(it)
    workers = _beton_threads()
    assert len(workers) == 2
    del it
    gc.collect()
    engine = ld._engine_feed()._owned
    deadline = time.monotonic() + 5
    while engine.queue_depth and time.monotonic() < deadline:  # cancelled entries are skipped
        time.sleep(0.01)
    assert engine.queue_depth == 0 and not engine.closed
    assert _beton_threads() == workers
    for _ in range(2):  # whole epochs, on the same two threads, with the right contents
        ids = ld.sample_order(ld.next_epoch)
        for b, (img, lab) in enumerate(ld):
            want = ids[b * 4 : b * 4 + 4]
            np.testing.assert_array_equal(np.asarray(lab)[:, 0], want.astype(np.int64) * 1010)
            np.testing.assert_array_equal(np.asarray(img)[0], fake_image(int(want[0])) + 1)
        assert _beton_threads() == workers
    it2 = iter(ld)
    next(it2)
    it3 = iter(ld)  # a new iterator closes the previous one
    next(it3)
    assert _beton_threads() == workers
    ld.close()
    assert not _beton_threads()


def test_a_dropped_loader_stops_its_workers():
    ld = _loader()
    next(iter(ld))
    assert len(_beton_threads()) == 2
    del ld
    gc.collect()
    deadline = time.monotonic() + 5
    while _beton_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _beton_threads()


def test_an_absurd_worker_count_is_refused_before_any_thread_starts():
    with pytest.raises(SpecError, match="num_workers 100000 is out of range: use an int up to"):
        _loader(num_workers=100_000)
    assert not _beton_threads()


def test_a_failed_epoch_stops_its_workers_and_the_next_starts_new_ones():
    r = FakeReader(n=16)
    pipes = {"image": [FakeImageDecoder(fail_on=9)], "label": [AddIndex()]}
    with _loader(r, pipelines=pipes, order=OrderOption.SEQUENTIAL) as ld:
        it = iter(ld)
        next(it), next(it)
        first = _beton_threads()
        with pytest.raises(PipelineError):
            next(it)
        assert not (_beton_threads() & first)  # stopped with the failed epoch
        img, lab = next(iter(ld))  # the next epoch runs on new workers
        np.testing.assert_array_equal(np.asarray(lab)[:, 0], [0, 1010, 2020, 3030])
        np.testing.assert_array_equal(np.asarray(img)[3], fake_image(3))
        assert len(_beton_threads()) == 2 and not (_beton_threads() & first)
    assert not _beton_threads()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "another-thread-inside-next"])
def test_a_forked_child_runs_its_epochs_on_its_own_workers(busy):
    """The parent's workers do not exist in a fork's child: its engine is closed there and the
    child's epoch starts new workers (it used to hang waiting for the parent's threads, had
    they been kept). The child's batches equal the parent's. ``busy``: another thread of the
    parent is inside the Loader's ``next()`` (holds its one-at-a-time lock) when it forks;
    that thread does not exist in the child, which must not take the lock for held."""
    import os
    import select
    import signal

    with _loader(seed=5, order=OrderOption.RANDOM) as ld:
        next(iter(ld))  # the parent's workers are running
        want = np.concatenate([np.asarray(lab)[:, 0] for _, lab in _copies(ld, ld.next_epoch)])
        epoch = ld.next_epoch - 1
        held, done = threading.Event(), threading.Event()
        holder = threading.Thread(
            target=lambda: (ld._busy.acquire(), held.set(), done.wait(30), ld._busy.release())
        )
        if busy:
            holder.start()
            assert held.wait(10)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one epoch, its labels through the pipe, then _exit
            signal.alarm(30)  # a hung child dies on its own (SIGALRM's default action)
            code = 1
            try:
                got = np.concatenate([np.asarray(lab)[:, 0] for _, lab in _copies(ld, epoch)])
                os.write(w, got.astype(np.int64).tobytes())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        data = b""
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if select.select([r], [], [], 0.5)[0]:
                    chunk = os.read(r, 1 << 16)
                    if not chunk:
                        break
                    data += chunk
        finally:
            os.close(r)
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        done.set()
        if busy:
            holder.join(10)
        assert os.waitstatus_to_exitcode(status) == 0
        np.testing.assert_array_equal(np.frombuffer(data, np.int64), want)
        assert len(_beton_threads()) == 2  # the parent's own, untouched
    assert not _beton_threads()


def test_a_hold_left_by_an_interrupted_call_does_not_lock_the_loader_out():
    """A Ctrl-C can land between taking the Loader's one-thread-at-a-time lock and the ``try``
    that gives it back, leaving it held. The interrupted thread must still iterate (another
    thread is refused, as while a call runs)."""
    ref = _copies(_loader(seed=5, order=OrderOption.RANDOM), 0)
    with _loader(seed=5, order=OrderOption.RANDOM) as ld:
        ld._busy.acquire()  # what an interrupt at the wrong bytecode leaves behind
        got = _copies(ld, 0)
        refused = []
        t = threading.Thread(target=lambda: refused.append(_refused(ld)))
        t.start()
        t.join(30)
        assert refused == [True]
    assert len(got) == len(ref)
    for g, w in zip(got, ref, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)


def _refused(ld) -> bool:
    try:
        iter(ld)
    except RuntimeError as exc:
        return "in use by another thread" in str(exc)
    return False


def _copies(ld, epoch):
    """Epoch ``epoch`` of ``ld``, each batch copied."""
    ld.next_epoch = epoch
    return [tuple(np.array(a) for a in batch) for batch in ld]


def test_a_new_epoch_first_releases_an_epoch_that_nobody_closed():
    """Two epochs of one Loader share its batch slots. An epoch feed left unclosed (a Ctrl-C
    can land between an iterator forgetting its feed and closing it) must not keep decoding
    into slots the next epoch hands out: the next epoch first cancels its queued batches and
    waits for its running ones."""
    reference = _copies(_loader(batches_ahead=3), 1)
    ld = _loader(batches_ahead=3)
    it = iter(ld)
    next(it)
    old = it._epoch_feed
    running = old._running
    futures = list(running.futures)
    assert futures  # batches were prepared ahead
    it._epoch_feed = None  # forgotten, never closed; `old` keeps it alive
    got = _copies(ld, 1)
    assert not running.futures and all(f.done() for f in futures)
    assert len(got) == len(reference)
    for g, w in zip(got, reference, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)
    del old
    ld.close()


def test_shared_engine_is_not_closed():
    with Engine(2) as eng:
        with _loader(engine=eng) as ld:
            assert len(list(ld)) == 5
        assert eng.alive_workers == 2


def test_client_tail_yields_tensors():
    torch = pytest.importorskip("torch")
    with _loader(pipelines={"image": None, "label": [NumpyToTorch()]}) as ld:
        (lab,) = next(iter(ld))
        assert isinstance(lab, torch.Tensor) and lab.dtype == torch.int64
        assert lab[:, 0].tolist() == [0, 10, 20, 30]


def test_custom_order_class_with_kwargs():
    class EveryOther(TraversalOrder):
        def __init__(self, loader, offset=0):
            super().__init__(loader)
            self.offset = offset

        def sample_order(self, epoch):
            return self.indices[self.offset :: 2]

    with _loader(order=EveryOther, order_kwargs={"offset": 1}) as ld:
        labs = np.concatenate([np.array(lab)[:, 0] for _, lab in ld])
        np.testing.assert_array_equal(labs, np.arange(1, 17, 2) * 10 + np.arange(1, 17, 2) * 1000)


def test_same_seed_same_batches_for_1_and_2_workers_and_epochs_differ():
    runs = []
    for workers in (1, 2):
        with _loader(order=OrderOption.RANDOM, seed=5, num_workers=workers) as ld:
            runs.append([[np.array(x) for x in b] for _ in range(2) for b in ld])
    for a, b in zip(*runs, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert not np.array_equal(runs[0][0][1], runs[0][5][1])  # epoch 0 vs epoch 1


def test_load_state_dict_rejects_other_loader():
    with _loader(seed=1) as a, _loader(seed=2) as b:
        with pytest.raises(SpecError, match="seed=1"):
            b.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kw",
    [
        {"order": OrderOption.SEQUENTIAL, "seed": 0},
        {"order": OrderOption.RANDOM, "seed": 3},
        {"order": OrderOption.QUASI_RANDOM, "seed": 3},
        {"order": OrderOption.RANDOM, "seed": 3, "distributed": True},
        {"order": OrderOption.QUASI_RANDOM, "seed": 3, "distributed": True},
    ],
    ids=["sequential", "random", "quasi_random", "distributed", "distributed_quasi"],
)
def test_resumability(kw, monkeypatch):
    if kw.get("distributed"):
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
    reader = FakeReader(n=40)
    run_test_save_load_state(lambda: _loader(reader, **kw), stop_after=2, epochs=2)


def test_failing_sample_reaches_the_consumer_and_budget_skips():
    r = FakeReader(n=16)
    pipes = {"image": [FakeImageDecoder(fail_on=9)], "label": [AddIndex()]}
    with _loader(r, pipelines=pipes) as ld:
        it = iter(ld)
        next(it), next(it)
        with pytest.raises(PipelineError) as info:
            next(it)
        assert info.value.sample_index == 9 and info.value.op.startswith("FakeImageDecoder")
    assert not _beton_threads()
    with _loader(r, pipelines=pipes, bad_sample_budget=2) as ld:
        labs = np.concatenate([np.array(lab)[:, 0] for _, lab in ld]) // 1010
        np.testing.assert_array_equal(labs, [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 11, 12, 13, 14, 15])
        assert [s[1] for s in ld.bad_samples] == [9]


def test_edge_cases_small_epochs_and_one_batch_ahead():
    with _loader(FakeReader(n=3), batch_size=4) as ld:
        assert len(ld) == 0 and list(ld) == []
    with _loader(
        FakeReader(n=3), batch_size=4, drop_last=False, batches_ahead=1, num_workers=1
    ) as ld:
        (batch,) = list(ld)
        np.testing.assert_array_equal(np.array(batch[1])[:, 0], [0, 1010, 2020])
    with pytest.raises(SpecError, match="batches_ahead"):
        _loader(batches_ahead=0)
    with pytest.raises(SpecError, match="indices"):
        _loader(indices=[0, 99])
    assert not _beton_threads()


class _Slow(AddOne):
    """A Python op (``python = True``) that takes 0.5 s per batch."""

    def generate_code(self):
        def slow(inp, dst):
            time.sleep(0.5)
            return inp

        slow.python = True
        return slow


def test_batch_timeout_raises_and_cleans_up():
    with _loader(pipelines={"image": [_Slow()], "label": None}, batch_timeout=0.05) as ld:
        with pytest.raises(PipelineError, match=r"did not arrive within 0\.05 s"):
            next(iter(ld))
    assert not _beton_threads()


def test_copy_true_batches_stay_valid_after_the_next_batch() -> None:
    # batches_ahead=1: 3 slots, so without copy the 4th batch reuses the 1st batch's slot.
    with _loader(seed=3, batches_ahead=1) as ld:
        want = [tuple(np.array(a, copy=True) for a in b) for b in ld]
    with _loader(seed=3, batches_ahead=1, copy=True) as ld:
        kept = list(ld)
        assert ld.copy is True
    assert len(kept) == len(want) > 3
    for got, exp in zip(kept, want, strict=True):
        for g, e in zip(got, exp, strict=True):
            np.testing.assert_array_equal(np.asarray(g), e)


def test_len_and_state_dict_still_answer_after_close() -> None:
    ld = _loader(seed=1)
    it = iter(ld)
    next(it)
    n, state = len(ld), ld.state_dict()
    ld.close()
    assert len(ld) == n and ld.state_dict() == state
    with pytest.raises(Exception, match="closed"):
        iter(ld)


def test_custom_fields_naming_no_field_is_refused_and_leaves_no_worker() -> None:
    from beton_serve.fields import IntField

    before = len(_beton_threads())
    with pytest.raises(SpecError, match=r"custom_fields\['nope'\]: the file has no field 'nope'"):
        _loader(custom_fields={"nope": IntField})
    assert len(_beton_threads()) == before
