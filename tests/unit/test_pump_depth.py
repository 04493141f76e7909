"""The notice pump's depth (``daemon._pump``): at most ``pump_depth`` batches submitted and not
yet published, this epoch's and the look-ahead's together; the rest of the ring is room for
published batches. These tests drive ``NoticePump._submit_locked`` with a stand-in stream whose
ring hands out its lowest free slot, as ``HostSlotRing.acquire`` does; the served path itself is
checked in ``tests/integration/test_pump_depth.py``.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import pytest
from beton_serve.daemon import _pump
from beton_serve.daemon._pump import NoticePump

pytestmark = pytest.mark.timeout(30)


class _Stream:
    """What ``_submit_locked`` calls: a ring of ``slots`` slots, lowest free first."""

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots))
        self.submitted: list[tuple[int, int, int]] = []  # (epoch, batch, slot)

    def acquire(self) -> int | None:
        if not self.free:
            return None
        slot = min(self.free)
        self.free.remove(slot)
        return slot

    def abandon(self, slot: int) -> None:
        self.free.append(slot)

    def waiting_for(self, first: bool) -> bool:
        return first

    def submit(self, epoch: int, b: int, slot: int, *, waiting: bool, by_ref: bool) -> Future:
        self.submitted.append((epoch, b, slot))
        return Future()


def _make_pump(stream: _Stream, n: int, depth: int) -> NoticePump:
    p = NoticePump.__new__(NoticePump)
    p.stream = stream  # type: ignore[assignment]
    p.epoch, p.n, p.b_next, p.ahead_next = 3, n, 0, 0
    p.pending, p.ahead = deque(), deque()
    p.depth, p.by_ref = depth, False
    return p


def _submit(p: NoticePump) -> list[Future]:
    new: list[Future] = []
    p._submit_locked(new)
    return new


def _publish_head(p: NoticePump, s: _Stream, *, release: bool) -> None:
    """The head batch is published; ``release``: the client has handed its slot back too."""
    _b, slot, _f = p.pending.popleft()
    if release:
        s.free.append(slot)


def test_the_first_fill_takes_depth_slots_of_sixteen() -> None:
    s = _Stream(16)
    p = _make_pump(s, n=40, depth=4)
    assert len(_submit(p)) == 4
    assert s.submitted == [(3, b, b) for b in range(4)]
    assert not p._wants_slot()  # at the depth: nothing more, and no starvation wait either


def test_each_publish_lets_one_more_in_and_slots_cycle_low() -> None:
    s = _Stream(16)
    p = _make_pump(s, n=40, depth=4)
    _submit(p)
    for _ in range(30):  # a client that keeps up: it releases each batch as the next comes
        _publish_head(p, s, release=True)
        assert len(_submit(p)) == 1
        assert len(p.pending) == 4
    assert {slot for _e, _b, slot in s.submitted} <= set(range(5))
    assert [b for _e, b, _s in s.submitted] == list(range(34))


def test_published_batches_the_client_holds_take_more_slots_not_more_work() -> None:
    s = _Stream(16)
    p = _make_pump(s, n=40, depth=4)
    _submit(p)
    for _ in range(8):  # published, not released: the client is behind
        _publish_head(p, s, release=False)
        _submit(p)
        assert len(p.pending) == 4
    assert len(s.free) == 16 - 4 - 8


def test_the_look_ahead_counts_against_the_same_depth() -> None:
    s = _Stream(16)
    p = _make_pump(s, n=6, depth=4)
    _submit(p)  # batches 0-3
    for _ in range(4):
        _publish_head(p, s, release=True)
        _submit(p)
    # this epoch's 4 and 5 are pending; the next epoch's first two fill the depth
    assert [b for b, _s, _f in p.pending] == [4, 5]
    assert [(e, b) for e, b, _s in s.submitted[-2:]] == [(4, 0), (4, 1)]
    assert len(p.ahead) == 2 and not p._wants_slot()
    _publish_head(p, s, release=True)
    _publish_head(p, s, release=True)  # the epoch is delivered
    _submit(p)
    assert [b for b, _s, _f in p.ahead] == [0, 1, 2, 3]  # at most 4 decoded ahead
    assert not p._wants_slot()


def test_depth_zero_fills_every_free_slot() -> None:
    s = _Stream(16)
    p = _make_pump(s, n=40, depth=0)
    assert len(_submit(p)) == 16
    assert not s.free


def test_the_ring_bounds_it_too() -> None:
    s = _Stream(3)
    p = _make_pump(s, n=40, depth=4)
    assert len(_submit(p)) == 3


@pytest.mark.parametrize(
    ("env", "workers", "want"),
    [(None, 2, 4), (None, 1, 3), (None, 16, 18), (None, None, 0), ("7", 2, 7), ("0", 2, 0)],
)
def test_depth_is_the_workers_plus_slack_or_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: str | None, workers: int | None, want: int
) -> None:
    if env is None:
        monkeypatch.delenv(_pump.DEPTH_ENV, raising=False)
    else:
        monkeypatch.setenv(_pump.DEPTH_ENV, env)
    assert _pump.pump_depth(workers) == want


@pytest.mark.parametrize("raw", ["four", "-1", "1.5"])
def test_a_bad_depth_variable_is_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    monkeypatch.setenv(_pump.DEPTH_ENV, raw)
    with caplog.at_level("WARNING", logger="beton_serve.daemon"):
        assert _pump.pump_depth(2) == 2 + _pump.DEPTH_SLACK
    assert _pump.DEPTH_ENV in caplog.text
