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
import numbers
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from beton_wire.address import ENV_ADDRESS, default_socket_path, socket_path_of, unix_target
from beton_wire.file_identity import FileIdentity
from beton_wire.limits import (
    MAX_BATCH_SIZE,
    MAX_BATCHES_AHEAD,
    MAX_INDICES,
    MAX_NAME_CHARS,
    MAX_OPS,
    MAX_PATH_CHARS,
    MAX_PIPELINES,
    MAX_REQUEST_BYTES,
    MAX_SPEC_BYTES,
    MAX_WORLD_SIZE,
    parse_params,
    short_repr,
)
from beton_wire.loader_state import (
    StateError,
    StateIdentity,
    check_state,
    indices_digest,
    make_state,
)
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc

from beton_client._ops import PipelinePlan, device_of, split_pipelines
from beton_client._options import ServeOptions, merge_serve_keywords
from beton_client._resume import RetryPolicy, retriable, retry
from beton_client._stream import _EpochIterator, _Stream
from beton_client._transport import Receiver, ShmReceiver
from beton_client._transport.cuda_ipc import TransportUnavailable
from beton_client._transport.cuda_ipc_slots import make_cuda_ipc_receiver
from beton_client._transport.grpc_receiver import make_grpc_receiver
from beton_client.errors import (
    BetonClientError,
    ServerError,
    ServerUnavailable,
    SpecError,
    TransportError,
    from_rpc_error,
)

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
def _is_int(value: object) -> bool:
    """True for Python and numpy integers (not bools)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


def _check_indices(indices: Sequence[int] | np.ndarray) -> list[int]:
    """``indices`` as a list of sample ids, within the daemon's limits (SpecError otherwise)."""
    arr = np.asarray(indices).reshape(-1)
    if arr.size > MAX_INDICES:
        raise SpecError(f"{arr.size} indices are too many: a daemon accepts at most {MAX_INDICES}")
    if arr.size == 0:
        raise SpecError("indices=[] selects no samples; pass indices=None for every sample")
    if arr.dtype.kind not in "iu" and not all(_is_int(i) for i in arr.tolist()):
        raise SpecError(f"indices must be integers, not {arr.dtype}")
    out = [int(i) for i in arr.tolist()]
    if min(out) < 0 or max(out) >= 2**64:
        raise SpecError("indices must be non-negative sample ids")
    return out


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


def _rank_world(environ: Mapping[str, str]) -> tuple[int, int]:
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank()), int(dist.get_world_size())
        except Exception:
            pass
    try:
        return int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SpecError("RANK and WORLD_SIZE must be integers") from None


def _server_list(server: str | Sequence[str], transport: str) -> tuple[list[str], str]:
    """``(every address, the first one)``; several addresses need the grpc transport."""
    if isinstance(server, str):
        return [server], server
    servers = [str(x) for x in server]
    if not servers:
        raise SpecError("server=[] names no daemon; give at least one address")
    if len(servers) > 1 and transport not in ("auto", "grpc"):
        raise SpecError(
            f"several daemons are read over grpc only, not transport={transport!r}; "
            "pass transport='grpc' or 'auto'"
        )
    return servers, servers[0]


