"""A served stream gives back the slot of a discarded batch only once nothing writes into it.

``Stream.discard`` drops batches that will not be published: the look-ahead of a next epoch the
client did not start at batch 0 (a ``load_state_dict`` resume, an epoch re-opened after Ctrl-C),
or the pending batches of a stopped epoch. A decode already running cannot be cancelled; its slot
used to go back to the ring at once, so the next batch could be decoded into it while the old
decode still wrote there, and the client received a batch mixed with another batch's rows (found
by ``tests/conformance/test_interrupted.py``'s real-signal test). These tests drive ``discard``
with a stand-in stream and ring, and real engine futures.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest
from beton_serve.daemon._stream import Stream
from beton_serve.engine import BatchFuture

pytestmark = pytest.mark.timeout(30)


class _Ring:
    def __init__(self) -> None:
        self.free: list[int] = []

    def abandon(self, slot: int) -> None:
        self.free.append(slot)


class _Stream:
    """The part of ``Stream`` that ``discard`` uses, with ``Stream``'s own methods."""

    abandon = Stream.abandon
    abandon_when_done = Stream.abandon_when_done
    discard = Stream.discard

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.closed = False
        self.ring = _Ring()


class _Task:
    def __init__(self) -> None:
        self.future = BatchFuture()


def _pending(*entries: tuple[int, int, Any]) -> deque[tuple[int, int, Any]]:
    return deque(entries)


def test_a_queued_batch_is_cancelled_and_its_slot_given_back_at_once() -> None:
    s = _Stream()
    queued = BatchFuture()
    s.discard(_pending((0, 3, queued)))
    assert queued.cancelled()
    assert s.ring.free == [3]


def test_a_running_batch_keeps_its_slot_until_its_decode_ends() -> None:
    s = _Stream()
    running, finished = BatchFuture(), BatchFuture()
    running.set_running_or_notify_cancel()
    finished.set_running_or_notify_cancel()
    finished.set_result([])
    pending = _pending((0, 5, running), (1, 6, finished))
    s.discard(pending)
    assert not pending
    assert s.ring.free == [6]  # the finished one at once; the running one still writes slot 5
    done = threading.Thread(target=running.set_result, args=([],))  # a worker ends the decode
    done.start()
    done.join()
    assert s.ring.free == [6, 5]


def test_a_running_batch_of_a_closed_stream_gives_nothing_back() -> None:
    s = _Stream()
    running = BatchFuture()
    running.set_running_or_notify_cancel()
    s.discard(_pending((0, 2, running)))
    s.closed = True  # the ring is gone with the stream
    running.set_exception(RuntimeError("decode failed"))
    assert s.ring.free == []


def test_a_split_batch_cancels_its_parts_not_started_and_waits_for_the_others() -> None:
    s = _Stream()
    batch = BatchFuture()
    batch.set_running_or_notify_cancel()  # a split batch's future runs from its submission
    started, queued = _Task(), _Task()
    started.future.set_running_or_notify_cancel()
    batch.tasks = [started, queued]
    s.discard(_pending((0, 4, batch)))
    assert queued.future.cancelled() and not started.future.cancelled()
    assert s.ring.free == []
    batch.set_result([])  # its last part ended
    assert s.ring.free == [4]
