"""Worker pool and BatchSource: priorities, worker replacement, credit, bad samples, determinism."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
from beton_serve.engine import BatchSource, Engine, OrderOption
from beton_serve.errors import BetonError, PipelineError, ResourceExhausted, SpecError
from beton_serve.pipeline import AllocationQuery, PlanCache, compile_pipelines
from beton_serve.pipeline._plan import shared_free_workspaces
from beton_wire.limits import MAX_WORKERS, workers_out_of_range
from helpers.fake_pipeline import AddIndex, AddOne, FakeImageDecoder, FakeReader, fake_image


def test_pool_runs_tasks_on_named_threads_and_closes():
    with Engine(2) as eng:
        futs = [eng.submit(lambda: threading.current_thread().name).future for _ in range(6)]
        names = {f.result(60) for f in futs}
        assert names <= {"beton-worker-0", "beton-worker-1"}
        assert eng.alive_workers == 2
    assert eng.alive_workers == 0
    with pytest.raises(BetonError, match="closed"):
        eng.submit(lambda: None)


def test_priority_zero_runs_first_and_promote():
    gate = threading.Event()
    order: list[str] = []
    with Engine(1) as eng:
        eng.submit(gate.wait, 5)  # occupies the only worker
        time.sleep(0.05)
        a = eng.submit(order.append, "prefetch-a", priority=1)
        b = eng.submit(order.append, "prefetch-b", priority=1)
        c = eng.submit(order.append, "waited", priority=0)
        assert eng.queue_depth == 3
        b.promote()
        gate.set()
        for t in (a, b, c):
            t.future.result(60)
    # priority 0 first (FIFO by submission among them), then prefetch work
    assert order == ["prefetch-b", "waited", "prefetch-a"]


class _Owner:
    """A stand-in submitter (the share is by owner identity)."""


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_owner_at_its_share_is_passed_over_for_another_owners_task():
    """Two workers, a slow owner A holding both, a fast owner B arriving: the first worker that
    frees runs B's tasks, even prefetch ones behind A's waited-for task, and A keeps one worker
    while B has work; once B is done, A gets both workers again (work-conserving)."""
    slow, fast = _Owner(), _Owner()
    gates = [threading.Event() for _ in range(5)]
    running: set[int] = set()
    log: list[str] = []
    lock = threading.Lock()

    def a_task(i: int) -> None:
        with lock:
            running.add(i)
            log.append(f"a{i}")
        gates[i].wait(10)
        with lock:
            running.discard(i)

    def b_task(i: int) -> None:
        with lock:
            log.append(f"b{i}")

    with Engine(2) as eng:
        a = [eng.submit(a_task, i, owner=slow) for i in range(2)]
        _wait_for(lambda: running == {0, 1})
        a += [eng.submit(a_task, i, priority=0, owner=slow) for i in (2, 3, 4)]
        b = [eng.submit(b_task, i, priority=1, owner=fast) for i in range(3)]
        gates[0].set()  # one worker frees: B's three tasks run there, A's wait
        for t in b:
            t.future.result(10)
        assert log[:5] == ["a0", "a1", "b0", "b1", "b2"]
        _wait_for(lambda: 2 in running)  # then A's next, on that worker
        assert running == {1, 2}  # both workers are A's again: nothing else is queued
        for g in gates:
            g.set()
        for t in a:
            t.future.result(10)
        assert eng.tasks_done == 8
        assert eng._queue._owners == {}  # every count went back to zero


def test_one_owner_or_tasks_without_one_get_every_worker():
    for owner in (None, _Owner()):
        gate = threading.Event()
        started = threading.Semaphore(0)

        def task(started: threading.Semaphore, gate: threading.Event) -> None:
            started.release()
            gate.wait(10)

        with Engine(3) as eng:
            tasks = [eng.submit(task, started, gate, owner=owner) for _ in range(3)]
            for _ in range(3):  # all three run at once
                assert started.acquire(timeout=10)
            gate.set()
            for t in tasks:
                t.future.result(10)


def test_a_promoted_task_and_closed_queues_leave_no_owner_counted():
    owner = _Owner()
    gate = threading.Event()
    with Engine(1) as eng:
        eng.submit(gate.wait, 5, owner=owner)
        _wait_for(lambda: eng.queue_depth == 0)
        waiting = eng.submit(int, 1, owner=owner)
        waiting.promote()  # two entries; one is skipped by its worker
        queued = eng.submit(int, 2, owner=_Owner())
        gate.set()
        assert waiting.future.result(10) == 1
        assert queued.future.result(10) == 2
        _wait_for(lambda: eng._queue._owners == {})
        gate.clear()
        eng.submit(gate.wait, 5, owner=owner)
        _wait_for(lambda: eng.queue_depth == 0)
        left = eng.submit(int, 3, owner=owner)
        threading.Timer(0.2, gate.set).start()
    assert left.future.cancelled()
    assert eng._queue._owners == {}


def test_dead_worker_is_replaced():
    def die():
        raise SystemExit("boom")

    with Engine(2) as eng:
        f = eng.submit(die).future
        # A task that kills its worker is re-run once (issue 6), then failed as a poison task.
        with pytest.raises(PipelineError, match="killed 2 worker"):
            f.result(60)
        deadline = time.monotonic() + 5
        while eng.workers_replaced < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.workers_replaced == 2
        assert eng.submit(lambda: 7).future.result(60) == 7
        assert eng.alive_workers == 2


def _refuse_threads_after(monkeypatch, allowed: int) -> None:
    """Make ``threading.Thread.start`` fail as the system does at its thread limit, after
    ``allowed`` more starts."""
    real = threading.Thread.start
    left = [allowed]

    def start(self):
        if left[0] <= 0:
            raise RuntimeError("can't start new thread")
        left[0] -= 1
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def _workers_alive() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("beton-worker")}


def test_a_refused_thread_is_a_typed_error_and_stops_the_started_workers(monkeypatch):
    before = _workers_alive()
    _refuse_threads_after(monkeypatch, 2)
    with pytest.raises(ResourceExhausted, match="worker thread 3 of 4: can't start new thread"):
        Engine(4)
    monkeypatch.undo()
    deadline = time.monotonic() + 5
    while _workers_alive() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _workers_alive() - before == set()


def test_ctrl_c_while_a_worker_starts_stops_the_started_workers(monkeypatch):
    """``Thread.start`` waits for the new thread; Ctrl-C breaks that wait with the thread
    running. The engine was never returned, and its workers, which hold it, ran for ever (a
    Loader interrupted in its first ``iter()`` leaked one engine per interrupt)."""
    real = threading.Thread.start
    started: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        real(self)
        started.append(self)
        if len(started) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        Engine(3)
    monkeypatch.undo()
    assert len(started) == 2
    for t in started:
        t.join(5)
    assert not [t.name for t in started if t.is_alive()]


def test_absurd_worker_counts_are_refused_before_any_thread_starts(monkeypatch):
    _refuse_threads_after(monkeypatch, 0)  # a SpecError, not a thread-limit error
    with pytest.raises(SpecError, match=f"num_workers {MAX_WORKERS + 1} is out of range"):
        Engine(MAX_WORKERS + 1)


def test_the_shared_worker_bound_message_names_the_value_and_what_below_one_means():
    # One helper words the bound for the Loader, the engine and the writer.
    for ok in (-1, 0, 1, MAX_WORKERS, np.int64(4)):
        assert workers_out_of_range(ok, "all usable CPUs") is None
    assert workers_out_of_range(MAX_WORKERS + 1, "all usable CPUs") == (
        f"num_workers {MAX_WORKERS + 1} is out of range: use an int up to {MAX_WORKERS} "
        "(< 1: all usable CPUs)"
    )
    long = workers_out_of_range("8" * 1000, "one per CPU")
    assert long is not None and "(1000 characters)" in long and len(long) < 300
    assert workers_out_of_range(2.5, "x") is not None


def test_a_dead_worker_that_cannot_be_replaced_leaves_a_smaller_pool_that_still_runs(
    monkeypatch, caplog
):
    def die():
        raise SystemExit("boom")

    with Engine(2) as eng:
        _refuse_threads_after(monkeypatch, 1)  # the first death is replaced, the second not
        f = eng.submit(die).future
        with pytest.raises(PipelineError, match="killed 2 worker"):
            f.result(60)
        monkeypatch.undo()
        assert eng.workers_replaced == 1
        assert "could not be replaced: can't start new thread" in caplog.text
        assert eng.alive_workers == 1
        assert [eng.submit(lambda i=i: i * i).future.result(60) for i in range(4)] == [0, 1, 4, 9]


def test_when_no_worker_is_left_queued_tasks_fail_instead_of_waiting_forever(monkeypatch):
    gate = threading.Event()

    def die():
        gate.wait(60)
        raise SystemExit("boom")

    eng = Engine(1, max_task_retries=3)
    _refuse_threads_after(monkeypatch, 0)
    poison = eng.submit(die).future
    queued = [eng.submit(lambda: 1).future for _ in range(3)]
    queued[1].cancel()
    gate.set()
    with pytest.raises(ResourceExhausted, match="last worker died"):
        poison.result(60)
    for f in (queued[0], queued[2]):
        with pytest.raises(ResourceExhausted, match="refused a new thread"):
            f.result(60)
    assert queued[1].cancelled()
    assert eng.closed and eng.alive_workers == 0
    with pytest.raises(BetonError, match="closed"):
        eng.submit(lambda: None)
    eng.close()


def test_close_fails_a_requeued_task_whose_future_already_runs():
    """A task re-queued after its worker died has a running future, which ``cancel`` cannot
    stop; closing the engine before it re-runs used to leave it pending forever."""
    eng = Engine(1)
    gate = threading.Event()
    blocker = eng.submit(gate.wait, 60).future
    deadline = time.monotonic() + 10
    while not blocker.running() and time.monotonic() < deadline:
        time.sleep(0.001)
    task = eng.submit(lambda: 1)
    assert task.future.set_running_or_notify_cancel()  # as a task re-queued after a death
    eng.close(join=False)
    with pytest.raises(PipelineError, match="closed before the task re-ran"):
        task.future.result(5)
    gate.set()
    assert blocker.result(60) is True
    eng.close()


def test_close_lets_a_running_task_finish_even_with_its_promoted_entry_still_queued():
    eng = Engine(1)
    first, second = threading.Event(), threading.Event()
    blocker = eng.submit(first.wait, 60).future
    deadline = time.monotonic() + 10
    while not blocker.running() and time.monotonic() < deadline:
        time.sleep(0.001)
    task = eng.submit(lambda: second.wait(60) and "done")
    task.promote()  # a consumer waits for it: a second queue entry, at priority 0
    first.set()  # the worker takes the priority-0 entry; the other stays queued
    while not task.future.running() and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = eng.submit(lambda: 1).future
    eng.close(join=False)
    assert queued.cancelled()
    second.set()
    assert task.future.result(60) == "done"
    eng.close()


def test_close_cancels_queued_work():
    gate = threading.Event()
    eng = Engine(1)
    eng.submit(gate.wait, 5)
    time.sleep(0.05)
    queued = eng.submit(lambda: 1)
    gate.set()
    eng.close()
    assert queued.future.cancelled() or queued.future.result(1) == 1


#: Compiled once for the module: these tests are about the engine, not numba.
CACHE = PlanCache()


def _plan(reader, batch_size=4, **kw):
    return compile_pipelines(
        reader,
        {"image": [kw.get("decoder") or FakeImageDecoder(), AddOne()], "label": [AddIndex()]},
        batch_size=batch_size,
        cache=CACHE,
    )


@pytest.mark.parametrize("slices", [1, 2])
def test_batch_source_outputs_match_reference(slices):
    r = FakeReader(n=20)
    plan = _plan(r, 8)
    with Engine(2) as eng:
        src = BatchSource(
            engine=eng,
            plan=plan,
            order=OrderOption.RANDOM,
            batch_size=8,
            seed=3,
            drop_last=False,
            slices=slices,
        )
        assert len(src) == 3
        for b in range(3):
            ids = src.batch_ids(1, b)
            out = [np.zeros((8, *o.shape), o.dtype) for o in plan.outputs]
            img, lab = src.submit(1, b, out).result(60)
            assert len(img) == len(ids) == (4 if b == 2 else 8)
            np.testing.assert_array_equal(img, np.stack([fake_image(int(i)) for i in ids]) + 1)
            np.testing.assert_array_equal(lab[:, 0], ids.astype(np.int64) * 1010)


def test_credit_bounds_batches_in_flight():
    r = FakeReader(n=40)
    plan = _plan(r, 4)
    gate = threading.Event()
    with Engine(1) as eng:
        eng.submit(gate.wait, 5)
        time.sleep(0.05)
        src = BatchSource(engine=eng, plan=plan, batch_size=4, batches_ahead=2)
        f0 = src.submit(0, 0)
        f1 = src.submit(0, 1)
        with pytest.raises(TimeoutError, match="2 batches in flight"):
            src.submit(0, 2, timeout=0.1)
        gate.set()
        f0.result(60)
        f1.result(60)
        src.submit(0, 2, timeout=5).result(60)


def test_failing_sample_raises_with_index_and_op():
    r = FakeReader(n=16)
    plan = _plan(r, 4, decoder=FakeImageDecoder(fail_on=6))
    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4)
        src.submit(0, 0).result(60)
        with pytest.raises(PipelineError) as info:
            src.submit(0, 1).result(60)
    assert info.value.sample_index == 6
    assert info.value.op == "FakeImageDecoder#0 (pipeline 'image')"
    assert "corrupt sample" in str(info.value)


def test_bad_sample_budget_skips_by_replacing_with_next_good_sample():
    r = FakeReader(n=16)
    plan = _plan(r, 4, decoder=FakeImageDecoder(fail_on=6))
    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4, bad_sample_budget=1)
        fut = src.submit(0, 1)
        img, lab = fut.result(60)  # ids 4..7, 6 fails -> replaced by 7
        np.testing.assert_array_equal(lab[:, 0], np.array([4, 5, 7, 7]) * 1010)
        np.testing.assert_array_equal(img[2], fake_image(7) + 1)
        # Found on the worker, charged only when the consumer delivers the batch.
        assert [(f.sample_id, f.op) for f in fut.bad] == [
            (6, "FakeImageDecoder#0 (pipeline 'image')")
        ]
        assert src.bad_samples == []
        src.charge(0, fut)
        assert src.bad_samples == [(0, 6, "FakeImageDecoder#0 (pipeline 'image')")]
        # The same batch decoded and delivered again (a resume) does not count twice.
        again = src.submit(0, 1)
        np.testing.assert_array_equal(again.result(60)[1][:, 0], np.array([4, 5, 7, 7]) * 1010)
        src.charge(0, again)
        assert len(src.bad_samples) == 1
        # The ids the batch holds name the replacement (issue 11 §8), and the budget is per
        # epoch: the next epoch may skip its own bad sample again.
        fut = src.submit(1, 1)
        np.testing.assert_array_equal(fut.result(60)[1][:, 0], np.array([4, 5, 7, 7]) * 1010)
        np.testing.assert_array_equal(fut.sample_ids, [4, 5, 7, 7])
        src.charge(1, fut)
        assert [(b.epoch, b.sample_id) for b in src.bad_samples] == [(0, 6), (1, 6)]
        # The cause is kept without the worker's traceback (its frames hold batch buffers).
        assert fut.bad[0].cause.__traceback__ is None


def test_the_budget_is_charged_in_delivery_order_whichever_batch_finished_first():
    """Budget 1, a bad sample in batch 0 and in batch 1: batch 1 finishes (and skips its
    sample) first, yet batch 0 is charged first and delivered, and batch 1 exhausts the
    budget, naming its own sample. Charged as batches finished, batch 1 took the budget and
    batch 0 raised: which batch failed depended on the workers' timing."""
    r = FakeReader(n=16)
    later_failed = threading.Event()
    plan = _slow_first_failing_plan(r, later_failed, 4)
    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4, bad_sample_budget=1)
        first, second = src.submit(0, 0), src.submit(0, 1)  # ids 0..3 (bad 1), 4..7 (bad 6)
        second.result(60)
        first.result(60)  # held back until batch 1 met its bad sample
        assert later_failed.is_set()
        src.charge(0, first)
        with pytest.raises(PipelineError, match="budget 1 exhausted") as info:
            src.charge(0, second)
    assert info.value.sample_index == 6
    assert [b.sample_id for b in src.bad_samples] == [1]


