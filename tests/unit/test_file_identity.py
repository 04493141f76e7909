"""The fingerprint that names a ``.beton`` by content (``beton_wire.file_identity``).

It hashed only the size and the first and last 64 KiB of a file. A dataset whose raw pixels
were regenerated with the same sizes, labels and order agrees with the old one in both ends, so
a Loader state or a name-addressed client took it for the same dataset and went on reading the
new pixels at the old position. It now also hashes spans spread between the ends, and says when
two digests are of different versions rather than calling them different.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest
from beton_serve.daemon import DatasetTable, EngineBackend
from beton_serve.errors import SpecError
from beton_serve.format import BetonReader, readers_digest
from beton_wire.file_identity import (
    FINGERPRINT_SPAN,
    INTERIOR_SPAN,
    INTERIOR_SPANS,
    FileIdentity,
    compare_digests,
    dataset_digest,
    interior_spans,
)
from helpers.labelled import write_pixels

pytestmark = pytest.mark.timeout(120)


def _ends_only(path: Path) -> str:
    """The fingerprint as version 1 computed it: size and both 64 KiB ends."""
    data = path.read_bytes()
    h = hashlib.sha256(len(data).to_bytes(8, "little"))
    h.update(data[:FINGERPRINT_SPAN])
    h.update(data[max(FINGERPRINT_SPAN, len(data) - FINGERPRINT_SPAN) :])
    return h.hexdigest()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A dataset and its pixels regenerated: same sizes, labels, order, and both ends."""
    root = tmp_path_factory.mktemp("regenerated")
    old = write_pixels(root / "old" / "train.beton", 256)
    new = write_pixels(root / "new" / "train.beton", 256, shift=7, changed=range(40, 216))
    return old, new


def test_a_dataset_regenerated_between_its_ends_has_another_fingerprint(
    regenerated: tuple[Path, Path],
) -> None:
    old, new = regenerated
    assert old.stat().st_size == new.stat().st_size
    assert old.read_bytes() != new.read_bytes()
    assert _ends_only(old) == _ends_only(new)  # the case version 1 could not tell apart
    a, b = FileIdentity.of(old), FileIdentity.of(new)
    assert a.fingerprint.startswith("v2:") and a.fingerprint != b.fingerprint
    assert not a.same_file(b, same_host=False)
    # The daemon's reader fingerprints the mapped bytes as the client fingerprints the file.
    with BetonReader(str(old)) as ra, BetonReader(str(new)) as rb:
        assert (ra.fingerprint, rb.fingerprint) == (a.fingerprint, b.fingerprint)
        da, db = readers_digest([ra]), readers_digest([rb])
    assert da == dataset_digest([(a.size, a.fingerprint)])
    assert compare_digests(da, db) is False
    assert compare_digests(da, da) is True


def test_a_copy_has_the_same_fingerprint(regenerated: tuple[Path, Path], tmp_path: Path) -> None:
    old, _ = regenerated
    copy = tmp_path / "train.beton"
    copy.write_bytes(old.read_bytes())
    a, c = FileIdentity.of(old), FileIdentity.of(copy)
    assert a.fingerprint == c.fingerprint and a.same_file(c, same_host=False)
    assert not a.same_file(c, same_host=True)  # another inode on this host


@pytest.mark.parametrize(
    "size",
    [0, 1, FINGERPRINT_SPAN, 2 * FINGERPRINT_SPAN, 2 * FINGERPRINT_SPAN + 1, 3 << 20, 10**11 + 7],
)
def test_interior_spans_cover_the_middle_evenly(size: int) -> None:
    spans = interior_spans(size)
    start, stop = FINGERPRINT_SPAN, size - FINGERPRINT_SPAN
    if stop <= start:
        assert spans == []
        return
    if stop - start <= INTERIOR_SPANS * INTERIOR_SPAN:
        assert spans == [(start, stop - start)]  # all of it
        return
    assert len(spans) == INTERIOR_SPANS
    assert all(n == INTERIOR_SPAN for _, n in spans)
    assert spans[0][0] == start and spans[-1][0] + INTERIOR_SPAN == stop
    offsets = [o for o, _ in spans]
    assert offsets == sorted(set(offsets))
    gaps = {b - a for a, b in itertools.pairwise(offsets)}
    assert max(gaps) - min(gaps) <= 1


def test_a_small_file_is_hashed_whole(tmp_path: Path) -> None:
    """Every byte of a file up to 128 KiB + 64 spans counts."""
    size = 2 * FINGERPRINT_SPAN + INTERIOR_SPANS * INTERIOR_SPAN
    data = bytearray(size)
    p = tmp_path / "f"
    p.write_bytes(data)
    before = FileIdentity.of(p).fingerprint
    for offset in (0, FINGERPRINT_SPAN + 5, size // 2, size - FINGERPRINT_SPAN - 1, size - 1):
        data[offset] ^= 1
        p.write_bytes(data)
        assert FileIdentity.of(p).fingerprint != before, offset
        data[offset] ^= 1


def test_digests_of_two_versions_are_not_compared() -> None:
    v2a, v2b = "v2:" + "a" * 32, "v2:" + "b" * 32
    legacy = "c" * 32  # version 1's digests had no scheme prefix
    assert compare_digests(v2a, v2a) is True
    assert compare_digests(v2a, v2b) is False
    assert compare_digests(legacy, legacy) is True
    assert compare_digests(legacy, v2a) is None
    assert compare_digests("", v2a) is None and compare_digests(v2a, None) is None


def test_the_daemon_names_a_fingerprint_of_another_version(
    regenerated: tuple[Path, Path],
) -> None:
    """A remote client of an older version names a copy of the served file: the daemon's
    refusal says the two fingerprint files differently, not only that the files differ."""
    old, _ = regenerated
    mine = FileIdentity.of(old)
    theirs = FileIdentity(
        path="/elsewhere/train.beton",
        device=1,
        inode=2,
        size=mine.size,
        mtime_ns=3,
        fingerprint=_ends_only(old),
    )
    assert mine.scheme_note(mine) == ""
    table = DatasetTable({"train": [str(old)]}, EngineBackend())
    try:
        with pytest.raises(
            SpecError, match=r"fingerprint files differently \(scheme v1 against v2"
        ):
            table.resolve("train", theirs, same_host=False)
        # The same client on this host is compared by device and inode, never by scheme.
        with pytest.raises(SpecError) as info:
            table.resolve("train", theirs, same_host=True)
        assert "fingerprint files differently" not in str(info.value)
    finally:
        table.close()
