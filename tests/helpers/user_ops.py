"""User ops as a training script's own module holds them, for the tests of custom ops served
(routes a-c of docs/custom-ops.md): the source, and writing it as an importable module."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any

#: The user's ops (NormalizeFirstChannel, AddSampleId, Posterize), as a script's module holds them.
OPS_SOURCE = textwrap.dedent(
    '''
    from dataclasses import replace

    import numpy as np
    import torch

    from beton_serve.pipeline.allocation_query import AllocationQuery
    from beton_serve.pipeline.compiler import Compiler
    from beton_serve.pipeline.operation import Operation


    class NormalizeFirstChannel(Operation):
        """The seed document's op: channel 0 of a (B, C, H, W) float batch, in place."""

        def __init__(self, mean, std):
            super().__init__()
            self.mean, self.std = mean, std

        def generate_code(self):
            mean, std = self.mean, self.std

            def normalize(images, dst):
                images[:, 0] = (images[:, 0] - mean) / std
                return images

            return normalize

        def declare_state_and_memory(self, previous_state):
            return previous_state, None


    class AddSampleId(Operation):
        """labels + sample id, into its own buffer (with_indices)."""

        def generate_code(self):
            def add(labels, dst, indices):
                ids = torch.from_numpy(indices.astype(np.int64)).view(-1, 1)
                dst.copy_(labels + ids)
                return dst

            add.with_indices = True
            return add

        def declare_state_and_memory(self, previous_state):
            return previous_state, AllocationQuery(
                previous_state.shape, previous_state.dtype, previous_state.device
            )


    class Posterize(Operation):
        """A Numba op before ToTensor: keep the top `bits` bits of each pixel, plus the sample
        id's parity in the last bit (uses with_indices)."""

        def __init__(self, bits, *, invert=False):
            super().__init__()
            self.bits, self.invert = bits, invert

        def generate_code(self):
            my_range = Compiler.get_iterator()
            mask = np.uint8((0xFF << (8 - self.bits)) & 0xFF)
            invert = self.invert

            def posterize(images, dst, indices):
                for i in my_range(images.shape[0]):
                    odd = np.uint8(indices[i] % 2)
                    for y in range(images.shape[1]):
                        for x in range(images.shape[2]):
                            for c in range(images.shape[3]):
                                v = images[i, y, x, c]
                                if invert:
                                    v = np.uint8(255) - v
                                dst[i, y, x, c] = (v & mask) | odd
                return dst

            posterize.with_indices = True
            return posterize

        def declare_state_and_memory(self, previous_state):
            return replace(previous_state), AllocationQuery(
                previous_state.shape, previous_state.dtype
            )
    '''
)


def write_ops_module(where: Path, name: str) -> Any:
    """Write :data:`OPS_SOURCE` as module ``name`` under ``where`` and import it here (the
    directory is not left on ``sys.path``: a daemon imports it only if given it)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(OPS_SOURCE)
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(where))