class _SlowFirstFailing(AddOne):
    """Python-mode ``AddOne`` that fails on samples 1 and 6, and holds a part that contains
    sample 0 back until the part with sample 6 has failed."""

    def __init__(self, later_failed: threading.Event) -> None:
        super().__init__()
        self.later_failed = later_failed

    def generate_code(self):
        later_failed = self.later_failed

        def add(inp, dst, batch_indices):
            ids = [int(x) for x in batch_indices]
            if 0 in ids and len(ids) > 1:  # the first part of the split batch
                later_failed.wait(10)
            if 6 in ids:
                try:
                    raise ValueError("corrupt sample 6")
                finally:
                    later_failed.set()
            if 1 in ids:
                raise ValueError("corrupt sample 1")
            dst[:] = inp + 1
            return dst

        add.with_indices = True  # type: ignore[attr-defined]
        add.python = True  # type: ignore[attr-defined]
        return add


def _slow_first_failing_plan(r: FakeReader, later_failed: threading.Event, batch_size: int):
    """Images through :class:`_SlowFirstFailing`, labels their ids."""
    return compile_pipelines(
        r,
        {"image": [FakeImageDecoder(), _SlowFirstFailing(later_failed)], "label": [AddIndex()]},
        batch_size=batch_size,
        cache=PlanCache(),
    )


