"""``beton-serve [serve] DATASET.beton [...]``: run the daemon (the default subcommand).

Start-up: read the config (TOML, then flags), import plugins, take the address lock (two daemons
never serve one address), sweep stale segments, open and validate every dataset (an invalid file
exits non-zero with the reader's error), start the engine and the grpc.aio control plane on
uvloop, and log the addresses, the datasets with their sample counts and the workers.

Addresses: the Unix socket (``--socket``, else ``BETON_SERVE_ADDRESS`` when it is a ``unix:``
target, else the per-user default) and every ``--listen`` address. ``--listen`` *adds* TCP: a
local Loader still finds this daemon on the per-user socket instead of spawning another one.
``--no-socket`` serves the ``--listen`` addresses only. When the socket was not named
explicitly and cannot be served (another daemon holds it, or its directory cannot be created),
a daemon with ``--listen`` addresses logs a warning and serves TCP only.

Shutdown: SIGTERM or SIGINT (or ``--idle-timeout`` seconds without a stream) drains the streams
(each gets ``UNAVAILABLE``), frees every segment, removes the socket and its ``.lock`` and exits
0. A daemon whose output goes to ``<socket>.log`` (an auto-spawned one, ``beton_client._spawn``)
removes that log too after a clean stop; after a failure the log stays, for the user to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import signal
import stat
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from beton_wire.private_dir import names_file

from beton_serve.cli._logging import add_logging_args, configure_logging
from beton_serve.cli.config import ServeConfig, given_flags, load_config, merge_flags
from beton_serve.errors import AddressInUse, ConfigError

if TYPE_CHECKING:
    from beton_serve.daemon import Daemon

__all__ = ["address_lock", "register", "resolve_socket", "run"]

log = logging.getLogger("beton_serve.serve")


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve",
        help="serve .beton datasets to beton_client Loaders (default command)",
        description="Serve .beton datasets over a Unix socket (default: per user) and/or TCP.",
    )
    p.add_argument("files", nargs="*", metavar="DATASET.beton", help="served under its file stem")
    p.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME=GLOB",
        help="serve shards with one schema as one dataset (repeatable; GLOB may be a,b,c)",
    )
    p.add_argument(
        "--socket",
        default=None,
        metavar="PATH",
        help="Unix socket path (default: $BETON_SERVE_ADDRESS, else the per-user socket)",
    )
    p.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="also serve on this TCP address (repeatable); the Unix socket is kept",
    )
    p.add_argument(
        "--no-socket",
        action="store_true",
        help="serve the --listen addresses only, without the Unix socket",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker threads (default: one per CPU the daemon may run on, its affinity/cpuset)",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="TOML config (flags override)")
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE|FILE.py",
        help="import a module or a .py file that registers custom ops/fields (repeatable)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="S",
        help="exit after S seconds without any open stream (0: never)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port)",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="address of the metrics endpoint (default 127.0.0.1; it has no authentication)",
    )
    sec = p.add_argument_group("remote clients (TCP): TLS, bearer token, listen policy")
    sec.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate (TLS)")
    sec.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key (TLS)")
    sec.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="FILE",
        help="require client certificates signed by this PEM CA (mutual TLS)",
    )
    sec.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="clients must send this bearer token (on every address, Unix socket included)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback --listen address without TLS or token (logged loudly)",
    )
    sec.add_argument(
        "--grpc-compression",
        default=None,
        metavar="LIST",
        help="compressions grpc streams may ask for, comma-separated (default lz4,zstd; "
        "'none' for none)",
    )
    share = p.add_argument_group("work sharing between identical streams (issue 6)")
    share.add_argument(
        "--share-max-lag",
        type=int,
        default=None,
        metavar="N",
        help="detach a stream N batches behind its group's leader onto its own decoding "
        "(default 8)",
    )
    share.add_argument(
        "--share-retain",
        type=int,
        default=None,
        metavar="N",
        help="keep the last N batches a group no longer needs, for streams that start a little "
        "later (default 4)",
    )
    share.add_argument(
        "--decode-cache-bytes",
        type=int,
        default=None,
        metavar="N",
        help="bytes of decoded images share_decode=True streams may cache (default 1 GiB, "
        "max 64 GiB, 0 = off)",
    )
    share.add_argument(
        "--no-share", action="store_true", help="decode every stream on its own, never shared"
    )
    p.add_argument(
        "--max-ring-bytes",
        type=int,
        default=None,
        metavar="N",
        help="bytes of batch buffers all open streams may hold together; a stream that would "
        "exceed it is refused (ResourceExhausted). Default 0: half the size of /dev/shm",
    )
    p.add_argument(
        "--max-idle-buffer-bytes",
        type=int,
        default=None,
        metavar="N",
        help="bytes of the ops' buffers kept between batches for the streams that use them; "
        "past it, those of the layouts used longest ago are freed. Default 0: an eighth of memory",
    )
    p.add_argument(
        "--bad-sample-budget",
        type=int,
        default=None,
        metavar="N",
        help="failing samples each stream may skip, counted in stats (default 0: the first one "
        "fails the stream with an error naming it)",
    )
    p.add_argument(
        "--verify-checksums",
        action="store_true",
        default=None,
        help="check every sample against its file's CRC32C sidecar (beton-serve checksum FILE) "
        "before decoding; a mismatch is a bad sample. Every file needs a current sidecar",
    )
    files = p.add_argument_group("files opened on demand (a client names a file not served yet)")
    files.add_argument(
        "--data-root",
        action="append",
        default=None,
        metavar="DIR",
        help="clients other than the daemon's own user on its Unix socket (TCP clients) may open "
        ".beton files under DIR (repeatable; realpath inside DIR, no symlink escape)",
    )
    files.add_argument(
        "--no-open-on-demand",
        action="store_true",
        help="serve only the files named at start, refusing any other file a client names",
    )
    files.add_argument(
        "--allow-op-imports",
        action="store_true",
        default=None,
        help="let any client (not only the daemon's own user) make the daemon import the module "
        "of a custom op from the daemon's own disk (docs/custom-ops.md)",
    )
    files.add_argument(
        "--idle-close",
        type=float,
        default=None,
        metavar="S",
        help="close a file opened on demand after S seconds without streams (default 300)",
    )
    files.add_argument(
        "--unattached-timeout",
        type=float,
        default=None,
        metavar="S",
        help="end a stream no client took up within S seconds, when no client holds its "
        "notice channel (a client that died right after opening it; default 30)",
    )
    add_logging_args(p)
    p.set_defaults(func=run)


def resolve_socket(cfg: ServeConfig, environ: Mapping[str, str]) -> str | None:
    """The Unix socket to serve: the config/flag, else ``BETON_SERVE_ADDRESS`` if it is a unix
    target, else the per-user default; ``None`` with ``unix_socket = false`` (``--no-socket``).

    ``listen`` addresses never replace the socket: they are served as well."""
    from beton_wire.address import ENV_ADDRESS, default_socket_path, socket_path_of

    if not cfg.unix_socket:
        return None
    if cfg.socket:
        return cfg.socket
    env = environ.get(ENV_ADDRESS, "")
    if env:
        path = socket_path_of(env)
        if path is not None:
            return path
    return default_socket_path(environ)


@contextlib.contextmanager
def address_lock(socket_path: str) -> Iterator[None]:
    """Hold ``<socket>.lock`` (flock, holding this daemon's pid) while serving; remove it after.

    The socket's directory is created 0700 if missing and must be this user's own: a directory
    another user created first (or may write) could hold their socket or a symbolic link in
    place of the lock, so it is refused (``beton_wire.private_dir``). The lock file is opened
    without following symbolic links, and created with ``O_EXCL`` when missing.

    The holder unlinks the lock file before it lets go of the lock, so a clean stop leaves no
    file behind. A daemon that got the lock on a file its previous holder had just unlinked
    sees that the path no longer names its file and takes the lock again on the current one:
    two daemons never hold "the" lock at once.

    Raises:
        AddressInUse: another live daemon holds the lock (exit status 75).
        ConfigError: the directory or the lock file cannot be trusted or prepared (the message
            says which, and to remove it or use ``--socket``).
    """
    from beton_wire.private_dir import (
        UnsafePathError,
        ensure_private_dir,
        open_private_file,
        remedy,
    )

    d = os.path.dirname(os.path.abspath(socket_path))
    lock_path = socket_path + ".lock"
    uid = os.getuid()
    try:
        ensure_private_dir(d, uid)
    except UnsafePathError as exc:
        raise ConfigError(
            f"refusing to serve {socket_path}: {exc}. {remedy(exc, uid)}; or use --socket PATH "
            "in a directory of your own (mode 0700), or set XDG_RUNTIME_DIR"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot prepare the socket directory {d}: {exc}") from None
    for _ in range(16):
        try:
            fd = open_private_file(lock_path, os.O_RDWR, uid)
        except UnsafePathError as exc:
            raise ConfigError(
                f"refusing to serve {socket_path}: {exc}. {remedy(exc, uid)}; or use --socket "
                "PATH in a directory of your own (mode 0700), or set XDG_RUNTIME_DIR"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot open the address lock {lock_path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AddressInUse(
                f"another beton-serve daemon already serves {socket_path}; stop it "
                f"(beton-serve stop --socket {socket_path}) or serve on another socket "
                "(--socket OTHER_PATH)"
            ) from None
        if names_file(lock_path, fd):
            break
        os.close(fd)  # its previous holder unlinked it on the way out: lock the current file
    else:
        raise ConfigError(f"the address lock {lock_path} keeps being replaced; is a loop running?")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        if names_file(lock_path, fd):
            with contextlib.suppress(OSError):
                os.unlink(lock_path)
        os.close(fd)


def _remove_spawn_log(socket_path: str) -> None:
    """Remove ``<socket>.log`` if it is this process's own stdout (an auto-spawned daemon's
    log, ``beton_client._spawn``); called only after a clean stop, so a failure's log stays."""
    log_path = socket_path + ".log"
    try:
        if names_file(log_path, 1):
            os.unlink(log_path)
    except OSError:
        pass


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT or the idle timeout; returns the exit status.

    Meant as the process's main (``beton-serve serve``): after a clean stop it returns with
    SIGTERM and SIGINT ignored, so that one arriving while the interpreter exits cannot turn the
    exit status into -15 (see :func:`_signal_while_stopping`).
    """
    env = os.environ if environ is None else environ
    previous = _catch_startup_signals()
    try:
        status = _run(args, env)
    except BaseException:
        _restore_signals(previous)
        raise
    # Everything is freed. The interpreter's own exit (joining threads) takes a while, and it
    # restores the default action of every Python-level handler, so a late SIGTERM would turn a
    # clean exit into -15; an ignored signal it leaves as it is (SIGKILL still ends a stuck exit).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return status


# Signals that arrived before the event loop's own handlers were installed (start-up), acted on
# as if they had arrived once serving: SIGTERM/SIGINT stop the daemon cleanly at the next
# checkpoint, and a SIGHUP reloads the config once serving.
_startup_signals: list[int] = []
_STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _remember_signal(signum: int, frame: Any) -> None:
    """A signal during start-up: remembered (no logging here: not reentrant)."""
    _startup_signals.append(signum)


def _catch_startup_signals() -> dict[int, Any]:
    """Install :func:`_remember_signal` for SIGTERM/SIGINT/SIGHUP; returns the handlers it
    replaced.

    Without it, a SIGTERM (or a SIGHUP) in the first moments (config, plugins, opening the
    datasets) took the default action: exit status 143 (129) and the address lock file left
    behind.
    """
    _startup_signals.clear()
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _remember_signal) for sig in _STARTUP_SIGNALS}


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _startup_stop_name() -> str:
    """The name of the first SIGTERM/SIGINT that arrived during start-up, ``""`` if none."""
    stops = [s for s in _startup_signals if s != signal.SIGHUP]
    return signal.Signals(stops[0]).name if stops else ""


def _stopped_during_startup(stage: str) -> bool:
    """Whether a SIGTERM/SIGINT arrived during start-up; logs it, naming the stage it stops at."""
    name = _startup_stop_name()
    if not name:
        return False
    log.info("%s during start-up (%s): stopping", name, stage)
    return True


class _StopRequest:
    """Why the serving daemon stops: set once, by the first of SIGTERM, SIGINT (their names)
    and the idle timeout, on the event loop; :meth:`Daemon.drain` names ``cause`` in the
    ``ShuttingDown`` its clients get (it said "SIGTERM" for a Ctrl-C too)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.cause = ""

    def set(self, cause: str) -> None:
        if not self.cause:
            self.cause = cause
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


