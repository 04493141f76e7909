"""The daemon's end of the shm notice channel (the protocol is in :mod:`beton_wire.notice`).

Data structure: one :class:`NoticeHub` per daemon listens on a ``SOCK_SEQPACKET`` unix socket
``/dev/shm/beton-<pid>-<instance>-notice-<n>`` (mode 0600; only the daemon's user may connect, which
``SO_PEERCRED`` re-checks; root too, since root may read the rings anyway). Each shm stream
registers a random token with the hub; a client connection that presents the token in its
``HELLO`` becomes that stream's :class:`NoticeConn`. The kernel's ``SO_PEERCRED`` pid of that
connection (:attr:`NoticeConn.peer_pid`) is how the daemon learns who its client is: the pid a
client writes in its request is never used (``transport.peer``).

Ownership: the hub owns the listening socket, its file and every connection; the daemon closes
the hub, which unlinks the file (the next daemon's sweep removes it after a crash, like a ring).
A stream closes its own connection when it ends, which is how its client learns that it ended.

Threads: the hub and the reading side run on the daemon's event-loop thread, driven by
``loop.add_reader``; a stream's ``NoticePump`` also sends from engine workers, so a connection's
sends and its close are serialised by its own lock. Sends never block: a stream has at most ``slot_count`` BATCH notices and one END outstanding,
far below a socket buffer, so a send that would block means a client that stopped reading, and
fails the stream with :class:`~beton_serve.errors.TransportError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from beton_wire import notice

from beton_serve.errors import TransportError
from beton_serve.transport.shm import SHM_DIR, ShmNamer

__all__ = ["HELLO_TIMEOUT_S", "NoticeConn", "NoticeHub"]

log = logging.getLogger("beton_serve.transport.notice")

#: Seconds a connection may stay open without a valid ``HELLO``.
HELLO_TIMEOUT_S = 10.0
#: Connections that have not said ``HELLO`` yet, at most.
MAX_UNBOUND = 256
#: The longest pause in listening after a failed ``accept`` (``NoticeHub._accept_failed``).
ACCEPT_BACKOFF_MAX_S = 1.0
_UCRED = struct.Struct("3i")  # pid, uid, gid


class NoticeConn:
    """One client's connection, bound to one stream after its ``HELLO``.

    Attributes:
        peer_pid: the connecting process, from ``SO_PEERCRED`` (in the daemon's PID namespace;
            0 if the client's is not visible from it).
        on_release: called with ``(slot, batch_index, wait_us)`` for each ``RELEASE``.
        on_wake: called for each ``WAKE`` (the client stored release words while the daemon
            was starved).
        on_start: called with ``(epoch, next_batch, credits)`` for each ``START``.
        on_close: called once when the client closes the connection or breaks the protocol.
    """

    def __init__(self, hub: NoticeHub, sock: socket.socket, peer_pid: int = 0) -> None:
        self._hub = hub
        self._sock = sock
        self.peer_pid = peer_pid
        self._lock = threading.Lock()
        self.bound = False
        self.closed = False
        self.on_release: Callable[[int, int, int], None] | None = None
        self.on_wake: Callable[[], None] | None = None
        self.on_start: Callable[[int, int, int], None] | None = None
        self.on_close: Callable[[], None] | None = None

    # -- sending (the stream's serving task) ----------------------------------------------------
    def send_batch(self, slot: int, epoch: int, index: int, length: int) -> None:
        """Tell the client that ``slot`` holds batch ``index`` of ``epoch`` (``length`` rows).

        Raises:
            TransportError: the client is gone or stopped reading.
        """
        self._send(notice.batch(slot, epoch, index, length))

    def send_batch_at(
        self, slot: int, epoch: int, index: int, length: int, segment: str, offset: int
    ) -> None:
        """Like :meth:`send_batch`, for a batch that lives at ``offset`` in ``segment``."""
        self._send(notice.batch_at(slot, epoch, index, length, segment, offset))

    def send_end(self, epoch: int, batches: int) -> None:
        """Tell the client that ``epoch`` ended after ``batches`` batches."""
        self._send(notice.end(epoch, batches))

    def _send(self, record: bytes) -> None:
        try:
            with self._lock:
                if self.closed:
                    raise TransportError("the client closed the stream's notice channel")
                self._sock.send(record)
        except BlockingIOError:
            raise TransportError(
                "the client stopped reading its notice channel (its socket buffer is full)"
            ) from None
        except OSError as exc:
            raise TransportError(f"the client's notice channel broke: {exc}") from None

    # -- receiving (loop reader) ------------------------------------------------------------------
    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data = self._sock.recv(notice.MAX_RECORD + 1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            try:
                if len(data) > notice.MAX_RECORD:  # recv cut it: not a record we know
                    raise ValueError(f"a notice record over {notice.MAX_RECORD} bytes")
                kind, a, b, c, _d, payload = notice.unpack(data)
            except ValueError:
                kind, a, b, c, payload = -1, 0, 0, 0, b""
            if not self.bound:
                if kind != notice.HELLO or not self._hub._bind(payload, self):
                    log.warning("notice channel: a connection presented no valid stream token")
                    self.close()
                    return
                self.bound = True
            elif kind == notice.RELEASE and self.on_release is not None:
                self.on_release(a, b, c)
            elif kind == notice.WAKE:
                if self.on_wake is not None:
                    self.on_wake()
            elif kind == notice.START and self.on_start is not None:
                self.on_start(b, c, a)
            else:
                log.warning(
                    "notice channel: a malformed or unexpected record (kind %d); closing it", kind
                )
                self.close()
                return

    def _expire(self) -> None:
        if not self.bound:
            log.warning("notice channel: no HELLO within %.0f s; closing it", HELLO_TIMEOUT_S)
            self.close()

    def close(self) -> None:
        """Close the connection (idempotent); calls ``on_close`` once (event-loop thread)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(Exception):
                self._hub.loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._hub._forget(self)
        cb, self.on_close = self.on_close, None
        self.on_release = self.on_wake = self.on_start = None
        if cb is not None:
            cb()


class NoticeHub:
    """Listens for notice connections and hands each to the stream whose token it presents.

    Args:
        namer: names the socket file like the daemon's segments (``beton-<pid>-<instance>-notice-<n>``).
        loop: the daemon's event loop (call from its thread).
        shm_dir: where the socket file lives; it must be the directory of the rings.

    Raises:
        OSError: the socket cannot be created or bound.
    """

    def __init__(
        self,
        namer: ShmNamer,
        loop: asyncio.AbstractEventLoop,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        self.loop = loop
        self.name = namer.next("notice")
        self.path = shm_dir / self.name
        self._waiting: dict[bytes, asyncio.Future[NoticeConn]] = {}
        self._conns: set[NoticeConn] = set()
        self._closed = False
        self._accept_backoff = 0.0  # seconds; 0 while accepting works
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        bound = False
        try:
            old = os.umask(0o177)  # the file is created 0600: nobody else may connect
            try:
                sock.bind(str(self.path))
                bound = True
            finally:
                os.umask(old)
            sock.setblocking(False)
            sock.listen(128)
            loop.add_reader(sock.fileno(), self._accept)
        except BaseException:
            sock.close()
            if bound:  # only the file this bind made: a failed bind's path is someone else's
                self.path.unlink(missing_ok=True)
            raise
        self._sock = sock

    def register(self) -> tuple[bytes, asyncio.Future[NoticeConn]]:
        """A fresh token for a stream, and the future of the connection that presents it."""
        token = secrets.token_bytes(notice.TOKEN_BYTES)
        fut: asyncio.Future[NoticeConn] = self.loop.create_future()
        self._waiting[token] = fut
        return token, fut

    def unregister(self, token: bytes) -> None:
        """Forget a stream's token (it ended); a connection bound to it is the stream's to close."""
        fut = self._waiting.pop(token, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def _bind(self, token: bytes, conn: NoticeConn) -> bool:
        fut = self._waiting.pop(bytes(token), None)
        if fut is None or fut.done():
            return False
        fut.set_result(conn)
        return True

    def _forget(self, conn: NoticeConn) -> None:
        self._conns.discard(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like
                self._accept_failed(exc)
                return
            self._accept_backoff = 0.0
            try:
                pid, uid, _gid = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
            except OSError:
                pid, uid = 0, -1
            unbound = sum(1 for c in self._conns if not c.bound)
            if uid not in (os.getuid(), 0) or unbound >= MAX_UNBOUND:
                sock.close()
                continue
            sock.setblocking(False)
            conn = NoticeConn(self, sock, peer_pid=max(0, pid))
            self._conns.add(conn)
            self.loop.add_reader(sock.fileno(), conn._on_readable)
            self.loop.call_later(HELLO_TIMEOUT_S, conn._expire)

    def _accept_failed(self, exc: OSError) -> None:
        """Stop listening for a while after a failed ``accept`` (out of file descriptors):
        the pending connection keeps the socket readable, so the loop called :meth:`_accept`
        again at once, for ever (a core spinning and ~9,000 log lines a second until fds came
        back). Listen again after a back-off that doubles up to a second; log once per
        back-off round."""
        self._accept_backoff = min(ACCEPT_BACKOFF_MAX_S, 2 * self._accept_backoff or 0.05)
        log.warning(
            "notice channel: accept failed: %s; listening again in %.2f s",
            exc,
            self._accept_backoff,
        )
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._sock.fileno())
        self.loop.call_later(self._accept_backoff, self._listen_again)

    def _listen_again(self) -> None:
        if self._closed:
            return
        self.loop.add_reader(self._sock.fileno(), self._accept)
        self._accept()  # what waited meanwhile (a new failure backs off again)

    def close(self) -> None:
        """Stop listening, close every connection and unlink the socket file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self.path.unlink(missing_ok=True)
        for conn in list(self._conns):
            conn.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self._waiting.clear()
