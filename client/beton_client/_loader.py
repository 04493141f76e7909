"""``beton_client.Loader``: FFCV's Loader, served by a beton-serve daemon.

Life of a Loader:

1. The constructor resolves the address (``server``, else ``BETON_SERVE_ADDRESS``, else the
   per-user default socket), auto-spawns a daemon for a ``.beton`` path when none answers and
   ``spawn=True``, splits each pipeline (``_ops``), and opens a stream: the daemon validates the
   request (a bad spec raises :class:`~beton_client.errors.SpecError` here), compiles the prefix,
   negotiates the transport and answers with the output specs and the ring to map.
2. Each ``iter(loader)`` is one epoch on that stream's ``Batches`` call. The pipeline spec is
   re-serialised first: if an op changed (e.g. ``decoder.output_size`` for progressive resizing),
   the stream is re-opened so the change takes effect from this epoch.
3. ``close()`` (or the context manager, or garbage collection) ends the call; the daemon then
   frees the stream's slots.

**Batch lifetime.** With ``copy=False`` (default) a batch's arrays/tensors are views of a daemon
slot: valid until the next batch is requested (or the loop ends and the next epoch starts). Keep
one longer by cloning it, or pass ``copy=True``. Tensors produced by client-side ops that
allocate (``Convert``, ``ToDevice('cuda')``, ``NormalizeImage``) are independent.

Threading: a Loader is used from one thread at a time. gRPC runs the request stream on its own
thread; nothing else runs in the background.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from beton_wire.address import (
    ENV_ADDRESS,
    default_socket_path,
    joined_addresses,
    port_problem,
    socket_path_of,
    socket_path_problem,
    unix_target,
)
from beton_wire.file_identity import FileIdentity, compare_digests, mapping_problem, unmappable
from beton_wire.limits import (
    MAX_INDICES,
    MAX_NAME_CHARS,
    MAX_OPS,
    MAX_PATH_CHARS,
    MAX_PIPELINES,
    MAX_REQUEST_BYTES,
    MAX_SPEC_BYTES,
    parse_params,
    short_repr,
)
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc

from beton_client._forks import owner_only
from beton_client._ops import BRANCH_FIELD, PipelinePlan, device_of, explain_refusal
from beton_client._options import ServeOptions, merge_serve_keywords
from beton_client._resume import RetryPolicy, retriable, retry
from beton_client._stream import _Stream
from beton_client._transport import Receiver, ShmReceiver
from beton_client._transport.cuda_ipc import TransportUnavailable
from beton_client._transport.cuda_ipc_slots import make_cuda_ipc_receiver
from beton_client._transport.grpc_receiver import make_grpc_receiver
from beton_client.errors import (
    BetonClientError,
    FormatError,
    ServerError,
    ServerUnavailable,
    SpecError,
    TransportError,
    from_rpc_error,
)
from beton_client.frontend import (
    CLIENT_ERRORS,
    Feed,
    FrontEnd,
    LoaderArgs,
    check_args,
    gc_paused,
    pipelines_key,
)
from beton_client.frontend import is_int as _is_int

__all__ = ["Loader", "OrderOption", "RetryPolicy", "ServeOptions"]

#: Seconds an auto-spawned daemon waits without clients before exiting.
SPAWN_IDLE_TIMEOUT_S = 300.0
_TRANSPORTS = ("auto", "shm", "cuda_ipc", "grpc")
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
)


def _shm_receiver(setup: Any) -> Receiver:
    s = setup.shm
    return ShmReceiver(
        s.segment,
        s.segment_bytes,
        s.slot_count,
        s.slot_bytes,
        ids_offset=s.ids_offset,
        release_offset=s.release_offset,
    )


#: Receivers by transport kind: ``make(TransportSetup message) -> Receiver``. The seam for the
#: cuda_ipc and grpc transports (issue 5): register their factory here; the kinds listed are
#: also what the client announces in ``Capabilities.transports``.
RECEIVERS: dict[str, Callable[[Any], Receiver]] = {"shm": _shm_receiver}
RECEIVERS["grpc"] = make_grpc_receiver  # type: ignore[assignment] # read through _multi_loader, not slot by slot
RECEIVERS["cuda_ipc"] = make_cuda_ipc_receiver

log = logging.getLogger("beton_client")
#: The bearer token when ``Loader(token=...)`` is not given.
ENV_TOKEN = "BETON_SERVE_TOKEN"


class OrderOption(enum.Enum):
    """Sample orders, with FFCV's names and values."""

    SEQUENTIAL = 1
    RANDOM = 2
    QUASI_RANDOM = 3


