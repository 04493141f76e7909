"""Which decode group a stream joins (issue 16; the cache itself: ``fields.decode_cache``).

A :class:`~beton_serve.engine.BatchSource` whose plan has a decoder built with
``share_decode=True`` joins, for each such decoder's field, the group keyed by:

- the dataset's identity: device, inode, size and mtime of every file of the reader
  (``beton_wire.file_identity``; the daemon's ``Dataset.key`` is built from the same facts), so
  two readers of one file share and two files never do;
- the field's name, and how the decoder's shared decode is made (``share_min_side``);
- the order key: the order's name, seed, a digest of the index subset, the distributed rank and
  world size, and the batch size only for ``QUASI_RANDOM`` (whose windows depend on it). Batch
  sizes may otherwise differ. A custom ``TraversalOrder`` has no comparable key: such a stream
  decodes alone.

The binding is made once per source and left when the source is garbage-collected
(``weakref.finalize``), or earlier with :func:`unbind`. The finalizer only queues the members
(``DecodeBinding.close_later``): the collector may run it inside a section of the cache that
holds its lock, on any thread, and taking the lock there deadlocked the daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from typing import Any

import numpy as np

from beton_serve.engine.orders import OrderOption
from beton_serve.fields.decode_cache import (
    DecodeBinding,
    DecodeCache,
    GroupKey,
    decode_key,
    default_decode_cache,
)

__all__ = ["bind_decode_groups", "dataset_identity", "order_key", "unbind"]


def dataset_identity(reader: Any) -> str | None:
    """Text identifying the file(s) behind ``reader``, or ``None`` when it has no path."""
    from beton_wire.file_identity import FileIdentity

    readers = getattr(reader, "readers", None) or [reader]
    parts = []
    for r in readers:
        path = getattr(r, "path", None)
        if not path:
            return None
        try:
            fid = FileIdentity.of(path)
        except OSError:
            return None
        parts.append([fid.device, fid.inode, fid.size, fid.mtime_ns])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def order_key(source: Any) -> str | None:
    """Canonical text of the order parameters of ``source`` (``None``: a custom order)."""
    order = source.order
    if not isinstance(order, OrderOption):
        return None
    cfg = source.config
    idx = np.ascontiguousarray(np.asarray(cfg.indices, dtype=np.int64))
    return json.dumps(
        {
            "order": order.name,
            "seed": int(cfg.seed),
            "indices": hashlib.sha256(idx.tobytes()).hexdigest(),
            "rank": int(cfg.rank) if cfg.distributed else 0,
            "world": int(cfg.world_size) if cfg.distributed else 1,
            "batch": int(cfg.batch_size) if order is OrderOption.QUASI_RANDOM else 0,
        },
        sort_keys=True,
    )


def _metadata_address(plan: Any, field: str) -> int:
    # The column the plan hands its decoders (Plan keeps one per field); the reader's own view
    # has the same address.
    md = getattr(plan, "_metadata", {}).get(field)
    if md is None:
        md = plan.reader.field_metadata(field)
    return int(md.__array_interface__["data"][0])


def bind_decode_groups(source: Any, cache: DecodeCache | None = None) -> DecodeBinding | None:
    """Join ``source`` to the decode group of each of its ``share_decode`` decoders.

    Args:
        source: a ``BatchSource`` (its ``plan``, ``order`` and ``config`` are read).
        cache: the cache to join (default: :func:`default_decode_cache`).

    Returns:
        The binding to enter around each unit of work (``decode_scope``), or ``None`` when the
        stream has no such decoder or cannot be grouped (no file identity, custom order).
    """
    plan = source.plan
    fields = sorted(
        {
            (nd.field_name, decode_key(int(getattr(nd.op, "share_min_side", 0))))
            for nd in getattr(plan, "nodes", ())
            if nd.parent is None and getattr(nd.op, "share_decode", False)
        }
    )
    if not fields:
        return None
    okey = order_key(source)
    ident = dataset_identity(plan.reader)
    if okey is None or ident is None:
        return None
    cache = default_decode_cache() if cache is None else cache
    n = int(plan.reader.num_samples)
    label = os.path.basename(str(getattr(plan.reader, "path", "") or ""))
    members: dict[int | tuple[int, str], Any] = {
        (_metadata_address(plan, f), dk): cache.join(
            GroupKey(dataset=ident, field=f, order=okey, decode=dk, label=label), n
        )
        for f, dk in fields
    }
    binding = DecodeBinding(members)
    # close_later: the collector may run this inside a locked section of the cache
    weakref.finalize(source, binding.close_later)
    return binding


def unbind(binding: DecodeBinding | None) -> None:
    """Leave the groups now (idempotent; ``None`` is fine)."""
    if binding is not None:
        binding.close()