#: The daemon's soft limit on open descriptors is raised to its hard limit, up to this.
FD_LIMIT_TARGET = 1 << 20


def _raise_fd_limit() -> None:
    """Raise the soft ``RLIMIT_NOFILE`` towards the hard one: each stream holds a few
    descriptors (its ring, its notice connection, the call), and the common soft default of
    1024 let a few hundred raw connections (another local user on a loopback ``--listen``)
    leave the daemon none for its own clients. Logged when it cannot be raised."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = FD_LIMIT_TARGET if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_TARGET)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.debug("open-file limit raised from %d to %d", soft, want)
    except (OSError, ValueError) as exc:
        log.warning("could not raise the open-file limit: %s", exc)


def _run(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from beton_serve.daemon import expand_dataset_args

    for a in args.dataset:
        name, sep, patterns = a.partition("=")
        if not (name and sep and patterns):
            raise ConfigError(f"--dataset {a!r}: expected NAME=GLOB (e.g. imagenet=train-*.beton)")
    flags = {
        "files": tuple(args.files),
        "datasets": {
            k: tuple(v.split(",")) for k, _, v in (a.partition("=") for a in args.dataset)
        },
        "socket": args.socket,
        "unix_socket": False if getattr(args, "no_socket", False) else None,
        "listen": tuple(args.listen),
        "workers": args.workers,
        "plugins": tuple(args.plugin),
        "idle_timeout": args.idle_timeout,
        "log_format": getattr(args, "log_format", None),
        "log_level": getattr(args, "log_level", None),
        "share": False if getattr(args, "no_share", False) else None,
        "share_max_lag": getattr(args, "share_max_lag", None),
        "share_retain": getattr(args, "share_retain", None),
        "decode_cache_bytes": getattr(args, "decode_cache_bytes", None),
        "bad_sample_budget": getattr(args, "bad_sample_budget", None),
        "max_ring_bytes": getattr(args, "max_ring_bytes", None),
        "max_idle_buffer_bytes": getattr(args, "max_idle_buffer_bytes", None),
        "verify_checksums": getattr(args, "verify_checksums", None),
        "data_roots": tuple(args.data_root) if getattr(args, "data_root", None) else None,
        "open_on_demand": False if getattr(args, "no_open_on_demand", False) else None,
        "idle_close": getattr(args, "idle_close", None),
        "unattached_timeout": getattr(args, "unattached_timeout", None),
        "allow_op_imports": getattr(args, "allow_op_imports", None),
        "tls_cert": getattr(args, "tls_cert", None),
        "tls_key": getattr(args, "tls_key", None),
        "tls_client_ca": getattr(args, "tls_client_ca", None),
        "token_file": getattr(args, "token_file", None),
        "insecure": getattr(args, "insecure", None),
        "grpc_compression": _codec_list(getattr(args, "grpc_compression", None)),
        "metrics_port": getattr(args, "metrics_port", None),
        "metrics_host": getattr(args, "metrics_host", None),
    }
    file_cfg = load_config(args.config)
    cfg = merge_flags(file_cfg, flags)
    configure_logging(cfg.log_format, cfg.log_level)
    if env.get("BETON_SERVE_UNATTACHED_TIMEOUT_S"):  # the variable this key replaced
        log.warning(
            "BETON_SERVE_UNATTACHED_TIMEOUT_S is no longer read: set unattached_timeout in the "
            "config file or pass --unattached-timeout (now %g s)",
            cfg.unattached_timeout,
        )
    from beton_serve.cli._plugins import load_plugins

    specs = _plugin_specs(cfg.plugins, args.config if not args.plugin else None)
    for spec, module in zip(specs, load_plugins(specs), strict=True):
        log.info(
            "plugin %s: imported as %s from %s",
            spec,
            module.__name__,
            getattr(module, "__file__", None) or "?",
        )
    security = _security(cfg)
    _raise_fd_limit()
    datasets = expand_dataset_args(cfg.files, cfg.dataset_args())
    socket_path = resolve_socket(cfg, env)
    if socket_path is not None:
        from beton_wire.address import not_a_socket_problem, socket_path_problem

        problem = socket_path_problem(socket_path) or not_a_socket_problem(socket_path)
        if problem is not None:
            raise ConfigError(problem)
    if socket_path is None and not cfg.listen:
        raise ConfigError(
            "no address to serve: --no-socket (unix_socket = false) needs a --listen HOST:PORT"
        )
    with contextlib.ExitStack() as lock:
        if socket_path is not None:
            try:
                lock.enter_context(address_lock(socket_path))
            except ConfigError as exc:  # AddressInUse included
                if cfg.socket or not cfg.listen:
                    raise
                # The socket was not asked for by name: serve the TCP addresses that were.
                log.warning(
                    "not serving the Unix socket %s (%s); serving only %s. Local Loaders will "
                    "not find this daemon there: pass --socket PATH, or --no-socket to silence "
                    "this",
                    socket_path,
                    exc,
                    ",".join(cfg.listen),
                )
                socket_path = None
        if _stopped_during_startup("before opening the datasets"):
            return 0
        from beton_serve.daemon import Daemon
        from beton_serve.fields.decode_cache import DecodeCache, set_default_decode_cache

        # Before any stream: every share_decode stream of this daemon joins this cache.
        set_default_decode_cache(DecodeCache(max_bytes=cfg.decode_cache_bytes))
        from beton_serve.pipeline import set_idle_workspace_limit

        set_idle_workspace_limit(cfg.max_idle_buffer_bytes)
        share_kw: dict[str, Any] = {
            "share": cfg.share,
            "share_max_lag": cfg.share_max_lag,
            "share_retain": cfg.share_retain,
            "bad_sample_budget": cfg.bad_sample_budget,
            "max_ring_bytes": cfg.max_ring_bytes,
            "verify_checksums": cfg.verify_checksums,
            "open_on_demand": cfg.open_on_demand,
            "data_roots": cfg.data_roots,
            "idle_close_s": cfg.idle_close,
            "unattached_timeout_s": cfg.unattached_timeout,
            "allow_op_imports": cfg.allow_op_imports,
        }
        from beton_serve.transport.grpc_ring import GrpcFactory, parse_codecs

        grpc_factory = GrpcFactory(allowed_codecs=parse_codecs(cfg.grpc_compression))
        daemon = Daemon.create(
            datasets,
            num_workers=cfg.workers or None,
            factories={"grpc": grpc_factory},
            **share_kw,
        )
        from beton_serve.cli._reload import ConfigReloader

        daemon.reloader = ConfigReloader(
            daemon, cfg, args.config, given_flags(flags), file_cfg
        ).on_signal
        if cfg.precompile:  # [[precompile]] tables: compiled on the compile thread meanwhile
            from beton_serve.daemon import start_precompile

            start_precompile(daemon, cfg.precompile)
        try:
            _run_loop(_serve(daemon, cfg, socket_path, security))
        finally:
            daemon.close()
            if socket_path and not_a_socket_problem(socket_path) is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket_path)  # ours (a file put there since is left alone)
        log.info("stopped")
        if socket_path:
            _remove_spawn_log(socket_path)  # still holding the lock: no new daemon writes it yet
    return 0


def _plugin_specs(plugins: tuple[str, ...], config_file: str | None) -> list[str]:
    """The plugins to import; relative paths from a config file are relative to its directory
    (those from ``--plugin`` to the working directory)."""
    from beton_serve.cli._plugins import is_plugin_path

    if not config_file:
        return list(plugins)
    base = os.path.dirname(os.path.abspath(config_file))
    return [
        os.path.join(base, p) if is_plugin_path(p) and not os.path.isabs(p) else p for p in plugins
    ]


def _run_loop(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(coro)
        return
    uvloop.run(coro)


def _codec_list(text: str | None) -> tuple[str, ...] | None:
    """``--grpc-compression lz4,zstd`` as a tuple; "none" is the empty allow-list."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    return tuple(n for n in names if n.lower() != "none") or ("none",)


