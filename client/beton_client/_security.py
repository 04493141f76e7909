"""Client side of the daemon's security (DESIGN.md §8): TLS channel credentials and the bearer token.

The daemon checks ``authorization: Bearer <token>`` on every call except health checks, and may
require TLS (optionally mutual TLS). This module builds the matching channel::

    channel = secure_or_plain_channel("h1:7777", ca_file="ca.pem", token=token,
                                      options=CHANNEL_OPTIONS)

On a TLS channel the token travels as call credentials (``grpc.access_token_call_credentials``);
grpcio refuses call credentials on a plain channel, so there a client interceptor adds the same
metadata to every call (only sensible on loopback or a trusted network; the daemon logs it).

API::

    channel_credentials(ca_file=None, *, cert_file=None, key_file=None) -> grpc.ChannelCredentials
    token_metadata(token) -> tuple[tuple[str, str]]
    token_call_credentials(token) -> grpc.CallCredentials
    secure_or_plain_channel(target, *, ca_file=None, cert_file=None, key_file=None, token=None,
                            options=(), server_name=None) -> grpc.Channel

``ca_file=None`` with TLS requested (a client certificate given) uses the system roots.

Unix sockets. Before a channel to ``unix:PATH`` is made, :func:`check_unix_target` checks that
the socket and its directory belong to the expected user (this process's uid unless the Loader
names another with ``socket_owner=``) and that nobody else may write the directory
(``beton_wire.private_dir``): a socket another user planted is refused, never connected to. A
missing socket is not connected to either (a directory and socket made after the check would
never have been checked).

    check_unix_target(target, owner=None) -> None      # raises UntrustedSocketError, ServerUnavailable

Loopback TCP. Any local user may listen on a free loopback port (while the daemon restarts, or
before it starts) and receive the token of a client that connects there, then serve it their
data. Before a plain (non-TLS) channel to a loopback ``host:port`` is made,
:func:`check_loopback_target` asks the kernel's socket table who listens on that port; a uid
other than the expected one (and root) is refused. A TLS channel with ``tls_ca`` authenticates
the daemon itself and is not checked.

    check_loopback_target(target, owner=None) -> None  # raises UntrustedSocketError
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from beton_wire.address import socket_path_of
from beton_wire.private_dir import UnsafePathError, remedy, trusted_socket_present
from beton_wire.socket_table import loopback_strangers

from beton_client.errors import ServerUnavailable, SpecError, UntrustedSocketError

__all__ = [
    "channel_credentials",
    "check_loopback_target",
    "check_unix_target",
    "secure_or_plain_channel",
    "token_call_credentials",
    "token_metadata",
]


def check_unix_target(target: str, owner: int | None = None, *, missing_ok: bool = False) -> None:
    """Refuse a ``unix:`` target whose socket or directory is not ``owner``'s, or that has no
    socket yet (does nothing for TCP targets).

    Args:
        target: the gRPC target.
        owner: the uid that must own the socket and its directory (default: this process's).
        missing_ok: a missing socket is no error (the directory exists and is trusted: the
            spawner, which made sure of it, starts the daemon that binds there).

    Raises:
        UntrustedSocketError: the directory is a symbolic link, another user's, or writable by
            others, or the socket is not a socket of ``owner``; the message says what to do.
        ServerUnavailable: the directory or the socket does not exist (no daemon answers
            there; retriable, and each retry checks again).
    """
    path = socket_path_of(target)
    if path is None:
        return
    uid = os.getuid() if owner is None else owner
    try:
        present = trusted_socket_present(path, uid)
    except UnsafePathError as exc:
        if owner is not None and owner != os.getuid():
            hint = (
                f"The daemon of uid {owner} must serve a socket in a directory of its own that "
                "you may search (mode 0711 or 0755) and that nobody else may write"
            )
        else:
            hint = (
                f"{remedy(exc, uid)} (and start your daemon again); or use a socket in a "
                "directory of your own, or, to trust a daemon that another user runs, pass "
                "socket_owner=<their uid> to the Loader"
            )
        raise UntrustedSocketError(f"refusing to connect to {target}: {exc}. {hint}") from None
    if not present and not missing_ok:  # what appears there later was never checked
        raise ServerUnavailable(
            f"no beton-serve daemon answers at {target}: there is no socket at {path}",
            code="UNAVAILABLE",
        )


def check_loopback_target(target: str, owner: int | None = None) -> None:
    """Refuse a loopback ``host:port`` target on which a user other than ``owner`` (default:
    this process's uid) and root listens (see the module docstring). Does nothing for other
    targets, or when no listener is found (none yet, no ``/proc``, another network namespace).
    Call it for plain channels only: TLS authenticates the daemon.

    Raises:
        UntrustedSocketError: another user listens there; the message says how to trust them.
    """
    uid = os.getuid() if owner is None else owner
    strangers = loopback_strangers(target, uid)
    if strangers:
        who = ", ".join(str(u) for u in sorted(strangers))
        raise UntrustedSocketError(
            f"refusing to connect to {target}: the port is listened on by uid {who}, not by "
            f"uid {uid}. Another local user may have taken the port to receive your token and "
            "serve you their data. Start your daemon there again (or on another port), use TLS "
            "(tls_ca) to authenticate it, or, to trust a daemon that user runs, pass "
            f"socket_owner={min(strangers)} to the Loader"
        )


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SpecError(f"{what}: cannot read {path!r}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise SpecError(f"{what}: {path!r} is not a PEM file")
    return data


def _check_token(token: str) -> str:
    if not token or any(c.isspace() or not c.isprintable() or ord(c) > 127 for c in token):
        raise SpecError("the bearer token must be non-empty printable ASCII without spaces")
    return token


def channel_credentials(
    ca_file: str | None = None, *, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials trusting ``ca_file`` (system roots if None); a client certificate and key
    (both or neither) enable mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise SpecError("give both cert_file and key_file for mutual TLS, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "ca_file") if ca_file else None,
        private_key=_read(key_file, "key_file") if key_file else None,
        certificate_chain=_read(cert_file, "cert_file") if cert_file else None,
    )


def token_metadata(token: str) -> tuple[tuple[str, str]]:
    """Call metadata carrying the bearer token."""
    return (("authorization", f"Bearer {_check_token(token)}"),)


def token_call_credentials(token: str) -> grpc.CallCredentials:
    """Call credentials carrying the bearer token (TLS channels only)."""
    return grpc.access_token_call_credentials(_check_token(token))


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token metadata to every call of a plain channel."""

    def __init__(self, token: str) -> None:
        self._md = token_metadata(token)

    def _details(self, d: Any) -> Any:
        md = tuple(d.metadata or ()) + self._md
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Callable[..., Any], d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)

    def intercept_stream_stream(self, continuation: Callable[..., Any], d: Any, it: Any) -> Any:
        return continuation(self._details(d), it)


class _Details(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def secure_or_plain_channel(
    target: str,
    *,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
    server_name: str | None = None,
) -> grpc.Channel:
    """A synchronous channel to a daemon.

    Args:
        target: ``host:port`` or ``unix:PATH``.
        ca_file, cert_file, key_file: TLS when any is given (see :func:`channel_credentials`).
        token: bearer token sent on every call.
        options: channel options (e.g. the transport's ``CHANNEL_OPTIONS``).
        server_name: expected name in the daemon's certificate, when it differs from the host.
    """
    opts = list(options)
    if server_name is not None:
        opts.append(("grpc.ssl_target_name_override", server_name))
    if ca_file or cert_file or key_file:
        creds = channel_credentials(ca_file, cert_file=cert_file, key_file=key_file)
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, token_call_credentials(token))
        return grpc.secure_channel(target, creds, options=opts)
    channel = grpc.insecure_channel(target, options=opts)
    if token is not None:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel
