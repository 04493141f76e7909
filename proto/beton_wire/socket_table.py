"""Who owns a TCP socket, from the kernel's socket table (``/proc/net/tcp`` and ``tcp6``).

Both ends use it: the daemon to learn which uid a loopback client is
(``beton_serve.transport.peer``), a client to learn which uid listens on the loopback port it
is about to send its token to (``beton_client._security.check_loopback_target``). A process may
write anything in a request; the table is the kernel's.

API::

    tcp_socket_uid(host, port, proc=Path("/proc")) -> int | None       # an established socket
    tcp_listener_uids(host, port, proc=Path("/proc")) -> set[int]      # who accepts host:port
    loopback_strangers(target, owner, proc=Path("/proc")) -> set[int]  # other uids on a port
"""

from __future__ import annotations

import ipaddress
import os
import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "is_loopback",
    "loopback_strangers",
    "split_host_port",
    "tcp_listener_uids",
    "tcp_socket_uid",
]

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_ESTABLISHED = "01"
_LISTEN = "0A"
_ANY = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


def _plain(ip: _IP) -> _IP:
    """An IPv4-mapped IPv6 address as the IPv4 address (``::ffff:127.0.0.1`` is 127.0.0.1)."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _decode(field: str) -> tuple[_IP, int]:
    """An address of ``/proc/net/tcp*`` (``0100007F:8A9A``: 32-bit words in host order)."""
    host, _, port = field.partition(":")
    raw = b"".join(struct.pack("=I", int(host[i : i + 8], 16)) for i in range(0, len(host), 8))
    return _plain(ipaddress.ip_address(raw)), int(port, 16)


def _entries(proc: Path, state: str) -> Iterator[tuple[_IP, int, int]]:
    """``(local address, local port, uid)`` of the table's sockets in ``state``."""
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != state:
                continue
            try:
                addr, port = _decode(f[1])
                yield addr, port, int(f[7])
            except ValueError:
                continue


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) names this host's loopback interface."""
    if host.lower() == "localhost":
        return True
    try:
        return _plain(ipaddress.ip_address(host.strip("[]"))).is_loopback
    except ValueError:
        return False


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
    uids = {uid for addr, p, uid in _entries(proc, _ESTABLISHED) if (addr, p) == want}
    return uids.pop() if len(uids) == 1 else None


def tcp_listener_uids(host: str, port: int, proc: Path = Path("/proc")) -> set[int]:
    """The uids of the listening sockets in this network namespace that would accept a
    connection to ``host:port``: those bound to that address, or, when there are none, those
    bound to the wildcard address (``0.0.0.0``, ``::``) on that port. ``localhost`` stands for
    both 127.0.0.1 and ::1. Empty when none is found (nothing listens, no ``/proc``, or the
    listener is in another network namespace).

    Args:
        host: an address, or ``localhost``.
        port: the port.
        proc: procfs root (tests).
    """
    names = ["127.0.0.1", "::1"] if host.lower() == "localhost" else [host.strip("[]")]
    try:
        wanted = {_plain(ipaddress.ip_address(n)) for n in names}
    except ValueError:
        return set()
    listeners = [(addr, uid) for addr, p, uid in _entries(proc, _LISTEN) if p == port]
    bound = {uid for addr, uid in listeners if addr in wanted}
    return bound or {uid for addr, uid in listeners if addr in _ANY}


def split_host_port(target: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT``, ``[IPV6]:PORT`` or ``dns:///HOST:PORT`` target;
    ``None`` for anything else (a Unix socket, gRPC's ``ipv4:`` lists, no port)."""
    if target.startswith("dns:///"):
        target = target[len("dns:///") :]
    if "://" in target or target.startswith(("unix:", "ipv4:", "ipv6:", "vsock:")):
        return None
    if target.startswith("["):
        host, sep, rest = target[1:].partition("]")
        port = rest[1:] if sep and rest.startswith(":") else ""
    else:
        host, sep, port = target.rpartition(":")
        if not sep or ":" in host:
            return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


def loopback_strangers(target: str, owner: int, proc: Path = Path("/proc")) -> set[int]:
    """The uids other than ``owner``, this process's and root that listen on ``target``'s port,
    when ``target`` is a loopback TCP address (else, or when none is found, the empty set).

    A client about to send its token (and to trust the data it gets back) over a plain loopback
    connection asks this first: any local user may bind a free loopback port, for example while
    the daemon restarts. Root is trusted, as everywhere (it may read everything anyway; a
    container runtime's port proxy runs as root)."""
    hp = split_host_port(target)
    if hp is None or not is_loopback(hp[0]):
        return set()
    return tcp_listener_uids(hp[0], hp[1], proc) - {owner, os.getuid(), 0}
