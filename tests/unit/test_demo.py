"""``beton-serve demo``: the sample dataset it writes (the full run is in tests/integration)."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.cli import build_parser, main
from beton_serve.cli._demo import DemoError, SampleImages, synth_image, write_sample_dataset


def test_synth_image_is_deterministic_and_varied() -> None:
    a = synth_image((1, 2), 24, 40)
    assert a.shape == (24, 40, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, synth_image((1, 2), 24, 40))
    b = synth_image((1, 3), 24, 40)
    assert not np.array_equal(a, b)
    # Photo-like, not flat: the pixels span a real range in every channel.
    assert all(int(np.ptp(a[..., c])) > 20 for c in range(3))


def test_sample_images_dataset() -> None:
    ds = SampleImages(5, 16, classes=3)
    assert len(ds) == 5
    img, label = ds[4]
    assert img.shape == (16, 16, 3) and label == 4 % 3
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(DemoError):
        SampleImages(0, 16)


def test_write_sample_dataset_reads_back(tmp_path) -> None:
    from beton_serve.format import BetonReader

    path = write_sample_dataset(tmp_path / "demo.beton", n=12, size=16)
    with BetonReader(path) as reader:
        assert reader.num_samples == 12
        assert reader.field_names == ["image", "label"]
        labels = reader.field_metadata("label")
        assert [int(v) for v in labels] == [i % 10 for i in range(12)]
        image_meta = reader.field_metadata("image")
        assert set(int(m) for m in image_meta["mode"]) == {0}  # stored as JPEG
        assert set(int(w) for w in image_meta["width"]) == {16}


def test_write_only_subcommand(tmp_path, capsys) -> None:
    out = tmp_path / "sample.beton"
    args = build_parser().parse_args(["demo", "--write-only", str(out), "--samples", "8"])
    assert args.command == "demo"
    assert main(["demo", "--write-only", str(out), "--samples", "8", "--size", "16"]) == 0
    assert out.is_file()
    assert "wrote 8 samples" in capsys.readouterr().out


def test_bad_arguments_fail_with_a_message(capsys) -> None:
    assert main(["demo", "--trainers", "0"]) == 1
    assert "--trainers" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_runs_under_a_long_tmpdir(tmp_path) -> None:
    """With a ``$TMPDIR`` long enough that ``$TMPDIR/beton-serve-demo-XXXX/beton.sock`` passes
    the kernel's 107 bytes, the demo failed on the socket's path. Its socket now goes to a
    short private directory, removed at the end."""
    import glob
    import os
    import subprocess
    import sys

    long_tmp = tmp_path / ("t" * 60) / ("u" * 40)
    long_tmp.mkdir(parents=True)
    before = set(glob.glob("/tmp/bs-demo-*"))
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    env.pop("BETON_SERVE_ADDRESS", None)
    cli = [sys.executable, "-c", "import sys; from beton_serve.cli import main; sys.exit(main())"]
    args = ["--samples", "32", "--size", "16", "--trainers", "1", "--epochs", "1"]
    proc = subprocess.run(
        [*cli, "demo", *args, "--batch-size", "16"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[4/4] daemon stopped cleanly" in proc.stdout
    assert "unix:///tmp/bs-demo-" in proc.stdout
    assert set(glob.glob("/tmp/bs-demo-*")) == before  # its socket directory is gone
    assert os.listdir(long_tmp) == []  # and its work directory
