"""Multi-daemon batch assignment and failover (beton_client._transport.multi), with fake daemons."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from beton_client._transport.multi import (
    AllDaemonsLostError,
    CallableLink,
    MultiDaemonReader,
)


@dataclass
class FakeDaemon:
    """Pipelined fake: answers requests in order; dies after `die_after` answers (or on request)."""

    index: int
    die_after: int | None = None
    die_on_request: int | None = None
    requested: list[tuple[int, int]] = field(default_factory=list)
    answered: list[tuple[int, int]] = field(default_factory=list)
    closed: bool = False
    max_pending: int = 0
    released: list[tuple[int, int]] = field(default_factory=list)

    def request(self, epoch: int, batch_index: int) -> None:
        if self.closed:
            raise ConnectionError(f"daemon {self.index} is closed")
        if self.die_on_request is not None and len(self.requested) >= self.die_on_request:
            raise ConnectionError(f"daemon {self.index} refused the request")
        self.requested.append((epoch, batch_index))
        self.max_pending = max(self.max_pending, len(self.requested) - len(self.answered))

    def receive(self) -> Batch:
        if self.closed or (self.die_after is not None and len(self.answered) >= self.die_after):
            raise ConnectionError(f"daemon {self.index} died")
        pos = self.requested[len(self.answered)]
        self.answered.append(pos)
        return Batch(pos[0], pos[1], self.index, self)

    def close(self) -> None:
        self.closed = True


@dataclass
class Batch:
    epoch: int
    index: int
    daemon: int
    src: FakeDaemon

    def release(self) -> None:
        self.src.released.append((self.epoch, self.index))


def _read(daemons: list[FakeDaemon], n: int, credits: int = 2, start: int = 0, lost=None):
    reader = MultiDaemonReader(daemons, credits_per_daemon=credits, on_daemon_lost=lost)
    return reader, list(reader.iter_epoch(7, n, start))


@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_batch_b_comes_from_daemon_b_mod_s_in_order(s: int) -> None:
    daemons = [FakeDaemon(i) for i in range(s)]
    _, out = _read(daemons, 23)
    assert [b.index for b in out] == list(range(23))
    assert all(b.epoch == 7 for b in out)
    assert [b.daemon for b in out] == [i % s for i in range(23)]
    for d in daemons:
        assert d.requested == [(7, b) for b in range(d.index, 23, s)]


def test_prefetch_is_bounded_by_credits() -> None:
    daemons = [FakeDaemon(i) for i in range(3)]
    _read(daemons, 60, credits=2)
    # credits per daemon, plus the batch the consumer is waiting for
    assert all(1 <= d.max_pending <= 3 for d in daemons)
    _read(daemons2 := [FakeDaemon(i) for i in range(3)], 60, credits=4)
    assert max(d.max_pending for d in daemons2) >= 3


def test_start_mid_epoch() -> None:
    daemons = [FakeDaemon(i) for i in range(2)]
    _, out = _read(daemons, 10, start=6)
    assert [b.index for b in out] == [6, 7, 8, 9]
    assert [b.daemon for b in out] == [0, 1, 0, 1]


def test_a_daemon_dying_mid_epoch_loses_and_repeats_nothing() -> None:
    daemons = [FakeDaemon(0), FakeDaemon(1, die_after=3), FakeDaemon(2)]
    lost: list[tuple[int, str]] = []
    reader, out = _read(daemons, 30, lost=lambda i, e: lost.append((i, str(e))))
    assert [b.index for b in out] == list(range(30))
    assert lost == [(1, "daemon 1 died")]
    assert reader.alive == (0, 2)
    assert daemons[1].closed
    # before the failure daemon 1 delivered its first 3 batches; afterwards nothing came from it
    assert [b.index for b in out if b.daemon == 1] == [1, 4, 7]
    # the survivors produced the rest of its share, split deterministically
    for b in out:
        if b.index % 3 == 1 and b.index > 7:
            assert b.daemon == reader.owner(b.index) == [0, 2][(b.index // 3) % 2]


def test_reassignment_is_deterministic() -> None:
    runs = []
    for _ in range(2):
        daemons = [FakeDaemon(0), FakeDaemon(1, die_after=2), FakeDaemon(2), FakeDaemon(3)]
        _, out = _read(daemons, 40)
        runs.append([(b.index, b.daemon) for b in out])
    assert runs[0] == runs[1]


def test_a_daemon_refusing_requests_is_failed_over() -> None:
    daemons = [FakeDaemon(0, die_on_request=1), FakeDaemon(1)]
    reader, out = _read(daemons, 8)
    assert [b.index for b in out] == list(range(8))
    # daemon 0 took the request for batch 0, then refused batch 2: batch 0, requested but never
    # received, moved to daemon 1 with the rest
    assert daemons[0].requested == [(7, 0)] and daemons[0].answered == []
    assert [b.daemon for b in out] == [1] * 8
    assert reader.alive == (1,)


def test_all_daemons_dying_raises_with_the_cause() -> None:
    daemons = [FakeDaemon(0, die_after=2), FakeDaemon(1, die_after=1)]
    reader = MultiDaemonReader(daemons)
    got = []
    with pytest.raises(AllDaemonsLostError, match="all 2 daemons failed; the last one, #") as info:
        for b in reader.iter_epoch(0, 20):
            got.append(b.index)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert got == [0, 1, 2]  # delivered in order and without gaps up to the failure
    # Every daemon's failure is kept, so the Loader can tell "all drained" from a crash.
    assert sorted(info.value.failures) == [0, 1]
    assert info.value.failures[1] is info.value.__cause__ or (
        info.value.failures[0] is info.value.__cause__
    )


def test_randomized_failures_never_lose_or_repeat() -> None:
    rng = random.Random(5)
    for _ in range(200):
        s = rng.randint(2, 5)
        daemons = [
            FakeDaemon(i, die_after=rng.choice([None, rng.randint(0, 10)])) for i in range(s)
        ]
        daemons[rng.randrange(s)].die_after = None  # keep at least one alive
        n = rng.randint(0, 40)
        start = rng.randint(0, n)
        _, out = _read(daemons, n, credits=rng.randint(1, 4), start=start)
        assert [b.index for b in out] == list(range(start, n))


def test_stopping_early_drains_and_releases_what_was_prefetched() -> None:
    daemons = [FakeDaemon(i) for i in range(2)]
    reader = MultiDaemonReader(daemons, credits_per_daemon=3, discard=lambda b: b.release())
    it = reader.iter_epoch(0, 50)
    first = [next(it) for _ in range(3)]
    it.close()
    for d in daemons:
        assert d.answered == d.requested  # links are back in sync for the next epoch
    released = sorted(p for d in daemons for p in d.released)
    assert released == sorted(
        set(p for d in daemons for p in d.requested) - {(0, 0), (0, 1), (0, 2)}
    )
    assert [b.index for b in first] == [0, 1, 2]
    out = list(reader.iter_epoch(1, 4))
    assert [(b.epoch, b.index) for b in out] == [(1, 0), (1, 1), (1, 2), (1, 3)]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_epoch_stopped_by_ctrl_c_drains_nothing_and_is_out_of_step(exc) -> None:
    """Ctrl-C can land between a link's receive and the reader's bookkeeping (here: the answer
    is taken, then the interrupt). A drain would then wait for an answer that never comes (a
    gRPC link waited for good): the reader drains nothing, gives back what it holds, and says
    it is out of step, so its owner re-opens the stream."""
    daemons = [FakeDaemon(i) for i in range(2)]
    reader = MultiDaemonReader(daemons, credits_per_daemon=3, discard=lambda b: b.release())
    it = reader.iter_epoch(0, 50)
    assert [next(it).index for _ in range(3)] == [0, 1, 2]
    real = daemons[1].receive

    def receive_then_interrupted() -> Batch:
        real()  # the answer is consumed, never counted
        raise exc

    daemons[1].receive = receive_then_interrupted  # type: ignore[method-assign]
    assert not reader.out_of_step
    with pytest.raises(exc):
        next(it)
    assert reader.out_of_step
    owed = [len(d.requested) - len(d.answered) for d in daemons]
    assert owed[0] > 0  # daemon 0 still owed answers, and nobody waited for them
    received_not_yielded = {(d.index, p) for d in daemons for p in d.answered} - {
        (0, (0, 0)),
        (1, (0, 1)),
        (0, (0, 2)),
        (1, (0, 3)),  # the one lost to the interrupt
    }
    released = {(d.index, p) for d in daemons for p in d.released}
    assert released == received_not_yielded


def test_callable_link_adapts_a_fetch_function() -> None:
    calls: list[tuple[int, int, int]] = []
    dead = {1}

    def fetch(d: int, epoch: int, b: int) -> tuple[int, int]:
        calls.append((d, epoch, b))
        if d in dead:
            raise ConnectionError("gone")
        return (b, d)

    reader = MultiDaemonReader([CallableLink(fetch, i) for i in range(3)])
    out = list(reader.iter_epoch(2, 9))
    assert [b for b, _ in out] == list(range(9))
    assert {d for _, d in out} == {0, 2}
    assert calls[1] == (1, 2, 1)


def test_argument_validation() -> None:
    with pytest.raises(ValueError):
        MultiDaemonReader([])
    with pytest.raises(ValueError):
        MultiDaemonReader([FakeDaemon(0)], credits_per_daemon=0)
    with pytest.raises(ValueError):
        list(MultiDaemonReader([FakeDaemon(0)]).iter_epoch(0, 3, start=4))


def test_one_daemon_failing_is_named_by_its_address() -> None:
    """It read "all 1 daemons failed; the last one, 0, with: ..."."""
    reader = MultiDaemonReader([FakeDaemon(0, die_after=1)], names=["unix:///run/d.sock"])
    with pytest.raises(AllDaemonsLostError) as info:
        list(reader.iter_epoch(0, 8))
    assert str(info.value).startswith("the daemon unix:///run/d.sock failed: ")