class Loader:
    """FFCV's ``Loader``, served by a beton-serve daemon (see the module docstring).

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
        ServerUnavailable: no daemon answers and none could be spawned (also while iterating,
            once the reconnection budget is spent).
        TransportError: the transport cannot work.
        UntrustedSocketError: the Unix socket or its directory is not ``socket_owner``'s.
    """

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
        server, transport, spawn, reconnect = (
            opts.server,
            opts.transport,
            opts.spawn,
            opts.reconnect,
        )
        compression, token, socket_owner = opts.compression, opts.token, opts.socket_owner
        tls_ca, tls_cert, tls_key = opts.tls_ca, opts.tls_cert, opts.tls_key
        # The daemon's request limits (beton_wire.limits), checked before anything is sent.
        if transport not in _TRANSPORTS:
            raise SpecError(f"transport must be one of {_TRANSPORTS}, not {short_repr(transport)}")
        if not _is_int(batch_size) or not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise SpecError(
                f"batch_size {short_repr(batch_size)} is out of range: use an int in "
                f"1..{MAX_BATCH_SIZE} (the daemon also refuses batches larger than its slot "
                "memory allows)"
            )
        if not _is_int(batches_ahead) or not 1 <= batches_ahead <= MAX_BATCHES_AHEAD:
            raise SpecError(
                f"batches_ahead {short_repr(batches_ahead)} is out of range: use an int in "
                f"1..{MAX_BATCHES_AHEAD}"
            )
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
            raise SpecError(f"seed must be an int in [0, 2**64), not {short_repr(seed)}")
        if _is_int(order) and not hasattr(order, "name"):
            order = OrderOption(order)  # FFCV's values; ValueError as in-process for others
        order_name = getattr(order, "name", str(order))
        if order_name not in _ORDER_PB:
            raise SpecError(
                f"order must be OrderOption.SEQUENTIAL, RANDOM or QUASI_RANDOM, not {order!r} "
                "(custom TraversalOrder classes cannot travel to a daemon)"
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
        self._file: FileIdentity | None = None
        if is_file and os.path.isfile(text):
            try:
                self._file = FileIdentity.of(text)
            except OSError as exc:
                raise SpecError(f"dataset file {text} cannot be read: {exc}") from None
        self.batch_size = int(batch_size)
        self.num_workers = num_workers
        self.os_cache = os_cache
        self.order = order
        self.distributed = bool(distributed)
        if seed is None:
            # As the in-process Loader: a fresh seed, except for distributed RANDOM, where every
            # rank must draw the same permutation.
            random_order = order_name == "RANDOM"
            seed = (
                0 if (self.distributed and random_order) else int(np.random.randint(0, 2**31 - 1))
            )
        self.seed = int(seed)
        self.indices = None if indices is None else _check_indices(indices)
        self.pipelines: dict[str, Any] = dict(pipelines or {})
        self.custom_fields = dict(custom_fields or {})
        self.drop_last = bool(drop_last)
        self.batches_ahead = int(batches_ahead)
        self.recompile = recompile
        self.transport = transport
        self.copy = bool(copy)
        self.rank, self.world_size = _rank_world(environ) if self.distributed else (0, 1)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or not 0 <= self.rank < self.world_size:
            raise SpecError(
                f"rank {self.rank} / world_size {self.world_size} (from torch.distributed or "
                f"RANK/WORLD_SIZE): need 1 <= world_size <= {MAX_WORLD_SIZE} and "
                "0 <= rank < world_size"
            )
        if isinstance(reconnect, RetryPolicy):
            self.reconnect = reconnect
        else:
            self.reconnect = RetryPolicy() if reconnect else RetryPolicy(budget_s=0.0)
        self.next_epoch = 0
        self._resume_batch = 0
        self._position: tuple[int, int] | None = None
        self._num_samples = 0
        self._indices_digest = indices_digest(self.indices)  # once: it hashes every id
        self.last_sample_ids: np.ndarray = np.empty(0, np.uint64)
        self._current: _EpochIterator | None = None
        self._stream: _Stream | None = None
        if server is None:
            server = environ.get(ENV_ADDRESS) or unix_target(default_socket_path(environ))
        self._servers, first = _server_list(server, transport)
        server = first
        if len(self._servers) > 1:
            transport = self.transport = "grpc"
        self.compression = compression or ""
        self.token = token if token is not None else (environ.get(ENV_TOKEN) or None)
        self._tls = (tls_ca, tls_cert, tls_key)
        if socket_owner is not None and (not _is_int(socket_owner) or socket_owner < 0):
            raise SpecError(f"socket_owner must be a uid (an int >= 0), not {socket_owner!r}")
        self.socket_owner = None if socket_owner is None else int(socket_owner)
        self.server = server
        sock = socket_path_of(server)
        #: ``(socket, file)`` when this Loader may (re)spawn its daemon (also on reconnect).
        self._spawn_args: tuple[str, str] | None = None
        if spawn and sock is not None and is_file:
            if not os.path.isfile(text):
                raise SpecError(f"dataset file {text} does not exist")
            self._spawn_args = (sock, text)
            self._ensure_daemon()
        self._connect()
        try:
            self._stream = self._open()
        except BaseException:
            self.close()
            raise

    # -- the stream ------------------------------------------------------------------------
    def _connect(self) -> None:
        """(Re)create the channel and stub (a fresh channel skips gRPC's own reconnect backoff)."""
        old = getattr(self, "_finalizer", None)
        if old is not None:
            old()
        self._channel = self._make_channel(self.server)
        self._stub = pb_grpc.BetonServeStub(self._channel)
        self._finalizer = weakref.finalize(self, self._channel.close)

    def _ensure_daemon(self) -> None:
        if self._spawn_args is not None:
            from beton_client._spawn import ensure_daemon

            sock, path = self._spawn_args
            ensure_daemon(sock, path, idle_timeout=SPAWN_IDLE_TIMEOUT_S, owner=self.socket_owner)

    def _reconnect(self, err: BaseException) -> _Stream:
        """Re-open the stream on a new channel under :attr:`reconnect` (see ``_resume``).

        Raises:
            ServerUnavailable: the retry budget ran out.
            ServerError: the new daemon's stream has another length (the dataset changed).
        """
        old = self._stream
        want = old.num_batches if old is not None else None
        if old is not None:
            old.close()
        self._stream = None

        def attempt() -> _Stream:
            self._ensure_daemon()  # an auto-spawned daemon that died is spawned again
            self._connect()
            return self._open()

        stream = retry(attempt, self.reconnect, what=f"reconnect to {self.server}", first_error=err)
        if want is not None and stream.num_batches != want:
            stream.close()
            raise ServerError(
                f"the daemon at {self.server} came back with {stream.num_batches} batches per "
                f"epoch instead of {want}: the dataset changed, so the position cannot be resumed"
            )
        self._stream = stream
        return stream

    def _request(self) -> tuple[pb.OpenStreamRequest, list[PipelinePlan]]:
        from beton_client._transport.identity import gather_facts

        plans = split_pipelines(self.pipelines)
        device = device_of(plans)
        facts = gather_facts(device, self.transport).to_dict()
        ident = facts["identity"]
        req = pb.OpenStreamRequest(
            dataset=self.dataset,
            pipelines=[
                pb.PipelineSpec(
                    name=p.name,
                    field=p.field,
                    skip=p.skip,
                    ops=[pb.OpSpec(name=n, params_json=j) for n, j in p.ops],
                )
                for p in plans
            ],
            batch_size=self.batch_size,
            order=_ORDER_PB[getattr(self.order, "name", str(self.order))],
            seed=self.seed,
            drop_last=self.drop_last,
            indices=self.indices or [],
            has_indices=self.indices is not None,
            distributed=self.distributed,
            rank=self.rank,
            world_size=self.world_size,
            batches_ahead=self.batches_ahead,
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
            custom_fields=_custom_field_specs(self.custom_fields),
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
        return req, plans

    @staticmethod
    def _key(plans: Sequence[PipelinePlan]) -> bytes:
        """What decides whether a stream can serve the next epoch: the daemon-side spec of every
        pipeline and the device (cheap: ``__iter__`` computes it every epoch)."""
        spec = [(p.name, p.field, p.skip, p.ops) for p in plans]
        return repr((spec, device_of(plans))).encode()

    def _open(self) -> _Stream:
        req, plans = self._request()
        try:
            reply = self._stub.OpenStream(req, timeout=300.0)
        except grpc.RpcError as err:
            raise from_rpc_error(err, target=self.server) from None
        #: samples this rank visits per epoch, as the daemon counted them (for ``state_dict``)
        self._num_samples = int(reply.num_samples)
        self.transport_rejections = [(r.transport, r.code, r.reason) for r in reply.rejected]
        self.chosen_transport = reply.transport.kind
        if reply.transport.kind == "grpc":
            from beton_client._multi_loader import open_remote

            return open_remote(  # type: ignore[return-value]
                request=req,
                first_reply=reply,
                first_channel=self._channel,
                targets=self._servers,
                make_channel=self._make_channel,
                plans=plans,
                key=self._key(plans),
                owner=self,
            )
        try:
            receiver = self._receiver(reply)
        except TransportUnavailable as exc:
            return self._fall_back_to_shm(exc)
        return _Stream(
            self._channel, self._stub, reply, receiver, plans, self._key(plans), self.server
        )

    def _make_channel(self, target: str) -> grpc.Channel:
        """A channel to ``target`` with this Loader's TLS files and token (``_security``), once a
        Unix socket's owner is checked (``check_unix_target``: raises UntrustedSocketError)."""
        from beton_client._security import check_unix_target, secure_or_plain_channel

        check_unix_target(target, self.socket_owner)
        ca, cert, key = self._tls
        return secure_or_plain_channel(
            target,
            ca_file=ca,
            cert_file=cert,
            key_file=key,
            token=self.token,
            options=_CHANNEL_OPTIONS,
        )

    def _fall_back_to_shm(self, exc: TransportUnavailable) -> _Stream:
        """The daemon chose cuda_ipc but this process cannot open it: re-open over shm."""
        log.warning("cuda_ipc cannot be used in this client (%s); falling back to shm", exc)
        rejections = [*self.transport_rejections, ("cuda_ipc", exc.code, str(exc))]
        self.transport = "shm"  # for good: this process cannot open CUDA IPC handles
        stream = self._open()
        self.transport_rejections = rejections + [
            r for r in self.transport_rejections if r not in rejections
        ]
        return stream

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

    # -- FFCV API --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        if self._stream is None:
            raise BetonClientError("the Loader is closed")
        return self._stream.num_batches

    def __iter__(self) -> _EpochIterator:
        """Start the next epoch (re-opening the stream if an op's parameters changed)."""
        if self._stream is None:
            raise BetonClientError("the Loader is closed")
        stream = self._stream
        abandoned = self._current is not None and not self._current.done
        if abandoned or self._key(split_pipelines(self.pipelines)) != stream.key:
            stream.close()
            self._stream = None
            try:
                stream = self._open()
            except ServerUnavailable as err:
                if not retriable(err, self.reconnect):
                    raise
                stream = self._reconnect(err)
            self._stream = stream
        epoch, start = self.next_epoch, self._resume_batch
        self.next_epoch, self._resume_batch = epoch + 1, 0
        self._position = (epoch, start)
        epoch_of = getattr(stream, "epoch", None)  # a remote (grpc) stream makes its own
        self._current = (
            epoch_of(self, epoch, start)
            if epoch_of is not None
            else _EpochIterator(self, stream, epoch, start)
        )
        return self._current

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: the epoch and the batches of it already yielded.

        The format is ``beton_wire.loader_state``, shared with ``beton_serve.loader.Loader``:
        ``{"version", "epoch", "batch"}`` plus what must match for an exact resume (seed, order,
        batch_size, drop_last, distributed settings, samples, an indices digest, ``len``).
        Restore it with :meth:`load_state_dict` on a Loader of either kind, over any transport,
        built with the same arguments: the next ``iter`` yields exactly the batches that were
        not yet yielded.
        """
        if self._position is not None:
            epoch, batch = self._position
        else:
            epoch, batch = self.next_epoch, self._resume_batch
        return make_state(epoch=epoch, batch=batch, identity=self._state_identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue from ``state`` (see :meth:`state_dict`).

        Accepts the states of both Loaders: version 2, version 1 and version-less dicts.

        Raises:
            SpecError: an unknown version, or the state comes from a Loader with other
                arguments (the message names the one that differs).
        """
        try:
            epoch, batch = check_state(state, self._state_identity())
        except StateError as exc:
            raise SpecError(str(exc)) from None
        self.next_epoch, self._resume_batch = epoch, batch
        self._position = None

    def _state_identity(self) -> StateIdentity:
        """What a state must match; ``num_samples`` is the daemon's count for this stream."""
        return StateIdentity(
            seed=self.seed,
            order=getattr(self.order, "name", str(self.order)),
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            distributed=self.distributed,
            rank=self.rank,
            world_size=self.world_size,
            num_samples=self._num_samples,
            indices=self._indices_digest,
            len=len(self),
        )

    @property
    def reader_outputs(self) -> list[str]:
        """The output names, in the order of the yielded tuples."""
        return list(self._stream.names) if self._stream is not None else []

    def close(self) -> None:
        """End the stream (the daemon frees its slots) and close the channel (idempotent)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