def _security(cfg: ServeConfig) -> tuple[Any, str | None]:
    """``(TlsConfig or None, token or None)`` from the config; applies the listen policy, and
    warns about a loopback TCP address that has neither a token nor mutual TLS.

    Raises:
        ConfigError: unreadable TLS/token files, or a non-loopback address without TLS, token
            or ``--insecure`` (the message says which flag to add).
    """
    from beton_serve.transport.security import (
        TlsConfig,
        enforce_listen_policy,
        is_loopback_address,
        read_token_file,
    )

    tls = (
        TlsConfig(
            cert_file=cfg.tls_cert,
            key_file=cfg.tls_key,
            client_ca_file=cfg.tls_client_ca or None,
        )
        if cfg.tls_cert
        else None
    )
    token = read_token_file(cfg.token_file) if cfg.token_file else None
    for addr in cfg.listen:
        enforce_listen_policy(addr, tls is not None, token is not None, cfg.insecure, log)
        # Loopback is not private: every local user can connect to it (unlike the Unix socket).
        tcp = not addr.startswith(("unix:", "unix-abstract:"))
        if tcp and token is None and not cfg.tls_client_ca and is_loopback_address(addr):
            log.warning(
                "listening on %s without a token: every local user can connect and read the "
                "served datasets; add --token-file (or mutual TLS) if other users share this "
                "host, or serve on the Unix socket only, which only this user can reach",
                addr,
            )
    return tls, token


