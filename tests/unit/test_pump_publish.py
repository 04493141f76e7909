"""The notice pump's publishing from engine workers (``daemon._pump.NoticePump._on_done``).

One thread publishes at a time, and a worker that completes a batch while another publishes
does not wait for it: it leaves a mark and goes back to the engine's queue, and the publishing
thread publishes again once it is done. These tests drive that protocol with a stand-in for
the publish step (the served path's batches themselves are compared bit for bit with the
in-process Loader in the integration tests, e.g. ``test_notice_channel.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import pytest
from beton_serve.daemon._pump import NoticePump

pytestmark = pytest.mark.timeout(60)


def _pump(publish) -> NoticePump:
    """A pump with only what ``_on_done`` uses: its lock, its marks and the publish step."""
    pump = NoticePump.__new__(NoticePump)
    pump._publishing = threading.Lock()
    pump._kicked = deque()
    pump._publish_done = publish  # type: ignore[method-assign]
    return pump


def test_a_completion_during_a_publish_does_not_wait_and_is_published_after_it() -> None:
    inside, go_on = threading.Event(), threading.Event()
    calls: list[str] = []

    def publish() -> list[Future]:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            inside.set()
            assert go_on.wait(10)
        return []

    pump = _pump(publish)
    a = threading.Thread(target=pump._on_done, args=(None,), name="a")
    a.start()
    assert inside.wait(10)
    t0 = time.perf_counter()
    pump._on_done(None)  # a publishes: this returns at once, leaving its mark
    assert time.perf_counter() - t0 < 1.0
    assert calls == ["a"]
    go_on.set()
    a.join(10)
    assert calls == ["a", "a"]  # a saw the mark and published again, for this completion
    assert not pump._kicked and not pump._publishing.locked()


def test_no_completion_is_left_unpublished_under_contention() -> None:
    """Four threads complete 2,000 batches each. Every completion must be followed by a publish
    that starts after it (so that it sees the batch done), whoever runs it."""
    clock = iter(range(10**9)).__next__  # atomic in CPython: a total order of events
    starts: list[int] = []

    def publish() -> list[Future]:
        starts.append(clock())
        time.sleep(0)  # let the others complete meanwhile
        return []

    pump = _pump(publish)
    last_done = [0] * 4

    def worker(k: int) -> None:
        for _ in range(2000):
            last_done[k] = clock()
            pump._on_done(None)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert max(last_done) < max(starts)  # the last completion was published after it
    assert not pump._kicked and not pump._publishing.locked()
    assert len(starts) < 8000  # and publishes were combined


def test_new_batches_get_the_callback_outside_the_publishing_lock() -> None:
    """A batch submitted by a publish may already be done: its callback then runs at once, on
    this thread, and must be able to publish (the lock is released first)."""
    done: Future = Future()
    done.set_result(None)
    rounds: list[int] = []

    def publish() -> list[Future]:
        rounds.append(1)
        return [done] if len(rounds) == 1 else []

    pump = _pump(publish)
    pump._on_done(None)
    assert len(rounds) == 2
