"""Bad parameters of built-in ops, sent raw as any gRPC client could: each is INVALID_ARGUMENT
with ``beton-error: SpecError`` and a message naming the op, the daemon logs no error and serves
on.

Seen on an earlier main (session 27): a ``Poison`` mask of strings, negative ``Poison`` or
``ReplaceLabel`` ids, and a ``Cutout`` fill of strings came back INTERNAL with a traceback in the
daemon's log (a ValueError or OverflowError outside the constructor's checks); a ``Cutout`` fill
of 2 values opened a stream whose kernel then read ``fill[2]`` past the array; a
``RandomTranslate(padding=10**7)`` opened a stream whose first batch failed inside a worker
with MemoryError (4.8 PB of scratch), reported as an internal error; a ``RandomResizedCrop``
transform with a negative scale or a size of 0 opened a stream; ``NormalizeImage`` to ``object``
came back INTERNAL (a ValueError of the slot layout).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from conformance._backends import module_daemon
from helpers.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(120)

MASK = [[[1.0] * 3] * 8] * 8
ALPHA = [[0.5] * 8] * 8


def _op(name: str, params: dict[str, Any]) -> Any:
    return pb.OpSpec(name=name, params_json=json.dumps(params))


#: case -> (the op, the pipeline it goes in, words the refusal must contain)
CASES: dict[str, tuple[Any, str, str]] = {
    "poison_mask_of_strings": (
        _op("Poison", {"mask": [[["a"] * 3] * 8] * 8, "alpha": ALPHA, "indices": [0]}),
        "image",
        "Poison: mask must hold numbers",
    ),
    "poison_negative_id": (
        _op("Poison", {"mask": MASK, "alpha": ALPHA, "indices": [-1, 3]}),
        "image",
        "bad params for op 'Poison'",
    ),
    "poison_alpha_of_strings": (
        _op("Poison", {"mask": MASK, "alpha": [["x"] * 8] * 8, "indices": [0]}),
        "image",
        "Poison: alpha must hold numbers",
    ),
    "cutout_fill_of_two": (
        _op("Cutout", {"crop_size": 3, "fill": [0, 0]}),
        "image",
        "Cutout: fill must be 3 numbers",
    ),
    "cutout_fill_of_strings": (
        _op("Cutout", {"crop_size": 3, "fill": ["a", "b", "c"]}),
        "image",
        "Cutout: fill must be 3 numbers",
    ),
    "translate_fill_nested": (
        _op("RandomTranslate", {"padding": 2, "fill": [[0, 0, 0]]}),
        "image",
        "RandomTranslate: fill must be 3 numbers",
    ),
    "translate_absurd_padding": (
        _op("RandomTranslate", {"padding": 10**7}),
        "image",
        "would take 4,800,003,840,001,600 bytes",
    ),
    "crop_transform_negative_scale": (
        _op("RandomResizedCrop", {"scale": [-1, 1], "ratio": [0.5, 2], "size": 4}),
        "image",
        "RandomResizedCrop: need 0 < scale[0] <= scale[1]",
    ),
    "crop_transform_size_0": (
        _op("RandomResizedCrop", {"scale": [0.1, 1], "ratio": [0.5, 2], "size": 0}),
        "image",
        "RandomResizedCrop: size must be at least 1",
    ),
    "normalize_to_objects": (
        _op("NormalizeImage", {"mean": [1, 2, 3], "std": [1, 2, 3], "type": "object"}),
        "image",
        "has dtype 'object', which the wire cannot carry",
    ),
    # Session 41: wrong types were coerced with int()/float(): "32" became a 3x2 output, 32.9
    # was truncated and true read as 1.
    "crop_decoder_size_string": (
        _op("RandomResizedCropRGBImageDecoder", {"output_size": "32"}),
        "decoder",
        "output_size must be (height, width), two integers, not '32'",
    ),
    "crop_decoder_size_float": (
        _op("RandomResizedCropRGBImageDecoder", {"output_size": [32.9, 32]}),
        "decoder",
        "two integers, not [32.9, 32]",
    ),
    "center_crop_size_bools": (
        _op("CenterCropRGBImageDecoder", {"output_size": [True, True], "ratio": 0.875}),
        "decoder",
        "two integers, not [True, True]",
    ),
    "cutout_fractional_size": (
        _op("Cutout", {"crop_size": 2.5}),
        "image",
        "Cutout: crop_size must be an integer, got 2.5",
    ),
    "translate_padding_bool": (
        _op("RandomTranslate", {"padding": True}),
        "image",
        "RandomTranslate: padding must be an integer, got True",
    ),
    "flip_prob_string": (
        _op("RandomHorizontalFlip", {"flip_prob": "0.5"}),
        "image",
        "RandomHorizontalFlip: flip_prob must be a number, got '0.5'",
    ),
    "replace_label_negative_id": (
        _op("ReplaceLabel", {"indices": [-5], "new_label": 3}),
        "label",
        "bad params for op 'ReplaceLabel'",
    ),
}


@pytest.fixture(scope="module")
def daemon(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    with module_daemon([fixtures_dir / "images_jpg.beton"]) as d:
        yield d


def _request(op: Any, where: str) -> Any:
    dec = _op("RandomResizedCropRGBImageDecoder", {"output_size": [8, 8]})
    image = [op] if where == "decoder" else [dec, op] if where == "image" else [dec]
    label = [_op("IntDecoder", {}), *([op] if where == "label" else [])]
    return pb.OpenStreamRequest(
        dataset="images_jpg",
        batch_size=4,
        batches_ahead=2,
        pipelines=[
            pb.PipelineSpec(name="image", ops=image),
            pb.PipelineSpec(name="label", ops=label),
        ],
        host=pb.HostIdentity(pid=os.getpid(), uid=os.getuid()),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_op_parameters_are_a_spec_error(daemon: DaemonProcess, case: str) -> None:
    op, where, says = CASES[case]
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.BetonServeStub(ch).OpenStream(_request(op, where), timeout=60)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert dict(err.trailing_metadata() or ()).get("beton-error") == "SpecError"
    assert says in (err.details() or ""), err.details()
    assert daemon.proc.poll() is None
    assert "level=error" not in daemon.log(), daemon.log()[-3000:]


def test_in_process_the_same_requests_are_spec_errors(fixtures_dir: Path) -> None:
    """The in-process Loader: buffers that cannot be allocated, and an op whose
    ``generate_code`` fails on its parameters, are ``SpecError`` naming the op."""
    from beton_serve.errors import SpecError
    from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from beton_serve.loader import Loader
    from beton_serve.pipeline.operation import Operation
    from beton_serve.transforms import RandomTranslate, ToTensor

    class Broken(Operation):
        def declare_state_and_memory(self, previous_state: Any) -> Any:
            return previous_state, None

        def generate_code(self) -> Any:
            raise ValueError("no kernel for these parameters")

    for op, says in (
        (RandomTranslate(10**7), "RandomTranslate#1 (pipeline 'image'): its buffers for a batch"),
        (Broken(), "Broken#1 (pipeline 'image'): generate_code() raised ValueError: no kernel"),
    ):
        with pytest.raises(SpecError, match=r".") as info:
            ld = Loader(
                str(fixtures_dir / "images_jpg.beton"),
                batch_size=4,
                num_workers=1,
                pipelines={
                    "image": [RandomResizedCropRGBImageDecoder((8, 8)), op, ToTensor()],
                    "label": [IntDecoder(), ToTensor()],
                },
            )
            try:
                next(iter(ld))
            finally:
                ld.close()
        assert says in str(info.value), str(info.value)


def _wrongly_typed() -> list[tuple[str, Any, str]]:
    from beton_serve.fields.decoders import (
        CenterCropRGBImageDecoder,
        RandomResizedCropRGBImageDecoder,
    )
    from beton_serve.transforms import (
        Cutout,
        MixupToOneHot,
        RandomBrightness,
        RandomHorizontalFlip,
        RandomResizedCrop,
        RandomTranslate,
        ReplaceLabel,
    )

    return [
        ("rrc_str", lambda: RandomResizedCropRGBImageDecoder("32"), "two integers, not '32'"),
        ("rrc_float", lambda: RandomResizedCropRGBImageDecoder((32.9, 32)), "not (32.9, 32)"),
        ("cc_bools", lambda: CenterCropRGBImageDecoder((True, True), 0.875), "not (True, True)"),
        ("cutout", lambda: Cutout(2.5), "crop_size must be an integer"),
        ("translate", lambda: RandomTranslate(True), "padding must be an integer"),
        ("rrc_op", lambda: RandomResizedCrop((0.08, 1), (0.75, 1.33), "8"), "size must be an"),
        ("label", lambda: ReplaceLabel([0], 1.5), "new_label must be an integer"),
        ("flip", lambda: RandomHorizontalFlip("0.5"), "flip_prob must be a number"),
        ("brightness", lambda: RandomBrightness(magnitude="big"), "magnitude must be a number"),
        ("onehot", lambda: MixupToOneHot(10.0), "num_classes must be an integer"),
    ]


@pytest.mark.parametrize(
    ("make", "says"), [c[1:] for c in _wrongly_typed()], ids=[c[0] for c in _wrongly_typed()]
)
def test_op_parameters_of_the_wrong_type_are_refused_not_coerced(make: Any, says: str) -> None:
    from beton_serve.errors import SpecError

    with pytest.raises(SpecError, match=re.escape(says)):
        make()


def test_numpy_integers_and_ints_for_floats_are_still_accepted() -> None:
    import numpy as np
    from beton_serve.fields.decoders import RandomResizedCropRGBImageDecoder
    from beton_serve.transforms import Cutout, RandomHorizontalFlip

    assert RandomResizedCropRGBImageDecoder((np.int64(8), 8)).spec_params()["output_size"] == [8, 8]
    assert Cutout(np.int32(3)).crop_size == 3
    assert RandomHorizontalFlip(1).flip_prob == 1.0
