"""``beton-serve inspect FILE [--json]``: validate a .beton and describe it.

Prints the header (version, page size, sample count), each field with its type and the
arguments the file stores, per-image-field statistics (jpg/raw counts, min/max width and height),
the data size and the validation result. Exit status 0 if the file is valid, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from beton_serve.cli._plugins import add_custom_field_option, load_field_classes

__all__ = ["describe_file", "register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("inspect", help="validate a .beton file and describe its contents")
    p.add_argument("file", help="the .beton file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_custom_field_option(p)
    p.set_defaults(func=run)


def describe_file(path: str, custom_fields: dict[str, type] | None = None) -> dict[str, Any]:
    """A JSON-serialisable description of ``path``; ``valid`` is false with ``error`` on failure.
    ``custom_fields`` reads those fields with those classes (FFCV's ``custom_fields``)."""
    import numpy as np

    # The pipeline package registers the per-user compile cache (`beton-serve cache`) for
    # the reader's SIGBUS guard, which went to ~/.cache/numba, or nowhere, without it.
    import beton_serve.pipeline  # noqa: F401
    from beton_serve.errors import FormatError
    from beton_serve.fields import TYPE_NAMES, BytesField, JSONField, RGBImageField
    from beton_serve.format import BetonReader

    try:
        reader = BetonReader(path, custom_fields=custom_fields or None)
    except FormatError as exc:
        return {"file": path, "valid": False, "error": str(exc), "offset": exc.offset}
    with reader:
        h = reader.header
        fields = []
        for name, tid in zip(reader.field_names, reader.type_ids, strict=True):
            handler = reader.handlers[name]
            info: dict[str, Any] = {
                "name": name,
                "type_id": tid,
                "type": (
                    type(handler).__name__  # a custom field: its class
                    if tid == 255
                    else TYPE_NAMES.get(tid, type(handler).__name__)
                ),
                "arguments": handler.describe() if hasattr(handler, "describe") else {},
            }
            # By class, so a subclass read through custom_fields (type id 255) is described as
            # its base is, when its metadata has the base's columns.
            col = reader.field_metadata(name) if reader.num_samples else None
            columns = set(col.dtype.names or ()) if col is not None else set()
            if isinstance(handler, RGBImageField) and {"width", "height", "mode"} <= columns:
                assert col is not None
                w, hh, mode = col["width"], col["height"], col["mode"]
                info["images"] = {
                    "jpg": int(np.count_nonzero(mode == 0)),
                    "raw": int(np.count_nonzero(mode == 1)),
                    "min_width": int(w.min()),
                    "max_width": int(w.max()),
                    "min_height": int(hh.min()),
                    "max_height": int(hh.max()),
                }
            elif isinstance(handler, (BytesField, JSONField)) and "size" in columns:
                assert col is not None
                sizes = col["size"]
                info["bytes"] = {"min_size": int(sizes.min()), "max_size": int(sizes.max())}
            fields.append(info)
        _, _, sizes = reader.allocations
        return {
            "file": path,
            "valid": True,
            "version": h.version,
            "page_size": h.page_size,
            "num_samples": h.num_samples,
            "num_fields": h.num_fields,
            "fields": fields,
            "file_size": reader.file_size,
            "record_size": reader.record_size,
            "data_start": reader.data_start,
            "data_region_bytes": h.alloc_table_ptr - reader.data_start,
            "data_bytes": int(sizes.sum()),
            "num_allocations": reader.num_allocations,
            "num_pages": (h.alloc_table_ptr - reader.data_start) // h.page_size,
            "schema_key": reader.schema_key(),
        }


def _text(d: dict[str, Any]) -> str:
    if not d["valid"]:
        return f"{d['file']}\n  validation: FAILED\n  {d['error']}"
    lines = [
        d["file"],
        f"  version {d['version']}, page size {d['page_size']} B, {d['num_samples']} samples, "
        f"{d['num_fields']} fields",
        "  fields:",
    ]
    for f in d["fields"]:
        args = ", ".join(f"{k}={v}" for k, v in f["arguments"].items())
        lines.append(
            f"    {f['name']}: {f['type']} (type {f['type_id']}){' ' + args if args else ''}"
        )
        if "images" in f:
            im = f["images"]
            lines.append(
                f"      images: {im['jpg']} jpg, {im['raw']} raw; width {im['min_width']}.."
                f"{im['max_width']}, height {im['min_height']}..{im['max_height']}"
            )
        if "bytes" in f:
            lines.append(f"      sizes: {f['bytes']['min_size']}..{f['bytes']['max_size']} B")
    lines.append(
        f"  data: {d['data_bytes']} B in {d['num_allocations']} allocations, "
        f"{d['num_pages']} pages ({d['data_region_bytes']} B); file {d['file_size']} B"
    )
    lines.append("  validation: OK")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    d = describe_file(args.file, load_field_classes(args.custom_field))
    print(json.dumps(d, indent=1) if args.json else _text(d), file=sys.stdout)
    return 0 if d["valid"] else 1
