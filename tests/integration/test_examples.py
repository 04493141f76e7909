"""The examples and ``beton-serve demo`` run end to end against a real daemon (CPU only).

* ``examples/ddp_train.py``: 2 DDP ranks (gloo) share one daemon through
  ``beton_client.Loader(distributed=True)``; each rank gets its share of every epoch;
* ``examples/paired_images/``: an input/target folder pair is written to a ``.beton`` with two
  ``RGBImageField(write_mode='smart')`` fields, then a tiny model trains on it through the
  seed's pipeline (issue 4, section 6), served;
* ``examples/lightning_datamodule.py``: imports without Lightning, and its loaders yield
  normalised batches from the daemon;
* ``beton-serve demo``: finishes well within a minute, reports both trainers, exits 0 and leaves
  no shared memory.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.daemon import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SHM = Path("/dev/shm")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("BETON_SERVE_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES), env.get("PYTHONPATH")]))
    return env


class Daemon:
    """A ``beton-serve serve`` subprocess on a private socket; stopped with SIGTERM."""

    def __init__(self, dataset: Path, workdir: Path, listen: str | None = None) -> None:
        self.socket = workdir / "beton.sock"
        self.target = f"unix://{self.socket}"
        self.listen = listen
        self.log = workdir / "daemon.log"
        extra = ["--listen", listen] if listen else []
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from beton_serve.cli import main; raise SystemExit(main())",
                    "serve",
                    str(dataset),
                    "--socket",
                    str(self.socket),
                    "--workers",
                    "2",
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=_env(),
            )
        from beton_serve.cli._health import check

        deadline = time.monotonic() + 60
        while check(self.target, timeout=1.0) != "SERVING":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"daemon did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return int(self.proc.returncode)


@pytest.fixture
def sample_dataset(tmp_path: Path) -> Path:
    from beton_serve.cli._demo import write_sample_dataset

    return write_sample_dataset(tmp_path / "sample.beton", n=256, size=32)


@pytest.fixture
def daemon(sample_dataset: Path, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(sample_dataset, tmp_path, listen=f"127.0.0.1:{free_port()}")
    try:
        yield d
    finally:
        status = d.stop()
    assert status == 0, d.log.read_text()[-3000:]
    assert not list(SHM.glob(f"beton-{d.proc.pid}-*"))


def _run(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def _json_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]


@pytest.mark.timeout(300)
def test_ddp_example_two_ranks_share_one_daemon(daemon: Daemon, sample_dataset: Path) -> None:
    epochs, batch = 2, 16
    proc = _run(
        [
            sys.executable,
            str(EXAMPLES / "ddp_train.py"),
            str(sample_dataset),
            "--nproc",
            "2",
            "--epochs",
            str(epochs),
            "--batch-size",
            str(batch),
            "--res",
            "32",
            "--server",
            daemon.target,
            # Rank 0 also evaluates each epoch through the same daemon's TCP listener (gRPC).
            "--eval-server",
            str(daemon.listen),
        ]
    )
    results = sorted(_json_lines(proc.stdout), key=lambda r: r["rank"])
    assert 0.0 <= results[0]["eval_accuracy"] <= 1.0
    assert "eval_accuracy" not in results[1]
    assert [r["rank"] for r in results] == [0, 1]
    per_rank = 256 // 2  # DistributedSampler: ceil(256 / 2) samples per rank
    for r in results:
        assert r["world_size"] == 2
        assert r["batches_per_epoch"] == per_rank // batch
        assert r["batches"] == epochs * r["batches_per_epoch"]
        assert r["samples"] == r["batches"] * batch
        assert math.isfinite(r["loss"])
        assert 0 <= r["stall_s"] <= r["wall_s"]


@pytest.mark.timeout(300)
def test_paired_images_example_end_to_end(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs"
    _run([sys.executable, str(EXAMPLES / "paired_images" / "make_folders.py"), str(pairs),
          "--count", "64", "--size", "32"])  # fmt: skip
    out = tmp_path / "pairs.beton"
    _run(
        [
            sys.executable,
            str(EXAMPLES / "paired_images" / "write_dataset.py"),
            str(pairs / "input"),
            str(pairs / "target"),
            str(out),
            "--smart-threshold",
            str(24 * 24 * 3),  # 32x32 images are above it: stored as JPEG
        ]
    )
    from beton_serve.format import BetonReader

    with BetonReader(out) as reader:
        assert reader.field_names == ["input", "target"]
        assert reader.num_samples == 64
        assert {int(m) for m in reader.field_metadata("input")["mode"]} == {0}

    d = Daemon(out, tmp_path)
    try:
        proc = _run(
            [
                sys.executable,
                str(EXAMPLES / "paired_images" / "train.py"),
                str(out),
                "--epochs",
                "3",
                "--batch-size",
                "16",
                "--server",
                d.target,
            ]
        )
    finally:
        assert d.stop() == 0
    (result,) = _json_lines(proc.stdout)
    assert result["batches"] == 3 * (64 // 16)
    assert result["samples"] == 3 * 64
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])
    # The model learns something: a residual denoiser beats its first batch.
    assert result["last_loss"] < result["first_loss"]


@pytest.mark.timeout(300)
def test_lightning_datamodule_loaders(daemon: Daemon, sample_dataset: Path) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import lightning_datamodule as ldm
    finally:
        sys.path.remove(str(EXAMPLES))
    import torch

    dm = ldm.BetonDataModule(
        str(sample_dataset), str(sample_dataset), batch_size=32, res=24, server=daemon.target
    )
    train = dm.train_dataloader()
    images, labels = next(iter(train))
    assert images.shape == (32, 3, 24, 24) and images.dtype == torch.float32
    assert labels.shape == (32,)
    assert abs(float(images.mean())) < 3.0  # normalised, not raw 0..255
    val = dm.val_dataloader()
    n = sum(int(lbl.shape[0]) for _, lbl in val)
    assert n == 256
    for loader in (train, val):
        close = getattr(loader, "close", None)
        if close is not None:
            close()


@pytest.mark.timeout(120)
def test_demo_runs_in_well_under_a_minute() -> None:
    t0 = time.monotonic()
    proc = _run(
        [
            sys.executable,
            "-c",
            "from beton_serve.cli import main; raise SystemExit(main())",
            "demo",
        ],
        timeout=110,
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout
    for i in (0, 1):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"trainer {i}:"))
        assert "images/s" in line and "data stall" in line
        images = int(line.split(":", 1)[1].split()[0])
        assert images == 2 * 2048  # two epochs of the 2048-image sample dataset, drop_last=False
    assert "stopped cleanly" in out
    m = re.search(r"daemon pid (\d+) serving", out)
    assert m is not None, out
    assert not list(SHM.glob(f"beton-{m.group(1)}-*"))
    assert elapsed < 60, f"the demo took {elapsed:.0f} s"
