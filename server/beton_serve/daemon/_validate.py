"""Checking an OpenStream request before the daemon does any work for it.

A bad request fails when the stream opens, with ``SpecError`` (``INVALID_ARGUMENT``) and a
message that names the argument and says what to change: before anything is compiled, decoded
or allocated. The numeric limits are ``beton_wire.limits``, the same numbers the client checks;
every client-supplied text echoed in a message goes through ``short_repr``.

Two checks, in the order :meth:`Daemon.open_stream <beton_serve.daemon.Daemon.open_stream>`
runs them:

* :func:`validate_request`: the request against the dataset it names (sizes, order, split,
  device, fields, indices), once the dataset is known and before the plan is compiled;
* :func:`batch_layout`: the slot layout of one batch of the compiled plan's outputs, refused
  when a slot would be absurdly large, before a ring is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from beton_wire.limits import (
    MAX_BATCH_SIZE,
    MAX_BATCHES_AHEAD,
    MAX_INDICES,
    MAX_WORLD_SIZE,
    indices_outside,
    no_such_field,
    short_repr,
)
from beton_wire.slots import SlotLayout, slot_layout
from numpy.typing import NDArray

from beton_serve.daemon._backend import OutputInfo
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._messages import StreamRequest
from beton_serve.errors import SpecError

__all__ = ["MAX_SLOT_BYTES", "ORDERS", "batch_layout", "validate_request"]

#: Largest slot, in bytes (one batch of every output).
MAX_SLOT_BYTES = 4 << 30
#: The sample orders a stream may ask for (``beton_serve.engine.OrderOption`` names).
ORDERS = ("SEQUENTIAL", "RANDOM", "QUASI_RANDOM")


def validate_request(req: StreamRequest, ds: Dataset) -> None:
    """Refuse a request that cannot be served over ``ds``, before anything is compiled.

    Raises:
        SpecError: the message names the argument and the accepted range.
    """
    _check_sizes(req)
    _check_split(req)
    _check_device(req)
    _check_pipelines(req, ds)
    if req.indices is not None:
        _check_indices(req.indices, ds.num_samples)


def batch_layout(outputs: Sequence[OutputInfo], batch_size: int) -> SlotLayout:
    """The slot layout of one batch of ``outputs``.

    Raises:
        SpecError: a slot would hold more than :data:`MAX_SLOT_BYTES`, or an output's dtype or
            shape is one the wire cannot carry (``NormalizeImage(type=object)``, say).
    """
    try:
        layout = slot_layout([(o.name, o.shape, o.dtype) for o in outputs], batch_size)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if layout.slot_bytes > MAX_SLOT_BYTES:
        raise SpecError(
            f"one batch needs {layout.slot_bytes} bytes, more than the {MAX_SLOT_BYTES} a slot "
            "may hold; use a smaller batch_size or output size"
        )
    return layout


def _check_sizes(req: StreamRequest) -> None:
    if not 1 <= req.batch_size <= MAX_BATCH_SIZE:
        raise SpecError(f"batch_size {req.batch_size} is out of range: use 1..{MAX_BATCH_SIZE}")
    if not 1 <= req.batches_ahead <= MAX_BATCHES_AHEAD:
        raise SpecError(
            f"batches_ahead {req.batches_ahead} is out of range: use 1..{MAX_BATCHES_AHEAD}"
        )
    if not 0 <= req.seed < 2**64:
        raise SpecError(f"seed {req.seed} is out of range: use 0..2**64-1")
    if req.order not in ORDERS:
        raise SpecError(
            f"unknown order {short_repr(req.order)}: use SEQUENTIAL, RANDOM or QUASI_RANDOM"
        )


def _check_split(req: StreamRequest) -> None:
    if not req.distributed:
        return
    # The distributed order pads to world_size * ceil(n / world_size) ids: bounded here.
    if not 1 <= req.world_size <= MAX_WORLD_SIZE:
        raise SpecError(f"world_size {req.world_size} is out of range: use 1..{MAX_WORLD_SIZE}")
    if not 0 <= req.rank < req.world_size:
        raise SpecError(
            f"rank {req.rank} / world_size {req.world_size}: need 0 <= rank < world_size"
        )


def _check_device(req: StreamRequest) -> None:
    offer = req.offer
    if offer.wants_cuda and offer.device_index not in {d.index for d in offer.cuda_devices}:
        seen = [f"cuda:{d.index}" for d in offer.cuda_devices] or "none"
        raise SpecError(
            f"device {short_repr(offer.device)} is not a CUDA device of the client (it "
            f"reports {seen}); pick one of those, or ToDevice('cpu')"
        )


def _check_pipelines(req: StreamRequest, ds: Dataset) -> None:
    names = {n for n, _ in ds.fields}
    seen_names = set()
    sources = {p.name for p in req.pipelines if not p.skip}
    for p in req.pipelines:
        fld = p.field or p.name
        if p.branch_of:  # a branch reads the field of the pipeline it branches from
            if p.branch_of == p.name or p.branch_of not in sources:
                raise SpecError(
                    f"pipeline {short_repr(p.name)} branches from pipeline "
                    f"{short_repr(p.branch_of)}, which this request does not have"
                )
        elif fld not in names and p.field in (None, "", p.name):
            raise SpecError(no_such_field(p.name, [n for n, _ in ds.fields]))
        elif fld not in names:
            raise SpecError(
                f"dataset {ds.name!r} has no field {short_repr(fld)}; its fields are "
                f"{sorted(names)}"
            )
        if p.name in seen_names:
            raise SpecError(f"pipeline {short_repr(p.name)} is given twice")
        seen_names.add(p.name)


def _check_indices(indices: tuple[int, ...] | NDArray[np.uint64], num_samples: int) -> None:
    n = len(indices)
    if n == 0:
        raise SpecError("indices=[] selects no samples; pass indices=None for every sample")
    if n > MAX_INDICES:
        raise SpecError(f"{n} indices are too many: at most {MAX_INDICES} are accepted")
    ids = np.asarray(indices)
    if ids.dtype.kind not in "iu":
        raise SpecError(f"indices must be integers, not {ids.dtype}")
    outside = (ids < 0) | (ids >= num_samples) if ids.dtype.kind == "i" else (ids >= num_samples)
    if outside.any():
        raise SpecError(indices_outside(num_samples, int(ids.min()), int(ids.max())))
