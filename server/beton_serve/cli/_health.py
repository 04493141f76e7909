"""``beton-serve health``: ask a running daemon whether it is serving.

The daemon serves the standard gRPC health service (``grpc.health.v1.Health``). This subcommand
sends one ``Check`` request and maps the answer to an exit status, which is what container health
checks, Kubernetes probes and systemd ``ExecStartPost`` lines understand:

=====  ======================================================================
exit   meaning
=====  ======================================================================
0      the daemon answered ``SERVING``
1      it answered, but not ``SERVING`` (e.g. ``NOT_SERVING`` while draining)
2      no answer: nothing listens at the address, or the deadline passed; or nothing was
       asked: a ``unix:`` socket failed the owner check (another user's, or in a directory
       others may write), or an option is wrong (the message, on stderr, says which)
=====  ======================================================================

A probe can so tell a daemon that is draining (1) from one it cannot or must not reach (2).

``--dataset NAME`` asks about one dataset served from the daemon's start instead (the health
service ``dataset/NAME``): ``NOT_SERVING`` (exit 1) once its file changed under the daemon, which
refuses it until a restart, while the daemon goes on serving its other datasets; also while the
daemon drains. A name the daemon does not serve from its start (a typo, a file opened on demand)
answers ``SERVICE_UNKNOWN`` (exit 1).

A daemon that serves TCP with TLS is checked with ``--tls-ca CA.pem`` (and, for mutual TLS,
``--tls-cert``/``--tls-key``). No token is needed: the daemon answers health checks without one.

The address uses gRPC target syntax (``unix:///path/to.sock`` or ``host:port``). Without
``--server`` it comes from ``BETON_SERVE_ADDRESS``, then the per-user default socket
(:mod:`beton_wire.address`), the same order the client uses.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import Any

from beton_serve.errors import ConfigError

__all__ = [
    "EXIT_NOT_SERVING",
    "EXIT_SERVING",
    "EXIT_UNREACHABLE",
    "check",
    "register",
    "resolve_target",
    "run",
]

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (``inf`` and ``nan`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``health`` on the ``beton-serve`` subcommand parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The new subparser; its ``func`` default is :func:`run`.
    """
    p = subparsers.add_parser(
        "health",
        help="check that a daemon answers the gRPC health service (exit 0 when SERVING)",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
    )
    p.add_argument(
        "--server",
        default=None,
        help="gRPC target: unix:///path/to.sock or host:port (default: $BETON_SERVE_ADDRESS, "
        "then the per-user socket)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--service",
        default="",
        help="health service name to check; '' (the default) means the whole server",
    )
    which.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="check one dataset served from the daemon's start (the service dataset/NAME): "
        "NOT_SERVING once its file changed, until a restart",
    )
    p.add_argument(
        "--timeout", type=positive_seconds, default=3.0, help="deadline in seconds (default 3)"
    )
    add_socket_owner_argument(p)
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA that signed the daemon's cert")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="client private key (mTLS)")
    p.set_defaults(func=run)
    return p


def add_socket_owner_argument(p: argparse.ArgumentParser) -> None:
    """``--socket-owner UID`` (health, stats, status): whose daemon a ``unix:`` target must be."""
    p.add_argument(
        "--socket-owner",
        type=int,
        default=None,
        metavar="UID",
        help="the uid that must own a unix: socket and its directory, or may listen on a plain "
        "loopback TCP port (default: yours)",
    )


