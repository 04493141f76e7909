"""``PipelineSpec``: one output's pipeline when a plain list of ops is not enough (FFCV's path).

``pipelines={name: [ops]}`` covers an output that decodes the field of the same name. An output
under another name, or one that branches from an op of another pipeline, needs a spec::

    pipelines = {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), flip := RandomHorizontalFlip()],
        "image2": PipelineSpec("image", transforms=[SimpleRGBImageDecoder()]),  # decodes again
        "view": PipelineSpec(flip, transforms=[ToTensor()]),  # continues from flip's output
    }
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beton_serve.errors import SpecError
from beton_serve.pipeline.operation import Operation

__all__ = ["PipelineSpec"]


class PipelineSpec:
    """The pipeline of one output.

    Args:
        source: a field name (the output decodes that field) or an :class:`Operation` instance of
            another pipeline (the output continues from that op's output, without decoding twice).
        decoder: the decoder, or ``None`` for the field's default decoder. Only meaningful when
            ``source`` is a field name.
        transforms: the ops after the decoder. ``torch.nn.Module`` instances are wrapped in
            ``ModuleWrapper`` when the pipeline is planned.
    """

    def __init__(
        self,
        source: str | Operation,
        decoder: Operation | None = None,
        transforms: Sequence[Any] | None = None,
    ) -> None:
        if not isinstance(source, str | Operation):
            raise SpecError(
                f"PipelineSpec source must be a field name or an Operation, not {type(source).__name__}"
            )
        if decoder is not None and not isinstance(decoder, Operation):
            raise SpecError(
                f"PipelineSpec decoder must be an Operation, not {type(decoder).__name__}"
            )
        if isinstance(source, Operation) and decoder is not None:
            raise SpecError("a PipelineSpec that branches from an op cannot have a decoder")
        self.source = source
        self.decoder = decoder
        self.transforms: list[Any] = list(transforms or [])

    def __repr__(self) -> str:
        return f"PipelineSpec({self.source!r}, decoder={self.decoder!r}, transforms={self.transforms!r})"