_ORDER_PB = {
    "SEQUENTIAL": pb.ORDER_SEQUENTIAL,
    "RANDOM": pb.ORDER_RANDOM,
    "QUASI_RANDOM": pb.ORDER_QUASI_RANDOM,
}


def _check_request(req: pb.OpenStreamRequest, facts: Mapping[str, Any]) -> None:
    """Refuse, as the daemon would (``beton_wire.limits``), before sending ``req``."""
    if len(req.pipelines) > MAX_PIPELINES:
        raise SpecError(f"{len(req.pipelines)} pipelines are too many: at most {MAX_PIPELINES}")
    spec_bytes = sum(len(o.name) + len(o.params_json) for p in req.pipelines for o in p.ops)
    if spec_bytes > MAX_SPEC_BYTES:
        raise SpecError(
            f"the pipelines' names and parameters take {spec_bytes} bytes; a daemon accepts "
            f"{MAX_SPEC_BYTES} in all"
        )
    for p in req.pipelines:
        if max(len(p.name), len(p.field)) > MAX_NAME_CHARS or len(p.ops) > MAX_OPS:
            raise SpecError(
                f"pipeline {short_repr(p.name)}: names are at most {MAX_NAME_CHARS} characters "
                f"and a pipeline has at most {MAX_OPS} daemon-side ops"
            )
        for o in p.ops:
            try:
                parse_params(o.params_json)
            except ValueError as exc:
                raise SpecError(
                    f"pipeline {short_repr(p.name)}, op {short_repr(o.name)}: {exc}"
                ) from None
    device = req.device
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        have = [d["index"] for d in facts["cuda_devices"]]
        if index not in have:
            hint = (
                "pick one of those"
                if have
                else "install a CUDA build of torch here, or use ToDevice('cpu')"
            )
            raise SpecError(
                f"ToDevice({short_repr(device)}): this process sees "
                f"{[f'cuda:{i}' for i in have] or 'no CUDA device'}; {hint}"
            )


def _custom_field_specs(custom_fields: Mapping[str, Any]) -> list[str]:
    """``custom_fields`` as ``"name=module:qualname"`` entries: the daemon imports each class by
    that path from its own disk (or finds it among its plugins), never code from the wire.

    Raises:
        SpecError: a value is not a class, or its class cannot be imported by name (defined in
            ``__main__`` or inside a function).
    """
    out = []
    for name, cls in custom_fields.items():
        if not isinstance(cls, type):
            raise SpecError(
                f"custom_fields[{short_repr(name)}] must be a Field class (FFCV passes the class, "
                f"not an instance), not {short_repr(cls)}"
            )
        module, qualname = cls.__module__, cls.__qualname__
        if module == "__main__" or "<locals>" in qualname:
            raise SpecError(
                f"custom_fields[{short_repr(name)}]: {qualname} is defined in "
                f"{'the training script' if module == '__main__' else 'a function'}, so a daemon "
                "cannot import it; move it to a module (importable where the daemon runs) or "
                "load that module into the daemon with --plugin"
            )
        out.append(f"{name}={module}:{qualname}")
    return out


