"""A new parameter value of a built-in op compiles nothing.

Numba freezes what a compiled closure captures into its machine code and never frees machine
code. The built-in ops captured their parameters, so every distinct value (a sweep over
``RandomBrightness(magnitude)``, ``RandomHorizontalFlip(p)``, a ``Poison`` mask per job)
compiled anew, 0.2-0.5 s, and kept 1.5-2 MB for the life of the process: a long-lived daemon
serving a sweep grew by that per job without bound (the plan registry's bound could not free
it). Their kernels now take the parameters as arguments (``transforms._util.bind``).

Each case builds a Loader with one value and reads a batch (compiling, or loading from the
compile cache), then a Loader with another value of every parameter, and counts the
dispatchers Numba is asked to compile or load for new arguments meanwhile: none. The pixels
of the second Loader are checked against the same op built in a fresh plan cache elsewhere
(the conformance and unit tests); here, that the parameter took effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader, OrderOption
from beton_serve.transforms import (
    Cutout,
    ImageMixup,
    LabelMixup,
    NormalizeImage,
    Poison,
    RandomBrightness,
    RandomContrast,
    RandomHorizontalFlip,
    RandomSaturation,
    RandomTranslate,
    ReplaceLabel,
    ToTensor,
)

pytestmark = pytest.mark.timeout(300)

S = 24  # output side of the crop decoder


def _poison(v: float) -> Poison:
    rng = np.random.default_rng(int(v * 100))
    return Poison(
        rng.uniform(0, 255, (S, S, 3)), rng.uniform(0, 1, (S, S)), [0, 2, 5], (0, v * 255)
    )


#: op name -> (image ops for a value, label ops for a value)
CASES: dict[str, Callable[[float], tuple[list[Any], list[Any]]]] = {
    "RandomBrightness": lambda v: ([RandomBrightness(v, p=v)], []),
    "RandomContrast": lambda v: ([RandomContrast(v, p=v)], []),
    "RandomSaturation": lambda v: ([RandomSaturation(v, p=v)], []),
    "RandomHorizontalFlip": lambda v: ([RandomHorizontalFlip(v)], []),
    "Cutout": lambda v: ([Cutout(int(v * 20), (int(v * 255), 0, 9))], []),
    "RandomTranslate": lambda v: ([RandomTranslate(int(v * 10), (0, int(v * 255), 0))], []),
    "NormalizeImage": lambda v: (
        [NormalizeImage(np.array([v * 255, 100, 50]), np.array([60, v * 90, 70]), np.float32)],
        [],
    ),
    "ImageMixup": lambda v: ([ImageMixup(v, v > 0.5)], []),
    "LabelMixup": lambda v: ([], [LabelMixup(v, v > 0.5)]),
    "Poison": lambda v: ([_poison(v)], []),
    "ReplaceLabel": lambda v: ([], [ReplaceLabel(np.arange(0, 40, int(v * 10)), int(v * 100))]),
}


def _batch(path: Path, case: str, v: float) -> tuple[np.ndarray, np.ndarray]:
    img, lab = CASES[case](v)
    ld = Loader(
        str(path),
        batch_size=8,
        num_workers=1,
        order=OrderOption.RANDOM,
        seed=3,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((S, S)), *img, ToTensor()],
            "label": [IntDecoder(), *lab, ToTensor()],
        },
    )
    try:
        x, y = next(iter(ld))[:2]
        return np.asarray(x).copy(), np.asarray(y).copy()
    finally:
        ld.close()


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the dispatchers Numba compiles (or loads) code for, from now on."""
    from numba.core.dispatcher import Dispatcher

    seen: list[str] = []
    real = Dispatcher._compile_for_args

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        seen.append(self.py_func.__qualname__)
        return real(self, *args, **kw)

    monkeypatch.setattr(Dispatcher, "_compile_for_args", spy)
    yield seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_new_parameter_value_compiles_nothing(
    fixtures_dir: Path, case: str, compiles: list[str]
) -> None:
    path = fixtures_dir / "images_jpg.beton"
    first = _batch(path, case, 0.3)
    compiles.clear()
    second = _batch(path, case, 0.7)
    assert compiles == [], f"{case}: a new parameter value compiled {compiles}"
    again = _batch(path, case, 0.3)
    assert compiles == []
    # the parameters are arguments now: each value still gives its own output, every time
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(
        a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, second, strict=True)
    ), f"{case}: 0.3 and 0.7 gave the same batch"
