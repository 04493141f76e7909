# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 11 §11: a corrupt JPEG is not always an error, so samples can be checked against a
CRC32C sidecar (``beton-serve checksum FILE`` writes ``FILE.crc32c``).

* One flipped bit in one sample's JPEG payload (in a copy of the FFCV fixture) decodes without
  any error into different pixels: in process and served, nothing notices.
* With verification (``Loader(verify_checksums=True)``, ``beton-serve serve
  --verify-checksums``) that sample fails with ``PipelineError`` naming its id and the op
  ``checksum``; under a bad-sample budget it is skipped, and every image delivered is a genuine
  one (its pixels are the original file's for its label).
* A flipped bit in a sample's metadata record (its label) is caught too; shards map to global ids.
* A stale sidecar (the file was rewritten), a damaged one or a missing one is refused when the
  Loader or the daemon opens the file; nothing is read unverified.
* ``beton-serve checksum --verify`` prints the bad ids and exits 1.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader as ServedLoader
from beton_client.errors import PipelineError as ClientPipelineError
from beton_serve.cli import main as cli_main
from beton_serve.errors import FormatError, PipelineError
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.format import BetonReader, ChecksumVerifier, sidecar_path, write_sidecar
from beton_serve.jpeg import CorruptJPEGError, decode_into
from beton_serve.loader import Loader
from beton_serve.transforms import ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "ffcv" / "images_jpg.beton"
VICTIM = 1  # a 32x32 JPEG: the centre crop below keeps every pixel, so a changed one shows
BATCH = 8


def _scan_data(jpeg: np.ndarray) -> tuple[int, int]:
    """``[start, end)`` of the entropy-coded data after the (first) SOS segment."""
    raw = bytes(jpeg)
    sos = raw.find(b"\xff\xda")
    start = sos + 2 + int.from_bytes(raw[sos + 2 : sos + 4], "big")
    return start, raw.rfind(b"\xff\xd9")


def _silent_flip(path: Path, sample: int) -> int:
    """File offset of a byte whose lowest-numbered flippable bit makes sample ``sample``'s JPEG
    decode *without error* into different pixels; returns ``offset * 8 + bit``."""
    with BetonReader(path) as r:
        meta = r.field_metadata("image")[sample]
        data = np.array(r.sample_bytes(sample, "image"))
        ptr = int(meta["data_ptr"])
        scratch = np.empty(int(meta["height"]) * int(meta["width"]) * 3 + 4096, np.uint8)
        ref = decode_into(data, scratch).copy()
        start, end = _scan_data(data)
        for pos in range((start + end) // 2, end):
            if data[pos] == 0xFF or data[pos - 1] == 0xFF:
                continue  # stay clear of markers and stuffed bytes
            for bit in range(8):
                flipped = data.copy()
                flipped[pos] ^= 1 << bit
                if flipped[pos] == 0xFF:
                    continue
                try:
                    out = decode_into(flipped, scratch)
                except CorruptJPEGError:
                    continue
                if out.shape == ref.shape and not np.array_equal(out, ref):
                    return (ptr + pos) * 8 + bit
    raise AssertionError("no silent one-bit flip found")


def _flip(path: Path, bit_offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(bit_offset // 8)
        b = f.read(1)[0]
        f.seek(bit_offset // 8)
        f.write(bytes([b ^ (1 << (bit_offset % 8))]))


@pytest.fixture
def pristine(tmp_path: Path) -> Path:
    """A copy of the FFCV fixture with its sidecar."""
    p = tmp_path / "clean" / "images_jpg.beton"
    p.parent.mkdir()
    shutil.copyfile(FIXTURE, p)
    with BetonReader(p) as r:
        write_sidecar(r)
    return p


@pytest.fixture
def corrupted(tmp_path: Path, pristine: Path) -> Path:
    """Another copy with the same sidecar, then one bit of ``VICTIM``'s JPEG payload flipped."""
    p = tmp_path / "bad" / "images_jpg.beton"
    p.parent.mkdir()
    shutil.copyfile(pristine, p)
    shutil.copyfile(sidecar_path(pristine), sidecar_path(p))
    _flip(p, _silent_flip(p, VICTIM))
    return p


def _pipelines(tensor: bool = False) -> dict[str, list[object]]:
    tail = [ToTensor()] if tensor else []
    return {
        "image": [CenterCropRGBImageDecoder((32, 32), 1.0), *tail],
        "label": [IntDecoder(), *tail],
        "weight": None,
    }


def _epoch(path: Path, **kw: object) -> tuple[np.ndarray, np.ndarray]:
    with Loader(
        str(path), BATCH, num_workers=1, pipelines=_pipelines(), drop_last=False, **kw
    ) as ld:
        batches = [(np.array(x), np.array(y)) for x, y in ld]
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def test_a_flipped_jpeg_bit_decodes_silently_into_other_pixels(
    pristine: Path, corrupted: Path
) -> None:
    """The README's old claim was false: the decoder raises nothing, the pixels differ."""
    img0, lab0 = _epoch(pristine)
    img1, lab1 = _epoch(corrupted)
    np.testing.assert_array_equal(lab0, lab1)
    differs = [i for i in range(len(img0)) if not np.array_equal(img0[i], img1[i])]
    assert differs == [VICTIM]


def test_in_process_verification_names_the_corrupt_sample(pristine: Path, corrupted: Path) -> None:
    img0, _ = _epoch(pristine, verify_checksums=True)  # a clean copy verifies
    assert img0.shape == (64, 32, 32, 3)
    with pytest.raises(PipelineError) as err:
        _epoch(corrupted, verify_checksums=True)
    assert err.value.sample_index == VICTIM
    assert err.value.op == "checksum"
    assert f"sample {VICTIM}" in str(err.value) and "CRC32C" in str(err.value)


def test_budget_skips_the_corrupt_sample_and_delivers_only_genuine_images(
    pristine: Path, corrupted: Path
) -> None:
    img0, lab0 = _epoch(pristine)
    by_label = {int(lab0[i, 0]): img0[i] for i in range(len(lab0))}
    with Loader(
        str(corrupted),
        BATCH,
        num_workers=1,
        pipelines=_pipelines(),
        drop_last=False,
        verify_checksums=True,
        bad_sample_budget=1,
    ) as ld:
        got = [(np.array(x), np.array(y)) for x, y in ld]
        skipped = [(b.sample_id, b.op) for b in ld.bad_samples]
    assert skipped == [(VICTIM, "checksum")]
    for images, labels in got:
        for img, lab in zip(images, labels[:, 0], strict=True):
            np.testing.assert_array_equal(img, by_label[int(lab)])
    assert int(lab0[VICTIM, 0]) not in {int(v) for _, y in got for v in y[:, 0]}


def test_a_flipped_label_bit_is_caught_too(pristine: Path, tmp_path: Path) -> None:
    """The metadata record is summed: a label changed by one bit names its sample."""
    with BetonReader(pristine) as r:
        at = r.metadata_offset + 9 * r.record_size + r.record.fields["f1"][1]  # sample 9's label
    _flip(pristine, at * 8 + 2)
    with pytest.raises(PipelineError) as err:
        _epoch(pristine, verify_checksums=True)
    assert err.value.sample_index == 9


def test_shards_report_global_sample_ids(pristine: Path, corrupted: Path) -> None:
    with BetonReader(pristine) as a, BetonReader(corrupted) as b:
        v = ChecksumVerifier([a, b])
        assert v.mismatches().tolist() == [64 + VICTIM]
        v.check(np.arange(64, dtype=np.uint64))  # the first shard is clean
        with pytest.raises(FormatError, match=f"sample {64 + VICTIM}:"):
            v.check(np.array([3, 64 + VICTIM, 70], dtype=np.uint64))


def test_stale_damaged_or_missing_sidecars_are_refused_at_open(
    pristine: Path, tmp_path: Path
) -> None:
    side = Path(sidecar_path(pristine))
    # Rewritten file (another dataset under the same name): the old sidecar is stale.
    other = tmp_path / "other" / "images_jpg.beton"
    other.parent.mkdir()
    shutil.copyfile(FIXTURE.parent / "images_raw.beton", other)
    shutil.copyfile(side, sidecar_path(other))
    with pytest.raises(FormatError, match="stale checksum sidecar"):
        Loader(str(other), BATCH, pipelines=_pipelines(), verify_checksums=True)
    # Same size and sample count, one byte of the allocation table changed: still stale.
    same = tmp_path / "same" / "images_jpg.beton"
    same.parent.mkdir()
    shutil.copyfile(pristine, same)
    shutil.copyfile(side, sidecar_path(same))
    with BetonReader(same) as r:
        at = r.header.alloc_table_ptr + 24 * (r.num_allocations - 1) + 16  # last entry's size
    with open(same, "r+b") as f:  # shrink the last allocation by one byte: still a valid file
        f.seek(at)
        size = int.from_bytes(f.read(8), "little")
        f.seek(at)
        f.write((size - 1).to_bytes(8, "little"))
    BetonReader(same).close()  # a valid file (a JPEG's allocation may have any size)
    with pytest.raises(FormatError, match="allocation table changed"):
        Loader(str(same), BATCH, pipelines=_pipelines(), verify_checksums=True)
    # A damaged sidecar table.
    data = bytearray(side.read_bytes())
    data[-1] ^= 0x10
    side.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="damaged"):
        Loader(str(pristine), BATCH, pipelines=_pipelines(), verify_checksums=True)
    # None at all.
    side.unlink()
    with pytest.raises(FormatError, match="beton-serve checksum"):
        Loader(str(pristine), BATCH, pipelines=_pipelines(), verify_checksums=True)
    # A FIFO (open() waited for a writer: a hang) or /dev/zero (read() never ended) in its place.
    os.mkfifo(side)
    with pytest.raises(FormatError, match="sidecar is not a regular file"):
        Loader(str(pristine), BATCH, pipelines=_pipelines(), verify_checksums=True)
    side.unlink()
    side.symlink_to("/dev/zero")
    with pytest.raises(FormatError, match="sidecar is not a regular file"):
        Loader(str(pristine), BATCH, pipelines=_pipelines(), verify_checksums=True)
    side.unlink()
    Loader(str(pristine), BATCH, pipelines=_pipelines()).close()  # without verification: fine


def test_cli_writes_atomically_and_verify_exit_code(
    pristine: Path, corrupted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    side = Path(sidecar_path(pristine))
    side.unlink()
    assert cli_main(["checksum", str(pristine)]) == 0
    assert side.exists() and not list(side.parent.glob("*.crc32c.*"))  # no temp file left
    assert cli_main(["checksum", "--verify", str(pristine)]) == 0
    assert "all 64 samples match" in capsys.readouterr().out
    assert cli_main(["checksum", "--verify", str(corrupted)]) == 1
    out = capsys.readouterr().out
    assert f"bad sample ids: {VICTIM}\n" in out
    # Re-writing the corrupted file's sidecar blesses the corruption: that is the operator's call.
    assert cli_main(["checksum", str(corrupted)]) == 0
    assert cli_main(["checksum", "--verify", str(corrupted)]) == 0
    Path(sidecar_path(corrupted)).unlink()
    assert cli_main(["checksum", "--verify", str(corrupted)]) == 1  # missing sidecar: an error
    assert "no checksum sidecar" in capsys.readouterr().err


def test_cli_goes_on_past_a_file_it_cannot_read(
    pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checksum A BAD B`` used to stop at BAD, so B's sidecar was never written."""
    other = tmp_path / "other.beton"
    other.write_bytes(pristine.read_bytes())
    empty = tmp_path / "empty.beton"
    empty.write_bytes(b"")
    Path(sidecar_path(pristine)).unlink()
    assert cli_main(["checksum", str(pristine), str(empty), str(other)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(empty) in err
    assert Path(sidecar_path(pristine)).exists() and Path(sidecar_path(other)).exists()
    assert cli_main(["checksum", "--verify", str(empty), str(other)]) == 1
    assert "all 64 samples match" in capsys.readouterr().out


def _served(address: str) -> tuple[np.ndarray, np.ndarray]:
    ld = ServedLoader(
        "images_jpg",
        BATCH,
        pipelines=_pipelines(tensor=True),
        server=address,
        spawn=False,
        drop_last=False,
    )
    try:
        batches = [(np.asarray(x).copy(), np.asarray(y).copy()) for x, y in ld]
    finally:
        ld.close()
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


@pytest.mark.slow
def test_served_silent_without_and_named_with_verify_checksums(
    daemon_factory, pristine: Path, corrupted: Path
) -> None:
    ref_img, _ = _epoch(pristine)
    plain = daemon_factory([corrupted])
    img, _ = _served(plain.address)
    differs = [i for i in range(len(img)) if not np.array_equal(img[i], ref_img[i])]
    assert differs == [VICTIM]  # served, unverified: wrong pixels, no error
    plain.stop()

    verified = daemon_factory([corrupted], args=["--verify-checksums"])
    with pytest.raises(ClientPipelineError, match=rf"sample {VICTIM}\b.*CRC32C"):
        _served(verified.address)
    verified.stop()

    clean = daemon_factory([pristine], args=["--verify-checksums"])
    img, _ = _served(clean.address)
    np.testing.assert_array_equal(img, ref_img)


@pytest.mark.slow
def test_daemon_refuses_to_start_with_a_stale_sidecar(
    daemon_factory, pristine: Path, tmp_path: Path
) -> None:
    other = tmp_path / "stale" / "images_jpg.beton"
    other.parent.mkdir()
    shutil.copyfile(FIXTURE.parent / "images_smart.beton", other)
    shutil.copyfile(sidecar_path(pristine), sidecar_path(other))
    with pytest.raises(RuntimeError, match="stale checksum sidecar"):
        daemon_factory([other], args=["--verify-checksums"])
