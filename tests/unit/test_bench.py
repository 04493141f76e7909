"""``beton-serve bench``: pipeline presets, argument checks and the in-process run.

The served run needs a daemon and a client process: tests/integration/test_bench_served.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from beton_serve.cli import build_parser, main
from beton_serve.cli._bench import build_pipelines
from beton_serve.cli._demo import write_sample_dataset
from beton_serve.errors import ConfigError


class _VariableSizes:
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(i)
        return rng.integers(0, 256, size=(20 + 2 * i, 24, 3), dtype=np.uint8), i


@pytest.fixture
def constant_file(tmp_path):
    return write_sample_dataset(tmp_path / "const.beton", n=16, size=16)


@pytest.fixture
def variable_file(tmp_path):
    from beton_serve.fields import IntField, RGBImageField
    from beton_serve.writer import DatasetWriter

    path = tmp_path / "var.beton"
    DatasetWriter(
        path, {"image": RGBImageField(write_mode="raw"), "label": IntField()}, num_workers=1
    ).from_indexed_dataset(_VariableSizes())
    return path


def _names(pipelines: dict) -> dict[str, list[str]]:
    return {k: [type(op).__name__ for op in v] for k, v in pipelines.items()}


def test_presets_on_constant_size_images(constant_file) -> None:
    from beton_serve.format import BetonReader

    with BetonReader(constant_file) as r:
        assert _names(build_pipelines(r, "decode", 32)) == {
            "image": ["SimpleRGBImageDecoder"],
            "label": ["IntDecoder"],
        }
        assert _names(build_pipelines(r, "rrc", 32))["image"] == [
            "RandomResizedCropRGBImageDecoder",
            "RandomHorizontalFlip",
        ]
        assert _names(build_pipelines(r, "cifar", 32))["image"] == [
            "SimpleRGBImageDecoder",
            "RandomHorizontalFlip",
            "RandomTranslate",
            "Cutout",
        ]
        with pytest.raises(ConfigError, match="unknown pipeline"):
            build_pipelines(r, "nope", 32)


def test_presets_on_variable_size_images(variable_file) -> None:
    from beton_serve.format import BetonReader

    with BetonReader(variable_file) as r:
        assert _names(build_pipelines(r, "decode", 16))["image"] == ["CenterCropRGBImageDecoder"]
        with pytest.raises(ConfigError, match="one size"):
            build_pipelines(r, "cifar", 16)


def test_cli_arguments(constant_file, capsys) -> None:
    args = build_parser().parse_args(["bench", str(constant_file), "--pipeline", "rrc", "--json"])
    assert args.command == "bench" and args.pipeline == "rrc" and args.json
    assert main(["bench", str(constant_file), "--epochs", "0"]) == 1
    assert "--epochs" in capsys.readouterr().err
    assert main(["bench", str(constant_file) + ".missing"]) == 65  # a FormatError, as serve


@pytest.mark.slow
def test_in_process_run_json(constant_file, capsys) -> None:
    argv = ["bench", str(constant_file), "--mode", "in-process", "--json"]
    argv += ["--epochs", "2", "--batch-size", "6", "--workers", "1"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["samples"] == 16 and payload["pipeline"] == "decode"
    (result,) = payload["results"]
    assert result["mode"] == "in-process"
    assert result["batches_per_epoch"] == 3  # ceil(16 / 6), drop_last=False
    assert result["images"] == 2 * 16
    assert result["steady_images_per_s"] > 0 and result["first_epoch_s"] > 0
    assert "served_over_in_process" not in payload