def check_trusted(
    target: str, owner: int | None = None, timeout: float = 0.0, *, tls: bool = False
) -> bool:
    """Wait up to ``timeout`` seconds for a ``unix:`` target's socket to be there, trusted: a
    socket of ``owner`` (default: this user) in a directory nobody else may write, as the Loader
    requires, before anything (a token, a request) is sent to it. Whether it came (always
    ``True`` for a TCP target). A plain (``tls=False``) loopback TCP target must not be
    listened on by another user than ``owner`` and root (``beton_wire.socket_table``), as the
    Loader requires too.

    Why wait here and not in gRPC (``wait_for_ready``): a directory missing when looked at
    could be made by another user meanwhile, with a socket of theirs in it, and gRPC would
    connect there unchecked.

    Raises:
        ConfigError: what is there is not trusted; the message says what is wrong and how to
            trust another user's daemon.
    """
    import os
    import time

    from beton_wire.address import socket_path_of
    from beton_wire.private_dir import UnsafePathError, trusted_socket_present
    from beton_wire.socket_table import loopback_strangers

    path = socket_path_of(target)
    uid = os.getuid() if owner is None else owner
    if path is None:
        strangers = set() if tls else loopback_strangers(target, uid)
        if strangers:
            raise ConfigError(
                f"refusing to connect to {target}: the port is listened on by uid "
                f"{', '.join(map(str, sorted(strangers)))}, not by uid {uid}. Another local user "
                "may have taken it to receive your token; use TLS (--tls-ca), or, to trust a "
                f"daemon that user runs, pass --socket-owner {min(strangers)}"
            )
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            if trusted_socket_present(path, uid):
                return True
        except UnsafePathError as exc:
            raise ConfigError(
                f"refusing to connect to {target}: {exc}. Another user may have planted it; "
                "to trust a daemon that another user runs, pass --socket-owner <their uid>"
            ) from None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def check(
    target: str,
    *,
    service: str = "",
    timeout: float = 3.0,
    credentials: Any | None = None,
    socket_owner: int | None = None,
) -> str:
    """Send one health ``Check`` to ``target``.

    Args:
        target: gRPC target syntax, e.g. ``unix:///run/beton-serve/beton-serve.sock``.
        service: the health service name; ``""`` asks about the server as a whole.
        timeout: deadline for connecting and answering, in seconds.
        credentials: ``grpc.ChannelCredentials`` for a TLS listener; ``None`` for plain.
        socket_owner: the uid a ``unix:`` target must belong to (default: this user's).

    Returns:
        The serving status name: ``"SERVING"``, ``"NOT_SERVING"``, ``"SERVICE_UNKNOWN"`` or
        ``"UNKNOWN"``; ``"UNREACHABLE"`` when no daemon answered before the deadline.

    Raises:
        ConfigError: a ``unix:`` target of another user (:func:`check_trusted`).
    """
    import time

    t0 = time.monotonic()
    if not check_trusted(target, socket_owner, timeout, tls=credentials is not None):
        return "UNREACHABLE"
    timeout = max(0.1, timeout - (time.monotonic() - t0))
    # Lazy imports: the grpc stubs are only needed by this subcommand.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def unanswered_hint(target: str, tls: bool, client_cert: bool | None = None) -> str:
    """Why a ``host:port`` daemon may not have answered although something listens there
    (one TCP connect, up to 1 s): a TLS daemon asked in plain text, or a mutual-TLS daemon
    that refused the client's certificate, or its lack of one. gRPC only retries those until
    the deadline, which read as "no daemon answered". ``""`` when nothing listens there, or
    for a Unix socket."""
    import socket

    from beton_wire.socket_table import split_host_port

    hp = split_host_port(target)
    if hp is None:
        return ""
    try:
        socket.create_connection(hp, timeout=1.0).close()
    except OSError:
        return ""
    if not tls:
        why = "if it serves TLS (--tls-cert), pass the CA that signed its certificate: --tls-ca"
    else:
        why = "the TLS handshake may have failed: check that --tls-ca signed its certificate; " + (
            "if it requires client certificates (--tls-client-ca), pass --tls-cert/--tls-key"
            if not client_cert
            else "it may have refused this client certificate (another CA, or expired?)"
        )
    return f"something accepts connections at {target} but no answer came: {why}"


def resolve_target(explicit: str | None, environ: Mapping[str, str]) -> str:
    """Pick the address: ``--server``, else ``BETON_SERVE_ADDRESS``, else the per-user default.

    Raises:
        ConfigError: ``--server`` was given but is empty, or the address is several joined by
            commas (these commands ask one daemon), or its port is not 1 to 65535.
    """
    from beton_wire.address import (
        ENV_ADDRESS,
        default_socket_path,
        joined_addresses,
        port_problem,
        unix_target,
    )

    if explicit is not None:
        if not explicit.strip():
            raise ConfigError("--server is empty: pass unix:///path/to.sock or host:port")
        target, where = explicit, "--server"
    else:
        target, where = environ.get(ENV_ADDRESS, ""), ENV_ADDRESS
        if not target:
            return unix_target(default_socket_path(environ))
    parts = joined_addresses(target)
    if parts is not None:
        raise ConfigError(
            f"{where} {target!r} is several addresses joined by commas (gRPC would look it up "
            f"as one host name); this command asks one daemon: pass one of {parts}"
        )
    if problem := port_problem(target.strip()):
        raise ConfigError(f"{where}: {problem}")
    return target


def tls_credentials(ca: str | None, cert: str | None, key: str | None) -> Any | None:
    """Channel credentials from PEM files, or ``None`` when no TLS option is given.

    Raises:
        ConfigError: a file cannot be read, or only one of ``cert``/``key`` is given.
    """
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ConfigError("mutual TLS needs both --tls-cert and --tls-key")
    import grpc

    def read(path: str | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca, "--tls-ca"),
        private_key=read(key, "--tls-key"),
        certificate_chain=read(cert, "--tls-cert"),
    )


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the subcommand; returns the exit status described in the module docstring (a
    :class:`ConfigError`, printed to stderr, is :data:`EXIT_UNREACHABLE`: nothing was asked)."""
    import os

    from beton_wire.address import dataset_health_service

    dataset = getattr(args, "dataset", None)
    service = args.service if dataset is None else dataset_health_service(dataset)
    try:
        target = resolve_target(args.server, os.environ if environ is None else environ)
        creds = tls_credentials(
            getattr(args, "tls_ca", None),
            getattr(args, "tls_cert", None),
            getattr(args, "tls_key", None),
        )
        status = check(
            target,
            service=service,
            timeout=args.timeout,
            credentials=creds,
            socket_owner=getattr(args, "socket_owner", None),
        )
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return EXIT_UNREACHABLE
    sys.stdout.write(f"{target}{' ' + service if service else ''}: {status}\n")
    if status == "SERVICE_UNKNOWN" and dataset is not None:
        sys.stderr.write(
            f"no dataset {dataset!r} was served from this daemon's start (datasets opened on "
            "demand have no health service); `beton-serve status` lists the datasets\n"
        )
    if status == "SERVING":
        return EXIT_SERVING
    if status == "UNREACHABLE":
        hint = unanswered_hint(
            target, creds is not None, getattr(args, "tls_cert", None) is not None
        )
        if hint:
            sys.stderr.write(hint + "\n")
        return EXIT_UNREACHABLE
    return EXIT_NOT_SERVING
