"""Where a daemon listens by default, computed the same way by the daemon and the client.

The default address is a per-user Unix socket:

* ``$XDG_RUNTIME_DIR/beton-serve/beton.sock`` when ``XDG_RUNTIME_DIR`` is set (systemd's per-user
  runtime directory, already private to the user);
* otherwise ``/tmp/beton-serve-<uid>/beton.sock``.

The directory is created with mode 0700 by whoever needs it first, and both sides refuse
one that is not the user's own (:mod:`beton_wire.private_dir`). ``BETON_SERVE_ADDRESS``
(gRPC target syntax: ``unix:///path/to.sock`` or ``host:port``) overrides it; it is read by the
daemon's CLI and by the client's constructor only, which pass the environment in.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

__all__ = [
    "ADDRESS_IN_USE_STATUS",
    "DATASET_HEALTH_PREFIX",
    "DATA_ERROR_STATUS",
    "ENV_ADDRESS",
    "dataset_health_service",
    "default_socket_path",
    "joined_addresses",
    "not_a_socket_problem",
    "port_problem",
    "socket_path_of",
    "unix_target",
]

#: The environment variable that names the daemon's address.
ENV_ADDRESS = "BETON_SERVE_ADDRESS"
#: ``beton-serve serve``'s exit status when another daemon already holds the address's lock
#: (EX_TEMPFAIL): a client that spawned it then waits for that other daemon instead.
ADDRESS_IN_USE_STATUS = 75
#: ``beton-serve serve``'s exit status when a dataset file is malformed, truncated or missing
#: (EX_DATAERR): a client that spawned it raises ``FormatError``, as the in-process Loader does.
DATA_ERROR_STATUS = 65
#: Address forms in which a comma is not a list of daemons: gRPC's own address lists
#: (``ipv4:a:1,b:2``, one channel balancing over them) and socket paths.
_COMMA_OK = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "/")
#: Prefix of the gRPC health service names that report one dataset each.
DATASET_HEALTH_PREFIX = "dataset/"


def dataset_health_service(name: str) -> str:
    """The gRPC health service name that reports the dataset called ``name`` (one served from
    the daemon's start): ``SERVING`` while it serves, ``NOT_SERVING`` once it is refused (its
    file changed) and while the daemon drains. ``beton-serve health --dataset NAME`` asks it."""
    return DATASET_HEALTH_PREFIX + name


def default_socket_path(environ: Mapping[str, str], uid: int | None = None) -> str:
    """The per-user default socket path (see the module docstring)."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "beton-serve", "beton.sock")
    uid = os.getuid() if uid is None else uid
    return f"/tmp/beton-serve-{uid}/beton.sock"


#: The longest Unix socket path the kernel takes: ``sun_path`` holds 108 bytes, NUL included.
MAX_SOCKET_PATH_BYTES = 107


def socket_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a Unix socket's path (too long), or ``None``.

    gRPC reported it as "Failed to bind" (the daemon) or "the target uri is not valid" (a
    client), after logging to stderr, without saying that the path was too long.
    """
    n = len(os.fsencode(path))  # as given: the kernel takes a relative path as it is
    if n <= MAX_SOCKET_PATH_BYTES:
        return None
    return (
        f"the socket path {path} is {n} bytes long, and a Unix socket path holds at most "
        f"{MAX_SOCKET_PATH_BYTES}: choose a shorter one (in a directory of your own)"
    )


def not_a_socket_problem(path: str) -> str | None:
    """Why a daemon must not replace what is at ``path`` (anything but a socket: a file, a
    directory, a link, such as a typo naming the dataset itself), or ``None`` when nothing or
    a socket (a dead daemon's) is there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot use the socket path {path}: {exc}"
    if stat.S_ISSOCK(mode):
        return None
    kind = "a directory" if stat.S_ISDIR(mode) else "a link" if stat.S_ISLNK(mode) else "a file"
    return (
        f"cannot listen on the socket path {path}: {kind} is there, not a socket; give the "
        "socket another path (the daemon replaces only a dead daemon's socket)"
    )


def unix_target(path: str) -> str:
    """The gRPC target of a Unix socket path."""
    return "unix://" + os.path.abspath(path)


def socket_path_of(target: str) -> str | None:
    """The socket path of a ``unix:`` target, or ``None`` for a TCP target."""
    if target.startswith("unix://"):
        return target[len("unix://") :]
    if target.startswith("unix:"):
        return target[len("unix:") :]
    return None


def joined_addresses(address: str) -> list[str] | None:
    """The daemons' addresses when ``address`` is several joined by commas (``"a:1,b:2"``, which
    gRPC would look up whole as one host name), else ``None``. A comma inside gRPC's own
    address lists (``ipv4:``, ``ipv6:``) or a socket path is not a list of daemons."""
    if "," not in address or address.startswith(_COMMA_OK):
        return None
    return [p.strip() for p in address.split(",")]


def port_problem(target: str) -> str | None:
    """Why ``target``'s port cannot be reached (a ``host:port`` target whose port is not 1 to
    65535, which gRPC only reports as a connection that never comes up), or ``None``. Targets
    with a scheme (``unix:``, ``dns:``, ``ipv4:``...) and host names without a port are left to
    gRPC."""
    if "://" in target or target.startswith(_COMMA_OK) or target.startswith("dns:"):
        return None
    if target.startswith("["):
        _, sep, rest = target.partition("]")
        port = rest[1:] if sep and rest.startswith(":") else ""
    else:
        host, sep, port = target.rpartition(":")
        if not sep or ":" in host:  # no port, or a bare IPv6 address
            return None
    if port.isdigit() and not 1 <= int(port) <= 65535:
        return f"port {port} of {target!r} is not a TCP port (1 to 65535)"
    return None
