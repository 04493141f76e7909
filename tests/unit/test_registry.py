"""Op registry: every built-in round-trips through its wire description."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.pipeline import Operation, State
from beton_serve.pipeline.registry import OpRegistry, op_from_spec, register_op, registered_ops


def builtins() -> list[Any]:
    torch = pytest.importorskip("torch")
    from beton_serve import transforms as t
    from beton_serve.fields import decoders as d

    return [
        d.IntDecoder(),
        d.FloatDecoder(),
        d.BytesDecoder(),
        d.NDArrayDecoder(),
        d.SimpleRGBImageDecoder(),
        d.RandomResizedCropRGBImageDecoder((224, 224), scale=(0.35, 1), resize="cv2"),
        d.CenterCropRGBImageDecoder((224, 224), 224 / 256, dct_scale=False),
        t.RandomHorizontalFlip(0.3),
        t.RandomTranslate(2, fill=np.array([1, 2, 3])),
        t.Cutout(4, (5, 6, 7)),
        t.RandomBrightness(0.2),
        t.RandomContrast(0.3, p=0.1),
        t.RandomSaturation(0.4),
        t.RandomResizedCrop((0.1, 1), (0.5, 2), 32),
        t.ImageMixup(0.2, True),
        t.LabelMixup(0.2, False),
        t.MixupToOneHot(10),
        t.Poison(np.zeros((2, 2, 3)), np.ones((2, 2)) * 0.5, [1, 2]),
        t.ReplaceLabel([4, 5], 7),
        t.NormalizeImage(np.array([1.0, 2, 3]), np.array([4.0, 5, 6]), np.float16),
        t.ToTensor(),
        t.ToDevice(torch.device("cpu"), non_blocking=False),
        t.ToTorchImage(channels_last=False),
        t.Convert(torch.float16),
        t.View(np.int16),
        t.Squeeze(1, 2),
    ]


def test_every_builtin_round_trips_through_json() -> None:
    ops = builtins()
    names = {type(op).spec_name for op in ops}
    assert names | {"ModuleWrapper"} == set(registered_ops())
    for op in ops:
        wire = json.loads(json.dumps({"op": op.spec_name, "params": op.spec_params()}))
        rebuilt = op_from_spec(wire["op"], wire["params"])
        assert type(rebuilt) is type(op)
        assert rebuilt.spec_params() == wire["params"]
    assert "NormalizeImage" in repr(ops[19])


def test_unknown_and_bad_params_raise_spec_error() -> None:
    with pytest.raises(SpecError, match="unknown op 'Nope'"):
        op_from_spec("Nope", {})
    with pytest.raises(SpecError, match="RandomHorizontalFlip"):
        op_from_spec("RandomHorizontalFlip", {"flip_prob": "often"})
    with pytest.raises(SpecError, match="expected Cutout"):
        op_from_spec("Cutout", {"size": 3})
    with pytest.raises(SpecError, match="JSON object"):
        op_from_spec("Cutout", [3])  # type: ignore[arg-type]
    with pytest.raises(SpecError):
        op_from_spec("Squeeze", {"dims": 3})


def test_register_custom_op() -> None:
    reg = OpRegistry()

    class Double(Operation):
        spec_name = "Double"

        def __init__(self, factor: float = 2.0) -> None:
            super().__init__()
            self.factor = factor

        def generate_code(self):
            return lambda x, dst: x * self.factor

        def declare_state_and_memory(self, previous_state: State):
            return previous_state, None

        def spec_params(self) -> dict[str, Any]:
            return {"factor": self.factor}

    reg.register(Double)
    assert reg.names() == ["Double"]
    assert reg.build("Double", {"factor": 3.0}).factor == 3.0

    class Other(Double):
        spec_name = "Double"

    with pytest.raises(SpecError, match="already registered"):
        reg.register(Other)
    with pytest.raises(SpecError):
        reg.register(int)  # type: ignore[arg-type]
    with pytest.raises(SpecError):
        register_op(type("NoName", (Double,), {"spec_name": None}))


def test_imports_are_lazy() -> None:
    code = (
        "import sys, beton_serve.pipeline.registry, beton_serve.transforms, "
        "beton_serve.fields.decoders, beton_serve.pipeline.registry as r; r.registered_ops(); "
        "print(sorted(m for m in ('numba', 'cv2', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
