# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Coalesced waits of a served shm stream (``beton_client._stream._Stream.nap_for`` and
``NoticeChannel.recv(nap_s)``): when a batch is not published yet and batches come less than a
few milliseconds apart (under ``NAP_MAX_PACE_S``), the client naps a third of its ring's slots in
batch periods (at most ``NAP_BATCHES``) before waiting on its notice socket, so that one wake-up
collects several batches.

The unit tests pin when it naps and that a nap loses nothing (a record sent during the nap, the
end of the channel during the nap); the served test checks, bit for bit against the in-process
Loader, that a stream that napped delivered exactly the same batches, and that
``BETON_CLIENT_COALESCE_WAITS=0`` turns the naps off.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from beton_client import Loader, OrderOption, _stream
from beton_client._transport import shm as client_shm
from beton_client._transport.shm import NoticeChannel
from beton_serve.loader import Loader as InProcessLoader
from beton_wire import notice
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.served_epochs import assert_same_epochs, read_epochs, rrc_pipelines

pytestmark = pytest.mark.timeout(60)


def _channel() -> tuple[NoticeChannel, socket.socket]:
    """A NoticeChannel over one end of a socket pair, and the daemon's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = NoticeChannel.__new__(NoticeChannel)
    ch._sock = ours
    return ch, theirs


class _Naps:
    """Stands in for ``time.sleep`` in the client's shm module: records each nap and runs
    ``during`` (what the daemon does meanwhile)."""

    def __init__(self, during: Any = None) -> None:
        self.naps: list[float] = []
        self.during = during

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        if self.during is not None:
            self.during()


def test_a_record_already_there_is_read_without_a_nap(monkeypatch: pytest.MonkeyPatch) -> None:
    ch, daemon = _channel()
    naps = _Naps()
    monkeypatch.setattr(client_shm.time, "sleep", naps.sleep)
    try:
        daemon.send(notice.batch(3, 1, 7, 512))
        assert ch.recv(0.001) == (notice.BATCH, 3, 1, 7, 512, b"")
        assert naps.naps == []
    finally:
        ch.close()
        daemon.close()


def test_a_record_sent_during_the_nap_is_read_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    ch, daemon = _channel()
    naps = _Naps(lambda: daemon.send(notice.batch(0, 2, 5, 100)))
    monkeypatch.setattr(client_shm.time, "sleep", naps.sleep)
    try:
        assert ch.recv(0.0007) == (notice.BATCH, 0, 2, 5, 100, b"")
        assert naps.naps == [0.0007]
    finally:
        ch.close()
        daemon.close()


def test_the_channel_closing_during_the_nap_is_end_of_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ch, daemon = _channel()
    naps = _Naps(daemon.close)
    monkeypatch.setattr(client_shm.time, "sleep", naps.sleep)
    try:
        assert ch.recv(0.001) is None
        assert len(naps.naps) == 1
    finally:
        ch.close()


def test_no_nap_asked_means_a_plain_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    ch, daemon = _channel()
    naps = _Naps()
    monkeypatch.setattr(client_shm.time, "sleep", naps.sleep)
    try:
        daemon.send(notice.end(4, 10))
        assert ch.recv() == (notice.END, 0, 4, 10, 0, b"")
        assert naps.naps == []
    finally:
        ch.close()
        daemon.close()


def _stream_stub(may_nap: bool = True, slots: int = 16) -> _stream._Stream:
    s = _stream._Stream.__new__(_stream._Stream)
    s._may_nap = may_nap
    s._nap_batches = _stream.nap_batches(slots)
    s._pace = 0.0
    s._last_ask = 0.0
    return s


def _naps_at(s: _stream._Stream, period: float, n: int, start: float = 100.0) -> list[float]:
    """``nap_for`` asked every ``period`` seconds, ``n`` times (the first is an epoch's first)."""
    return [s.nap_for(start + i * period, i == 0) for i in range(n)]


def test_batches_a_fraction_of_a_millisecond_apart_nap_five_periods_on_sixteen_slots() -> None:
    naps = _naps_at(_stream_stub(), 0.0004, 80)
    assert naps[0] == 0.0  # an epoch's first batch never naps (its latency is start-up time)
    assert naps[-1] == pytest.approx(5 * 0.0004, rel=0.02)
    assert all(0.0 <= x <= 5 * 0.0004 * 1.001 for x in naps)


@pytest.mark.parametrize(("slots", "periods"), [(8, 8 / 3), (12, 4.0), (16, 5.0), (64, 5.0)])
def test_the_nap_is_a_third_of_the_ring_in_batch_periods_at_most_five(
    slots: int, periods: float
) -> None:
    # The daemon fills the ring while the client naps: a nap must leave room for the slot the
    # client holds and those being decoded, and a ring of 8 slots naps as before (~2.5).
    assert _stream.nap_batches(slots) == pytest.approx(periods)
    naps = _naps_at(_stream_stub(slots=slots), 0.0004, 80)
    assert naps[-1] == pytest.approx(periods * 0.0004, rel=0.02)


def test_slow_batches_never_nap() -> None:
    # 20 ms apart (ImageNet-sized batches): a wake-up per batch is cheap next to the batch
    assert _naps_at(_stream_stub(), 0.02, 60) == [0.0] * 60


def test_four_clients_of_one_daemon_nap_too() -> None:
    # CIFAR batches shared by four clients come ~1.6 ms apart to each
    naps = _naps_at(_stream_stub(), 0.0016, 60)
    assert naps[-1] == pytest.approx(5 * 0.0016, rel=0.02)


def test_a_stream_that_may_not_nap_never_does() -> None:
    assert _naps_at(_stream_stub(may_nap=False), 0.0004, 40) == [0.0] * 40


def test_a_long_pause_in_the_training_loop_stops_the_naps() -> None:
    s = _stream_stub()
    _naps_at(s, 0.0004, 60)
    assert s.nap_for(100.0 + 60 * 0.0004 + 0.5, False) == 0.0  # the loop paused 0.5 s


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("coalesce", ["1", "0"])
def test_a_stream_that_naps_serves_what_the_in_process_loader_does(
    daemon_factory, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, coalesce: str
) -> None:
    # Nap whatever the pace and ring (this machine's pace is not the point): JPEG batches on
    # one daemon worker are slower than this client, so batches are often not there yet.
    monkeypatch.setattr(_stream, "NAP_MAX_PACE_S", 10.0)
    monkeypatch.setattr(_stream, "NAP_MIN_SLOTS", 1)
    monkeypatch.setenv(_stream.ENV_COALESCE, coalesce)
    naps = _Naps()
    real_sleep = client_shm.time.sleep

    def sleep(seconds: float) -> None:
        naps.sleep(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(client_shm.time, "sleep", sleep)
    beton = fixtures_dir / "images_jpg.beton"
    kw: dict[str, Any] = dict(batch_size=4, order=OrderOption.RANDOM, seed=5, drop_last=False)
    with InProcessLoader(str(beton), pipelines=rrc_pipelines(48), num_workers=1, **kw) as ref:
        want = read_epochs(ref, 3)
    d = daemon_factory([beton], args=["--workers", "1"])
    with Loader("images_jpg", pipelines=rrc_pipelines(48), server=d.address, **kw) as ld:
        got = read_epochs(ld, 3)
        assert ld._feed is not None and ld._feed.notice is not None  # the notice channel
    assert len(got) == len(want) >= 6
    assert_same_epochs(got, want)
    if coalesce == "1":
        assert naps.naps, "the stream never napped: the test checked nothing about naps"
        assert all(x > 0.0 for x in naps.naps)
    else:
        assert naps.naps == []
