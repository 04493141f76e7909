"""Who is at the other end of a call: the peer's uid and pid, taken from the kernel only.

A client reports its uid and pid in ``OpenStreamRequest.host``. The daemon never uses them for a
decision, because any process can write anything there. What it uses (:func:`peer_credentials`,
called by the RPC layer with ``context.peer()`` when a stream opens):

* **a call on the Unix socket**: the daemon's own uid, while the socket admits no one else.
  grpc does not expose ``SO_PEERCRED`` for a call (grpc/grpc#15511 and #28755: the auth context
  of a Unix-socket call is empty, and ``peer()`` is just ``"unix:"``). But connecting needs write
  permission on the socket file, and the socket is created with mode 0600
  (``rpc.create_server`` binds it under umask 0177), so the kernel lets only the daemon's user
  and root connect. Root may read the daemon's shared memory anyway, so it is treated like the
  daemon's user. The socket's mode is looked at again on every call (:class:`UnixSocketWatch`):
  once it admits others (a ``chmod``, an ACL, another owner), which the docs once suggested for
  ``socket_owner=``, its callers are unverified from then on (uid ``None``), as a TCP peer that
  is not in the socket table: grpc only, and only the datasets any peer may read. Before, such a
  caller was taken for the daemon's user and could open any file that user can read.
* **a TCP call**: the uid that owns the client's socket in the kernel's socket table
  (``/proc/net/tcp`` and ``tcp6``: the established entry whose local address is the peer's
  address). A peer that is not there (another host, another network namespace) is unverified:
  uid ``None``, which the negotiation treats as another user, so it gets grpc.
* **the pid** is 0 (unknown) when the stream opens. An shm stream's client proves its pid when
  it connects its notice channel: the daemon reads ``SO_PEERCRED`` there
  (``transport.notice``), and that pid is the one the liveness monitor watches. A stream without
  a notice channel ends when its call ends (the kernel closes a dead process's connection).
"""

from __future__ import annotations

import logging
import os
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from beton_wire.socket_table import tcp_socket_uid

__all__ = ["PeerCredentials", "UnixSocketWatch", "peer_credentials", "tcp_socket_uid"]

#: ``PeerCredentials.source`` of a call on the daemon's own, private Unix socket.
UNIX_SOCKET = "unix socket"

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerCredentials:
    """A call's peer as the kernel knows it.

    Attributes:
        uid: the peer's user id, or ``None`` when it could not be verified.
        pid: the peer's process id in the daemon's PID namespace, or 0 when unknown.
        source: how it was learnt, for logs ("unix socket", "tcp socket table", "unverified").
    """

    uid: int | None
    pid: int = 0
    source: str = "unverified"


class UnixSocketWatch:
    """Whether the daemon's Unix socket still admits only the daemon's user (and root).

    Connecting to a Unix socket needs write permission on its file, so a socket owned by the
    daemon's uid with no group or other permission bits (an ACL shows in the group bits) admits
    nobody else. :meth:`private` looks again (one ``lstat``) on every call that asks who its peer
    is. Once the socket was seen admitting others it stays untrusted for the daemon's life: a
    connection made then may still be open. A socket file removed or replaced keeps the last
    verdict (nothing new connects through the daemon's own socket any more).

    Args:
        path: the socket the daemon listens on (bound already).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        st = os.lstat(path)
        self._inode = (st.st_dev, st.st_ino)
        self.shared = False

    def private(self) -> bool:
        """Whether the socket admits only the daemon's user (see the class docstring)."""
        if self.shared:
            return False
        try:
            st = os.lstat(self.path)
        except OSError:
            return True
        if (st.st_dev, st.st_ino) != self._inode:
            return True
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return True
        self.shared = True
        log.warning(
            "the socket %s admits other users (mode %o, owner uid %d): its callers are "
            "unverified from now on (grpc only, only the datasets any peer may read), until a "
            "restart. Serve other users over TCP with a token and TLS instead",
            self.path,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
        )
        return False


def peer_credentials(
    peer: str, proc: Path = Path("/proc"), unix_socket: UnixSocketWatch | None = None
) -> PeerCredentials:
    """The credentials of the peer that grpc's ``context.peer()`` names (see the module
    docstring): ``unix:...``, ``ipv4:HOST:PORT`` or ``ipv6:[HOST]:PORT`` (possibly
    percent-encoded). Anything else is unverified, and so is a Unix-socket peer once
    ``unix_socket`` (the daemon's socket) admits other users."""
    text = urllib.parse.unquote(peer)
    if text.startswith("unix:"):
        if unix_socket is not None and not unix_socket.private():
            return PeerCredentials(uid=None, source="shared unix socket")
        return PeerCredentials(uid=os.getuid(), source=UNIX_SOCKET)
    for prefix in ("ipv4:", "ipv6:"):
        if text.startswith(prefix):
            host, sep, port = text[len(prefix) :].rpartition(":")
            if not sep or not port.isdigit():
                break
            uid = tcp_socket_uid(host.strip("[]"), int(port), proc)
            if uid is not None:
                return PeerCredentials(uid=uid, source="tcp socket table")
            break
    return PeerCredentials(uid=None)
