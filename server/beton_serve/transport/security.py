"""Security of the daemon's TCP listener (DESIGN.md §8): TLS, mutual TLS, bearer token, listen policy.

Policy. The daemon listens on loopback (or a Unix socket) unless told otherwise. A listener on any
other address must have TLS, a bearer token, or an explicit ``--insecure``; the last is allowed but
logged loudly. :func:`check_listen_policy` is the pure rule; the CLI calls it for every address and
logs the warnings it returns at WARNING level (or uses :func:`enforce_listen_policy`, which does).

Token. Clients send ``authorization: Bearer <token>`` metadata (``grpc.access_token_call_credentials``
does exactly this on TLS channels; ``beton_client._security`` adds it on plain ones). The
interceptor compares in constant time and answers ``UNAUTHENTICATED`` without revealing whether
the header was missing or wrong; the standard health service stays open so orchestrators can probe.

API::

    check_listen_policy(address, tls, token, insecure) -> list[str]      # raises ConfigError
    enforce_listen_policy(address, tls, token, insecure, logger=log) -> None
    is_loopback_address(address) -> bool
    TlsConfig(cert_file, key_file, client_ca_file=None)                 # validated when built
    server_credentials(tls: TlsConfig) -> grpc.ServerCredentials         # mutual TLS with a CA
    check_server_files(tls: TlsConfig) -> None                           # key matches the cert
    read_token_file(path) -> str
    BearerTokenInterceptor(token, exempt=HEALTH_METHODS)                 # threaded grpc.Server
    AioBearerTokenInterceptor(token, exempt=HEALTH_METHODS)              # grpc.aio.Server

    server = grpc.server(pool, interceptors=[BearerTokenInterceptor(token)])
    server.add_secure_port("0.0.0.0:7777", server_credentials(TlsConfig(...)))
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from beton_serve.errors import ConfigError

__all__ = [
    "HEALTH_METHODS",
    "AioBearerTokenInterceptor",
    "BearerTokenInterceptor",
    "TlsConfig",
    "check_listen_policy",
    "enforce_listen_policy",
    "is_loopback_address",
    "read_token_file",
    "check_server_files",
    "server_credentials",
]

log = logging.getLogger(__name__)

HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
_DENIED = "missing or invalid bearer token (send 'authorization: Bearer <token>' metadata)"


def _split_host(address: str) -> str:
    """The host part of ``host:port``, ``[v6]:port``; raise ConfigError if malformed."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"bad listen address {address!r}; use [v6addr]:port")
        port = rest[1:]
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise ConfigError(f"bad listen address {address!r}; use host:port or unix:/path")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"bad listen address {address!r}; use host:port with a port 0..65535")
    return host


def is_loopback_address(address: str) -> bool:
    """True for Unix sockets, ``localhost``, 127.0.0.0/8 and ``::1`` (names are not resolved).

    Raises:
        ConfigError: the address is not ``unix:PATH``, ``host:port`` or ``[v6]:port``.
    """
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = _split_host(address)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or wildcard other than localhost: reachable from elsewhere


def check_listen_policy(address: str, tls: bool, token: bool, insecure: bool) -> list[str]:
    """Apply the listen rule to one address.

    Args:
        address: what the daemon binds (``host:port``, ``[v6]:port`` or ``unix:PATH``).
        tls: the listener has a certificate (TLS, possibly mutual).
        token: clients must present a bearer token.
        insecure: the operator passed ``--insecure``.

    Returns:
        Warnings to log at WARNING level (empty when nothing is questionable).

    Raises:
        ConfigError: a non-loopback address without TLS, token or ``insecure``, a malformed
            address, or a Unix socket (``unix:``, ``unix-abstract:``). The message says which
            flag to use.
    """
    if address.startswith(("unix:", "unix-abstract:")):
        # The daemon treats every caller on a Unix socket as its own user (transport.peer),
        # which only its --socket guarantees: created 0600 in a directory nobody else may
        # write. An abstract socket has no permissions at all: any local user could connect.
        raise ConfigError(
            f"refusing --listen {address}: --listen takes TCP addresses (host:port); serve a "
            "Unix socket with --socket PATH, which the daemon creates mode 0600 in a private "
            "directory (every caller on a Unix socket is treated as the daemon's own user)"
        )
    if is_loopback_address(address):
        return []
    warnings: list[str] = []
    if tls or token:
        if token and not tls:
            warnings.append(
                f"listening on {address} with a bearer token but without TLS: the token and every "
                "batch travel in clear text; add --tls-cert/--tls-key"
            )
        return warnings
    if not insecure:
        raise ConfigError(
            f"refusing to listen on non-loopback address {address} without protection: add TLS "
            "(--tls-cert and --tls-key), a bearer token (--token-file), or pass --insecure to "
            "accept that anyone who can reach it may read the served datasets"
        )
    warnings.append(
        f"INSECURE: listening on {address} without TLS or a token (--insecure); anyone who can "
        "reach this address can open streams and read every served dataset"
    )
    return warnings


def enforce_listen_policy(
    address: str, tls: bool, token: bool, insecure: bool, logger: logging.Logger = log
) -> None:
    """:func:`check_listen_policy`, logging each warning at WARNING level."""
    for w in check_listen_policy(address, tls, token, insecure):
        logger.warning("%s", w)