def test_a_split_batch_names_its_first_bad_sample_whichever_part_fails_first():
    """Bad samples in both parts of a split batch: the error names the first in batch order
    (as the whole batch run on one worker does), although the second part failed first. It
    named the first part to finish, so served batches (split over the daemon's workers) could
    name another sample than the in-process Loader (found by the corrupt-JPEG fuzz)."""
    r = FakeReader(n=16)
    later_failed = threading.Event()
    plan = _slow_first_failing_plan(r, later_failed, 8)
    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=8, slices=2)
        with pytest.raises(PipelineError) as info:
            src.submit(0, 0).result(60)  # ids 0..7: parts 0..3 and 4..7
    assert later_failed.is_set()
    assert info.value.sample_index == 1


@pytest.mark.parametrize("budget", [1, 2])
def test_a_split_batch_spends_the_budget_as_the_whole_batch_does(budget):
    """Bad samples 1 and 6 in the two parts of a split batch, the part with 6 failing first.
    Budget 1: the batch fails (when its consumer charges it) naming sample 1 and records none,
    as the batch run whole does; it was charged part by part, so the part with 6 spent the
    budget, was recorded, and the part with 1 failed naming it (or the other way round,
    whichever part came first). Budget 2:
    both are skipped, each replaced by the next good sample of the batch, recorded in batch
    order."""
    r = FakeReader(n=16)
    got = []
    for slices in (1, 2):
        later_failed = threading.Event()
        if slices == 1:
            later_failed.set()  # one part: nothing to hold back
        plan = _slow_first_failing_plan(r, later_failed, 8)
        with Engine(2) as eng:
            src = BatchSource(
                engine=eng, plan=plan, batch_size=8, slices=slices, bad_sample_budget=budget
            )
            fut = src.submit(0, 0)
            img, lab = fut.result(60)
            assert [f.sample_id for f in fut.bad] == [1, 6], slices  # found once, in order
            if budget == 1:
                with pytest.raises(PipelineError, match="budget 1 exhausted") as info:
                    src.charge(0, fut)
                assert info.value.sample_index == 1, slices
                got.append(None)
            else:
                src.charge(0, fut)
                np.testing.assert_array_equal(fut.sample_ids, [0, 2, 2, 3, 4, 5, 7, 7])
                np.testing.assert_array_equal(img[1], fake_image(2) + 1)
                np.testing.assert_array_equal(img[6], fake_image(7) + 1)
                got.append((img.copy(), lab.copy()))
            assert [b.sample_id for b in src.bad_samples] == ([] if budget == 1 else [1, 6])
    if budget == 2:
        np.testing.assert_array_equal(got[0][0], got[1][0])
        np.testing.assert_array_equal(got[0][1], got[1][1])


