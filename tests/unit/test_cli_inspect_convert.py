"""``beton-serve inspect`` and ``beton-serve convert imagefolder`` against real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from beton_serve.cli import SUBCOMMANDS, main
from beton_serve.format import BetonReader


def test_registry_lists_inspect_and_convert() -> None:
    assert "beton_serve.cli._inspect" in SUBCOMMANDS
    assert "beton_serve.cli._convert" in SUBCOMMANDS


def test_help_and_no_command(capsys: pytest.CaptureFixture) -> None:
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    assert main([]) == 2


def test_inspect_text(fixtures_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(fixtures_dir / "images_smart.beton")]) == 0
    out = capsys.readouterr().out
    assert "version 2, page size 2097152 B, 64 samples, 2 fields" in out
    assert "image: RGBImageField (type 2)" in out
    assert "images: 57 jpg, 7 raw; width 1..256, height 1..256" in out
    assert "label: IntField (type 1)" in out
    assert "validation: OK" in out


def test_inspect_json(fixtures_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--json", str(fixtures_dir / "mixed_fields.beton")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["valid"] and d["version"] == 2 and d["num_samples"] == 50
    by_name = {f["name"]: f for f in d["fields"]}
    assert by_name["array"]["arguments"] == {"dtype": "<f4", "shape": [3, 4]}
    assert by_name["blob"]["bytes"]["max_size"] == 513
    assert by_name["meta"]["type"] == "JSONField"
    assert d["num_allocations"] == 150 and d["num_pages"] == 1
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        assert d["data_bytes"] == int(r.allocations[2].sum())
        assert d["schema_key"] == r.schema_key()


def test_inspect_invalid_file(tmp_path: Path, fixtures_dir: Path, capsys) -> None:
    bad = tmp_path / "bad.beton"
    data = bytearray((fixtures_dir / "images_raw.beton").read_bytes())
    data[16:24] = bytes(8)  # alloc_table_ptr = 0, what a crashed writer leaves
    bad.write_bytes(bytes(data))
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "validation: FAILED" in out and "alloc_table_ptr" in out
    assert main(["inspect", "--json", str(bad)]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["valid"] is False and d["offset"] == 16


def _imagefolder(root: Path) -> list[tuple[np.ndarray, int]]:
    import cv2

    rng = np.random.default_rng(0)
    expected = []
    for label, cls in enumerate(["cat", "dog"]):
        (root / cls).mkdir(parents=True)
        for k in range(3):
            img = rng.integers(0, 255, (10 + k, 12 + 2 * k, 3), dtype=np.uint8)
            cv2.imwrite(str(root / cls / f"{k}.png"), img[..., ::-1])  # PNG is lossless
            expected.append((img, label))
    gray = rng.integers(0, 255, (9, 7), dtype=np.uint8)
    cv2.imwrite(str(root / "dog" / "z_gray.png"), gray)
    expected.append((np.repeat(gray[..., None], 3, axis=2), 1))
    (root / "dog" / "notes.txt").write_text("ignored: not an image")
    return expected


def test_convert_imagefolder_raw(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    expected = _imagefolder(tmp_path / "data")
    out = tmp_path / "out.beton"
    rc = main(
        [
            "convert",
            "imagefolder",
            str(tmp_path / "data"),
            str(out),
            "--write-mode",
            "raw",
            "--workers",
            "2",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "wrote 7 images in 2 classes" in capsys.readouterr().err
    with BetonReader(out) as r:
        assert r.num_samples == 7
        assert r.field_metadata("label").tolist() == [lab for _, lab in expected]
        for k, (img, _) in enumerate(expected):
            assert np.array_equal(r.sample_bytes(k, "image").reshape(img.shape), img)
    assert main(["inspect", str(out)]) == 0
    assert "images: 0 jpg, 7 raw" in capsys.readouterr().out


def test_convert_terminated_leaves_no_file_and_a_later_write_sweeps_dead_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (``timeout``, Slurm, Kubernetes) during ``convert`` left a hidden temporary file
    the size of the dataset that nothing removed. It is now handled as Ctrl-C is; and a file
    that a SIGKILL left (its pid gone) is removed by the next write of the same output."""
    import signal
    import subprocess
    import sys

    from beton_serve.writer import DatasetWriter

    _imagefolder(tmp_path / "data")
    out = tmp_path / "out.beton"
    real_pack = DatasetWriter._pack
    calls = []

    def pack_then_terminate(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` sends it, mid-write
        return real_pack(self, *a, **kw)

    monkeypatch.setattr(DatasetWriter, "_pack", pack_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    rc = main(["convert", "imagefolder", str(tmp_path / "data"), str(out), "--workers", "1"])
    assert rc == 128 + signal.SIGTERM
    assert "terminated by SIGTERM: nothing written" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    assert sorted(os.listdir(tmp_path)) == ["data"]  # no output, no temporary file
    monkeypatch.setattr(DatasetWriter, "_pack", real_pack)
    # A dead writer's temporary file (a pid that has exited) and a live one's (kept).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.beton.{dead.pid}.0123abcd.tmp"
    stale.write_bytes(b"x" * 100)
    live = tmp_path / f".out.beton.{os.getppid()}.89abcdef.tmp"
    live.write_bytes(b"y")
    assert main(["convert", "imagefolder", str(tmp_path / "data"), str(out)]) == 0
    assert not stale.exists() and live.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["data", "out.beton", live.name])


def test_convert_jpg_with_max_resolution(tmp_path: Path, capsys) -> None:
    _imagefolder(tmp_path / "data")
    out = tmp_path / "out.beton"
    rc = main(
        [
            "convert",
            "imagefolder",
            str(tmp_path / "data"),
            str(out),
            "--max-resolution",
            "8",
            "--jpeg-quality",
            "80",
        ]
    )
    assert rc == 0
    with BetonReader(out) as r:
        meta = r.field_metadata("image")
        assert set(meta["mode"].tolist()) == {0}
        assert max(meta["width"].max(), meta["height"].max()) == 8


def test_convert_unreadable_image_reports_path(tmp_path: Path, capsys) -> None:
    _imagefolder(tmp_path / "data")
    broken = tmp_path / "data" / "cat" / "1_broken.jpg"
    broken.write_bytes(b"\xff\xd8 this is not a jpeg")
    out = tmp_path / "out.beton"
    assert main(["convert", "imagefolder", str(tmp_path / "data"), str(out)]) == 1
    err = capsys.readouterr().err
    assert str(broken) in err and "cannot decode image" in err
    assert not out.exists()


def test_convert_errors_about_one_image_name_its_file(tmp_path: Path, capsys) -> None:
    """A side over 65535 px and a raw image larger than a page named the sample index only;
    now the file too, and the page-size error names convert's flag."""
    import cv2

    (tmp_path / "wide" / "a").mkdir(parents=True)
    wide = tmp_path / "wide" / "a" / "wide.png"
    cv2.imwrite(str(wide), np.zeros((1, 70000, 3), np.uint8))
    out = tmp_path / "o1.beton"
    assert main(["convert", "imagefolder", str(tmp_path / "wide"), str(out)]) == 1
    err = capsys.readouterr().err
    assert str(wide) in err and "65535" in err and not out.exists()

    (tmp_path / "big" / "a").mkdir(parents=True)
    big = tmp_path / "big" / "a" / "big.png"
    cv2.imwrite(str(big), np.full((1000, 1000, 3), 7, np.uint8))  # 3 MB raw
    out = tmp_path / "o2.beton"
    args = ["convert", "imagefolder", str(tmp_path / "big"), str(out), "--write-mode", "raw"]
    assert main([*args, "--page-size", str(1 << 21)]) == 1
    err = capsys.readouterr().err
    assert str(big) in err and "--page-size, now 2097152" in err and not out.exists()


def test_convert_empty_or_missing_dir(tmp_path: Path, capsys) -> None:
    assert main(["convert", "imagefolder", str(tmp_path / "nope"), str(tmp_path / "o")]) == 1
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    assert main(["convert", "imagefolder", str(tmp_path / "empty"), str(tmp_path / "o")]) == 1
    assert "no images" in capsys.readouterr().err


def test_convert_follows_a_link_loop_once(tmp_path: Path, capsys) -> None:
    expected = _imagefolder(tmp_path / "data")
    (tmp_path / "data" / "cat" / "up").symlink_to("..")  # cat/up/cat/up/... for ever
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data" / "dog" / "more").symlink_to(tmp_path / "elsewhere")
    import cv2

    extra = np.full((5, 6, 3), 77, np.uint8)
    cv2.imwrite(str(tmp_path / "elsewhere" / "x.png"), extra)
    out = tmp_path / "out.beton"
    rc = main(["convert", "imagefolder", str(tmp_path / "data"), str(out), "--write-mode", "raw"])
    assert rc == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "wrote 8 images in 2 classes" in err
    assert f"skipped {tmp_path / 'data' / 'cat' / 'up'}: a link to a directory that contains" in err
    with BetonReader(out) as r:
        labels = r.field_metadata("label").tolist()
        assert labels == [lab for _, lab in expected[:3]] + [1] * 5
        assert np.array_equal(r.sample_bytes(7, "image").reshape(extra.shape), extra)


def test_convert_orders_nested_directories_as_torchvision(tmp_path: Path) -> None:
    """torchvision's ImageFolder sorts ``os.walk``'s tuples by path: ``x-z`` (``-`` is 0x2d)
    before ``x/y`` (``/`` is 0x2f). Ours walked each directory's children right after it, so
    sample i was not ``ImageFolder(root).samples[i]`` and index lists made with torchvision
    pointed at other images (with their right labels)."""
    from beton_serve.cli._convert import ImageFolder

    for rel in ("cat/x/1.png", "cat/x/y/2.png", "cat/x-z/3.png", "cat/x.a/4.png", "dog/0.png"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    got = [
        (os.path.relpath(path, tmp_path), label)
        for path, label in ImageFolder(str(tmp_path)).samples
    ]
    # torchvision.datasets.folder.make_dataset's rule, restated
    want = []
    for label, cls in enumerate(["cat", "dog"]):
        for root, _, files in sorted(os.walk(tmp_path / cls)):
            want += [
                (os.path.relpath(os.path.join(root, f), tmp_path), label) for f in sorted(files)
            ]
    assert got == want
    assert [g for g, _ in got][:4] == [
        "cat/x/1.png",
        "cat/x-z/3.png",
        "cat/x.a/4.png",
        "cat/x/y/2.png",
    ]


def test_convert_refuses_a_class_without_images(tmp_path: Path, capsys) -> None:
    _imagefolder(tmp_path / "data")
    (tmp_path / "data" / "emu").mkdir()
    out = tmp_path / "out.beton"
    assert main(["convert", "imagefolder", str(tmp_path / "data"), str(out)]) == 1
    err = capsys.readouterr().err
    assert "class directories without images" in err and "emu" in err
    assert not out.exists()


def test_convert_stores_pixels_as_the_file_holds_them_ignoring_exif_orientation(
    tmp_path: Path, capsys
) -> None:
    import struct

    import cv2

    img = np.zeros((10, 30, 3), np.uint8)
    img[:, :10] = 255
    ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 100])
    assert ok
    jpg = enc.tobytes()
    # An APP1 Exif segment whose one IFD entry is Orientation = 6 (rotate 90 degrees).
    tiff = b"II*\x00" + struct.pack("<IH", 8, 1) + struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0)
    app1 = b"Exif\x00\x00" + tiff + struct.pack("<I", 0)
    (tmp_path / "data" / "cls").mkdir(parents=True)
    (tmp_path / "data" / "cls" / "r.jpg").write_bytes(
        jpg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpg[2:]
    )
    assert cv2.imread(str(tmp_path / "data" / "cls" / "r.jpg")).shape[:2] == (30, 10)  # rotated
    out = tmp_path / "out.beton"
    rc = main(["convert", "imagefolder", str(tmp_path / "data"), str(out), "--write-mode", "raw"])
    assert rc == 0, capsys.readouterr().err
    with BetonReader(out) as r:
        meta = r.field_metadata("image")
        assert (int(meta["height"][0]), int(meta["width"][0])) == (10, 30)


def test_convert_to_an_unwritable_path_is_an_error_line_before_any_work(
    tmp_path: Path, capsys
) -> None:
    _imagefolder(tmp_path / "data")
    rc = main(["convert", "imagefolder", str(tmp_path / "data"), str(tmp_path / "no" / "o.beton")])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "does not exist" in err
    assert "Traceback" not in err


def test_default_subcommand_and_registry_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module added to SUBCOMMANDS registers itself; a bare file argument means the default."""
    import sys
    import types

    import beton_serve.cli as cli

    seen = {}
    fake = types.ModuleType("beton_serve_test_fake_serve")

    def register(sub) -> None:
        p = sub.add_parser("fakecmd")
        p.add_argument("files", nargs="+")
        p.set_defaults(func=lambda args: seen.setdefault("files", args.files) and 0)

    fake.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, fake.__name__])
    monkeypatch.setattr(cli, "DEFAULT_SUBCOMMAND", "fakecmd")
    assert cli.main(["a.beton", "b.beton"]) == 0
    assert seen["files"] == ["a.beton", "b.beton"]


def test_library_imports_stay_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, beton_serve.fields, beton_serve.format, beton_serve.writer, beton_serve.cli;"
        "print(sorted(m for m in ('numba', 'cv2', 'torch', 'tqdm') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


_FIELD_FILE = '''
from beton_serve.fields import IntField


class LabelField(IntField):
    """An IntField subclass: written with the custom type id 255."""

    @staticmethod
    def from_binary(binary):
        return LabelField()
'''


def test_inspect_and_checksum_read_custom_fields(tmp_path: Path, capsys) -> None:
    from beton_serve.cli._plugins import load_field_classes
    from beton_serve.writer import DatasetWriter

    (tmp_path / "myfields.py").write_text(_FIELD_FILE)
    entry = f"label={tmp_path / 'myfields.py'}:LabelField"
    (cls,) = load_field_classes([entry]).values()
    out = tmp_path / "custom.beton"
    DatasetWriter(out, {"label": cls()}).from_indexed_dataset([(i,) for i in range(5)])

    assert main(["inspect", str(out)]) == 1  # without the class: refused, naming the option
    assert "custom type id 255" in capsys.readouterr().out
    assert main(["inspect", str(out), "--custom-field", entry]) == 0
    text = capsys.readouterr().out
    assert "LabelField" in text and "validation: OK" in text
    assert main(["checksum", str(out), "--custom-field", entry]) == 0
    assert main(["checksum", "--verify", str(out), "--custom-field", entry]) == 0
    assert "all 5 samples match" in capsys.readouterr().out


_IMAGE_FIELD_FILE = '''
from beton_serve.fields import RGBImageField


class MyImages(RGBImageField):
    """An RGBImageField subclass: written with the custom type id 255."""

    @staticmethod
    def from_binary(binary):
        return MyImages()
'''


def test_inspect_describes_the_images_of_an_image_field_subclass(tmp_path: Path, capsys) -> None:
    """A subclass of RGBImageField (type id 255) had no ``images:`` line: it was picked by
    type id 2 only."""
    import numpy as np
    from beton_serve.cli._plugins import load_field_classes
    from beton_serve.writer import DatasetWriter

    (tmp_path / "myimages.py").write_text(_IMAGE_FIELD_FILE)
    entry = f"image={tmp_path / 'myimages.py'}:MyImages"
    (cls,) = load_field_classes([entry]).values()
    out = tmp_path / "images.beton"
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 256, (8 + i, 12, 3), dtype=np.uint8),) for i in range(4)]
    DatasetWriter(out, {"image": cls(write_mode="raw")}).from_indexed_dataset(rows)
    assert main(["inspect", str(out), "--custom-field", entry]) == 0
    text = capsys.readouterr().out
    assert "MyImages" in text
    assert "images: 0 jpg, 4 raw; width 12..12, height 8..11" in text


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("label", "expected NAME=MODULE:CLASS"),
        ("label=beton_serve.fields:NoSuchField", "has no Field subclass named NoSuchField"),
        ("label=beton_serve.errors:SpecError", "has no Field subclass named SpecError"),
        ("label=no_such_module_xyz:F", "no_such_module_xyz"),
    ],
)
def test_a_bad_custom_field_option_is_an_error_line(tmp_path: Path, capsys, entry, words) -> None:
    assert main(["inspect", str(tmp_path / "x.beton"), "--custom-field", entry]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


def test_an_override_of_a_built_in_field_with_another_metadata_layout_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--custom-field image=...:IntField`` on an RGB image field: ``inspect`` crashed with a
    traceback, and ``checksum`` wrote a sidecar computed with the wrong record size (every
    sample then "corrupt"). The reader now refuses an override whose metadata layout is not
    the stored field's, for every reader of the file (the Loader too)."""
    from beton_serve.errors import FormatError
    from beton_serve.fields import IntField
    from beton_serve.loader import Loader

    _imagefolder(tmp_path / "data")
    out = tmp_path / "out.beton"
    assert main(["convert", "imagefolder", str(tmp_path / "data"), str(out)]) == 0
    capsys.readouterr()
    entry = "image=beton_serve.fields:IntField"
    assert main(["inspect", str(out), "--custom-field", entry]) == 1
    text = capsys.readouterr().out
    assert "validation: FAILED" in text and "must keep its metadata layout" in text
    assert main(["checksum", str(out), "--custom-field", entry]) == 1
    assert "must keep its metadata layout" in capsys.readouterr().err
    assert not (tmp_path / "out.beton.crc32c").exists()
    with pytest.raises(FormatError, match="RGBImageField with metadata"):
        Loader(str(out), batch_size=2, custom_fields={"image": IntField})
    with BetonReader(out, {"label": IntField}) as r:  # the same layout: still accepted
        assert r.num_samples == 7
