"""A worker that crashes is replaced and its task redone; a poison task fails after the retries."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from beton_serve.engine import Engine
from beton_serve.errors import PipelineError


class _Crash(BaseException):
    """Simulates a crash that ends the worker thread (not an ``Exception``)."""


def test_a_crashed_worker_is_replaced_and_its_task_rerun() -> None:
    calls: list[str] = []
    lock = threading.Lock()

    def flaky(out: np.ndarray) -> np.ndarray:
        with lock:
            calls.append(threading.current_thread().name)
            first = len(calls) == 1
        if first:
            raise _Crash("simulated worker crash")
        out[:] = 7
        return out

    with Engine(2) as eng:
        out = np.zeros(4, np.int64)
        task = eng.submit(flaky, out)
        assert task.future.result(timeout=10) is out
        assert out.tolist() == [7, 7, 7, 7]  # the batch was redone, not lost
        assert eng.workers_replaced == 1 and eng.tasks_retried == 1
        assert len(calls) == 2 and calls[0] != calls[1]  # ran again on another worker
        assert eng.alive_workers == 2
        # The pool still works afterwards, and busy time was accounted.
        assert [eng.submit(lambda i=i: i * 2).future.result(timeout=10) for i in range(5)] == [
            0,
            2,
            4,
            6,
            8,
        ]
        assert eng.busy_s > 0


def test_a_poison_task_fails_after_its_retries_and_the_pool_keeps_its_size() -> None:
    def always() -> None:
        raise _Crash("boom")

    with Engine(2, max_task_retries=2) as eng:
        task = eng.submit(always)
        with pytest.raises(PipelineError, match="killed 3 worker"):
            task.future.result(timeout=10)
        assert eng.workers_replaced == 3 and eng.tasks_retried == 2
        assert eng.alive_workers == 2
        assert eng.submit(lambda: "ok").future.result(timeout=10) == "ok"


def test_a_batch_whose_worker_crashed_is_redone_with_the_same_content(monkeypatch) -> None:
    from beton_serve.engine import BatchSource, OrderOption
    from beton_serve.pipeline import compile_pipelines
    from helpers.fake_pipeline import AddIndex, AddOne, FakeImageDecoder, FakeReader

    reader = FakeReader(n=16)
    plan = compile_pipelines(
        reader,
        {"image": [FakeImageDecoder(), AddOne()], "label": [AddIndex()]},
        batch_size=4,
    )
    with Engine(2) as eng:
        src = BatchSource(engine=eng, plan=plan, order=OrderOption.RANDOM, batch_size=4, seed=5)
        reference = [[a.copy() for a in src.submit(0, b).result(60)] for b in range(4)]
        real_run = BatchSource._run
        crashed: list[int] = []

        def crash_once(self, epoch, batch, *rest):  # type: ignore[no-untyped-def]
            if not crashed:
                crashed.append(int(batch[0]))
                raise _Crash("simulated worker crash mid-batch")
            return real_run(self, epoch, batch, *rest)

        monkeypatch.setattr(BatchSource, "_run", crash_once)
        again = [[a.copy() for a in src.submit(0, b).result(60)] for b in range(4)]
    assert crashed and eng.workers_replaced == 1 and eng.tasks_retried == 1
    for x, y in zip(reference, again, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)
