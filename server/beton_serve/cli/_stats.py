"""``beton-serve stats``: the daemon's stats, live in the terminal or as one JSON snapshot.

It calls the daemon's ``Stats`` RPC (``beton_wire.v1.BetonServe/Stats``) and shows:

- the daemon: pid, uptime, workers, shared-memory bytes, the ring budget, the ops' buffers
  (all, idle, and the idle bound), compiled plans, streams opened;
- per stream: dataset, client, transport, batches/s, images/s, data-stall %, slots in use;
- per dataset: samples decoded (in total and per second), batches decoded;
- per decode group (issue 16, jobs whose pipelines differ sharing decodes): members, detached,
  samples delivered, JPEG decodes, and the decode work in epochs per epoch
  (``decoded * members / delivered``: 1.0 means each sample decoded once for the whole group),
  hits, waits, evictions and cached bytes.

Rates. In the live view (the default) rates are the difference between two consecutive
snapshots divided by the time between them (``--interval``, 1 s by default). A single snapshot
(``--json``, or the first frame) has no previous one, so its rates are averages over each
stream's lifetime (since the daemon started, for datasets); the JSON says which in
``rate_basis`` (``"interval"`` or ``"lifetime"``).

Data stall. The client reports how long its training loop waited for each batch (the
``wait_us`` of its releases); the daemon sums them per stream (``client_wait_us``). The stall
share is that wait over the wall time it covers: the stream's age, or the interval.

``--json`` prints one snapshot: every field of the ``StatsResponse`` (proto field names, all
present) plus the derived ``batches_per_s``, ``images_per_s`` and ``stall_pct`` per stream and
``samples_per_s`` per dataset, ``decode_epochs_per_epoch`` per decode group. Each dataset's
total ``samples_decoded`` is there.

The address is resolved as for ``beton-serve health``: ``--server``, then
``BETON_SERVE_ADDRESS``, then the per-user default socket. A daemon started with a token wants
it on every call, the Unix socket included: ``--token-file`` or ``BETON_SERVE_TOKEN`` (the
variable the client reads). A TLS listener takes ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
for mutual TLS), as for ``health``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from beton_wire.limits import human_bytes

from beton_serve.cli._health import add_socket_owner_argument, positive_seconds
from beton_serve.errors import TransportError

__all__ = ["fetch_stats", "register", "render", "run", "snapshot_dict"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``stats`` on the ``beton-serve`` subcommand parser; returns the subparser."""
    p = subparsers.add_parser(
        "stats",
        help="show a running daemon's streams, rates, data stall and decode counters",
        description="Show a running daemon's stats (Stats RPC): live as a table, or one "
        "snapshot with --json.",
    )
    p.add_argument(
        "--server",
        default=None,
        help="gRPC target: unix:///path/to.sock or host:port (default: $BETON_SERVE_ADDRESS, "
        "then the per-user socket)",
    )
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    add_socket_owner_argument(p)
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="seconds between refreshes of the live view (default 1)",
    )
    p.add_argument(
        "--count",
        type=_count,
        default=0,
        metavar="N",
        help="stop after N refreshes of the live view (default 0: until Ctrl-C)",
    )
    p.add_argument("--timeout", type=positive_seconds, default=5.0, help="RPC deadline in seconds")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="file holding the daemon's bearer token (default: $BETON_SERVE_TOKEN, if set)",
    )
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA that signed the daemon's cert")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="client private key (mTLS)")
    p.set_defaults(func=run)
    return p