async def _serve(
    daemon: Daemon,
    cfg: ServeConfig,
    socket_path: str | None,
    security: tuple[Any, str | None] = (None, None),
) -> None:
    from beton_serve.rpc import create_server

    tls, token = security
    handle = create_server(daemon, unix_socket=socket_path, listen=cfg.listen, tls=tls, token=token)
    await handle.server.start()
    metrics = None
    try:
        if socket_path:
            os.chmod(socket_path, stat.S_IRUSR | stat.S_IWUSR)
        daemon.start()
        if cfg.metrics_port >= 0:  # before SERVING: a port in use fails the start, not later
            from beton_serve.metrics import serve_daemon_metrics

            # Every dataset, but public stream names: the endpoint has no authentication.
            metrics, bound = serve_daemon_metrics(
                functools.partial(daemon.stats, public_ids=True),
                asyncio.get_running_loop(),
                cfg.metrics_port,
                cfg.metrics_host,
            )
            log.info("metrics url=http://%s:%d/metrics", cfg.metrics_host, bound)
        for ds in daemon.all_datasets():  # the datasets served from the start, by name
            await handle.set_dataset(ds.name, True)
        await handle.set_serving(True)
        addresses = ([f"unix://{os.path.abspath(socket_path)}"] if socket_path else []) + [
            a.rsplit(":", 1)[0] + f":{handle.port}" if a.endswith(":0") else a for a in cfg.listen
        ]
        from beton_serve.pipeline import workspace_memory

        log.info(
            "serving addresses=%s workers=%d pid=%d max_ring_bytes=%d max_idle_buffer_bytes=%d",
            ",".join(addresses),
            daemon.workers,
            os.getpid(),
            daemon.max_ring_bytes,
            workspace_memory().limit_bytes,
        )
        for ds in daemon.all_datasets():
            log.info(
                "dataset name=%s samples=%d shards=%d fields=%s",
                ds.name,
                ds.num_samples,
                len(ds.paths),
                ",".join(n for n, _ in ds.fields),
            )
        stop = _StopRequest()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set, sig.name)
        if daemon.reloader is not None:  # SIGHUP reloads the config (_reload)
            loop.add_signal_handler(signal.SIGHUP, daemon.reloader)
        if _stopped_during_startup("before serving"):
            stop.set(_startup_stop_name())
        elif signal.SIGHUP in _startup_signals and daemon.reloader is not None:
            log.info("SIGHUP during start-up: reloading the config now")
            daemon.reloader()
        idle = loop.create_task(_idle_watch(daemon, cfg.idle_timeout, stop))
        files = loop.create_task(_file_watch(daemon, handle))
        await stop.wait()
        files.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # restores SIG_DFL (SIGHUP's ends the process: a reload racing the stop, from
            # logrotate or ExecReload, would kill it mid-cleanup): replaced at once, below
            loop.remove_signal_handler(sig)
            signal.signal(sig, _signal_while_stopping)
        idle.cancel()
        log.info("draining streams=%d", len(daemon.streams))
        await handle.set_serving(False)
        await daemon.drain(cause=stop.cause)
    finally:
        if metrics is not None:
            # A scrape in flight waits for this loop (at most 2 s), so stop off the loop.
            await asyncio.get_running_loop().run_in_executor(None, metrics.stop)
        await handle.server.stop(grace=1.0)


