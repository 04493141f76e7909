"""The Loader on FFCV-written fixtures, with FFCV's own Loader calls (manifest.json), against FFCV's outputs."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.loader import Loader, OrderOption
from beton_serve.pipeline import PlanCache

dec = pytest.importorskip("beton_serve.fields.decoders")


def _collect(loader: Loader) -> list[np.ndarray]:
    batches = [[np.array(x, copy=True) for x in b] for b in loader]
    return [np.concatenate(col) for col in zip(*batches, strict=True)]


def test_mixed_fields_match_ffcv(fixtures_dir):
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    pipes = {
        "int": [dec.IntDecoder()],
        "float": [dec.FloatDecoder()],
        "array": [dec.NDArrayDecoder()],
        "blob": [dec.BytesDecoder()],
        "meta": [dec.BytesDecoder()],
    }
    path = fixtures_dir / "mixed_fields.beton"
    with Loader(path, batch_size=10, num_workers=2, drop_last=False, pipelines=pipes, seed=0) as ld:
        assert len(ld) == 5
        got = dict(zip(["int", "float", "array", "blob", "meta"], _collect(ld), strict=True))
    np.testing.assert_array_equal(got["int"], exp["int"])
    np.testing.assert_array_equal(got["float"], exp["float"])  # nan == nan in assert_array_equal
    np.testing.assert_array_equal(got["array"], exp["array"])
    for name in ("blob", "meta"):
        sizes = exp[f"{name}__size"].astype(int)
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(got[name][i, :n], exp[name][i, :n])


def test_image_pairs_and_output_order(fixtures_dir):
    exp = np.load(fixtures_dir / "image_pairs.expected.npz")
    pipes = {"target": [dec.SimpleRGBImageDecoder()], "input": [dec.SimpleRGBImageDecoder()]}
    with Loader(
        fixtures_dir / "image_pairs.beton",
        batch_size=4,
        num_workers=2,
        drop_last=False,
        pipelines=pipes,
        seed=0,
    ) as ld:
        inp, tgt = _collect(ld)  # file order: input, then target
    np.testing.assert_array_equal(inp, exp["input"])
    np.testing.assert_array_equal(tgt, exp["target"])


@pytest.mark.parametrize("name", ["images_raw", "images_jpg"])
def test_center_crop_and_random_order(fixtures_dir, name):
    exp = np.load(fixtures_dir / f"{name}.expected.npz")
    extra = {"weight": None} if name == "images_jpg" else {}
    pipes = {
        "image": [dec.CenterCropRGBImageDecoder((64, 64), ratio=1.0)],
        "label": [dec.IntDecoder()],
        **extra,
    }
    path = fixtures_dir / f"{name}.beton"
    with Loader(path, batch_size=16, num_workers=2, drop_last=False, pipelines=pipes, seed=0) as ld:
        img, lab = _collect(ld)
    np.testing.assert_array_equal(lab, exp["label"])
    assert img.shape == exp["image"].shape and img.dtype == np.uint8
    if name == "images_raw":  # JPEG parity is the decoders' tests' business (test_decoders*)
        diff = np.abs(img.astype(int) - exp["image"])
        assert diff.max() <= 2 and diff.mean() < 0.1
    with Loader(
        path,
        batch_size=16,
        num_workers=2,
        order=OrderOption.RANDOM,
        seed=0,
        pipelines={"image": None, "label": [dec.IntDecoder()], **extra},
    ) as ld:
        for epoch in range(2):
            (lab,) = _collect(ld)
            np.testing.assert_array_equal(
                lab[:, 0], exp["label"][exp[f"random_order_seed0_epoch{epoch}"], 0]
            )


def test_progressive_resizing_takes_effect_next_epoch(fixtures_dir):
    rrc = dec.RandomResizedCropRGBImageDecoder((32, 32))
    pipes = {"image": [rrc], "label": None, "weight": None}
    with Loader(
        fixtures_dir / "images_jpg.beton", batch_size=16, num_workers=2, pipelines=pipes, seed=0
    ) as ld:
        assert next(iter(ld))[0].shape == (16, 32, 32, 3)
        rrc.output_size = (24, 40)
        shapes = {b[0].shape for b in ld}
        assert shapes == {(16, 24, 40, 3)}
        assert ld.plan.outputs[0].shape == (24, 40, 3)


def test_same_seed_bit_identical_random_crops_for_1_and_2_workers(fixtures_dir):
    tr = pytest.importorskip("beton_serve.transforms")
    runs = []
    cache = PlanCache()
    for workers in (1, 2):
        pipes = {
            "image": [dec.RandomResizedCropRGBImageDecoder((32, 32)), tr.RandomHorizontalFlip()],
            "label": None,
            "weight": None,
        }
        with Loader(
            fixtures_dir / "images_jpg.beton",
            batch_size=16,
            num_workers=workers,
            order=OrderOption.RANDOM,
            pipelines=pipes,
            seed=11,
            plan_cache=cache,
        ) as ld:
            runs.append([_collect(ld)[0] for _ in range(2)])
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert not np.array_equal(runs[0][0], runs[0][1])  # epochs differ


def test_default_pipelines_yield_tensors_in_file_order(fixtures_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("beton_serve.transforms")
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    with Loader(fixtures_dir / "mixed_fields.beton", batch_size=25, num_workers=1, seed=0) as ld:
        batches = [tuple(x.clone() for x in b) for b in ld]
    assert len(batches) == 2 and len(batches[0]) == 5  # int, float, array, blob, meta
    assert all(isinstance(x, torch.Tensor) for x in batches[0])
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), exp["int"])
    np.testing.assert_array_equal(torch.cat([b[2] for b in batches]).numpy(), exp["array"])


def test_real_torch_op_before_to_tensor_is_rejected(fixtures_dir):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("beton_serve.transforms")
    from beton_serve.errors import SpecError

    pipes = {"int": [dec.IntDecoder(), tr.Convert(torch.float32), tr.ToTensor()]}
    with pytest.raises(SpecError, match=r"Convert .*after ToTensor"):
        Loader(fixtures_dir / "mixed_fields.beton", batch_size=5, pipelines=pipes, seed=0)


def test_torch_module_after_to_tensor_is_wrapped_and_runs(fixtures_dir):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("beton_serve.transforms")

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    pipes = {
        "int": [dec.IntDecoder(), tr.ToTensor(), Double()],
        "float": None,
        "array": None,
        "blob": None,
        "meta": None,
    }
    with Loader(
        fixtures_dir / "mixed_fields.beton",
        batch_size=5,
        num_workers=1,
        pipelines=pipes,
        seed=0,
        indices=[4, 5, 6, 7, 8],
    ) as ld:
        # The front end runs the tail (ToTensor, the module); the engine's plan holds
        # placeholders that keep their graph positions.
        assert [type(op).__name__ for op in ld.plan.client_tail["int"]] == ["ClientOp"] * 2
        (x,) = next(iter(ld))
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    np.testing.assert_array_equal(x.numpy(), exp["int"][4:9] * 2)


def test_distributed_rank_and_world_from_env(fixtures_dir, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    pipes = {"int": [dec.IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
    with Loader(
        fixtures_dir / "mixed_fields.beton",
        batch_size=4,
        distributed=True,
        seed=0,
        drop_last=False,
        pipelines=pipes,
    ) as ld:
        assert (ld.rank, ld.world_size) == (2, 3)
        assert len(ld) == 5  # ceil(50 / 3) = 17 samples -> 5 batches
        monkeypatch.setenv("RANK", "0")  # read at construction, not later
        assert ld.rank == 2
        n = sum(len(b[0]) for b in ld)
    assert n == 17


def test_distributed_without_a_process_group_or_env_warns(fixtures_dir, monkeypatch, caplog):
    """FFCV raises here; we run as rank 0 of 1, and say so: every rank of a job that forgot
    init_process_group would otherwise read the whole dataset silently."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pipes = {"int": [dec.IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
    with caplog.at_level("WARNING", logger="beton_client"):
        with Loader(
            fixtures_dir / "mixed_fields.beton", batch_size=4, distributed=True, pipelines=pipes
        ) as ld:
            assert (ld.rank, ld.world_size) == (0, 1)
    assert "rank 0 of 1" in caplog.text
    caplog.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun's environment: no warning
    with caplog.at_level("WARNING", logger="beton_client"):
        with Loader(
            fixtures_dir / "mixed_fields.beton", batch_size=4, distributed=True, pipelines=pipes
        ):
            pass
    assert "rank 0 of 1" not in caplog.text


@pytest.mark.parametrize(
    "pipes,match",
    [
        (
            {"image": [dec.IntDecoder()]},
            r"IntDecoder cannot decode field 'image' \(RGBImageField\); use SimpleRGBImageDecoder",
        ),
        (
            {"lable": [dec.IntDecoder()]},
            r"no field is named 'lable' \(fields: \['image', 'label'\]\)",
        ),
        ({"image": [dec.SimpleRGBImageDecoder()]}, "same size"),  # variable-size images
    ],
)
def test_construction_errors_on_a_real_file(fixtures_dir, pipes, match):
    from beton_serve.errors import SpecError

    with pytest.raises(SpecError, match=match):
        Loader(
            fixtures_dir / "images_raw.beton",
            batch_size=4,
            seed=0,
            pipelines={"label": None, **pipes},
        )


def test_filter_returns_sample_ids(fixtures_dir):
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    pipes = {"int": [dec.IntDecoder()], "float": None, "array": None, "blob": None, "meta": None}
    with Loader(
        fixtures_dir / "mixed_fields.beton",
        batch_size=4,
        drop_last=False,
        seed=0,
        pipelines=pipes,
        indices=list(range(10, 40)),
    ) as ld:
        sub = ld.filter("float", lambda v: np.isfinite(v[0]) and v[0] > 0)
        want = [
            i for i in range(10, 40) if np.isfinite(exp["float"][i, 0]) and exp["float"][i, 0] > 0
        ]
        assert sub.indices.tolist() == want and 0 < len(want) < 30
        (got,) = _collect(sub)
        np.testing.assert_array_equal(got, exp["int"][want])
        sub.close()


@pytest.mark.parametrize("order", [OrderOption.RANDOM, OrderOption.QUASI_RANDOM])
def test_resumability_with_random_augmentations(fixtures_dir, order):
    from helpers.resumability import run_test_save_load_state

    tr = pytest.importorskip("beton_serve.transforms")
    cache = PlanCache()

    def make():
        pipes = {
            "image": [dec.RandomResizedCropRGBImageDecoder((24, 24)), tr.RandomHorizontalFlip()],
            "label": [dec.IntDecoder()],
            "weight": None,
        }
        return Loader(
            fixtures_dir / "images_jpg.beton",
            batch_size=8,
            num_workers=2,
            order=order,
            seed=4,
            pipelines=pipes,
            plan_cache=cache,
        )

    run_test_save_load_state(make, stop_after=3, epochs=2)
