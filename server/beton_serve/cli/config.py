"""The daemon's configuration: one frozen dataclass, read from TOML, overridden by CLI flags.

:data:`KEYS` is the single table of keys and defaults (``deploy/beton-serve.toml`` lists every one
of them, and a test checks that it does). A TOML file holds these keys at its top level::

    files = ["/data/cifar.beton"]             # served by file stem
    datasets = { imagenet = "/data/train-*.beton" }   # NAME = GLOB (or a list of globs)
    socket = ""                               # "" = the per-user default
    unix_socket = true                        # false: no Unix socket (TCP --listen only)
    listen = []                               # ["127.0.0.1:7070"]
    workers = 0                               # 0 = one per core
    plugins = []
    idle_timeout = 0.0                        # seconds without streams before exiting; 0 = never
    log_format = "kv"
    log_level = "info"
    share = true                              # identical streams decode each batch once
    share_max_lag = 8                         # batches behind before a stream is detached
    share_retain = 4                          # batches a group keeps for late joiners
    decode_cache_bytes = 1073741824           # decoded images share_decode groups may cache
    max_ring_bytes = 0                        # stream buffers all streams may hold; 0 = half
                                              # of /dev/shm
    max_idle_buffer_bytes = 0                 # ops' buffers kept between batches; 0 = an
                                              # eighth of memory
    bad_sample_budget = 0                     # failing samples a stream may skip; 0 = fail
    verify_checksums = false                  # check samples against FILE.crc32c sidecars
    open_on_demand = true                     # open a .beton a client names (see data_roots)
    data_roots = []                           # where clients other than the owner may open files
    idle_close = 300.0                        # seconds before an idle on-demand file is closed
    unattached_timeout = 30.0                 # seconds a stream no client took up is kept
    allow_op_imports = false                  # any peer may make the daemon import op modules
    tls_cert = ""                             # TLS on the TCP addresses (with tls_key)
    tls_key = ""
    tls_client_ca = ""                        # mutual TLS: client certificates signed by this CA
    token_file = ""                           # clients must send this bearer token
    insecure = false                          # allow a non-loopback address without TLS/token
    grpc_compression = ["lz4", "zstd"]        # compressions grpc clients may ask for
    metrics_port = -1                         # Prometheus /metrics port; -1 = off, 0 = any free
    metrics_host = "127.0.0.1"                # its address; "0.0.0.0" to let Prometheus scrape a pod
    precompile = []                           # [[precompile]] pipelines compiled at start
                                              # (see beton_serve.daemon.parse_precompile)

Unknown keys and wrong types are errors (:class:`~beton_serve.errors.ConfigError`).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beton_wire.limits import MAX_WORKERS

from beton_serve.cli._logging import LOG_LEVELS
from beton_serve.errors import ConfigError

if TYPE_CHECKING:
    from beton_serve.daemon import PrecompileSpec

__all__ = ["KEYS", "ServeConfig", "load_config", "merge_flags"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Everything ``beton-serve`` (serve) needs.

    Attributes:
        files: dataset files served under their stem.
        datasets: ``NAME -> [GLOB, ...]`` served as one sharded dataset each.
        socket: Unix socket path; "" means the per-user default.
        unix_socket: serve on the Unix socket (``socket``) too; ``False`` (``--no-socket``)
            serves only the ``listen`` addresses. ``listen`` adds addresses, it never removes
            the Unix socket.
        listen: TCP ``HOST:PORT`` addresses.
        workers: worker threads of the shared engine; 0 means one per core.
        plugins: modules or ``.py`` file paths imported at start (custom ops and fields).
        idle_timeout: seconds with no open stream after which the daemon exits; 0 = never.
        log_format: "kv" or "json".
        log_level: "debug", "info", "warning", "error" or "critical" (any case).
        share: streams with identical specs share decoding (``--no-share`` turns it off).
        share_max_lag: a shared stream this many batches behind is detached (reloadable).
        share_retain: batches a sharing group keeps for late joiners (reloadable).
        decode_cache_bytes: bytes of decoded images the decode groups of ``share_decode=True``
            streams may cache (default 1 GiB, at most 64 GiB; 0 turns the cache off).
        max_ring_bytes: bytes of batch buffers (each stream's ring: shared memory, or the
            daemon's own memory for grpc streams) all open streams may hold together; a stream
            that would exceed it is refused with ``ResourceExhausted``. 0 (the default) means
            half the size of ``/dev/shm``, so that the daemon never fills it for everyone else.
        max_idle_buffer_bytes: bytes of the ops' buffers (one set per batch being decoded) the
            daemon keeps between batches for the streams that use them; past it, the kept sets
            of the layouts used longest ago are freed (reallocated when next needed). 0 (the
            default) means an eighth of the memory (the host's, or the cgroup's limit).
            Reloadable.
        bad_sample_budget: failing samples each stream may skip, counted in stats; 0 fails the
            stream with an error naming the sample (reloadable; new streams).
        verify_checksums: check every sample against its file's CRC32C sidecar (``beton-serve
            checksum FILE``) right before decoding; a mismatch is a bad sample. Every file must
            have a current sidecar, or the daemon refuses to start (restart to change).
        open_on_demand: open a ``.beton`` file a client names that is not served yet: any file
            the daemon's user can read for a client of that user on the Unix socket, files under
            ``data_roots`` for any other client. ``False``: only the files named at start.
        data_roots: directories under which clients other than the daemon's own user on its
            Unix socket (TCP clients) may open files (realpath inside, no symlink escape).
        idle_close: seconds without streams after which a file opened on demand is closed.
        unattached_timeout: seconds a stream is kept when no serving call took it up and no
            client holds its notice channel (a client that died right after opening it); a
            live client that holds the channel keeps its stream however long it waits.
        allow_op_imports: any client, not only the daemon's own user, may make the daemon import
            a custom op's module from the daemon's own disk (docs/custom-ops.md, route b).
        tls_cert: PEM certificate of the TCP listeners ("" = no TLS); needs ``tls_key``.
        tls_key: its PEM private key.
        tls_client_ca: PEM CA that client certificates must chain to (mutual TLS).
        token_file: file holding the bearer token clients must send ("" = none). Required on
            every address, the Unix socket included, when set.
        insecure: allow a non-loopback TCP address without TLS or token (logged loudly).
        grpc_compression: compressions a grpc stream may ask for ("lz4", "zstd").
        metrics_port: port of the Prometheus ``/metrics`` endpoint; -1 = off, 0 = any free port.
        metrics_host: address the metrics endpoint binds (loopback by default; the endpoint has
            no authentication, so expose it only where the network is trusted).
        precompile: pipelines to compile when the daemon starts (``[[precompile]]`` tables,
            parsed by ``beton_serve.daemon.parse_precompile``), so that their first clients,
            and every client after a restart, find the kernels in the compile cache.
    """

    files: tuple[str, ...] = ()
    datasets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    socket: str = ""
    unix_socket: bool = True
    listen: tuple[str, ...] = ()
    workers: int = 0
    plugins: tuple[str, ...] = ()
    idle_timeout: float = 0.0
    log_format: str = "kv"
    log_level: str = "info"
    share: bool = True
    share_max_lag: int = 8
    share_retain: int = 4
    decode_cache_bytes: int = 1 << 30
    max_ring_bytes: int = 0
    max_idle_buffer_bytes: int = 0
    bad_sample_budget: int = 0
    verify_checksums: bool = False
    open_on_demand: bool = True
    data_roots: tuple[str, ...] = ()
    idle_close: float = 300.0
    unattached_timeout: float = 30.0
    allow_op_imports: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    token_file: str = ""
    insecure: bool = False
    grpc_compression: tuple[str, ...] = ("lz4", "zstd")
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    precompile: tuple[PrecompileSpec, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise ConfigError(
                f"workers must be in 0..{MAX_WORKERS} (0 = one per core), got {self.workers}"
            )
        for key in ("idle_close", "unattached_timeout", "idle_timeout"):
            value = getattr(self, key)
            if isinstance(value, float) and math.isinf(value):
                raise ConfigError(
                    f"{key} must be a finite number of seconds, got {value}"
                    + ("; 0 means never" if key == "idle_timeout" else "")
                )
        if not self.idle_close > 0:  # NaN too
            raise ConfigError(f"idle_close must be > 0 seconds, got {self.idle_close}")
        if not self.unattached_timeout > 0:  # NaN too
            raise ConfigError(
                f"unattached_timeout must be > 0 seconds, got {self.unattached_timeout}"
            )
        if not self.idle_timeout >= 0:  # NaN too
            raise ConfigError(f"idle_timeout must be >= 0 seconds, got {self.idle_timeout}")
        for key in (
            "share_max_lag",
            "share_retain",
            "bad_sample_budget",
            "max_ring_bytes",
            "max_idle_buffer_bytes",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.decode_cache_bytes <= 64 << 30:
            raise ConfigError(
                f"decode_cache_bytes must be in [0, {64 << 30}] (64 GiB), "
                f"got {self.decode_cache_bytes}"
            )
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (off) or 0..65535, got {self.metrics_port}")
        if not self.metrics_host.strip():
            raise ConfigError(
                "metrics_host is empty, which would bind the unauthenticated metrics endpoint on "
                "every interface: name the address (127.0.0.1, the default; 0.0.0.0 for all)"
            )
        if self.log_format not in ("kv", "json"):
            raise ConfigError(f"log_format must be 'kv' or 'json', got {self.log_format!r}")
        if not isinstance(self.log_level, str) or self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both tls_cert and tls_key (--tls-cert and --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")

    def dataset_args(self) -> list[str]:
        """``datasets`` as ``NAME=GLOB,GLOB`` strings."""
        return [f"{k}={','.join(v)}" for k, v in self.datasets.items()]


#: Every key with its default (the single table; see the module docstring).
KEYS: dict[str, Any] = {
    f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc,operator]
    for f in dataclasses.fields(ServeConfig)
}

_SEQUENCES = {"files", "listen", "plugins", "grpc_compression", "data_roots"}


def _coerce(key: str, value: Any, where: str) -> Any:
    default = KEYS[key]
    if key == "precompile":
        from beton_serve.daemon import parse_precompile

        return parse_precompile(value, where)
    if key in _SEQUENCES:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: {key} must be a list of strings")
        return tuple(value)
    if key == "datasets":
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: datasets must be a table of NAME = GLOB or [GLOB, ...]")
        out: dict[str, tuple[str, ...]] = {}
        for name, globs in value.items():
            if isinstance(globs, str):
                globs = [globs]
            if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
                raise ConfigError(f"{where}: datasets.{name} must be a glob or a list of globs")
            out[name] = tuple(globs)
        return out
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false, not {type(value).__name__}")
        return value
    if isinstance(value, bool):  # an int to Python, not to a reader of the file
        raise ConfigError(f"{where}: {key} must be a {type(default).__name__}, not bool")
    if not isinstance(value, type(default)):
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(
            f"{where}: {key} must be a {type(default).__name__}, not {type(value).__name__}"
        )
    return value


def load_config(path: str | Path | None) -> ServeConfig:
    """Read a TOML config (``None``: the defaults).

    Raises:
        ConfigError: unreadable file, invalid TOML, unknown key, wrong type or a value out of
            range (naming the file and the key).
    """
    if path is None:
        return ServeConfig()
    p = Path(path)
    try:
        data = tomllib.loads(_read_regular(p))
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: not UTF-8 text ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {unknown}; known keys are {sorted(KEYS)}")
    values = {k: _coerce(k, v, str(p)) for k, v in data.items()}
    try:
        return ServeConfig(**values)
    except ConfigError as exc:  # a value out of range: say which file holds it
        raise ConfigError(f"{p}: {exc}") from None


#: A config file larger than this is refused (a real one is a few KB).
MAX_CONFIG_BYTES = 1 << 20


def _read_regular(p: Path) -> str:
    """The text of ``p``, which must be a regular file (``open_regular``, as the reader's: a
    FIFO would wait for a writer, and SIGHUP reads the file again while the daemon serves) of
    at most :data:`MAX_CONFIG_BYTES`."""
    from beton_serve.format import open_regular

    with open_regular(str(p)) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_CONFIG_BYTES} bytes")
    return data.decode("utf-8")


def given_flags(flags: Mapping[str, Any]) -> frozenset[str]:
    """The keys of ``flags`` that were given (what :func:`merge_flags` lets override)."""
    return frozenset(k for k, v in flags.items() if not (v is None or v == () or v == []))


def merge_flags(base: ServeConfig, flags: Mapping[str, Any]) -> ServeConfig:
    """``base`` with every flag that was given (not ``None``, not empty) overriding it.

    Positional files and ``--dataset`` arguments are added to the file's, not replacing them.
    """
    changes: dict[str, Any] = {}
    given = given_flags(flags)
    for key, value in flags.items():
        if key not in KEYS:
            raise ConfigError(f"unknown setting {key!r}")
        if key not in given:
            continue
        if key == "files":
            value = (*base.files, *value)
        elif key == "datasets":
            value = {**base.datasets, **value}
        changes[key] = value
    return dataclasses.replace(base, **changes)
