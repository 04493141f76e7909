"""Structured logging: logfmt and JSON lines, log_event, the CLI flags."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re

import pytest
from beton_serve.cli._logging import (
    add_logging_args,
    configure_logging,
    configure_logging_from_args,
    log_event,
)
from beton_serve.errors import ConfigError

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def parse_kv(line: str) -> dict[str, str]:
    """A small logfmt parser (bare or double-quoted values with backslash escapes)."""
    out: dict[str, str] = {}
    i, n = 0, len(line)
    while i < n:
        j = line.index("=", i)
        key = line[i:j]
        i = j + 1
        if i < n and line[i] == '"':
            i += 1
            val = []
            while line[i] != '"':
                if line[i] == "\\":
                    i += 1
                    val.append({"n": "\n", "t": "\t", "r": "\r"}.get(line[i], line[i]))
                else:
                    val.append(line[i])
                i += 1
            i += 1
            out[key] = "".join(val)
        else:
            j = line.find(" ", i)
            j = n if j < 0 else j
            out[key] = line[i:j]
            i = j
        while i < n and line[i] == " ":
            i += 1
    return out


@pytest.fixture
def logger():
    """A private logger configured by the test; its handlers are removed afterwards."""
    lg = logging.getLogger("beton_serve.test_logging")
    lg.propagate = False
    before = list(lg.handlers)
    yield lg
    for h in list(lg.handlers):
        if h not in before:
            lg.removeHandler(h)
            h.close()
    lg.setLevel(logging.NOTSET)
    lg.propagate = True


def test_kv_event_line(logger: logging.Logger) -> None:
    buf = io.StringIO()
    configure_logging("kv", "info", stream=buf, logger=logger)
    log_event(
        logger,
        "stream_opened",
        stream=3,
        dataset="cifar 10",
        path='a "b"=c\\d',
        ratio=0.25,
        ok=True,
        client=None,
        empty="",
        text="two\nlines",
    )
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1  # the embedded newline is escaped
    line = lines[0]
    assert line.startswith("ts=")
    assert " level=info logger=beton_serve.test_logging event=stream_opened stream=3 " in line
    kv = parse_kv(line)
    assert TS.match(kv["ts"])
    assert kv["dataset"] == "cifar 10"
    assert kv["path"] == 'a "b"=c\\d'
    assert kv["ratio"] == "0.25"
    assert kv["ok"] == "true" and kv["client"] == "null" and kv["empty"] == ""
    assert kv["text"] == "two\nlines"
    assert list(kv)[:4] == ["ts", "level", "logger", "event"]


def test_json_event_line(logger: logging.Logger) -> None:
    buf = io.StringIO()
    configure_logging("json", "debug", stream=buf, logger=logger)
    log_event(
        logger,
        "batch_done",
        level=logging.DEBUG,
        stream="s1",
        n=4,
        t=0.5,
        obj=object,
        nan=float("nan"),
        msg="clash",
    )
    (line,) = buf.getvalue().splitlines()
    rec = json.loads(line)
    assert rec["level"] == "debug" and rec["event"] == "batch_done"
    assert rec["stream"] == "s1" and rec["n"] == 4 and rec["t"] == 0.5
    assert rec["obj"] == str(object)
    assert rec["nan"] == "nan"
    assert rec["field_msg"] == "clash"  # a field never clobbers a standard key
    assert "msg" not in rec
    assert TS.match(rec["ts"])
    assert list(rec)[:4] == ["ts", "level", "logger", "event"]


def test_plain_messages_and_exceptions(logger: logging.Logger) -> None:
    buf = io.StringIO()
    configure_logging("kv", "info", stream=buf, logger=logger)
    logger.info("listening on %s", "unix:///tmp/x.sock")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("worker failed")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first, second = parse_kv(lines[0]), parse_kv(lines[1])
    assert first["msg"] == "listening on unix:///tmp/x.sock" and "event" not in first
    assert second["level"] == "error" and second["msg"] == "worker failed"
    assert "ValueError: boom" in second["exc"] and "Traceback" in second["exc"]

    buf2 = io.StringIO()
    configure_logging("json", "info", stream=buf2, logger=logger)
    try:
        raise KeyError("k")
    except KeyError:
        logger.exception("oops")
    rec = json.loads(buf2.getvalue())
    assert "KeyError" in rec["exc"] and rec["msg"] == "oops"


def test_level_filters_and_reconfigure_replaces_handler(logger: logging.Logger) -> None:
    buf = io.StringIO()
    configure_logging("kv", "warning", stream=buf, logger=logger)
    log_event(logger, "quiet")  # INFO < WARNING
    logger.info("also quiet")
    log_event(logger, "loud", level=logging.WARNING)
    assert [parse_kv(x)["event"] for x in buf.getvalue().splitlines()] == ["loud"]

    buf2 = io.StringIO()
    configure_logging("json", "info", stream=buf2, logger=logger)
    ours = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    assert len(ours) == 1  # replaced, not stacked
    log_event(logger, "again")
    assert buf.getvalue().count("\n") == 1
    assert json.loads(buf2.getvalue())["event"] == "again"


def test_log_event_under_a_plain_formatter(logger: logging.Logger) -> None:
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    log_event(logger, "stream_closed", stream=7, reason="client gone")
    assert buf.getvalue() == 'stream_closed stream=7 reason="client gone"\n'


def test_flags_and_validation(logger: logging.Logger) -> None:
    parser = argparse.ArgumentParser()
    add_logging_args(parser)
    args = parser.parse_args(["--log-format", "json", "--log-level", "DEBUG"])
    assert args.log_format == "json" and args.log_level == "debug"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
    defaults = parser.parse_args([])
    assert defaults.log_format is None and defaults.log_level is None

    buf = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        h = configure_logging_from_args(defaults, default_format="json", stream=buf)
        assert h in root.handlers and root.level == logging.INFO
        log_event(logging.getLogger("beton_serve.x"), "hello", a=1)
        assert json.loads(buf.getvalue().splitlines()[-1])["a"] == 1
    finally:
        for hh in list(root.handlers):
            if hh not in saved[0]:
                root.removeHandler(hh)
        root.setLevel(saved[1])

    with pytest.raises(ConfigError, match="--log-format"):
        configure_logging("xml", logger=logger)
    with pytest.raises(ConfigError, match="--log-level"):
        configure_logging("kv", "loud", logger=logger)