def test_a_zero_budget_fails_the_batch_naming_the_setting():
    r = FakeReader(n=16)
    plan = _plan(r, 4, decoder=FakeImageDecoder(fail_on=6))
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4, bad_sample_budget=0)
        with pytest.raises(PipelineError, match="raise bad_sample_budget"):
            src.submit(0, 1).result(60)


def test_same_results_for_one_and_two_workers():
    r = FakeReader(n=32)
    got = []
    for workers in (1, 2):
        plan = _plan(r, 8)
        with Engine(workers) as eng:
            src = BatchSource(
                engine=eng,
                plan=plan,
                order=OrderOption.RANDOM,
                batch_size=8,
                seed=9,
                slices=workers,
            )
            futs = [src.submit(0, b) for b in range(len(src))]
            got.append(
                [
                    np.concatenate(
                        [a.reshape(len(a), -1).view(np.uint8) for a in f.result(60)], axis=1
                    )
                    for f in futs
                ]
            )
    for a, b in zip(*got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_close_logs_a_worker_that_does_not_stop(caplog):
    gate = threading.Event()
    eng = Engine(1, join_timeout=0.1)
    eng.submit(gate.wait, 30)
    time.sleep(0.05)
    with caplog.at_level("WARNING", logger="beton_serve.engine._pool"):
        eng.close()
    assert "did not stop within 0.1 s" in caplog.text
    gate.set()
    for t in threading.enumerate():
        if t.name.startswith("beton-worker-"):
            t.join(5)


class _Uncompilable(AddOne):
    def generate_code(self):
        def bad(inp, dst):
            object()  # nopython mode cannot type this
            return inp

        return bad


def test_numba_compile_error_names_the_op_and_the_fix():
    r = FakeReader(n=8)
    plan = compile_pipelines(r, {"image": [_Uncompilable()], "label": None}, batch_size=4)
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4, bad_sample_budget=8)
        with pytest.raises(
            PipelineError, match=r"numba could not compile.*after ToTensor\(\)"
        ) as info:
            src.submit(0, 0).result(60)
    assert info.value.op == "_Uncompilable#1 (pipeline 'image')"
    assert src.bad_samples == []


