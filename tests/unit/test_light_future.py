"""``LightFuture`` (``engine._future``): the ``concurrent.futures.Future`` contract without a
``Condition`` per future.

Every behavioural test runs on both ``concurrent.futures.Future`` and ``LightFuture``, so the
reference implementation proves what each test expects. The rest checks what only the light one
has to get right: its gate lock handed from waiter to waiter, ``concurrent.futures.wait`` and
``as_completed`` through its ``_condition`` and ``_waiters``, ``asyncio.wrap_future``, and no
reference cycle left by a raised exception.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import logging
import random
import threading
import time
import weakref
from typing import Any

import pytest
from beton_serve.engine import BatchFuture
from beton_serve.engine._future import LightFuture

pytestmark = pytest.mark.timeout(60)

KINDS = [cf.Future, LightFuture, BatchFuture]


@pytest.fixture(params=KINDS, ids=lambda k: k.__name__)
def make(request: pytest.FixtureRequest) -> type[cf.Future[Any]]:
    return request.param  # type: ignore[no-any-return]


def test_result_and_states(make: type[cf.Future[Any]]) -> None:
    f = make()
    assert not f.done() and not f.running() and not f.cancelled()
    assert f.set_running_or_notify_cancel() is True
    assert f.running() and not f.done()
    f.set_result([1, 2])
    assert f.done() and not f.running() and not f.cancelled()
    assert f.result() == [1, 2] and f.result(timeout=0) == [1, 2]
    assert f.exception() is None
    with pytest.raises(cf.InvalidStateError):
        f.set_result(3)
    with pytest.raises(cf.InvalidStateError):
        f.set_exception(ValueError("late"))
    assert f.cancel() is False
    assert f.result() == [1, 2]


def test_exception(make: type[cf.Future[Any]]) -> None:
    f = make()
    f.set_running_or_notify_cancel()
    err = KeyError("sample 7")
    f.set_exception(err)
    assert f.done() and f.exception() is err
    for _ in range(2):  # raised again on every call
        with pytest.raises(KeyError) as info:
            f.result()
        assert info.value is err


def test_cancel_pending_then_notify(make: type[cf.Future[Any]]) -> None:
    f = make()
    seen: list[bool] = []
    f.add_done_callback(lambda g: seen.append(g.cancelled()))
    assert f.cancel() is True and f.cancel() is True
    assert f.cancelled() and f.done() and seen == [True]
    with pytest.raises(cf.CancelledError):
        f.result()
    with pytest.raises(cf.CancelledError):
        f.exception(timeout=0)
    assert f.set_running_or_notify_cancel() is False  # the producer learns it was cancelled
    assert f.cancelled() and seen == [True]
    with pytest.raises(RuntimeError):
        f.set_running_or_notify_cancel()


def test_running_cannot_be_cancelled(make: type[cf.Future[Any]]) -> None:
    f = make()
    f.set_running_or_notify_cancel()
    assert f.cancel() is False and not f.cancelled()
    with pytest.raises(RuntimeError):
        f.set_running_or_notify_cancel()
    f.set_result(None)
    assert f.result() is None


@pytest.mark.parametrize("timeout", [0, 0.02, -1.0])
def test_timeout_on_pending(make: type[cf.Future[Any]], timeout: float) -> None:
    f = make()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        f.result(timeout=timeout)
    with pytest.raises(TimeoutError):
        f.exception(timeout=timeout)
    assert time.monotonic() - t0 < 5
    f.set_result(5)  # a timed-out wait leaves the future usable
    assert f.result(timeout=timeout) == 5


def test_callbacks(make: type[cf.Future[Any]], caplog: pytest.LogCaptureFixture) -> None:
    f = make()
    calls: list[tuple[str, str]] = []

    def bad(_g: cf.Future[Any]) -> None:
        raise RuntimeError("callback bug")

    f.add_done_callback(lambda g: calls.append(("first", threading.current_thread().name)))
    f.add_done_callback(bad)
    f.add_done_callback(lambda g: calls.append(("third", threading.current_thread().name)))
    assert calls == []
    t = threading.Thread(target=f.set_result, args=(1,), name="producer")
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        t.start()
        t.join(5)
    # in order, in the completing thread, once; a failing one is logged and the rest still run
    assert calls == [("first", "producer"), ("third", "producer")]
    assert "exception calling callback" in caplog.text
    f.add_done_callback(lambda g: calls.append(("late", threading.current_thread().name)))
    assert calls[-1] == ("late", threading.current_thread().name)  # done: runs at once, here
    assert len(calls) == 3


def test_many_waiters_all_wake(make: type[cf.Future[Any]]) -> None:
    f = make()
    got: list[Any] = []
    lock = threading.Lock()

    def wait() -> None:
        r = f.result(timeout=10)
        with lock:
            got.append(r)

    threads = [threading.Thread(target=wait) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # most of them are blocked by now
    f.set_result("batch")
    for t in threads:
        t.join(10)
    assert got == ["batch"] * 12


def test_waiters_wake_on_cancel_and_exception(make: type[cf.Future[Any]]) -> None:
    for finish in ("cancel", "exception"):
        f = make()
        outcome: list[str] = []

        def wait(f: cf.Future[Any] = f, outcome: list[str] = outcome) -> None:
            try:
                f.result(timeout=10)
            except cf.CancelledError:
                outcome.append("cancelled")
            except ValueError:
                outcome.append("raised")

        threads = [threading.Thread(target=wait) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.02)
        if finish == "cancel":
            assert f.cancel()
        else:
            f.set_running_or_notify_cancel()
            f.set_exception(ValueError("bad sample"))
        for t in threads:
            t.join(10)
        assert outcome == (["cancelled"] if finish == "cancel" else ["raised"]) * 3


def test_cross_thread_stress(make: type[cf.Future[Any]]) -> None:
    """A producer completing 3,000 futures while the consumer waits with short timeouts and
    re-waits: every value arrives, in order, none lost between a timeout and a completion."""
    n = 3000
    futs = [make() for _ in range(n)]
    rng = random.Random(0)

    def produce() -> None:
        for i, f in enumerate(futs):
            f.set_running_or_notify_cancel()
            if i % 97 == 0:
                time.sleep(0.001)
            f.set_result(i)

    t = threading.Thread(target=produce)
    t.start()
    out = []
    for f in futs:
        while True:
            try:
                out.append(f.result(timeout=rng.choice([0, 0.0001, 0.001])))
                break
            except TimeoutError:
                continue
    t.join(10)
    assert out == list(range(n))


def test_concurrent_futures_wait_and_as_completed() -> None:
    plain: cf.Future[Any] = cf.Future()
    light = LightFuture()
    done, pending = cf.wait([plain, light], timeout=0.01)
    assert done == set() and pending == {plain, light}

    threading.Timer(0.05, light.set_result, args=("light",)).start()
    done, pending = cf.wait([plain, light], timeout=10, return_when=cf.FIRST_COMPLETED)
    assert done == {light} and pending == {plain}

    later = LightFuture()
    threading.Timer(0.02, later.set_exception, args=(ValueError("x"),)).start()
    done, _ = cf.wait([later], timeout=10, return_when=cf.FIRST_EXCEPTION)
    assert done == {later}

    cancelled = LightFuture()
    cancelled.cancel()

    def notify() -> None:
        cancelled.set_running_or_notify_cancel()
        plain.set_result("plain")

    threading.Timer(0.02, notify).start()
    order = list(cf.as_completed([plain, cancelled, light], timeout=10))
    assert order[0] is light and set(order) == {plain, cancelled, light}
    assert not light._waiters and not cancelled._waiters  # as_completed took its waiters back


def test_asyncio_wrap_future() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        f = BatchFuture()
        loop.call_later(0.01, lambda: threading.Thread(target=f.set_result, args=(7,)).start())
        assert await asyncio.wait_for(asyncio.wrap_future(f), 10) == 7

        g = BatchFuture()
        g.set_running_or_notify_cancel()
        threading.Timer(0.01, g.set_exception, args=(KeyError("k"),)).start()
        with pytest.raises(KeyError):
            await asyncio.wait_for(asyncio.wrap_future(g), 10)

        h = BatchFuture()  # cancelling the asyncio side cancels a pending source
        ah = asyncio.wrap_future(h)
        ah.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ah
        await asyncio.sleep(0)  # the asyncio future's done-callbacks run on the next step
        assert h.cancelled()

    asyncio.run(main())


def test_raised_exception_leaves_no_cycle() -> None:
    """The future is freed by reference counting once the caught exception is gone, as
    ``Future.__get_result`` arranges (a frame of ``result`` in the traceback would hold it)."""
    gc.disable()
    try:
        f = LightFuture()
        f.set_exception(ValueError("boom"))
        ref = weakref.ref(f)
        try:
            f.result()
        except ValueError:
            pass
        del f
        assert ref() is None
    finally:
        gc.enable()


def test_repr() -> None:
    f = BatchFuture()
    assert "state=pending" in repr(f)
    f.set_result([])
    assert "state=finished returned list" in repr(f)
    g = LightFuture()
    g.set_exception(ValueError())
    assert "raised ValueError" in repr(g)


def test_batch_future_keeps_its_bookkeeping() -> None:
    f = BatchFuture()
    assert f.sample_ids is None and f.tasks == [] and f.decoded_here and f.shared_ref is None
    assert isinstance(f, cf.Future)
