"""``ServeOptions``: how a served Loader reaches its daemon, in one value.

FFCV's arguments stay flat on :class:`beton_client.Loader` (``batch_size``, ``order``,
``pipelines``...). Everything about *serving* (which daemon, which transport, security,
reconnection, compression, auto-spawn) is one frozen dataclass, so that a training script passes
it around (or builds it from its own config) without a dozen keywords::

    from beton_client import Loader, ServeOptions

    serve = ServeOptions(server="10.0.0.5:7070", transport="grpc", token=os.environ["TOKEN"])
    train = Loader("imagenet_train", batch_size=256, pipelines=..., serve=serve)
    val = Loader("imagenet_val", batch_size=256, pipelines=..., serve=serve)

The same names given as ``Loader`` keywords still work and warn (``DeprecationWarning``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from beton_client._resume import RetryPolicy
from beton_client.errors import SpecError

__all__ = ["SERVE_KEYWORDS", "ServeOptions", "merge_serve_keywords"]


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How a :class:`~beton_client.Loader` reaches and talks to its daemon.

    Attributes:
        server: the daemon's address in gRPC target syntax (``unix:///path.sock`` or
            ``host:port``); default ``BETON_SERVE_ADDRESS``, then the per-user socket. A list of
            addresses spreads each epoch over several daemons serving the same file (batch b
            from daemon b mod S, delivered in order; a daemon that fails hands its share to the
            others, nothing lost or repeated); the transport is then grpc (``_multi_loader``).
        transport: ``"auto"``, ``"shm"``, ``"cuda_ipc"`` or ``"grpc"``; a forced transport that
            cannot work raises :class:`TransportError` with the reason. ``auto`` picks cuda_ipc
            for a GPU pipeline on the daemon's host, shm on that host, grpc from elsewhere; the
            choice is :attr:`chosen_transport` and the reasons against the faster ones are
            :attr:`transport_rejections` (``(transport, code, reason)``). When the daemon chose
            cuda_ipc but this process cannot open it (no CuPy), the stream is re-opened over
            shm, logged, and the reason added to :attr:`transport_rejections`.
        spawn: start a daemon for ``fname_or_dataset`` when none answers (Unix sockets only).
        reconnect: when the daemon goes away mid-stream (killed, restarted), re-open the stream
            under this :class:`RetryPolicy` (``True``: the default, a 30 s budget with
            exponential backoff; ``False``: never) and resume at the exact batch not yet
            yielded, so that every sample is delivered exactly once per epoch. A daemon this
            Loader auto-spawned (``spawn``) is spawned again if it died.
        compression: grpc only: ``"lz4"``, ``"zstd"`` or ``"zstd:LEVEL"`` per stream (``None``:
            none, the default; measured to help only on links slower than ~1 Gb/s). The daemon
            refuses one it does not allow (``--grpc-compression``) with :class:`SpecError`.
        token: bearer token the daemon requires (``--token-file``); default ``BETON_SERVE_TOKEN``,
            read when the Loader is built.
        tls_ca: PEM CA that signed the daemon's certificate: TLS to a ``host:port`` daemon.
        tls_cert, tls_key: this client's PEM certificate and key, for mutual TLS.
        socket_owner: the uid that must own a Unix-socket daemon's socket and its directory
            (default: this process's uid). Checked before every connection, for the default
            socket and for ``server=`` alike; a socket of anyone else raises
            :class:`~beton_client.errors.UntrustedSocketError`. On a plain (non-TLS)
            loopback ``host:port`` the listener must be that uid, yours or root: another
            local user may take a free loopback port to receive the token. Name another
            user's uid here to trust a daemon that user runs (its Unix socket then treats
            this client as any other user: grpc, and only the datasets any peer may read).
        connect_timeout: seconds one connection attempt may take, TCP or TLS handshake
            included, before it counts as failed (gRPC's own default is 20 s). An address that
            accepts connections but never answers (a stopped or wedged daemon, a wrong port)
            then fails with :class:`~beton_client.errors.ServerUnavailable` after about this
            long, and ``reconnect`` retries in steps of it.
    """

    server: str | Sequence[str] | None = None
    transport: str = "auto"
    spawn: bool = True
    reconnect: RetryPolicy | bool = True
    compression: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    socket_owner: int | None = None
    connect_timeout: float = 10.0


#: The Loader keywords that are fields of :class:`ServeOptions` (deprecated as keywords).
SERVE_KEYWORDS = frozenset(f.name for f in dataclasses.fields(ServeOptions))

#: Arguments of the in-process ``beton_serve.loader.Loader`` that the served Loader does not
#: take, and where their setting lives instead (the ``TypeError`` names it).
IN_PROCESS_ONLY: Mapping[str, str] = {
    "verify_checksums": "the daemon verifies every stream it serves when started with "
    "--verify-checksums",
    "bad_sample_budget": "the daemon's setting, --bad-sample-budget N",
    "engine": "the daemon's one worker pool, sized by its --workers",
    "plan_cache": "the daemon keeps the compiled plans",
    "slices": "the daemon splits batches itself",
    "batch_timeout": "the served Loader has no per-batch deadline; a daemon that goes away "
    "is retried as serve=ServeOptions(reconnect=...) says",
    "order_kwargs": "a custom TraversalOrder runs only in process (beton_serve.loader.Loader)",
}


def merge_serve_keywords(serve: ServeOptions | None, given: Mapping[str, Any]) -> ServeOptions:
    """``serve`` with the deprecated keywords in ``given`` applied on top (with one warning).

    Raises:
        SpecError: ``serve`` is not a ServeOptions, a keyword is unknown, or a keyword repeats
            a field ``serve`` already sets.
    """
    if serve is not None and not isinstance(serve, ServeOptions):
        raise SpecError(f"serve must be a beton_client.ServeOptions, not {type(serve).__name__}")
    base = serve if serve is not None else ServeOptions()
    if not given:
        return base
    unknown = sorted(set(given) - SERVE_KEYWORDS)
    if unknown:
        hints = [f"{k}: {IN_PROCESS_ONLY[k]}" for k in unknown if k in IN_PROCESS_ONLY]
        raise TypeError(
            f"Loader() got unexpected keyword arguments {unknown}"
            + (f" ({'; '.join(hints)})" if hints else "")
        )
    if serve is not None:
        defaults = ServeOptions()
        both = sorted(k for k in given if getattr(serve, k) != getattr(defaults, k))
        if both:
            raise SpecError(
                f"{both} given both as Loader keywords and in serve=ServeOptions(...); "
                "give each once, in ServeOptions"
            )
    names = ", ".join(f"{k}=" for k in sorted(given))
    warnings.warn(
        f"Loader({names}...) is deprecated: pass serve=beton_client.ServeOptions({names}...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return dataclasses.replace(base, **given)