def test_the_next_epochs_order_is_ready_once_the_last_batch_is_queued(monkeypatch):
    """Built-in orders: epoch e + 1's order and seed keys are computed when epoch e's last batch
    is submitted (while workers run it), so the next epoch's start does not wait for them; the
    batches are those of a source that computed them at the start."""
    import beton_serve.engine._source as source_mod

    calls: list[int] = []
    real = source_mod.make_order

    def counting(order, cfg, epoch):
        calls.append(epoch)
        return real(order, cfg, epoch)

    monkeypatch.setattr(source_mod, "make_order", counting)
    r = FakeReader(n=20)
    plan = _plan(r, 8)

    def epochs(src: BatchSource, prepared: bool) -> list:
        out = []
        for e in range(3):
            for b in range(len(src)):
                if b == len(src) - 1 and prepared:
                    assert e + 1 not in src._orders  # not before the last batch
                out.append(src.submit(e, b).result(60))
            assert (e + 1 in src._orders) is prepared
        return out

    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, order=OrderOption.RANDOM, batch_size=8, seed=4)
        got = epochs(src, True)
        assert calls == [0, 1, 2, 3]  # each epoch's order once, the next one early
        monkeypatch.setattr(source_mod.BatchSource, "_prepare_epoch", lambda self, e: None)
        ref = BatchSource(engine=eng, plan=plan, order=OrderOption.RANDOM, batch_size=8, seed=4)
        want = epochs(ref, False)
    for (xi, xl), (yi, yl) in zip(got, want, strict=True):
        np.testing.assert_array_equal(xi, yi)
        np.testing.assert_array_equal(xl, yl)


