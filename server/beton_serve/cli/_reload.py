"""SIGHUP: re-read the daemon's config file and apply the keys that are safe to change live.

Reloadable (:data:`RELOADABLE`): ``log_level``, ``log_format``, ``bad_sample_budget`` and
``max_ring_bytes`` (streams opened afterwards; streams share decodes only with streams of the
same ``bad_sample_budget``, ``engine.sharing.ShareKey``), ``max_idle_buffer_bytes`` (at once: a
lower bound frees the kept buffers past it), ``share_max_lag`` and ``share_retain`` (sharing
groups formed afterwards), ``unattached_timeout`` (the liveness monitor's next tick).
Every other key (datasets, files, sockets, addresses, workers, plugins, TLS, token, sharing on or
off) needs a restart: a change to one of them is logged as refused, naming the keys, and the
daemon keeps its running value.

Flags win over the file, at start and on reload: a key given as a command-line flag keeps the
flag's value, even where the file later says otherwise.

Each reload compares the file with what the daemon runs: a refused change is refused again (and
logged again) at every SIGHUP until the file is put back, and putting it back is no change.

The file is read on a thread of its own (:meth:`ConfigReloader.on_signal`), never on the event
loop: a config path that blocks on read (a FIFO, a hung network mount) used to stall every
stream, health check and SIGTERM until the read returned. ``load_config`` also refuses a path
that is not a regular file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from beton_serve.cli._logging import configure_logging
from beton_serve.cli.config import KEYS, ServeConfig, load_config
from beton_serve.errors import ConfigError

if TYPE_CHECKING:
    from beton_serve.daemon import Daemon

__all__ = ["RELOADABLE", "ConfigReloader"]

log = logging.getLogger("beton_serve.serve")

#: Keys SIGHUP applies (see the module docstring).
RELOADABLE = (
    "log_level",
    "log_format",
    "bad_sample_budget",
    "max_ring_bytes",
    "max_idle_buffer_bytes",
    "share_max_lag",
    "share_retain",
    "unattached_timeout",
)


class ConfigReloader:
    """Reloads ``path`` into ``daemon``: :meth:`on_signal` is the event loop's SIGHUP handler
    (it reads the file on a thread); calling the object reads and applies at once.

    Args:
        daemon: the running :class:`~beton_serve.daemon.Daemon`.
        cfg: the configuration it started with (file + flags).
        path: the config file (``None``: nothing to reload; SIGHUP is logged and ignored).
        flagged: the keys given as command-line flags (they keep the flag's value); ``None``:
            the keys whose value at start differs from the file's.
        file_cfg: the file as the daemon read it at start (``None``: read it now). Pass it: the
            file may have changed since, and a change read here would never be applied.
    """

    def __init__(
        self,
        daemon: Daemon,
        cfg: ServeConfig,
        path: str | None,
        flagged: Collection[str] | None = None,
        file_cfg: ServeConfig | None = None,
    ) -> None:
        self.daemon = daemon
        self.cfg = cfg
        self.path = path
        #: The file's values the daemon runs with (a refused change never becomes one).
        self._file = load_config(path) if file_cfg is None else file_cfg
        #: Keys a flag set at start (they keep the flag's value).
        self.flagged = (
            {k for k in KEYS if getattr(cfg, k) != getattr(self._file, k)}
            if flagged is None
            else set(flagged)
        )
        self._reading = False

    def on_signal(self) -> None:
        """SIGHUP, on the event loop: read the file on a daemon thread, then apply it on the
        loop. A read that never returns holds that thread only (and not the daemon's exit); a
        SIGHUP while one is reading is logged and ignored."""
        if self.path is None:
            log.warning("SIGHUP: no --config file, nothing to reload")
            return
        if self._reading:
            log.warning("SIGHUP ignored: still reading %s for the last one", self.path)
            return
        self._reading = True
        loop = asyncio.get_running_loop()

        def read() -> None:
            try:
                result: ServeConfig | ConfigError = load_config(self.path)
            except ConfigError as exc:
                result = exc
            except BaseException as exc:  # never lost silently on a thread
                result = ConfigError(f"cannot read config {self.path}: {exc!r}")
            try:
                loop.call_soon_threadsafe(self._read_done, result)
            except RuntimeError:
                pass  # the loop closed meanwhile: the daemon is gone

        threading.Thread(target=read, name="beton-config-reload", daemon=True).start()

    def _read_done(self, result: ServeConfig | ConfigError) -> None:
        self._reading = False
        self._reload(result)

    def __call__(self) -> dict[str, Any]:
        """Read the file here and apply it; returns the applied changes (logged, never
        raises)."""
        if self.path is None:
            log.warning("SIGHUP: no --config file, nothing to reload")
            return {}
        try:
            new: ServeConfig | ConfigError = load_config(self.path)
        except ConfigError as exc:
            new = exc
        return self._reload(new)

    def _reload(self, new: ServeConfig | ConfigError) -> dict[str, Any]:
        if isinstance(new, ConfigError):
            log.error("SIGHUP: config not reloaded, the file is invalid: %s", new)
            return {}
        changed = {k for k in KEYS if getattr(new, k) != getattr(self._file, k)}
        refused = sorted(changed - set(RELOADABLE))
        if refused:
            log.warning(
                "SIGHUP: not reloaded (restart the daemon to change them) keys=%s",
                ",".join(refused),
            )
        overridden = sorted(k for k in changed & set(RELOADABLE) if k in self.flagged)
        if overridden:
            log.warning(
                "SIGHUP: kept (set by a command-line flag, which overrides the file) keys=%s",
                ",".join(overridden),
            )
        apply = {
            k: getattr(new, k) for k in sorted(changed & set(RELOADABLE)) if k not in self.flagged
        }
        try:
            self._apply(apply)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded: %s", exc)
            return {}
        self._file = dataclasses.replace(self._file, **apply)
        self.cfg = dataclasses.replace(self.cfg, **apply)
        log.info(
            "config reloaded path=%s changed=%s",
            self.path,
            ",".join(f"{k}={v}" for k, v in apply.items()) or "-",
        )
        return apply

    def _apply(self, apply: dict[str, Any]) -> None:
        if "log_level" in apply or "log_format" in apply:
            configure_logging(
                apply.get("log_format", self.cfg.log_format),
                apply.get("log_level", self.cfg.log_level),
            )
        d = self.daemon
        if "bad_sample_budget" in apply:
            d.bad_sample_budget = int(apply["bad_sample_budget"])
        if "max_ring_bytes" in apply:
            from beton_serve.daemon import ring_budget

            d.max_ring_bytes = ring_budget(int(apply["max_ring_bytes"]))
        if "max_idle_buffer_bytes" in apply:
            from beton_serve.pipeline import set_idle_workspace_limit

            set_idle_workspace_limit(int(apply["max_idle_buffer_bytes"]))
        if "unattached_timeout" in apply:
            d.streams.unattached_timeout_s = float(apply["unattached_timeout"])
        sharing = d.sharing
        if sharing is not None:
            if "share_max_lag" in apply:
                sharing.max_lag = int(apply["share_max_lag"])
            if "share_retain" in apply:
                sharing.retain = int(apply["share_retain"])
