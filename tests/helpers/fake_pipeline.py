"""Test-only reader, fields and ops for the planner, engine and Loader tests.

``FakeReader`` has the surface of ``BetonReader`` the planner uses (CONTRACTS.md). Its
``storage_state`` is a ``(N, H, W, 3)`` uint8 array of images; ``label`` metadata is ``int64``.
Every sample's image is filled with ``sample_id % 251`` plus a per-pixel ramp, so a batch's
content identifies its sample ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from beton_serve.pipeline import AllocationQuery, Compiler, Operation, State


def fake_image(sample_id: int, hw: tuple[int, int] = (4, 5)) -> np.ndarray:
    h, w = hw
    ramp = np.arange(h * w * 3, dtype=np.int64).reshape(h, w, 3)
    return ((ramp + sample_id) % 251).astype(np.uint8)


class FakeLabelDecoder(Operation):
    def spec_params(self):
        return {}

    def declare_state_and_memory(self, previous_state):
        return State(True, "cpu", (1,), np.dtype(np.int64)), AllocationQuery((1,), np.int64)

    def generate_code(self):
        rng = Compiler.get_iterator()

        def decode(batch_indices, dst, metadata, storage_state):
            for i in rng(batch_indices.shape[0]):
                dst[i, 0] = metadata[batch_indices[i]]
            return dst

        return decode


class FakeImageDecoder(Operation):
    def __init__(self, fail_on: int = -1) -> None:
        super().__init__()
        self.fail_on = fail_on

    def declare_state_and_memory(self, previous_state):
        shape = self.field.shape
        return State(True, "cpu", shape, np.dtype(np.uint8)), AllocationQuery(shape, np.uint8)

    def generate_code(self):
        rng = Compiler.get_iterator()
        fail_on = self.fail_on

        def decode(batch_indices, dst, metadata, storage_state):
            for i in rng(batch_indices.shape[0]):
                ix = batch_indices[i]
                if ix == fail_on:
                    raise ValueError("corrupt sample")
                dst[i] = storage_state[ix]
            return dst

        return decode

    def spec_params(self):
        return {"fail_on": self.fail_on}


class OtherDecoder(FakeLabelDecoder):
    """A decoder class that does not fit the image field."""


@dataclasses.dataclass
class FakeField:
    decoder: type
    shape: tuple[int, ...] = ()

    def get_decoder_class(self):
        return self.decoder


class FakeReader:
    def __init__(self, n: int = 40, hw: tuple[int, int] = (4, 5), per_page: int = 8) -> None:
        self.path = f"/fake/{n}"
        # What PlanCache keys by (BetonReader.identity): the same contents, the same identity.
        self.identity = ("fake", n, tuple(hw), per_page)
        self.num_samples = n
        self.field_names = ["image", "label"]
        self.handlers = {
            "image": FakeField(FakeImageDecoder, (*hw, 3)),
            "label": FakeField(FakeLabelDecoder),
        }
        self._meta = {"image": np.zeros(n, np.int64), "label": np.arange(n, dtype=np.int64) * 10}
        self.storage_state = np.stack([fake_image(i, hw) for i in range(n)])
        self.sample_pages = (np.arange(n) // per_page).astype(np.int64)

    def field_metadata(self, name):
        return self._meta[name]

    @staticmethod
    def memory_read(ptr, storage_state):
        return storage_state[ptr]

    def schema_key(self):
        return "fake-schema"

    def close(self):
        pass


class AddOne(Operation):
    """jit transform into its own buffer: ``out = inp + 1`` (uint8 wraps)."""

    def declare_state_and_memory(self, previous_state):
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):
        def add(inp, dst):
            for i in range(inp.shape[0]):
                dst[i] = inp[i] + 1
            return dst

        return add

    def spec_params(self):
        return {}


class AddIndex(Operation):
    """In place, ``with_indices``: label += 1000 * sample id."""

    def declare_state_and_memory(self, previous_state):
        return previous_state, None

    def generate_code(self):
        def add(inp, dst, indices):
            for i in range(inp.shape[0]):
                inp[i] += 1000 * np.int64(indices[i])
            return inp

        add.with_indices = True
        return add

    def spec_params(self):
        return {}


class NumpyToTorch(Operation):
    """A minimal ToTensor for tests that must not depend on beton_serve.transforms."""

    def declare_state_and_memory(self, previous_state):
        import torch

        dt = torch.from_numpy(np.zeros(0, previous_state.dtype)).dtype
        return dataclasses.replace(previous_state, jit_mode=False, dtype=dt), None

    def generate_code(self):
        import torch

        def to_tensor(inp, dst):
            return torch.from_numpy(inp)

        return to_tensor


class TorchDouble(Operation):
    """A torch op (python tail): ``x * 2`` into a preallocated torch buffer."""

    def declare_state_and_memory(self, previous_state):
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)

    def generate_code(self):
        import torch

        def double(inp, dst):
            torch.mul(inp, 2, out=dst)
            return dst

        return double
