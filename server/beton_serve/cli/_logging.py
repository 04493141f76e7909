"""Structured logs for the daemon: one event per line, as ``key=value`` (logfmt) or JSON.

Every line carries ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger`` and either
``event`` (a short snake_case name, from :func:`log_event`) or ``msg`` (a plain ``logger.info``
message), then the event's fields, then ``exc`` with the traceback when there is one::

    ts=2026-11-30T03:44:15.123Z level=info logger=beton_serve.daemon event=stream_opened stream=3 dataset=cifar
    {"ts": "2026-11-30T03:44:15.123Z", "level": "info", "logger": "beton_serve.daemon", "event": "stream_opened", "stream": 3, "dataset": "cifar"}

Key=value quoting: a value is written bare unless it is empty or contains a space, ``=``, ``"``,
``\\`` or a control character; then it is double-quoted with ``\\``, ``"`` and control characters
escaped (newlines as ``\\n``), so every record is exactly one line. ``None`` is written as
``null``, booleans as ``true``/``false``. In JSON, values that are not JSON types are written as
their ``str()``.

The CLI calls :func:`add_logging_args` on its parser and :func:`configure_logging` once at start.
Library code only ever calls ``logging.getLogger(__name__)`` and :func:`log_event`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import IO, Any

from beton_serve.errors import ConfigError

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "JsonFormatter",
    "KeyValueFormatter",
    "add_logging_args",
    "configure_logging",
    "configure_logging_from_args",
    "log_event",
]

LOG_FORMATS = ("kv", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# The attribute of a LogRecord that carries log_event's fields.
_FIELDS_ATTR = "beton_fields"
_EVENT_ATTR = "beton_event"
# Keys every line starts with; an event field with one of these names is prefixed with "field_".
_RESERVED = frozenset({"ts", "level", "logger", "event", "msg", "exc"})
# Marks the handler configure_logging installed, so a second call replaces it instead of adding.
_HANDLER_MARK = "_beton_serve_handler"


def log_event(
    logger: logging.Logger, event: str, /, *, level: int = logging.INFO, **fields: Any
) -> None:
    """Log a structured event: a short name plus ``key=value`` fields.

    Args:
        logger: the module's logger (``logging.getLogger(__name__)``).
        event: a short snake_case name, e.g. ``"stream_opened"``.
        level: the ``logging`` level; INFO by default. (So no field can be called ``level``.)
        **fields: the event's fields. Fields named like the standard keys (``ts``, ``logger``,
            ``msg``, ``exc``...) are written as ``field_<name>`` rather than clobbering them.

    Formatted by :class:`KeyValueFormatter` or :class:`JsonFormatter`; any other formatter sees a
    message ``"event key=value ..."``, so nothing is lost under a plain ``logging`` setup.
    """
    if not logger.isEnabledFor(level):
        return
    text = " ".join([event, *(f"{k}={_kv_value(v)}" for k, v in fields.items())])
    logger.log(
        level,
        "%s",
        text,
        extra={_EVENT_ATTR: event, _FIELDS_ATTR: fields},
        stacklevel=2,
    )


def _iso_utc(created: float) -> str:
    dt = datetime.fromtimestamp(created, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _record_items(record: logging.LogRecord, formatter: logging.Formatter) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = [
        ("ts", _iso_utc(record.created)),
        ("level", record.levelname.lower()),
        ("logger", record.name),
    ]
    event = getattr(record, _EVENT_ATTR, None)
    if event is not None:
        items.append(("event", event))
        fields: dict[str, Any] = getattr(record, _FIELDS_ATTR, {})
        for k, v in fields.items():
            items.append((f"field_{k}" if k in _RESERVED else k, v))
    else:
        items.append(("msg", record.getMessage()))
    if record.exc_info:
        items.append(("exc", formatter.formatException(record.exc_info)))
    elif record.exc_text:
        items.append(("exc", record.exc_text))
    if record.stack_info:
        items.append(("stack", formatter.formatStack(record.stack_info)))
    return items


def _needs_quotes(s: str) -> bool:
    return s == "" or any(c in ' ="\\' or ord(c) < 0x20 or ord(c) == 0x7F for c in s)


def _kv_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        s = repr(v) if math.isfinite(v) else str(v)
    else:
        s = str(v)
    if not _needs_quotes(s):
        return s
    out = []
    for c in s:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


class KeyValueFormatter(logging.Formatter):
    """Formats a record as one logfmt line: ``ts=... level=... logger=... event=... k=v ...``."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_kv_value(v)}" for k, v in _record_items(record, self))


def _json_default(v: Any) -> Any:
    return str(v)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object per line, keys in the same order as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        items = dict(_record_items(record, self))
        # NaN/inf are not JSON: write them as strings rather than emit an unparsable line.
        for k, v in items.items():
            if isinstance(v, float) and not math.isfinite(v):
                items[k] = str(v)
        return json.dumps(items, default=_json_default, ensure_ascii=False)


def configure_logging(
    fmt: str = "kv",
    level: str | int = "info",
    stream: IO[str] | None = None,
    logger: logging.Logger | None = None,
) -> logging.Handler:
    """Install one structured handler on ``logger`` (the root logger by default).

    Calling it again replaces the handler it installed before (other handlers are left alone),
    so tests and re-configuration (SIGHUP) do not stack duplicate handlers.

    Args:
        fmt: ``"kv"`` (logfmt) or ``"json"``.
        level: a name from :data:`LOG_LEVELS` (any case) or a ``logging`` level number.
        stream: where lines go; ``sys.stderr`` by default.
        logger: the logger to configure; the root logger by default.

    Returns:
        The installed handler (remove it with ``logger.removeHandler`` to undo).

    Raises:
        ConfigError: an unknown format or level; the message lists the choices.
    """
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if isinstance(level, str):
        if level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        levelno = logging.getLevelName(level.upper())
    else:
        levelno = int(level)
    target = logger if logger is not None else logging.getLogger()
    for h in list(target.handlers):
        if getattr(h, _HANDLER_MARK, False):
            target.removeHandler(h)
            h.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(KeyValueFormatter() if fmt == "kv" else JsonFormatter())
    setattr(handler, _HANDLER_MARK, True)
    target.addHandler(handler)
    target.setLevel(levelno)
    return handler


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--log-format {kv,json}`` and ``--log-level`` to a (sub)command's parser.

    Both default to ``None`` so a config file can supply them; :func:`configure_logging_from_args`
    falls back to ``kv`` and ``info``.
    """
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="log lines as key=value (logfmt, default) or JSON objects",
    )
    group.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        type=str.lower,
        help="the least severe level logged (default: info)",
    )


def configure_logging_from_args(
    args: argparse.Namespace,
    *,
    default_format: str = "kv",
    default_level: str = "info",
    stream: IO[str] | None = None,
) -> logging.Handler:
    """:func:`configure_logging` from the flags :func:`add_logging_args` added.

    ``default_format``/``default_level`` are used where a flag was not given (pass the config
    file's values here: flags override the file).
    """
    fmt = getattr(args, "log_format", None) or default_format
    level = getattr(args, "log_level", None) or default_level
    return configure_logging(fmt, level, stream=stream)