def _token(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The bearer token: from ``path`` (``--token-file``), else ``BETON_SERVE_TOKEN``."""
    if path:
        from beton_serve.transport.security import read_token_file

        return read_token_file(path)
    return environ.get("BETON_SERVE_TOKEN") or None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: until Ctrl-C), got {text}")
    return value


def fetch_stats(
    target: str,
    *,
    timeout: float = 5.0,
    token: str | None = None,
    credentials: Any = None,
    socket_owner: int | None = None,
) -> Any:
    """Call ``Stats`` on the daemon at ``target`` and return its ``StatsResponse``.

    Args:
        target: the gRPC target.
        timeout: the RPC deadline in seconds.
        token: the daemon's bearer token, sent as ``authorization`` metadata.
        credentials: ``grpc.ChannelCredentials`` for a TLS listener (``None``: plaintext).
        socket_owner: the uid a ``unix:`` target must belong to (default: this user's); the
            token is never sent to another user's socket.

    Raises:
        ConfigError: a ``unix:`` target of another user (``_health.check_trusted``).
        TransportError: no daemon answered before the deadline, or it returned an error; the
            message names the address and the gRPC status.
    """
    import grpc
    from beton_wire.v1 import beton_pb2 as pb
    from beton_wire.v1 import beton_pb2_grpc as pb_grpc

    from beton_serve.cli._health import check_trusted, unanswered_hint

    budget = timeout
    t0 = time.monotonic()
    if not check_trusted(target, socket_owner, timeout, tls=credentials is not None):
        raise TransportError(
            f"no beton-serve daemon answered at {target} within {budget:g} s; start one "
            "(beton-serve DATASET.beton) or pass --server"
        )
    timeout = max(0.1, timeout - (time.monotonic() - t0))
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with channel:
        stub = pb_grpc.BetonServeStub(channel)
        try:
            return stub.Stats(
                pb.StatsRequest(), timeout=timeout, wait_for_ready=True, metadata=metadata
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                hint = unanswered_hint(target, credentials is not None)
                raise TransportError(
                    hint
                    or f"no beton-serve daemon answered at {target} within {budget:g} s; start "
                    "one (beton-serve DATASET.beton) or pass --server"
                ) from None
            name = code.name if code is not None else "UNKNOWN"
            raise TransportError(f"Stats RPC to {target} failed: {name}: {detail}") from None


def _message_dict(msg: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _int(v: Any) -> int:
    # MessageToDict writes 64-bit integers as strings (JSON precision); give numbers back.
    return int(v) if v not in (None, "") else 0


_INT64_STREAM = ("batches_sent", "samples_sent", "client_wait_us")
_INT64_DATASET = ("samples_decoded", "batches_decoded", "bad_samples")
_INT64_TOP = (
    "shm_bytes",
    "streams_opened",
    "workers_replaced",
    "max_ring_bytes",
    "ring_bytes",
    "buffer_bytes",
    "idle_buffer_bytes",
    "max_idle_buffer_bytes",
    "idle_buffers_freed",
)
_INT64_GROUP = ("delivered", "decoded", "hits", "evicted", "live_bytes", "waits")


def snapshot_dict(
    resp: Any, previous: Mapping[str, Any] | None = None, *, now: float | None = None
) -> dict[str, Any]:
    """A JSON-safe dict of a ``StatsResponse`` with derived rates.

    Args:
        resp: the ``StatsResponse``.
        previous: the dict this function returned for the previous snapshot of the same daemon,
            to compute rates over the interval; ``None`` for lifetime averages.
        now: the monotonic time the snapshot was taken (``time.monotonic()`` by default).

    Returns:
        Every proto field (proto names, 64-bit integers as ints) plus ``taken_at`` (monotonic),
        ``rate_basis``, and per stream ``batches_per_s``, ``images_per_s``, ``stall_pct``; per
        dataset ``samples_per_s``. A stream that was not in ``previous`` (new since) gets lifetime
        averages.
    """
    now = time.monotonic() if now is None else now
    d = _message_dict(resp)
    for k in _INT64_TOP:
        d[k] = _int(d.get(k))
    prev_streams: dict[str, Any] = {}
    prev_datasets: dict[str, Any] = {}
    dt = 0.0
    if previous is not None:
        dt = now - float(previous["taken_at"])
        prev_streams = {s["stream_id"]: s for s in previous.get("streams", [])}
        prev_datasets = {x["name"]: x for x in previous.get("datasets", [])}
    # Another daemon since the previous snapshot (restarted on the same address): its counters
    # started again, so rates over the interval would be negative (found: -222 samples/s).
    same_daemon = previous is not None and (
        previous.get("pid") == d.get("pid")
        and float(previous.get("uptime_s", 0.0)) <= float(d.get("uptime_s", 0.0))
    )
    interval = previous is not None and dt > 0 and same_daemon
    for s in d.get("streams", []):
        for k in _INT64_STREAM:
            s[k] = _int(s.get(k))
        p = prev_streams.get(s["stream_id"]) if interval else None
        if p is not None:
            span = dt
            db = s["batches_sent"] - p["batches_sent"]
            di = s["samples_sent"] - p["samples_sent"]
            dw = s["client_wait_us"] - p["client_wait_us"]
        else:
            span = float(s.get("age_s", 0.0))
            db, di, dw = s["batches_sent"], s["samples_sent"], s["client_wait_us"]
        s["batches_per_s"] = db / span if span > 0 else 0.0
        s["images_per_s"] = di / span if span > 0 else 0.0
        s["stall_pct"] = min(100.0, 100.0 * dw / 1e6 / span) if span > 0 else 0.0
    for x in d.get("datasets", []):
        for k in _INT64_DATASET:
            x[k] = _int(x.get(k))
        p = prev_datasets.get(x["name"]) if interval else None
        if p is not None and x["samples_decoded"] < p["samples_decoded"]:
            p = None  # a dataset closed and opened again under its name: its own lifetime
        if p is not None:
            x["samples_per_s"] = (x["samples_decoded"] - p["samples_decoded"]) / dt
        else:
            up = float(d.get("uptime_s", 0.0))
            x["samples_per_s"] = x["samples_decoded"] / up if up > 0 else 0.0
    for g in d.get("decode_groups", []):
        for k in _INT64_GROUP:
            g[k] = _int(g.get(k))
        members, delivered = int(g.get("members", 0)), g["delivered"]
        # lifetime figure: the group's decodes per sample each member read, in epochs
        g["decode_epochs_per_epoch"] = g["decoded"] * members / delivered if delivered else 0.0
    d["taken_at"] = now
    d["rate_basis"] = "interval" if interval else "lifetime"
    return d


def _budget(snap: Mapping[str, Any]) -> str:
    """``"154.0 MiB of 6.0 GiB (3%)"``: the rings counted against ``max_ring_bytes``."""
    used, cap = float(snap.get("ring_bytes", 0)), float(snap["max_ring_bytes"])
    return f"{human_bytes(used)} of {human_bytes(cap)} ({100 * used / cap:.0f}%)"


def _buffers(snap: Mapping[str, Any]) -> str:
    """``"buffers 231.0 MiB (idle 154.0 MiB of 3.0 GiB)"``: the ops' buffers, and the idle ones
    against ``max_idle_buffer_bytes``."""
    live, idle = float(snap.get("buffer_bytes", 0)), float(snap.get("idle_buffer_bytes", 0))
    cap = float(snap.get("max_idle_buffer_bytes", 0))
    return f"buffers {human_bytes(live)} (idle {human_bytes(idle)} of {human_bytes(cap)})"


def _human_duration(s: float) -> str:
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def render(snap: Mapping[str, Any], *, target: str = "") -> Any:
    """The rich renderable of one :func:`snapshot_dict`: a header line and two tables, and a
    third for decode groups when there are any."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    basis = "over the last interval" if snap.get("rate_basis") == "interval" else "lifetime avg"
    head = Text.assemble(
        ("beton-serve", "bold"),
        f" {target}  " if target else "  ",
        f"pid {snap.get('pid', 0)}  up {_human_duration(float(snap.get('uptime_s', 0.0)))}  ",
        f"workers {snap.get('workers', 0)}  ",
        *([f"queue {snap['queue_depth']}  "] if "queue_depth" in snap else []),
        f"shm {human_bytes(float(snap.get('shm_bytes', 0)))}  ",
        *([f"ring budget {_budget(snap)}  "] if snap.get("max_ring_bytes") else []),
        *([f"{_buffers(snap)}  "] if snap.get("max_idle_buffer_bytes") else []),
        f"plans {snap.get('compiled_plans', 0)}  streams opened {snap.get('streams_opened', 0)}",
    )
    streams = Table(title=f"streams (rates: {basis})", title_justify="left", expand=False)
    for col, just in (
        ("stream", "left"),
        ("dataset", "left"),
        ("client", "left"),
        ("transport", "left"),
        ("batches/s", "right"),
        ("images/s", "right"),
        ("stall %", "right"),
        ("slots", "right"),
        ("batches", "right"),
    ):
        streams.add_column(col, justify=just)  # type: ignore[arg-type]
    rows = sorted(snap.get("streams", []), key=lambda s: (s.get("dataset", ""), s["stream_id"]))
    for s in rows:
        client = s.get("client_name", "") or "?"
        if s.get("client_pid"):
            client += f" ({s['client_pid']})"
        stall = float(s.get("stall_pct", 0.0))
        style = "red" if stall >= 20 else "yellow" if stall >= 5 else ""
        streams.add_row(
            str(s["stream_id"]),
            str(s.get("dataset", "")),
            client,
            str(s.get("transport", "")),
            f"{s.get('batches_per_s', 0.0):.1f}",
            f"{s.get('images_per_s', 0.0):.0f}",
            Text(f"{stall:.1f}", style=style),
            f"{s.get('slots_leased', 0)}/{s.get('slot_count', 0)}",
            str(s.get("batches_sent", 0)),
        )
    if not rows:
        streams.caption = "(no open streams)"
    datasets = Table(title="datasets", title_justify="left", expand=False)
    for col, just in (
        ("dataset", "left"),
        ("samples decoded", "right"),
        ("samples/s", "right"),
        ("batches decoded", "right"),
    ):
        datasets.add_column(col, justify=just)  # type: ignore[arg-type]
    for x in sorted(snap.get("datasets", []), key=lambda x: x["name"]):
        datasets.add_row(
            Text(f"{x['name']} (REFUSED)", style="bold red")
            if x.get("refused")
            else str(x["name"]),
            f"{x.get('samples_decoded', 0):,}",
            f"{x.get('samples_per_s', 0.0):.0f}",
            f"{x.get('batches_decoded', 0):,}",
        )
    groups = snap.get("decode_groups", [])
    if not groups:
        return Group(head, streams, datasets)
    table = Table(title="decode groups (lifetime)", title_justify="left", expand=False)
    for col, just in (
        ("dataset", "left"),
        ("field", "left"),
        ("decode", "left"),
        ("members", "right"),
        ("detached", "right"),
        ("delivered", "right"),
        ("decoded", "right"),
        ("epochs/epoch", "right"),
        ("hits", "right"),
        ("waits", "right"),
        ("evicted", "right"),
        ("cached", "right"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for g in sorted(groups, key=lambda g: (g.get("dataset", ""), g.get("field", ""))):
        table.add_row(
            str(g.get("dataset", "")),
            str(g.get("field", "")),
            str(g.get("decode", "")),
            str(g.get("members", 0)),
            str(g.get("detached", 0)),
            f"{g.get('delivered', 0):,}",
            f"{g.get('decoded', 0):,}",
            f"{g.get('decode_epochs_per_epoch', 0.0):.2f}",
            f"{g.get('hits', 0):,}",
            f"{g.get('waits', 0):,}",
            f"{g.get('evicted', 0):,}",
            human_bytes(float(g.get("live_bytes", 0))),
        )
    return Group(head, streams, datasets, table)


def run(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    fetch: Callable[[str], Any] | None = None,
    out: Any = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Run the subcommand; returns 0, or raises :class:`TransportError` (exit 1) when no daemon
    answers.

    ``environ``, ``fetch`` (``target -> StatsResponse``), ``out`` (a text stream) and ``sleep``
    are injectable for tests.
    """
    import os

    from beton_serve.cli._health import resolve_target, tls_credentials

    env = os.environ if environ is None else environ
    target = resolve_target(args.server, env)
    if fetch is None:
        token = _token(getattr(args, "token_file", None), env)
        creds = tls_credentials(
            getattr(args, "tls_ca", None),
            getattr(args, "tls_cert", None),
            getattr(args, "tls_key", None),
        )

        def fetch(t: str) -> Any:
            return fetch_stats(
                t,
                timeout=args.timeout,
                token=token,
                credentials=creds,
                socket_owner=getattr(args, "socket_owner", None),
            )

    get = fetch
    stream = out if out is not None else sys.stdout
    if args.json:
        stream.write(json.dumps(snapshot_dict(get(target)), indent=2, sort_keys=True) + "\n")
        return 0

    from rich.console import Console
    from rich.live import Live

    console = Console(file=stream)
    snap = snapshot_dict(get(target))
    n = 1
    try:
        with Live(
            render(snap, target=target), console=console, auto_refresh=False, transient=False
        ) as live:
            while args.count <= 0 or n < args.count:
                sleep(args.interval)
                snap = snapshot_dict(get(target), snap)
                live.update(render(snap, target=target), refresh=True)
                n += 1
    except KeyboardInterrupt:
        pass
    return 0