def _client_name() -> str:
    """The script's name, for the daemon's logs (at most ``MAX_NAME_CHARS`` characters)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return name[:MAX_NAME_CHARS]


#: The ``beton-error`` name of the daemon's refusal of a dataset it does not serve
#: (``beton_serve.errors.UnknownDataset``; a unit test checks they agree).
UNKNOWN_DATASET = "UnknownDataset"


def _check_address(address: str) -> None:
    """Refuse an address gRPC cannot parse the way it was meant (``SpecError``)."""
    if not address.strip():
        raise SpecError(
            f"server={address!r} is empty; leave it None for this host's default socket, or "
            "give an address (unix:///path/to.sock, host:port)"
        )
    parts = joined_addresses(address)
    if parts is not None:
        raise SpecError(
            f"server={address!r} is one address with commas in it (gRPC would look it up as a "
            f"host name); give several daemons as a list: server={parts!r}"
        )
    if problem := port_problem(address.strip()):
        raise SpecError(f"server={address!r}: {problem}")


def _server_list(server: str | Sequence[str], transport: str) -> tuple[list[str], str]:
    """``(every address, the first one)``; several addresses need the grpc transport.

    Raises:
        SpecError: an empty or blank address (gRPC answered ``ServerError`` "the target uri is
            not valid" and logged to stderr).
    """
    if isinstance(server, str):
        _check_address(server)
        return [server], server
    servers = [str(x) for x in server]
    if not servers:
        raise SpecError("server=[] names no daemon; give at least one address")
    for s in servers:
        _check_address(s)
    if len(servers) > 1 and transport not in ("auto", "grpc"):
        raise SpecError(
            f"several daemons are read over grpc only, not transport={transport!r}; "
            "pass transport='grpc' or 'auto'"
        )
    return servers, servers[0]


class DaemonBackend:
    """The served backend (``beton_client.frontend.Backend``): a daemon reached over gRPC.

    Opens one stream per feed: the daemon validates the request (a bad spec raises
    :class:`~beton_client.errors.SpecError`), compiles the prefix, negotiates the transport and
    answers with the output specs and the ring to map. The feed is a :class:`_Stream` (shm,
    cuda_ipc) or a remote stream over one or several daemons (grpc).

    Attributes:
        server: the first daemon's address.
        transport: the transport asked for (``"shm"`` for good once cuda_ipc failed here).
        transport_rejections: ``(transport, code, reason)`` for every better transport the
            daemon (or this process) rejected, from the latest stream.
        chosen_transport: the transport of the latest stream.
    """

    errors = CLIENT_ERRORS
    #: A daemon's stream belongs to the process that opened it (``_forks``).
    fork_safe = False

    def __init__(
        self,
        *,
        dataset: str,
        file: FileIdentity | None,
        servers: Sequence[str],
        transport: str,
        compression: str,
        token: str | None,
        tls: tuple[str | None, str | None, str | None],
        socket_owner: int | None,
        reconnect: RetryPolicy,
        connect_timeout: float = 10.0,
        spawn_args: tuple[str, str] | None,
        custom_fields: Sequence[str],
        owner: object,
        missing_file: str | None = None,
    ) -> None:
        self.dataset = dataset
        self._file = file
        self._servers = list(servers)
        self.server = self._servers[0]
        self.transport = transport
        self.compression = compression
        self.token = token
        self._tls = tls
        self.socket_owner = socket_owner
        self.reconnect_policy = reconnect
        # gRPC's minimum connection-attempt deadline is this channel argument (default 20 s)
        self._channel_options = (
            *_CHANNEL_OPTIONS,
            ("grpc.min_reconnect_backoff_ms", max(1, round(connect_timeout * 1000))),
        )
        #: ``(socket, file)`` when this Loader may (re)spawn its daemon (also on reconnect).
        self._spawn_args = spawn_args
        self._custom_fields = list(custom_fields)
        #: Why the path the Loader was given is no file here (``file_identity.mapping_problem``),
        #: or ``None``; the daemon is still asked (it may have the file, or a dataset by its stem).
        self._missing_file = missing_file
        #: The Loader (weakly: it owns this backend, and must be freed by reference counting).
        self._owner = weakref.ref(owner)
        self.transport_rejections: list[tuple[str, str, str]] = []
        self.chosen_transport = ""
        #: The first stream's ``dataset_digest``: every later stream must read the same files.
        self._dataset_digest = ""
        self._finalizer: weakref.finalize | None = None
        self._ensure_daemon()
        self._connect()

    # -- channel and daemon ----------------------------------------------------------------
    def _connect(self) -> None:
        """(Re)create the channel and stub (a fresh channel skips gRPC's own reconnect backoff)."""
        if self._finalizer is not None:
            self._finalizer()
        self._channel = self._make_channel(self.server)
        self._stub = pb_grpc.BetonServeStub(self._channel)
        # On the Loader: its remote streams register their own finalizers on it, which then run
        # first (newest first) and end their calls before this closes the channel.
        self._finalizer = weakref.finalize(self._owner_or_self(), owner_only(self._channel.close))

    def _owner_or_self(self) -> object:
        owner = self._owner()
        return self if owner is None else owner

    def _ensure_daemon(self) -> None:
        if self._spawn_args is not None:
            from beton_client._spawn import ensure_daemon

            sock, path = self._spawn_args
            ensure_daemon(sock, path, idle_timeout=SPAWN_IDLE_TIMEOUT_S, owner=self.socket_owner)

    def _make_channel(self, target: str) -> grpc.Channel:
        """A channel to ``target`` with this Loader's TLS files and token (``_security``), once a
        Unix socket's owner, or a plain loopback port's listener, is checked
        (``check_unix_target``, ``check_loopback_target``: raise UntrustedSocketError)."""
        from beton_client._security import (
            check_loopback_target,
            check_unix_target,
            secure_or_plain_channel,
        )

        check_unix_target(target, self.socket_owner)
        ca, cert, key = self._tls
        if not (ca or cert or key):
            check_loopback_target(target, self.socket_owner)
        return secure_or_plain_channel(
            target,
            ca_file=ca,
            cert_file=cert,
            key_file=key,
            token=self.token,
            options=self._channel_options,
        )

    # -- the Backend protocol ----------------------------------------------------------------
    def retriable(self, err: BaseException) -> bool:
        return retriable(err, self.reconnect_policy)

    def reconnect(
        self,
        err: BaseException,
        args: LoaderArgs,
        plans: Sequence[PipelinePlan],
        num_batches: int | None,
    ) -> Feed:
        """Re-open the stream on a new channel under the reconnection policy (``_resume``).

        Raises:
            ServerUnavailable: the retry budget ran out.
            ServerError: the new daemon's stream has another length (the dataset changed).
        """

        def attempt() -> Feed:
            self._ensure_daemon()  # an auto-spawned daemon that died is spawned again
            self._connect()
            return self.open(args, plans)

        feed = retry(
            attempt, self.reconnect_policy, what=f"reconnect to {self.server}", first_error=err
        )
        if num_batches is not None and feed.num_batches != num_batches:
            feed.close()
            raise ServerError(
                f"the daemon at {self.server} came back with {feed.num_batches} batches per "
                f"epoch instead of {num_batches}: the dataset changed, so the position cannot "
                "be resumed"
            )
        return feed

    def open(self, args: LoaderArgs, plans: Sequence[PipelinePlan]) -> Feed:
        """A stream for ``plans``, on the dataset this Loader's first stream read.

        Raises:
            ServerError: the daemon now serves other files under the dataset's name (it was
                restarted with another file of the same name): the Loader never goes on with
                another dataset's samples.
        """
        feed = self._open(args, plans)
        digest = feed.dataset_digest
        same = compare_digests(digest, self._dataset_digest)
        if same is None and digest and self._dataset_digest:
            log.warning(
                "the daemon at %s came back as another beton-serve version that names datasets "
                "differently (dataset digest %s, was %s): the files it serves as %r are checked "
                "by their batch count only",
                self.server,
                digest[:15],
                self._dataset_digest[:15],
                self.dataset,
            )
        if same is False:
            feed.close()
            raise ServerError(
                f"the daemon at {self.server} now serves other files as {self.dataset!r} than "
                "the ones this Loader started on (their contents differ: dataset digest "
                f"{digest[:15]}, was {self._dataset_digest[:15]}), so the Loader cannot go on: "
                "build a new Loader to read the new dataset"
            )
        self._dataset_digest = digest or self._dataset_digest
        return feed

    def _open(self, args: LoaderArgs, plans: Sequence[PipelinePlan]) -> Feed:
        req = self._request(args, plans)
        try:
            reply = self._stub.OpenStream(req, timeout=300.0)
        except grpc.RpcError as err:
            # No local holds the error raised: its traceback keeps this frame (no cycle).
            raise self._plain_to_tls(
                self._no_such_file(
                    explain_refusal(from_rpc_error(err, target=self.server), self.server)
                )
            ) from None
        self.transport_rejections = [(r.transport, r.code, r.reason) for r in reply.rejected]
        self.chosen_transport = reply.transport.kind
        key = pipelines_key(plans)
        if reply.transport.kind == "grpc":
            from beton_client._multi_loader import open_remote

            return open_remote(
                request=req,
                first_reply=reply,
                first_channel=self._channel,
                targets=self._servers,
                make_channel=self._make_channel,
                key=key,
                owner=self._owner_or_self(),
            )
        try:
            receiver = self._receiver(reply)
        except TransportUnavailable as exc:
            return self._fall_back_to_shm(exc, args, plans)
        return _Stream(self._channel, self._stub, reply, receiver, key, self.server)

    def _no_such_file(self, exc: BetonClientError) -> BetonClientError:
        """The daemon's "unknown dataset" for a path that is no file here: the in-process
        Loader's ``FormatError`` (the missing file), naming what the daemon serves too.

        The refusal is known by its class name in the ``beton-error`` trailing metadata
        (``UnknownDataset``, a ``SpecError``), never by its words."""
        if (
            self._missing_file is None
            or not isinstance(exc, SpecError)
            or exc.server_error != UNKNOWN_DATASET
        ):
            return exc
        return FormatError(
            f"{self._missing_file}; nor does the daemon at {self.server} serve a dataset of "
            f"that name ({exc})",
            code=exc.code,
            server_error=exc.server_error,
        )

    def _plain_to_tls(self, exc: BetonClientError) -> BetonClientError:
        """A "Socket closed" from a ``host:port`` daemon, with the likely reason: a plain-text
        client's daemon serves TLS (``--tls-cert``) and closed the unencrypted connection; a TLS
        client's daemon requires a client certificate (``--tls-client-ca``) and refused the
        one it got, or none. (A server certificate the client refuses is named by gRPC.)"""
        if (
            not isinstance(exc, ServerUnavailable)
            or self.server.startswith("unix:")
            or "Socket closed" not in str(exc)
        ):
            return exc
        ca, cert, _ = self._tls
        if ca is None:
            hint = (
                "if that daemon serves TLS (--tls-cert), pass the CA that signed its "
                "certificate: ServeOptions(tls_ca=...)"
            )
        else:
            hint = (
                "the daemon closed the TLS connection: if it requires client certificates "
                "(--tls-client-ca), "
                + (
                    "pass one it trusts: ServeOptions(tls_cert=..., tls_key=...)"
                    if cert is None
                    else "it refused this one (signed by another CA, or expired?)"
                )
            )
        return ServerUnavailable(f"{exc}; {hint}", code=exc.code, server_error=exc.server_error)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    # -- the request ---------------------------------------------------------------------------
    def _request(self, args: LoaderArgs, plans: Sequence[PipelinePlan]) -> pb.OpenStreamRequest:
        from beton_client._transport.identity import gather_facts

        if args.indices is not None and args.indices.size > MAX_INDICES:
            raise SpecError(
                f"{args.indices.size} indices are too many: a daemon accepts at most {MAX_INDICES}"
            )
        device = device_of(plans)
        facts = gather_facts(device, self.transport).to_dict()
        ident = facts["identity"]
        req = pb.OpenStreamRequest(
            dataset=self.dataset,
            pipelines=[
                pb.PipelineSpec(
                    name=p.name,
                    field=BRANCH_FIELD if p.branch_of else p.field,
                    skip=p.skip,
                    ops=[pb.OpSpec(name=n, params_json=j) for n, j in p.ops],
                    branch_of=p.branch_of,
                    branch_op=p.branch_op,
                )
                for p in plans
            ],
            batch_size=args.batch_size,
            order=_ORDER_PB[args.order_name],
            seed=args.seed,
            drop_last=args.drop_last,
            indices=[] if args.indices is None else args.indices.tolist(),
            has_indices=args.indices is not None,
            distributed=args.distributed,
            rank=args.rank,
            world_size=args.world_size,
            batches_ahead=args.batches_ahead,
            transport=self.transport,
            compression=self.compression,
            device=device,
            host=pb.HostIdentity(
                boot_id=ident["boot_id"],
                hostname=ident["hostname"],
                uid=ident["uid"],
                pid=ident["pid"],
                ipc_ns=ident["ipc_ns"] or 0,
                has_ipc_ns=ident["ipc_ns"] is not None,
            ),
            capabilities=pb.Capabilities(
                torch=facts["has_torch"],
                cuda=facts["has_cuda"],
                cupy=facts["has_cupy"],
                transports=sorted(RECEIVERS),
                cuda_devices=[
                    pb.CudaDevice(index=d["index"], uuid=d["uuid"]) for d in facts["cuda_devices"]
                ],
            ),
            client_name=_client_name(),
            custom_fields=self._custom_fields,
        )
        f = self._file
        if f is not None:
            req.file.CopyFrom(
                pb.FileIdentity(
                    path=f.path,
                    device=f.device,
                    inode=f.inode,
                    size=f.size,
                    mtime_ns=f.mtime_ns,
                    fingerprint=f.fingerprint,
                )
            )
        _check_request(req, facts)
        return req

    def _fall_back_to_shm(
        self, exc: TransportUnavailable, args: LoaderArgs, plans: Sequence[PipelinePlan]
    ) -> Feed:
        """The daemon chose cuda_ipc but this process cannot open it: re-open over shm."""
        log.warning("cuda_ipc cannot be used in this client (%s); falling back to shm", exc)
        rejections = [*self.transport_rejections, ("cuda_ipc", exc.code, str(exc))]
        self.transport = "shm"  # for good: this process cannot open CUDA IPC handles
        feed = self.open(args, plans)
        self.transport_rejections = rejections + [
            r for r in self.transport_rejections if r not in rejections
        ]
        return feed

    def _receiver(self, reply: Any) -> Receiver:
        setup = reply.transport
        make = RECEIVERS.get(setup.kind)
        if make is None:
            raise TransportError(
                f"the daemon chose the {setup.kind!r} transport, which this client cannot "
                f"receive (it supports {sorted(RECEIVERS)}); pass transport='shm' on the "
                "daemon's host"
            )
        return make(setup)


class Loader(FrontEnd):
    """FFCV's ``Loader``, served by a beton-serve daemon (see the module docstring).

    The front end (``beton_client.frontend.FrontEnd``) is the in-process Loader's; this class adds the
    served backend (:class:`DaemonBackend`) and its options.

    Args:
        fname_or_dataset: a ``.beton`` path or the name of a dataset the daemon serves. A path
            that exists here names that file: the daemon serves exactly it (same device, inode,
            size and mtime; across hosts, same size and content fingerprint) or the Loader fails
            with :class:`SpecError` naming both paths; a file is never matched by its stem.
        batch_size: samples per batch.
        num_workers: accepted for FFCV compatibility; a hint only, since the daemon owns the pool.
        os_cache: accepted for FFCV compatibility (the daemon maps files).
        order: an :class:`OrderOption` (or an FFCV/beton_serve one with the same names).
        distributed: split each epoch over ranks; rank and world size come from
            ``torch.distributed`` when initialised, else from ``RANK``/``WORLD_SIZE``.
        seed: the order and augmentation seed (``None``: a random one, or 0 for distributed
            RANDOM so that every rank draws the same permutation, as in-process).
        indices: the sample ids to use (default: all).
        pipelines: FFCV-style ``{name: [ops] | None}``.
        custom_fields: FFCV's ``{field name: Field class}``. Each class travels as its import
            path; the daemon uses its plugin's class of that path, or imports the module from
            its own disk for a client of its own user (``--allow-op-imports`` for others), and
            reads the file with it (docs/custom-ops.md).
        drop_last: drop the last partial batch.
        batches_ahead: batches the daemon prepares ahead of the one being read.
        recompile: accepted for FFCV compatibility; changed ops always take effect at the next
            epoch (the stream is re-opened).
        copy: copy every batch out of the daemon's slot (see "Batch lifetime").
        serve: how to reach the daemon (:class:`~beton_client.ServeOptions`: server, transport,
            spawn, reconnect, compression, token, TLS, socket_owner). Those names given here as
            keywords still work, with a ``DeprecationWarning``.

    Raises:
        SpecError: invalid arguments or pipelines (also as reported by the daemon).
        FormatError: the ``.beton`` path is no file this process can read (missing, a
            directory, no permission), or the daemon found the file damaged: the in-process
            Loader's error and words.
        ServerUnavailable: no daemon answers and none could be spawned (also while iterating,
            once the reconnection budget is spent).
        TransportError: the transport cannot work.
        UntrustedSocketError: the Unix socket or its directory is not ``socket_owner``'s.
    """

    _backend: DaemonBackend

    def __init__(
        self,
        fname_or_dataset: str | os.PathLike[str],
        batch_size: int,
        num_workers: int = -1,
        os_cache: bool = True,
        order: Any = OrderOption.SEQUENTIAL,
        distributed: bool = False,
        seed: int | None = None,
        indices: Sequence[int] | None = None,
        pipelines: Mapping[str, Any] | None = None,
        custom_fields: Mapping[str, Any] | None = None,
        drop_last: bool = True,
        batches_ahead: int = 3,
        recompile: bool = False,
        *,
        serve: ServeOptions | None = None,
        copy: bool = False,
        **serving: Any,
    ) -> None:
        environ = os.environ
        #: How this Loader reaches its daemon (the deprecated keywords folded in).
        self.serve = opts = merge_serve_keywords(serve, serving)
        transport = opts.transport
        if transport not in _TRANSPORTS:
            raise SpecError(f"transport must be one of {_TRANSPORTS}, not {short_repr(transport)}")
        args = check_args(
            batch_size=batch_size,
            num_workers=num_workers,
            order=order,
            distributed=distributed,
            seed=seed,
            indices=indices,
            custom_fields=custom_fields,
            drop_last=drop_last,
            batches_ahead=batches_ahead,
            recompile=recompile,
            copy=copy,
            errors=CLIENT_ERRORS,
            environ=environ,
        )
        text = os.fspath(fname_or_dataset)
        if len(text) > MAX_PATH_CHARS:
            raise SpecError(
                f"dataset {short_repr(text)} is longer than the {MAX_PATH_CHARS} characters a "
                "request may use"
            )
        self.fname = text
        is_file = text.endswith(".beton") or os.sep in text
        self.dataset = Path(text).stem if is_file else text
        #: The file named, resolved by the daemon by identity, never by stem (issue 11); ``None``
        #: for a dataset name, or a path that does not exist here (a remote daemon's file).
        file: FileIdentity | None = None
        missing = mapping_problem(text) if is_file else None
        if is_file and missing is None:
            try:
                file = FileIdentity.of(text)
            except OSError as exc:  # e.g. no permission: the in-process Loader's words
                raise FormatError(f"{text}: {unmappable(exc)}") from None
        self.os_cache = os_cache
        #: The sample ids given (``None``: every sample).
        self.indices = None if args.indices is None else args.indices.tolist()
        reconnect = opts.reconnect
        if isinstance(reconnect, RetryPolicy):
            policy = reconnect
        else:
            policy = RetryPolicy() if reconnect else RetryPolicy(budget_s=0.0)
        server = opts.server
        if server is None:
            server = environ.get(ENV_ADDRESS) or unix_target(default_socket_path(environ))
        servers, first = _server_list(server, transport)
        if len(servers) > 1:
            transport = "grpc"
        socket_owner = opts.socket_owner
        if socket_owner is not None and (not _is_int(socket_owner) or socket_owner < 0):
            raise SpecError(f"socket_owner must be a uid (an int >= 0), not {socket_owner!r}")
        for path in filter(None, map(socket_path_of, servers)):
            problem = socket_path_problem(path)
            if problem is not None:
                raise SpecError(problem)
        connect_timeout = opts.connect_timeout
        if (
            isinstance(connect_timeout, bool)
            or not isinstance(connect_timeout, (int, float))
            or not 0 < connect_timeout <= 3600  # NaN fails too
        ):
            raise SpecError(
                f"connect_timeout must be seconds in (0, 3600], not {short_repr(connect_timeout)}"
            )
        sock = socket_path_of(first)
        spawn_args = None
        if opts.spawn and sock is not None and is_file:
            if missing is not None:  # the in-process Loader's error
                raise FormatError(missing)
            spawn_args = (sock, text)
        backend = DaemonBackend(
            dataset=self.dataset,
            file=file,
            servers=servers,
            transport=transport,
            compression=opts.compression or "",
            token=opts.token if opts.token is not None else (environ.get(ENV_TOKEN) or None),
            tls=(opts.tls_ca, opts.tls_cert, opts.tls_key),
            socket_owner=None if socket_owner is None else int(socket_owner),
            reconnect=policy,
            connect_timeout=float(connect_timeout),
            spawn_args=spawn_args,
            custom_fields=_custom_field_specs(args.custom_fields),
            owner=self,
            missing_file=missing,
        )
        # no decorator on __init__: the DeprecationWarning above must name the caller's line
        with gc_paused():  # beton_client._gcpause
            self._start(backend, args, order, pipelines)
        self._freeze()

    # -- serving attributes (the backend's) -------------------------------------------------
    @property
    def server(self) -> str:
        """The (first) daemon's address."""
        return self._backend.server

    @property
    def transport(self) -> str:
        """The transport asked for (``"grpc"`` for several daemons)."""
        return self._backend.transport

    @property
    def transport_rejections(self) -> list[tuple[str, str, str]]:
        """``(transport, code, reason)`` of every better transport rejected for this stream."""
        return self._backend.transport_rejections

    @property
    def chosen_transport(self) -> str:
        """The transport the daemon chose for the current stream."""
        return self._backend.chosen_transport

    @property
    def reconnect(self) -> RetryPolicy:
        """How long to try reconnecting when the daemon goes away."""
        return self._backend.reconnect_policy

    @property
    def token(self) -> str | None:
        return self._backend.token

    @property
    def compression(self) -> str:
        return self._backend.compression

    @property
    def socket_owner(self) -> int | None:
        return self._backend.socket_owner

    @property
    def _stream(self) -> Any:
        """The current feed (a ``_Stream`` or a remote stream; ``None`` once closed)."""
        return self._feed

    def __enter__(self) -> Loader:
        return self
