"""The ops through the real planner (``compile_pipelines``): call conventions fit end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
)
from beton_serve.format import BetonReader
from beton_serve.pipeline import PipelineSpec, compile_pipelines
from beton_serve.transforms import (
    ImageMixup,
    LabelMixup,
    RandomHorizontalFlip,
    Squeeze,
    ToTensor,
)


def test_mixup_image_and_label_agree_through_the_planner(fixtures_dir: Path) -> None:
    decoder = CenterCropRGBImageDecoder((24, 24), 1.0)
    with BetonReader(fixtures_dir / "images_raw.beton") as r:
        plan = compile_pipelines(
            r,
            {
                "image": [decoder, ImageMixup(0.4, False)],
                "plain": PipelineSpec(decoder),
                "label": [IntDecoder(), LabelMixup(0.4, False)],
            },
            batch_size=8,
        )
        names = [o.name for o in plan.outputs]
        ids = np.arange(8, 16, dtype=np.uint64)
        outs = dict(
            zip(names, plan.run(plan.acquire_workspace(), ids, plan.seed_keys(0, 0)), strict=True)
        )
    lab, plain, mixed = outs["label"], outs["plain"].astype(np.float64), outs["image"]
    labels = np.load(fixtures_dir / "images_raw.expected.npz")["label"][8:16, 0]
    np.testing.assert_array_equal(lab[:, 0], labels)
    for i in range(8):
        j = i - 1 if i else 7
        lam = float(lab[i, 2])
        assert lab[i, 1] == lab[j, 0]
        ref = plain[i] * lam + plain[j] * (1 - lam)
        # lam travels as float32 in the label; the image used the float64 value
        assert np.abs(mixed[i].astype(np.float64) - ref).max() <= 1.0


def test_seeded_pipeline_is_reproducible_and_batch_slicing_independent(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        pipelines = {
            "image": [RandomResizedCropRGBImageDecoder((20, 20)), RandomHorizontalFlip()],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        }
        plan = compile_pipelines(r, pipelines, batch_size=16)
        keys = plan.seed_keys(7, 3)
        ids = np.arange(16, dtype=np.uint64)[::-1].copy()
        whole = np.array(plan.run(plan.acquire_workspace(), ids, keys)[0])
        parts = [
            np.array(plan.run(plan.acquire_workspace(), ids[a:b].copy(), keys)[0])
            for a, b in [(0, 5), (5, 16)]
        ]
        other_epoch = np.array(plan.run(plan.acquire_workspace(), ids, plan.seed_keys(7, 4))[0])
        assert [type(op).__name__ for op in plan.client_tail["label"]] == ["ToTensor", "Squeeze"]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    assert (whole != other_epoch).any()