@dataclass(frozen=True, kw_only=True, slots=True)
class TlsConfig:
    """Files of a TLS listener, checked to exist when built.

    Attributes:
        cert_file: PEM certificate chain of the daemon.
        key_file: PEM private key of that certificate.
        client_ca_file: PEM CA bundle; when set, clients must present a certificate it signed
            (mutual TLS).
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def __post_init__(self) -> None:
        for what, path in (
            ("--tls-cert", self.cert_file),
            ("--tls-key", self.key_file),
            ("--tls-client-ca", self.client_ca_file),
        ):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{what}: {path!r} is not a readable file")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{what}: {path!r} is not PEM")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials for ``add_secure_port``; requires client certificates with a CA.

    The files are checked first (:func:`check_server_files`), so a key that does not match its
    certificate is reported as that, not as gRPC's "Failed to bind to address".
    """
    cert = _read(tls.cert_file, "--tls-cert")
    key = _read(tls.key_file, "--tls-key")
    ca = _read(tls.client_ca_file, "--tls-client-ca") if tls.client_ca_file else None
    check_server_files(tls)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    raise _EncryptedKey


def check_server_files(tls: TlsConfig, now: float | None = None) -> None:
    """Check that the key matches the certificate and the CA bundle loads; warn when the
    certificate has expired or is not valid yet (clients will refuse it, but an operator may be
    renewing it).

    Raises:
        ConfigError: a key of another certificate, a password-protected key (gRPC cannot read
            it), or a file OpenSSL cannot load; the message names the file and the flag.
    """
    import ssl
    import time

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except _EncryptedKey:
        raise ConfigError(
            f"--tls-key: {tls.key_file!r} is password-protected, which gRPC cannot read; "
            "write it unencrypted (openssl pkey -in KEY -out KEY.plain) and keep it mode 0600"
        ) from None
    except ssl.SSLError as exc:
        why = (
            "the key is not the certificate's (KEY_VALUES_MISMATCH): give the key the "
            "certificate was made for"
            if "KEY_VALUES_MISMATCH" in str(exc)
            else f"OpenSSL cannot load them: {exc}"
        )
        raise ConfigError(
            f"--tls-cert {tls.cert_file!r} / --tls-key {tls.key_file!r}: {why}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"--tls-cert/--tls-key: cannot read: {exc}") from None
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"--tls-client-ca: OpenSSL cannot load {tls.client_ca_file!r}: {exc}"
            ) from None
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:  # pragma: no cover - CPython has it
        return
    try:
        info = decode(tls.cert_file)
        not_before = ssl.cert_time_to_seconds(info["notBefore"])
        not_after = ssl.cert_time_to_seconds(info["notAfter"])
    except Exception:  # pragma: no cover - the warning is a courtesy; gRPC reads the file
        return
    t = time.time() if now is None else now
    if t > not_after:
        log.warning(
            "--tls-cert %s expired on %s: TLS clients will refuse this daemon until it is renewed",
            tls.cert_file,
            info["notAfter"],
        )
    elif t < not_before:
        log.warning(
            "--tls-cert %s is not valid before %s: TLS clients will refuse this daemon until then",
            tls.cert_file,
            info["notBefore"],
        )


def _check_token(token: str) -> bytes:
    if not token or any(c.isspace() or not c.isprintable() or ord(c) > 127 for c in token):
        raise ConfigError("the bearer token must be non-empty printable ASCII without spaces")
    return token.encode("ascii")


def read_token_file(path: str) -> str:
    """Read a token file (surrounding whitespace stripped).

    Raises:
        ConfigError: unreadable, empty, or not a valid token. A file readable by group or others
            is accepted but logged.
    """
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file: cannot read {path!r}: {exc}") from None
    _check_token(token)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is accessible by group or others; chmod 600 it", path)
    return token


def _authorized(expected: bytes, metadata: Iterable[tuple[str, Any]] | None) -> bool:
    got = b""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value.encode("latin-1") if isinstance(value, str) else bytes(value)
            if raw[:7].lower() == b"bearer ":
                got = raw[7:].strip()
            break
    # compare_digest runs in time independent of where the first difference is
    return hmac.compare_digest(got, expected)


def _deny_handler_sync(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    return _same_kind(handler, deny)


def _same_kind(handler: grpc.RpcMethodHandler, fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
    req_s, resp_s = handler.request_streaming, handler.response_streaming
    if req_s and resp_s:
        return grpc.stream_stream_rpc_method_handler(fn)
    if req_s:
        return grpc.stream_unary_rpc_method_handler(fn)
    if resp_s:
        return grpc.unary_stream_rpc_method_handler(fn)
    return grpc.unary_unary_rpc_method_handler(fn)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    Args:
        token: the expected token (printable ASCII, no spaces).
        exempt: full method paths that need no token (default: the health service).
    """

    def __init__(self, token: str, exempt: Iterable[str] = HEALTH_METHODS) -> None:
        self._expected = _check_token(token)
        self._exempt = frozenset(exempt)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:  # type: ignore[attr-defined]
            return handler
        if _authorized(self._expected, handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return handler
        return _deny_handler_sync(handler)


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """The :class:`BearerTokenInterceptor` rule for ``grpc.aio`` servers."""

    def __init__(self, token: str, exempt: Iterable[str] = HEALTH_METHODS) -> None:
        self._expected = _check_token(token)
        self._exempt = frozenset(exempt)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:  # type: ignore[attr-defined]
            return handler
        if _authorized(self._expected, handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

        return _same_kind(handler, deny)
