"""The notice channel's records (beton_wire.notice) and the daemon's NoticeHub with the client's
NoticeChannel, on a real event loop and a socket in a temporary directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from beton_client._transport.shm import NoticeChannel
from beton_client.errors import TransportError as ClientTransportError
from beton_serve.errors import TransportError
from beton_serve.transport.notice import NoticeHub
from beton_serve.transport.shm import ShmNamer
from beton_wire import notice

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory: unix socket paths are limited to 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_records_round_trip_and_are_32_bytes() -> None:
    assert notice.RECORD.size == 32
    assert notice.unpack(notice.batch(3, 7, 11, 512)) == (notice.BATCH, 3, 7, 11, 512, b"")
    assert notice.unpack(notice.end(7, 40)) == (notice.END, 0, 7, 40, 0, b"")
    assert notice.unpack(notice.release(2, 9, -5)) == (notice.RELEASE, 2, 9, 0, 0, b"")
    tok = bytes(range(notice.TOKEN_BYTES))
    assert notice.unpack(notice.hello(tok)) == (notice.HELLO, 0, 0, 0, 0, tok)
    with pytest.raises(ValueError, match="at least 32"):
        notice.unpack(b"\x02" * 31)


def test_hub_binds_a_connection_to_its_stream_and_carries_both_ways(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = NoticeHub(ShmNamer(), loop, shm_dir=tmp_path)
        try:
            assert stat.S_ISSOCK(os.stat(hub.path).st_mode)
            assert stat.S_IMODE(os.stat(hub.path).st_mode) == 0o600
            token, fut = hub.register()
            other, other_fut = hub.register()
            ch = await loop.run_in_executor(
                None, lambda: NoticeChannel(hub.name, token, shm_dir=tmp_path)
            )
            conn = await asyncio.wait_for(fut, 5)
            assert not other_fut.done()
            released: list[tuple[int, int, int]] = []
            closed: list[bool] = []
            conn.on_release = lambda *a: released.append(a)
            conn.on_close = lambda: closed.append(True)
            conn.send_batch(1, 0, 4, 16)
            conn.send_end(0, 5)
            assert await loop.run_in_executor(None, ch.recv) == (notice.BATCH, 1, 0, 4, 16, b"")
            assert await loop.run_in_executor(None, ch.recv) == (notice.END, 0, 0, 5, 0, b"")
            ch.release(1, 4, 250)
            for _ in range(100):
                if released:
                    break
                await asyncio.sleep(0.01)
            assert released == [(1, 4, 250)]
            ch.close()  # the client leaves: the stream hears of it once
            for _ in range(100):
                if closed:
                    break
                await asyncio.sleep(0.01)
            assert closed == [True] and conn.closed
            with pytest.raises(TransportError, match="closed"):
                conn.send_batch(0, 0, 5, 16)
            hub.unregister(other)
            assert other_fut.cancelled()
        finally:
            hub.close()
        assert not hub.path.exists()
        hub.close()  # idempotent

    asyncio.run(main())


def test_daemon_closing_the_connection_reads_as_end_of_file(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = NoticeHub(ShmNamer(), loop, shm_dir=tmp_path)
        try:
            token, fut = hub.register()
            ch = NoticeChannel(hub.name, token, shm_dir=tmp_path)
            conn = await asyncio.wait_for(fut, 5)
            conn.close()
            assert await loop.run_in_executor(None, ch.recv) is None
            ch.release(0, 0, 0)  # a daemon that is gone: no error here
            ch.close()
        finally:
            hub.close()

    asyncio.run(main())


def test_client_refuses_foreign_socket_names(tmp_path: Path) -> None:
    for name in ("../etc/x", "other-socket", "beton-1/../../x"):
        with pytest.raises(ClientTransportError, match="not a beton-serve socket"):
            NoticeChannel(name, b"t" * 32, shm_dir=tmp_path)
    with pytest.raises(OSError):
        NoticeChannel("beton-1-notice-0", b"t" * 32, shm_dir=tmp_path)


class _FixedNamer(ShmNamer):
    """A namer whose next name is one the test chose (someone else's file)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.fixed = name

    def next(self, purpose: str) -> str:
        return self.fixed


def test_a_hub_that_cannot_bind_leaves_the_file_in_its_way_alone(tmp_path: Path) -> None:
    """A failed bind's path belongs to someone else: the hub used to unlink it (as root, any
    user's file), which also hid the real error behind a later one."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        theirs = tmp_path / "beton-1-notice-0"
        theirs.write_bytes(b"not ours")
        with pytest.raises(OSError, match="in use"):
            NoticeHub(_FixedNamer(theirs.name), loop, shm_dir=tmp_path)
        assert theirs.read_bytes() == b"not ours"

    asyncio.run(main())


def test_a_failed_accept_backs_off_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors, ``accept`` fails while the pending connection keeps the socket
    readable: the hub was called again at once, for ever (a core and ~9,000 log lines a
    second). It now stops listening for a back-off, then accepts what waited."""
    import errno
    import socket as socket_mod

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = NoticeHub(ShmNamer(), loop, shm_dir=tmp_path)
        try:
            calls = [0]
            real = hub._sock

            class Exhausted:
                def accept(self) -> tuple[socket_mod.socket, object]:
                    calls[0] += 1
                    if calls[0] <= 3:
                        raise OSError(errno.EMFILE, "Too many open files")
                    return real.accept()

                def __getattr__(self, name: str) -> object:
                    return getattr(real, name)

            monkeypatch.setattr(hub, "_sock", Exhausted())
            token, fut = hub.register()
            ch = await loop.run_in_executor(
                None, lambda: NoticeChannel(hub.name, token, shm_dir=tmp_path)
            )
            await asyncio.sleep(0.02)
            assert calls[0] == 1  # one try, then no reader until the back-off ends
            conn = await asyncio.wait_for(fut, 5)  # 0.05 s, then 0.1 s, then accepted
            assert calls[0] >= 4 and hub._accept_backoff == 0.0
            assert not conn.closed
            ch.close()
        finally:
            hub.close()

    asyncio.run(main())


def test_an_oversized_record_closes_the_channel_instead_of_counting_as_a_release(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hub reads at most one byte more than the largest record; a longer one was cut to
    that and, when it began like a ``RELEASE``, freed a slot. Now it closes the channel, as any
    record the daemon does not know does."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hub = NoticeHub(ShmNamer(), loop, shm_dir=tmp_path)
        try:
            token, fut = hub.register()
            ch = await loop.run_in_executor(
                None, lambda: NoticeChannel(hub.name, token, shm_dir=tmp_path)
            )
            conn = await asyncio.wait_for(fut, 5)
            released: list[tuple[int, int, int]] = []
            closed: list[bool] = []
            conn.on_release = lambda *a: released.append(a)
            conn.on_close = lambda: closed.append(True)
            big = notice.release(1, 4, 250) + b"\0" * notice.MAX_RECORD
            ch._sock.send(big)
            for _ in range(200):
                if closed:
                    break
                await asyncio.sleep(0.01)
            assert closed == [True] and conn.closed
            assert released == []
            ch.close()
        finally:
            hub.close()

    with caplog.at_level("WARNING", logger="beton_serve.transport.notice"):
        asyncio.run(main())
    assert "malformed or unexpected record (kind -1)" in caplog.text
