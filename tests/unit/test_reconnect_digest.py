"""``DaemonBackend.open``: every stream of a served Loader must read the files its first one
read. A daemon restarted on other files is refused; one restarted as another beton-serve
version, whose digest cannot be compared, is accepted with a warning (refusing would stop every
trainer across an upgrade); the stream a refusal opened is closed."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from beton_client._loader import DaemonBackend
from beton_client.errors import ServerError

pytestmark = pytest.mark.timeout(30)

A, B = "v2:" + "a" * 32, "v2:" + "b" * 32
OLD = "c" * 32  # a version-1 digest: no scheme prefix


class _Feed:
    def __init__(self, digest: str) -> None:
        self.dataset_digest, self.closed = digest, False

    def close(self) -> None:
        self.closed = True


def _backend(digests: list[str]) -> tuple[DaemonBackend, list[_Feed]]:
    """A backend whose streams answer with ``digests`` in turn (no daemon, no channel)."""
    backend = object.__new__(DaemonBackend)
    backend.dataset, backend.server, backend._dataset_digest = "train", "unix:///x.sock", ""
    feeds = [_Feed(d) for d in digests]
    it = iter(feeds)
    backend._open = lambda args, plans: next(it)  # type: ignore[method-assign]
    return backend, feeds


def test_a_stream_of_other_files_is_refused_and_closed() -> None:
    backend, feeds = _backend([A, A, B, "", A])
    assert backend.open(Any, []) is feeds[0]
    assert backend.open(Any, []) is feeds[1]
    with pytest.raises(ServerError, match="now serves other files as 'train'"):
        backend.open(Any, [])
    assert feeds[2].closed and not feeds[1].closed
    assert backend.open(Any, []) is feeds[3]  # a daemon that does not know: not compared
    assert backend.open(Any, []) is feeds[4]  # ... and the first digest is kept


def test_a_daemon_of_another_version_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, feeds = _backend([A, OLD, OLD])
    backend.open(Any, [])
    with caplog.at_level(logging.WARNING, logger="beton_client"):
        assert backend.open(Any, []) is feeds[1]
    assert "another beton-serve version" in caplog.text and not feeds[1].closed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="beton_client"):
        backend.open(Any, [])  # the same version as the last stream: compared, no warning
    assert caplog.text == ""
