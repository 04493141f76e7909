"""A raw ``OpenStreamRequest`` for the tests that speak the protocol directly."""

from __future__ import annotations

import os

from beton_wire.v1 import beton_pb2 as pb

__all__ = ["MIXED_SKIPPED", "int_only_request"]

#: The fields of the ``mixed_fields`` fixture besides ``int``.
MIXED_SKIPPED = ("float", "array", "blob", "meta")


def int_only_request(**kw: object) -> pb.OpenStreamRequest:
    """A request for ``mixed_fields``'s ``int`` field alone (``IntDecoder``), batch 4;
    ``kw`` sets fields (``indices`` and ``params_json`` of the decoder too)."""
    req = pb.OpenStreamRequest(
        dataset="mixed_fields",
        batch_size=4,
        batches_ahead=2,
        pipelines=[
            pb.PipelineSpec(name="int", ops=[pb.OpSpec(name="IntDecoder", params_json="{}")]),
            *(pb.PipelineSpec(name=n, skip=True) for n in MIXED_SKIPPED),
        ],
        host=pb.HostIdentity(pid=os.getpid(), uid=os.getuid()),
    )
    for key, value in kw.items():
        if key == "indices":
            req.indices.extend(value)  # type: ignore[call-overload]
            req.has_indices = True
        elif key == "params_json":
            req.pipelines[0].ops[0].params_json = value
        else:
            setattr(req, key, value)
    return req
