"""SIGHUP: re-read the daemon's config file and apply the keys that are safe to change live.

Reloadable (:data:`RELOADABLE`): ``log_level``, ``log_format``, ``bad_sample_budget`` and
``max_ring_bytes`` (streams opened afterwards; streams share decodes only with streams of the
same ``bad_sample_budget``, ``engine.sharing.ShareKey``), ``max_idle_buffer_bytes`` (at once: a
lower bound frees the kept buffers past it), ``share_max_lag`` and ``share_retain`` (sharing
groups formed afterwards), ``unattached_timeout`` (the liveness monitor's next tick).
Every other key (datasets, files, sockets, addresses, workers, plugins, TLS, token, sharing on or
off) needs a restart: a change to one of them is logged as refused, naming the keys, and the
daemon keeps its running value.

Flags win over the file, at start and on reload: a key whose value at start differed from the
file's (so a command-line flag set it) keeps the flag's value.
"""

from __future__ import annotations

import dataclasses
import logging
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
    """Call it (from the event loop's SIGHUP handler) to reload ``path`` into ``daemon``.

    Args:
        daemon: the running :class:`~beton_serve.daemon.Daemon`.
        cfg: the configuration it started with (file + flags).
        path: the config file (``None``: nothing to reload; SIGHUP is logged and ignored).
    """

    def __init__(self, daemon: Daemon, cfg: ServeConfig, path: str | None) -> None:
        self.daemon = daemon
        self.cfg = cfg
        self.path = path
        self._file = load_config(path)
        #: Keys a flag set at start (they keep the flag's value).
        self.flagged = {k for k in KEYS if getattr(cfg, k) != getattr(self._file, k)}

    def __call__(self) -> dict[str, Any]:
        """Reload; returns the applied changes (logged, never raises)."""
        if self.path is None:
            log.warning("SIGHUP: no --config file, nothing to reload")
            return {}
        try:
            new = load_config(self.path)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded, the file is invalid: %s", exc)
            return {}
        changed = {k for k in KEYS if getattr(new, k) != getattr(self._file, k)}
        refused = sorted(changed - set(RELOADABLE))
        if refused:
            log.warning(
                "SIGHUP: not reloaded (restart the daemon to change them) keys=%s",
                ",".join(refused),
            )
        apply = {
            k: getattr(new, k) for k in sorted(changed & set(RELOADABLE)) if k not in self.flagged
        }
        try:
            self._apply(apply)
        except ConfigError as exc:
            log.error("SIGHUP: config not reloaded: %s", exc)
            return {}
        self._file = new
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
