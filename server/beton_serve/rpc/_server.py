"""Building the gRPC server: the BetonServe service plus the standard health and reflection services.

:func:`create_server` binds the addresses and returns the (unstarted) server and the bound TCP
port, so that tests bind port 0 (grpc's examples). The caller starts and stops it on its event
loop. Unix sockets are made private to the daemon's user (0600).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import grpc
from beton_wire.address import dataset_health_service, not_a_socket_problem
from beton_wire.limits import MAX_REQUEST_BYTES
from beton_wire.v1 import beton_pb2 as pb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from beton_serve.daemon import Daemon, producer_factory
from beton_serve.errors import ConfigError
from beton_serve.rpc._errors import status_for
from beton_serve.rpc._service import BetonServeServicer
from beton_serve.rpc._strict import add_strict_servicer
from beton_serve.transport.grpc_codec import add_batch_stream_handler
from beton_serve.transport.grpc_ring import BATCH_SERVICE
from beton_serve.transport.peer import UnixSocketWatch
from beton_serve.transport.security import (
    AioBearerTokenInterceptor,
    TlsConfig,
    server_credentials,
)

__all__ = ["SERVICE_NAME", "ServerHandle", "create_server"]

#: The full name of the service (for health checks and reflection).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BetonServe"].full_name

#: Channel options of the daemon's server. It sends large messages (the grpc transport); it
#: receives nothing larger than the largest valid request (``beton_wire.limits``), so gRPC
#: itself refuses a bigger one (RESOURCE_EXHAUSTED) before any of our code runs.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A connection that has not finished its HTTP/2 (or TLS) handshake after 5 s is closed:
    # raw connections from another local user held a descriptor each for about a minute, and
    # enough of them left the daemon none for its own clients.
    ("grpc.server_handshake_timeout_ms", 5_000),
)


def _status(serving: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


class ServerHandle:
    """A built server with its health servicer (to flip to NOT_SERVING while draining).

    Besides the server as a whole (``""``) and :data:`SERVICE_NAME`, the health service reports
    each dataset served from the start under ``dataset/NAME``
    (:func:`beton_wire.address.dataset_health_service`), so that a probe can watch one dataset.
    """

    def __init__(
        self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, port: int
    ) -> None:
        self.server = server
        self.health = health_servicer
        self.port = port
        self._datasets: dict[str, bool] = {}  # dataset name -> serving

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING / NOT_SERVING for the overall server and the service. Not serving
        (draining) also reports every dataset NOT_SERVING; serving leaves each dataset as
        :meth:`set_dataset` last set it."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _status(serving))
        if not serving:
            for dataset in list(self._datasets):
                await self.set_dataset(dataset, False)

    async def set_dataset(self, dataset: str, serving: bool) -> None:
        """Report SERVING / NOT_SERVING for the dataset called ``dataset``."""
        self._datasets[dataset] = serving
        await self.health.set(dataset_health_service(dataset), _status(serving))

    def dataset_serving(self, dataset: str) -> bool | None:
        """What :meth:`set_dataset` last reported for ``dataset`` (``None``: never)."""
        return self._datasets.get(dataset)


def create_server(
    daemon: Daemon,
    *,
    unix_socket: str | None = None,
    listen: Sequence[str] = (),
    tls: TlsConfig | None = None,
    token: str | None = None,
) -> ServerHandle:
    """Build the daemon's gRPC server (call on the event loop that will run it).

    Besides BetonServe, health and reflection, the server hosts the pass-through batch method of
    the grpc transport (``beton_serve.daemon.producer_factory``) when the daemon offers it.

    Security: ``tls`` secures every TCP address (the Unix socket is private to the daemon's user
    and stays plain). ``token``, when given, is required on *every* call but health checks, on
    TCP and on the Unix socket alike: one rule, and a client configured for a token works on
    either address. The listen policy (``check_listen_policy``) is the caller's (the CLI's).

    Args:
        daemon: what to serve.
        unix_socket: path of a Unix socket to listen on (a stale file there is replaced).
        listen: ``HOST:PORT`` TCP addresses (port 0 picks a free port).
        tls: certificate and key (and client CA for mutual TLS) of the TCP addresses.
        token: the bearer token clients must send.

    Returns:
        The handle; ``port`` is the last bound TCP port (0 if none).

    Raises:
        ConfigError: an address cannot be bound (the message names it).
    """
    if not unix_socket and not listen:
        raise ConfigError("give a Unix socket path or a TCP address to listen on")
    interceptors = [AioBearerTokenInterceptor(token)] if token else []
    server = grpc.aio.server(options=list(SERVER_OPTIONS), interceptors=interceptors)
    # A message that does not parse is INVALID_ARGUMENT, not grpcio's UNKNOWN (_strict).
    servicer = BetonServeServicer(daemon)
    add_strict_servicer(servicer, server)
    grpc_factory = daemon.grpc_factory
    if grpc_factory is not None:
        add_batch_stream_handler(
            server,
            producer_factory(daemon.streams, grpc_factory.allowed_codecs),
            service_name=BATCH_SERVICE,
            allowed_codecs=grpc_factory.allowed_codecs,
            status_for=status_for,
        )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = 0
    if unix_socket:
        _remove_stale_socket(unix_socket)
        # grpc binds here; the umask makes the socket 0600 from the start, so no other user can
        # connect before the caller's chmod (the daemon treats every peer of this socket as its
        # own user: see transport.peer).
        old_umask = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{unix_socket}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on unix socket {unix_socket}: {exc}") from None
        finally:
            os.umask(old_umask)
        servicer.unix_socket = UnixSocketWatch(unix_socket)
    creds = server_credentials(tls) if tls is not None else None
    for addr in listen:
        try:
            port = (
                server.add_secure_port(addr, creds)
                if creds is not None
                else server.add_insecure_port(addr)
            )
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {addr}: {exc}") from None
    return ServerHandle(server, health_servicer, port)


def _remove_stale_socket(path: str) -> None:
    """Remove a dead daemon's socket at ``path`` (the caller holds the address lock).

    Raises:
        ConfigError: something other than a socket is there; it is never deleted.
    """
    problem = not_a_socket_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