_late_signals = 0


def _signal_while_stopping(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT/SIGHUP once the daemon is already stopping: logged, not fatal (a SIGHUP
    reloads nothing then).

    Once the event loop closes, its handlers are gone and the default action would end the process
    in the middle of its cleanup, leaving its shared memory behind (a second ``docker stop``, a
    supervisor repeating SIGTERM, Ctrl-C pressed twice). The cleanup goes on; SIGKILL still ends it.
    """
    global _late_signals
    _late_signals += 1
    if _late_signals == 1:
        log.warning(
            "%s while stopping: the daemon finishes draining and frees its shared memory first; "
            "kill -KILL %d ends it at once (and leaves shared memory behind)",
            signal.Signals(signum).name,
            os.getpid(),
        )


#: Seconds between two looks at the served files by :func:`_file_watch`.
FILE_WATCH_S = 2.0


async def _file_watch(daemon: Daemon, handle: Any, every: float = FILE_WATCH_S) -> None:
    """Look at the files of the datasets served from the start every ``every`` seconds, as a
    stream does before each batch (``daemon._health.FileWatch``): a file changed under the
    daemon is logged when it happens, not only when a client next reads. A refused dataset
    (until a restart) turns its own health service (``dataset/NAME``) NOT_SERVING, and once
    every one of those datasets is refused, the whole server's too, so that the deploy files'
    health checks restart the daemon. It said SERVING for ever before."""
    from beton_serve.errors import FormatError

    served = daemon.all_datasets()
    if not served:  # files opened on demand only: nothing whose loss makes the daemon useless
        return
    while True:
        await asyncio.sleep(every)
        for ds in served:
            with contextlib.suppress(FormatError):
                ds.check_files()
            if ds.refused and handle.dataset_serving(ds.name):
                log.warning("health dataset/%s NOT_SERVING (refused until a restart)", ds.name)
                await handle.set_dataset(ds.name, False)
        if all(ds.refused for ds in served):
            log.error(
                "every dataset served from the start is refused (its file changed): health "
                "NOT_SERVING; restart the daemon once the files are restored"
            )
            await handle.set_serving(False)
            return


async def _idle_watch(daemon: Daemon, timeout: float, stop: _StopRequest) -> None:
    if timeout <= 0:
        return
    last_busy = time.monotonic()
    while True:
        await asyncio.sleep(max(0.05, min(0.5, timeout / 4)))  # never a busy loop
        if daemon.streams:
            last_busy = time.monotonic()
        elif time.monotonic() - last_busy >= timeout:
            log.info("idle for %.1f s: exiting", timeout)
            stop.set(f"idle for {timeout:g} s")
            return