def test_a_custom_order_is_not_asked_for_the_next_epoch_early():
    """A TraversalOrder may read state its user sets between epochs (a curriculum): its
    ``sample_order(e + 1)`` is called at epoch e + 1's start, never ahead."""
    from beton_serve.engine import TraversalOrder

    asked: list[int] = []

    class Recorded(TraversalOrder):
        def sample_order(self, epoch):
            asked.append(epoch)
            return self.indices

    r = FakeReader(n=8)
    plan = _plan(r, 4)
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4, seed=0)
        src.order = Recorded(src.config)
        src._orders.clear()  # the built-in order's epoch 0, taken for len()
        for b in range(len(src)):
            src.submit(0, b).result(60)
    assert asked == [0]


def test_an_error_computing_the_next_order_early_reaches_only_that_epoch(monkeypatch):
    """The last batch's ``submit`` has queued its batch: a failure of the early order must not
    escape from it (its caller would take the batch for unsubmitted); the next epoch raises it
    when it starts."""
    import beton_serve.engine._source as source_mod

    real = source_mod.make_order

    def failing(order, cfg, epoch):
        if epoch == 1:
            raise RuntimeError("no order for epoch 1")
        return real(order, cfg, epoch)

    monkeypatch.setattr(source_mod, "make_order", failing)
    plan = _plan(FakeReader(n=8), 4)
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, order=OrderOption.RANDOM, batch_size=4, seed=1)
        assert [len(src.submit(0, b).result(60)[0]) for b in range(2)] == [4, 4]
        with pytest.raises(RuntimeError, match="epoch 1"):
            src.submit(1, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("owns_engine", "failed"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_an_epochs_finalizer_run_inside_one_of_its_tasks_waits_for_nothing(owns_engine, failed):
    """An in-process epoch's finalizer (``_Running.release``) may be run by the garbage
    collector on one of the engine's own workers, inside a task of that very epoch. It used to
    wait ``join_timeout`` for that task (itself) and then fail to join its own thread. It stops
    an engine the Loader owns only when the epoch failed (the workers live with the Loader)."""
    from beton_serve.loader._loader import _Running

    engine = Engine(2, join_timeout=20.0)
    running = _Running(engine, owns_engine, 3)
    running.failed = failed
    took: list[float] = []
    errors: list[BaseException] = []

    def task_collected_mid_run() -> int:
        t0 = time.perf_counter()
        try:
            running.release()  # as if the collector ran the finalizer here
        except BaseException as exc:
            errors.append(exc)
        took.append(time.perf_counter() - t0)
        return 7

    task = engine.submit(task_collected_mid_run)
    running.futures.append(task.future)
    assert task.future.result(timeout=10) == 7
    assert errors == [] and took[0] < 5.0
    assert not running.futures
    if owns_engine and failed:
        _assert_stops(engine)
    else:
        assert engine.submit(int, 3).future.result(timeout=10) == 3  # the engine lives
        engine.close()


def _assert_stops(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while engine.alive_workers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.alive_workers == 0  # told to stop, each after its task
    with pytest.raises(BetonError, match="closed"):
        engine.submit(int)


@pytest.mark.timeout(30)
def test_a_loaders_engine_finalizer_run_inside_one_of_its_tasks_waits_for_nothing():
    """The Loader's own engine outlives its epochs and is stopped by the feed's finalizer
    (``_stop_engine``), which the garbage collector may also run inside one of its tasks."""
    from beton_serve.loader._loader import _stop_engine

    engine = Engine(2, join_timeout=20.0)
    took: list[float] = []

    def task_collected_mid_run() -> int:
        t0 = time.perf_counter()
        _stop_engine(engine)
        took.append(time.perf_counter() - t0)
        return 7

    assert engine.submit(task_collected_mid_run).future.result(timeout=10) == 7
    assert took[0] < 5.0
    _assert_stops(engine)


def test_held_plans_share_free_workspaces_by_layout_until_their_last_source_closes():
    """The daemon keeps idle plans for reuse: their batch workspaces go with the last source of
    their layout (``Plan.hold``/``unhold``). Plans of one layout (another parameter value, the
    same ops and shapes) share the free ones; the same batches come from workspaces reused or
    allocated anew."""
    r = FakeReader(n=16)
    # batch sizes 6 and 7: layouts no other test of this module holds
    a_plan = _plan(r, 6)
    b_plan = _plan(r, 6, decoder=FakeImageDecoder(fail_on=-2))  # another spec, one layout
    c_plan = _plan(r, 7)  # another batch size: another layout
    assert a_plan._layout == b_plan._layout != c_plan._layout

    def free(plan) -> int:
        return shared_free_workspaces().get(plan._layout, 0)

    with Engine(2) as eng:
        a = BatchSource(engine=eng, plan=a_plan, batch_size=6)
        first = [np.array(x) for x in a.submit(0, 0).result(60)]
        assert free(a_plan) == 1  # kept for the next batch
        b = BatchSource(engine=eng, plan=b_plan, batch_size=6)
        ws = b_plan.acquire_workspace()
        assert free(a_plan) == 0  # a's free workspace serves b's batch
        b_plan.release_workspace(ws)
        c_ws = c_plan.acquire_workspace()
        c_plan.release_workspace(c_ws)  # c is held by no source: its own free list
        assert c_plan.acquire_workspace() is c_ws and free(c_plan) == 0
        a.close()
        a.close()  # idempotent: one release per source
        assert free(a_plan) == 1  # b still runs the layout
        b.submit(0, 1).result(60)
        b.close()
        assert free(a_plan) == 0  # no source left: no batch memory kept
        again_src = BatchSource(engine=eng, plan=a_plan, batch_size=6)
        again = [np.array(x) for x in again_src.submit(0, 0).result(60)]
        assert free(a_plan) == 1
        again_src.close()
    assert free(a_plan) == 0
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))


class _Widening(AddOne):
    """``AddOne`` into a buffer of :attr:`dtype`, which the user may change between epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype = np.dtype(np.uint8)

    def declare_state_and_memory(self, previous_state):
        state = dataclasses.replace(previous_state, dtype=self.dtype)
        return state, AllocationQuery(previous_state.shape, self.dtype)

    def spec_params(self):
        return {"dtype": self.dtype.str}


def test_a_plan_refreshed_to_another_layout_moves_its_hold():
    """``refresh`` that changes a buffer (FFCV's per-epoch ``output_size``) gives the plan a new
    layout: its hold moves there, and the old layout's free workspaces go."""
    r = FakeReader(n=16)
    op = _Widening()
    plan = compile_pipelines(
        r, {"image": [FakeImageDecoder(), op], "label": [AddIndex()]}, batch_size=4
    )
    old = plan._layout
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=4)
        first = src.submit(0, 0).result(60)[0]
        assert first.dtype == np.uint8 and shared_free_workspaces().get(old) == 1
        op.dtype = np.dtype(np.uint16)
        assert plan.refresh(1)
        new = plan._layout
        assert new != old
        assert old not in shared_free_workspaces()  # the only hold moved: the old sets went
        wide = src.submit(1, 0).result(60)[0]
        assert wide.dtype == np.uint16 and shared_free_workspaces().get(new) == 1
        ids = src.batch_ids(1, 0)
        expected = np.stack([fake_image(int(i)) for i in ids]).astype(np.uint16) + 1
        assert np.array_equal(wide, expected)
        src.close()
    assert new not in shared_free_workspaces()
    # A plan no source ever held (a precompile, a direct caller) keeps its own free list.
    direct = _plan(r, 4)
    ws = direct.acquire_workspace()
    direct.release_workspace(ws)
    assert direct.acquire_workspace() is ws


def test_a_collected_source_releases_its_plan():
    """The in-process Loader never closes its sources: a source that is collected gives up its
    hold, so the process keeps no free workspaces for a Loader that is gone."""
    import gc

    r = FakeReader(n=16)
    plan = _plan(r, 5)  # a layout of its own in this module
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=5)
        src.submit(0, 0).result(60)
        assert shared_free_workspaces().get(plan._layout) == 1
        del src
        gc.collect()
        assert plan._layout not in shared_free_workspaces()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_inherit_a_held_workspace_lock():
    """The workspace bookkeeping's lock is process-wide: held by a thread at a fork, it would
    hang every batch in the child. The child gets a fresh one."""
    from beton_serve.pipeline import _plan

    with _plan._FREE_SETS.lock:
        pid = os.fork()
        if pid == 0:  # the child: exits with 0 only if it could take the lock
            os._exit(0 if _plan._FREE_SETS.lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_hold_released_while_the_workspace_lock_is_held_does_not_deadlock():
    """A source in a reference cycle is released by the garbage collector's finalizer, which
    may run inside any allocation: also inside the workspace bookkeeping's own locked section,
    on the thread that holds the lock. The release waits for the end of that section: run at
    once, in the middle of a ``put``, it left the idle bytes counted above what the lists hold
    (found by a check of that sum after every test of this module)."""
    from beton_serve.pipeline import _plan as plan_mod

    r = FakeReader(n=16)
    plan = _plan(r, 9)  # a layout of its own in this module
    done = threading.Event()
    sets = plan_mod._FREE_SETS
    with Engine(1) as eng:
        src = BatchSource(engine=eng, plan=plan, batch_size=9)
        src.submit(0, 0).result(60)

        def reenter() -> None:
            with sets:  # as if the collector ran the finalizer inside a section
                kept = shared_free_workspaces().get(plan._layout)
                src.close()
                assert shared_free_workspaces().get(plan._layout) == kept  # not yet
                done.set()

        t = threading.Thread(target=reenter, daemon=True)
        t.start()
        t.join(5)
    assert done.is_set(), "releasing a hold inside the locked section deadlocked"
    assert plan._layout not in shared_free_workspaces()  # released at the section's end
    with sets:
        assert sets.free_bytes == sum(ws.nbytes for v in sets.free.values() for ws in v)


def test_idle_workspaces_past_the_limit_go_the_layouts_used_longest_ago_first():
    """Held plans of many layouts at once (a sweep over output sizes, each job open) each keep
    up to one set per worker. Past ``set_idle_workspace_limit`` the sets of the layouts used
    longest ago are freed; a layout that runs again allocates anew, with the same batches, and
    :func:`workspace_memory` counts what is alive and what is kept."""
    import gc

    from beton_serve.pipeline import set_idle_workspace_limit, workspace_memory

    r = FakeReader(n=24)
    plans = {b: _plan(r, b) for b in (10, 11, 12)}  # layouts no other test of this module holds
    size: dict[int, int] = {}

    def free(b: int) -> int:
        return shared_free_workspaces().get(plans[b]._layout, 0)

    def check(src: BatchSource, epoch: int, b: int) -> None:
        img, lab = src.submit(epoch, b).result(60)
        ids = src.batch_ids(epoch, b)
        assert np.array_equal(img, np.stack([fake_image(int(i)) for i in ids]) + 1)
        assert np.array_equal(lab.ravel(), ids.astype(lab.dtype) * 1010)  # 10 id + 1000 id

    try:
        with Engine(1) as eng:
            srcs = {b: BatchSource(engine=eng, plan=p, batch_size=b) for b, p in plans.items()}
            check(srcs[10], 0, 0)
            assert free(10) == 1
            set_idle_workspace_limit(1)  # frees every idle set of this process, at once
            assert free(10) == 0 and workspace_memory().idle_bytes == 0
            check(srcs[10], 0, 0)  # and each one released from now on
            assert free(10) == 0 and workspace_memory().idle_bytes == 0
            live_before = workspace_memory().live_bytes  # none of ours: the one set went
            set_idle_workspace_limit(None)
            for b in (10, 11, 12):
                idle = workspace_memory().idle_bytes
                check(srcs[b], 0, 1)
                size[b] = workspace_memory().idle_bytes - idle  # the set just kept
                assert 0 < size[b] < plans[b].workspace_bytes  # the output buffer: never made
            set_idle_workspace_limit(size[11] + size[12])
            # 10 was used longest ago: its set went, at once
            assert (free(10), free(11), free(12)) == (0, 1, 1)
            mem = workspace_memory()
            assert mem.idle_bytes == size[11] + size[12] == mem.limit_bytes
            assert mem.evicted >= 1
            check(srcs[10], 1, 0)  # allocated anew, the same pixels; now 11 is the oldest
            assert (free(10), free(11), free(12)) == (1, 0, 1)
            assert workspace_memory().idle_bytes == size[10] + size[12]
            for src in srcs.values():
                src.close()
            assert workspace_memory().idle_bytes == 0
            del srcs
        gc.collect()
        assert workspace_memory().live_bytes == live_before  # nothing alive is left uncounted
    finally:
        assert set_idle_workspace_limit(None) > 1 << 20  # the default: an eighth of memory
