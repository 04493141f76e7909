"""Field types (mirrors ``ffcv.fields``): what a column stores and how it is encoded and read.

Built-in fields and their type ids: ``FloatField`` 0, ``IntField`` 1, ``RGBImageField`` 2,
``BytesField`` 3, ``NDArrayField`` 4, ``JSONField`` 5, ``TorchTensorField`` 6 (torch optional).
Subclass :class:`Field` for a custom field (type id 255). Decoders live in
``beton_serve.fields.decoders`` and are imported lazily by ``get_decoder_class()``.
"""

from __future__ import annotations

from beton_serve.fields.base import AllocationCheck, Field
from beton_serve.fields.basics import FloatField, IntField
from beton_serve.fields.bytes import BytesField
from beton_serve.fields.json import JSONField
from beton_serve.fields.ndarray import NDArrayField
from beton_serve.fields.rgb_image import RGBImageField
from beton_serve.fields.torch_tensor import TorchTensorField

__all__ = [
    "AllocationCheck",
    "BytesField",
    "Field",
    "FloatField",
    "IntField",
    "JSONField",
    "NDArrayField",
    "RGBImageField",
    "TorchTensorField",
]
