"""User ops written against FFCV's Operation API run with only their imports changed.

The seed of the project: an op that normalises channel 0 of a ``(B, C, H, W)`` float batch in
``generate_code`` and whose ``declare_state_and_memory`` returns ``previous_state, 0`` (a falsy
non-query: no allocation). Also: an op that allocates memory, and one that uses ``with_indices``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

# --- the user's code: FFCV imports, renamed --------------------------------------------------
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.compiler import Compiler
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.state import State
from helpers.fake_pipeline import NumpyToTorch

MEAN, STD = 100.0, 50.0


class NormalizeChannel0(Operation):
    def __init__(self, mean: float, std: float):
        super().__init__()
        self.mean, self.std = mean, std

    def generate_code(self):
        my_range = Compiler.get_iterator()
        mean, std = self.mean, self.std

        def normalize(images, dst):
            for i in my_range(images.shape[0]):
                images[i, 0] = (images[i, 0] - mean) / std
            return images

        return normalize

    def declare_state_and_memory(self, previous_state: State):
        return previous_state, 0


class ToCHWFloat(Operation):
    """Allocates its output: (H, W, C) uint8 -> (C, H, W) float32."""

    def generate_code(self):
        my_range = Compiler.get_iterator()

        def convert(images, dst):
            for i in my_range(images.shape[0]):
                for c in range(images.shape[3]):
                    dst[i, c] = images[i, :, :, c]
            return dst

        return convert

    def declare_state_and_memory(self, previous_state: State):
        h, w, c = previous_state.shape
        new = dataclasses.replace(previous_state, shape=(c, h, w), dtype=np.dtype(np.float32))
        return new, AllocationQuery((c, h, w), np.dtype(np.float32))


class AddSampleId(Operation):
    """with_indices: writes label + sample id into its own buffer."""

    def generate_code(self):
        def add(labels, dst, indices):
            for i in range(labels.shape[0]):
                dst[i, 0] = labels[i, 0] + np.int64(indices[i])
            return dst

        add.with_indices = True
        return add

    def declare_state_and_memory(self, previous_state: State):
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)


# ------------------------------------------------------------------------------------------------
dec = pytest.importorskip("beton_serve.fields.decoders")
from beton_serve.loader import Loader  # noqa: E402


def _reference(fixtures_dir):
    exp = np.load(fixtures_dir / "image_pairs.expected.npz")
    ref = exp["input"].transpose(0, 3, 1, 2).astype(np.float32)
    ref[:, 0] = (ref[:, 0] - np.float32(MEAN)) / np.float32(STD)
    return ref


def test_seed_op_in_numba_stage(fixtures_dir):
    pipes = {
        "input": [dec.SimpleRGBImageDecoder(), ToCHWFloat(), NormalizeChannel0(MEAN, STD)],
        "target": None,
    }
    with Loader(
        fixtures_dir / "image_pairs.beton", batch_size=4, num_workers=2, pipelines=pipes, seed=0
    ) as ld:
        assert ld.plan.outputs[0].shape == (3, 24, 32) and ld.plan.outputs[0].dtype == np.float32
        got = np.concatenate([np.array(b[0]) for b in ld])
    np.testing.assert_allclose(got, _reference(fixtures_dir), rtol=1e-6, atol=1e-6)


def test_seed_op_on_torch_tensors_after_to_tensor(fixtures_dir):
    torch = pytest.importorskip("torch")
    pipes = {
        "input": [
            dec.SimpleRGBImageDecoder(),
            ToCHWFloat(),
            NumpyToTorch(),
            NormalizeChannel0(MEAN, STD),
        ],
        "target": None,
    }
    with Loader(
        fixtures_dir / "image_pairs.beton", batch_size=4, num_workers=2, pipelines=pipes, seed=0
    ) as ld:
        assert [type(op).__name__ for op in ld.plan.client_tail["input"]] == [
            "NumpyToTorch",
            "NormalizeChannel0",
        ]
        batches = [b[0].clone() for b in ld]
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in batches)
    np.testing.assert_allclose(
        torch.cat(batches).numpy(), _reference(fixtures_dir), rtol=1e-6, atol=1e-6
    )


def test_with_indices_op(fixtures_dir):
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    pipes = {
        "int": [dec.IntDecoder(), AddSampleId()],
        "float": None,
        "array": None,
        "blob": None,
        "meta": None,
    }
    ids = [7, 3, 3, 49]
    with Loader(
        fixtures_dir / "mixed_fields.beton",
        batch_size=2,
        num_workers=2,
        indices=ids,
        pipelines=pipes,
        seed=0,
    ) as ld:
        got = np.concatenate([np.array(b[0]) for b in ld])[:, 0]
    want = exp["int"][ids, 0] + np.array(ids)  # int64 wraps like numba's
    np.testing.assert_array_equal(got, want)
