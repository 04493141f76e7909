"""Who is at the other end of a call: the peer's uid and pid, taken from the kernel only.

A client reports its uid and pid in ``OpenStreamRequest.host``. The daemon never uses them for a
decision, because any process can write anything there. What it uses (:func:`peer_credentials`,
called by the RPC layer with ``context.peer()`` when a stream opens):

* **a call on the Unix socket**: the daemon's own uid. grpc does not expose ``SO_PEERCRED`` for
  a call (grpc/grpc#15511 and #28755: the auth context of a Unix-socket call is empty, and
  ``peer()`` is just ``"unix:"``). But the kernel lets only the daemon's user and root connect:
  the socket is created with mode 0600 (``rpc.create_server`` binds it under umask 0177), in a
  directory of the daemon's user that nobody else may write (``cli._serve.address_lock``).
  Root may read the daemon's shared memory anyway, so it is treated like the daemon's user.
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

import ipaddress
import os
import struct
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PeerCredentials", "peer_credentials", "tcp_socket_uid"]

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_ESTABLISHED = "01"


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


def _plain(ip: _IP) -> _IP:
    """An IPv4-mapped IPv6 address as the IPv4 address (``::ffff:127.0.0.1`` is 127.0.0.1)."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _decode(field: str) -> tuple[_IP, int]:
    """An address of ``/proc/net/tcp*`` (``0100007F:8A9A``: 32-bit words in host order)."""
    host, _, port = field.partition(":")
    raw = b"".join(struct.pack("=I", int(host[i : i + 8], 16)) for i in range(0, len(host), 8))
    return _plain(ipaddress.ip_address(raw)), int(port, 16)


def tcp_socket_uid(host: str, port: int, proc: Path = Path("/proc")) -> int | None:
    """The uid owning the established TCP socket whose local address is ``host:port`` in this
    network namespace, or ``None`` if there is none or the entries disagree.

    Args:
        host: an IPv4 or IPv6 address (IPv4-mapped IPv6 addresses match their IPv4 form).
        port: the port.
        proc: procfs root (tests).
    """
    try:
        want = (_plain(ipaddress.ip_address(host)), port)
    except ValueError:
        return None
    uids: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != _ESTABLISHED:
                continue
            try:
                if _decode(f[1]) == want:
                    uids.add(int(f[7]))
            except ValueError:
                continue
    return uids.pop() if len(uids) == 1 else None


def peer_credentials(peer: str, proc: Path = Path("/proc")) -> PeerCredentials:
    """The credentials of the peer that grpc's ``context.peer()`` names (see the module
    docstring): ``unix:...``, ``ipv4:HOST:PORT`` or ``ipv6:[HOST]:PORT`` (possibly
    percent-encoded). Anything else is unverified."""
    text = urllib.parse.unquote(peer)
    if text.startswith("unix:"):
        return PeerCredentials(uid=os.getuid(), source="unix socket")
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
