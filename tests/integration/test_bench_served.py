"""``beton-serve bench`` end to end: in process, then served by a daemon it starts itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from beton_serve.cli import main
from beton_serve.cli._demo import write_sample_dataset

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_bench_both_modes_json(tmp_path, capsys) -> None:
    path = write_sample_dataset(tmp_path / "bench.beton", n=96, size=24)
    argv = ["bench", str(path), "--json", "--epochs", "2", "--batch-size", "16", "--workers", "1"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    inproc, served = payload["results"]
    assert (inproc["mode"], served["mode"]) == ("in-process", "served")
    for r in (inproc, served):
        assert r["batches_per_epoch"] == 6 and r["images"] == 2 * 96
        assert r["steady_images_per_s"] > 0
    assert served["transport"] == "shm"  # same host, same user
    assert served["daemon_cpu_s"] > 0
    # The served trainer does not decode: its own CPU per batch is below the in-process one's.
    assert served["loader_cpu_s_per_batch"] < inproc["loader_cpu_s_per_batch"]
    ratio = served["steady_images_per_s"] / inproc["steady_images_per_s"]
    assert payload["served_over_in_process"] == pytest.approx(ratio, rel=1e-3)
    # The daemon it started is gone, and took its shared memory with it.
    assert not list(Path("/dev/shm").glob(f"beton-{served['daemon_pid']}-*"))


@pytest.mark.timeout(240)
def test_bench_table_output(tmp_path, capsys) -> None:
    path = write_sample_dataset(tmp_path / "bench.beton", n=32, size=16)
    argv = ["bench", str(path), "--mode", "served", "--epochs", "1", "--batch-size", "8"]
    assert main([*argv, "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "served (shm)" in out and "images/s" in out
