"""Field types (mirrors ``ffcv.fields``): what a column stores and how it is encoded and read.

Built-in fields and their type ids: ``FloatField`` 0, ``IntField`` 1, ``RGBImageField`` 2,
``BytesField`` 3, ``NDArrayField`` 4, ``JSONField`` 5, ``TorchTensorField`` 6 (torch optional).
Subclass :class:`Field` for a custom field (type id 255). Decoders live in
``beton_serve.fields.decoders`` and are imported lazily by ``get_decoder_class()``.

``CLASS_BY_TYPE_ID`` is that table (read-only), the one ``BetonReader`` uses by default;
``TYPE_NAMES`` names each type id (``"custom"`` for 255); ``type_id_of(field)`` is the id the
writer stores for a field instance (exact class; 255 otherwise).
"""

from __future__ import annotations

from beton_serve.fields._registry import CLASS_BY_TYPE_ID, TYPE_NAMES, type_id_of
from beton_serve.fields.base import AllocationCheck, Field
from beton_serve.fields.basics import FloatField, IntField
from beton_serve.fields.bytes import BytesField
from beton_serve.fields.json import JSONField
from beton_serve.fields.ndarray import NDArrayField
from beton_serve.fields.rgb_image import RGBImageField
from beton_serve.fields.torch_tensor import TorchTensorField

__all__ = [
    "CLASS_BY_TYPE_ID",
    "TYPE_NAMES",
    "AllocationCheck",
    "BytesField",
    "Field",
    "FloatField",
    "IntField",
    "JSONField",
    "NDArrayField",
    "RGBImageField",
    "TorchTensorField",
    "type_id_of",
]
