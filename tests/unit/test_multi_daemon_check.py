"""Several daemons behind one Loader (``_multi_loader._check_same_stream``): each must serve the
first one's stream: grpc, the same batch count and outputs, the same files. Daemons of two
beton-serve versions, whose dataset digests cannot be compared, are accepted with a warning
that names both (refusing would stop every trainer across a rolling upgrade)."""

from __future__ import annotations

import logging

import pytest
from beton_client._multi_loader import _check_same_stream
from beton_client.errors import SpecError
from beton_wire.v1 import beton_pb2 as pb

pytestmark = pytest.mark.timeout(30)

A, B = "v2:" + "a" * 32, "v2:" + "b" * 32
OLD = "c" * 32  # a version-1 digest: no scheme prefix


def _reply(
    digest: str, *, kind: str = "grpc", batches: int = 10, outputs: tuple[str, ...] = ("x", "y")
) -> pb.OpenStreamResponse:
    return pb.OpenStreamResponse(
        outputs=[pb.OutputSpec(name=n) for n in outputs],
        transport=pb.TransportSetup(kind=kind),
        num_batches=batches,
        dataset_digest=digest,
    )


def test_the_same_stream_passes_quietly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="beton_client"):
        _check_same_stream("h2:7000", _reply(A), "h1:7000", _reply(A))
    assert caplog.records == []


def test_another_file_is_refused_naming_both_daemons() -> None:
    with pytest.raises(SpecError, match=r"h2:7000 serves another file .* h1:7000"):
        _check_same_stream("h2:7000", _reply(B), "h1:7000", _reply(A))


@pytest.mark.parametrize(
    "reply, what",
    [
        (_reply(A, kind="shm"), "chose the shm transport"),
        (_reply(A, batches=11), "serves 11 batches"),
        (_reply(A, outputs=("x",)), r"outputs \['x'\]"),
    ],
)
def test_another_stream_is_refused(reply: pb.OpenStreamResponse, what: str) -> None:
    with pytest.raises(SpecError, match=what):
        _check_same_stream("h2:7000", reply, "h1:7000", _reply(A))


def test_daemons_of_two_versions_are_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="beton_client"):
        _check_same_stream("h2:7000", _reply(OLD), "h1:7000", _reply(A))
    [rec] = caplog.records
    msg = rec.getMessage()
    assert "h2:7000" in msg and "h1:7000" in msg and "versions" in msg
    assert OLD[:15] in msg and A[:15] in msg
    # but a version skew does not excuse another batch count
    with pytest.raises(SpecError, match="serves 11 batches"):
        _check_same_stream("h2:7000", _reply(OLD, batches=11), "h1:7000", _reply(A))


def test_a_daemon_that_names_no_digest_is_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="beton_client"):
        _check_same_stream("h2:7000", _reply(""), "h1:7000", _reply(A))
    assert caplog.records == []
