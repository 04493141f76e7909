"""Type ids of the built-in fields (FFCV's table, ffcv-format.md §2.1).

The writer picks a type id by *exact* class: a subclass of a built-in field is written as 255
(custom), as FFCV does, and needs ``custom_fields={name: cls}`` to be read. ``CLASS_BY_TYPE_ID``
is the table that ``BetonReader`` reads built-in columns with: the format layer below does not
import this package, so the table is passed to it (``field_types``), or supplied as its default
by the package root (``beton_serve._field_types``). Both tables are read-only.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from beton_serve.fields.basics import FloatField, IntField
from beton_serve.fields.bytes import BytesField
from beton_serve.fields.json import JSONField
from beton_serve.fields.ndarray import NDArrayField
from beton_serve.fields.rgb_image import RGBImageField
from beton_serve.fields.torch_tensor import TorchTensorField
from beton_serve.format import TYPE_CUSTOM

__all__ = ["CLASS_BY_TYPE_ID", "TYPE_NAMES", "type_id_of"]

#: The built-in Field class of each type id (255, custom, is not in it).
CLASS_BY_TYPE_ID: Mapping[int, type] = MappingProxyType(
    {
        0: FloatField,
        1: IntField,
        2: RGBImageField,
        3: BytesField,
        4: NDArrayField,
        5: JSONField,
        6: TorchTensorField,
    }
)
#: A display name per type id: the class name, ``"custom"`` for 255.
TYPE_NAMES: Mapping[int, str] = MappingProxyType(
    {**{k: v.__name__ for k, v in CLASS_BY_TYPE_ID.items()}, TYPE_CUSTOM: "custom"}
)
_ID_BY_CLASS = {cls: tid for tid, cls in CLASS_BY_TYPE_ID.items()}


def type_id_of(field: object) -> int:
    """The type id the writer stores for ``field`` (exact class lookup; 255 otherwise)."""
    return _ID_BY_CLASS.get(type(field), TYPE_CUSTOM)
