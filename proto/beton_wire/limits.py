"""Request limits: the largest request a daemon accepts, the same numbers on both sides.

A client checks a request against these limits before it sends it (``SpecError``); the daemon
checks them again when it converts the message (``INVALID_ARGUMENT``, ``beton-error:
SpecError``), before it allocates anything that grows with the input. Nothing here depends on
the daemon's configuration, so a client can never send what a daemon would refuse for size.

=======================  ===========================  ==============================================
limit                    value                        what it bounds
=======================  ===========================  ==============================================
MAX_BATCH_SIZE           65,536                       ``batch_size``
MAX_BATCHES_AHEAD        64                           ``batches_ahead`` (at least 1)
MAX_EPOCH                4,294,967,295 (2**32 - 1)    the epoch an ``iter()`` starts (``next_epoch``,
                                                      a ``load_state_dict`` state, a ``Start``)
MAX_WORLD_SIZE           65,536                       ``world_size`` (at least 1) of a distributed
                                                      stream; the padded order is ``n + world`` ids
MAX_INDICES              4,194,304 (2**22)            ``indices`` of one request (at least 1)
MAX_PIPELINES            1,024                        pipelines of one request
MAX_OPS                  64                           daemon-side ops of one pipeline
MAX_NAME_CHARS           256                          every name and short text: pipeline, field,
                                                      op, transport, device, compression, client
                                                      name, host identity strings
MAX_PATH_CHARS           4,096                        a dataset name or file path
MAX_PARAMS_BYTES         1 MiB                        one op's ``params_json``
MAX_SPEC_BYTES           4 MiB                        all names and parameters of the pipelines
MAX_PARAMS_DEPTH         32                           nesting of arrays and objects in parameters
MAX_INT_DIGITS           20                           digits of an integer in parameters (and
                                                      ``-2**63 <= value < 2**64``)
MAX_WIRE_RECORDS         131,072                      fields and list entries of one request, at
                                                      every level; counted on the bytes before
                                                      they are parsed (packed indices are one)
MAX_WANTS_IN_FLIGHT      128                          batches a client has asked for (WANT) and
                                                      not yet received, on one batch call; a
                                                      client keeps at most its credits out
MAX_REQUEST_BYTES        46 MiB                       one gRPC message to the daemon: what the
                                                      limits above allow, plus 2 MiB; gRPC itself
                                                      refuses a larger one (``RESOURCE_EXHAUSTED``)
=======================  ===========================  ==============================================

One more number is local, never sent, but checked the same way by every backend:
:data:`MAX_WORKERS` (1,024) bounds ``num_workers`` of an in-process Loader and ``workers`` of a
daemon. Each worker is a thread with its own stack; ``num_workers=100000`` is a typo, and it used
to end in ``RuntimeError: can't start new thread``.

Text that a client supplied is echoed in error messages through :func:`short_repr` only, so that
a 1 MB name cannot turn an ``INVALID_ARGUMENT`` into an oversized status (gRPC drops trailers
over 16 KiB); :data:`MAX_ERROR_CHARS` caps a whole message.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_BATCHES_AHEAD",
    "MAX_EPOCH",
    "MAX_BATCH_SIZE",
    "MAX_ECHO_CHARS",
    "MAX_ERROR_CHARS",
    "MAX_INDICES",
    "MAX_INT_DIGITS",
    "MAX_NAME_CHARS",
    "MAX_OPS",
    "MAX_PARAMS_BYTES",
    "MAX_PARAMS_DEPTH",
    "MAX_PATH_CHARS",
    "MAX_PIPELINES",
    "MAX_REQUEST_BYTES",
    "MAX_SPEC_BYTES",
    "MAX_WIRE_RECORDS",
    "MAX_WANTS_IN_FLIGHT",
    "MAX_WORKERS",
    "MAX_WORLD_SIZE",
    "cap_message",
    "human_bytes",
    "indices_outside",
    "no_such_field",
    "parse_params",
    "short_repr",
    "workers_out_of_range",
]

MAX_BATCH_SIZE = 1 << 16
MAX_BATCHES_AHEAD = 64
#: A 1-second epoch would take 136 years to get there; past 2**63 the daemon's arithmetic overflowed.
MAX_EPOCH = (1 << 32) - 1
MAX_WORLD_SIZE = 1 << 16
#: Twice the largest ``batches_ahead``: the client's reader keeps 3 out per daemon.
MAX_WANTS_IN_FLIGHT = 2 * MAX_BATCHES_AHEAD
MAX_WORKERS = 1024
MAX_INDICES = 1 << 22
MAX_PIPELINES = 1024
MAX_OPS = 64
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
MAX_PARAMS_BYTES = 1 << 20
MAX_SPEC_BYTES = 4 << 20
MAX_PARAMS_DEPTH = 32
MAX_INT_DIGITS = 20
#: A valid request has at most MAX_PIPELINES * (MAX_OPS + 4) + 3 * MAX_PIPELINES + 32 records.
MAX_WIRE_RECORDS = 1 << 17
#: Indices take at most 10 bytes each on the wire (a uint64 varint); every other field together
#: (dataset, file identity, host, capabilities: each bounded above) takes well under 2 MiB.
MAX_REQUEST_BYTES = MAX_INDICES * 10 + MAX_SPEC_BYTES + (2 << 20)

#: Characters of one client-supplied value echoed in a message.
MAX_ECHO_CHARS = 120
#: Characters of a whole error message (a status detail).
MAX_ERROR_CHARS = 4000

_INT_MIN = -(1 << 63)
_INT_END = 1 << 64


def short_repr(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters.

    A longer string (or bytes) keeps its start and says how long it was, e.g.
    ``'xxxxxxxx'... (1048576 characters)``; it is cut *before* ``repr`` runs, so echoing a huge
    value costs nothing. Never raises.
    """
    if isinstance(value, str | bytes) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text)} characters)"
    return text


def cap_message(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how many were cut (never raises)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters cut)"


def indices_outside(num_samples: int, lo: int, hi: int) -> str:
    """The message for ``indices`` with values outside ``[0, num_samples)``, from ``lo`` to
    ``hi`` (the in-process Loader and the daemon say the same)."""
    return (
        f"indices must be integer sample ids in [0, {num_samples}); got values from "
        f"{short_repr(lo)} to {short_repr(hi)}"
    )


def no_such_field(key: str, field_names: Sequence[str]) -> str:
    """The message for a ``pipelines`` key that names no field of the file (``field_names``,
    in file order) and is not a ``PipelineSpec`` (the in-process Loader and the daemon say the
    same)."""
    return (
        f"pipelines[{short_repr(key)}]: no field is named {short_repr(key)} (fields: "
        f"{list(field_names)}); to add an output, use PipelineSpec(source=<field name or op>, "
        "transforms=[...])"
    )


def workers_out_of_range(value: object, below_one: str) -> str | None:
    """The message for a worker count over :data:`MAX_WORKERS`, or ``None`` when it is within.

    ``value`` is what the caller passed (an integer, ``operator.index``; anything else is out
    of range), and ``below_one`` says what a count under 1 means to that caller, e.g. ``"one
    per CPU this process may use"``. The caller raises its own error type with the message.
    """
    try:
        if operator.index(value) <= MAX_WORKERS:  # type: ignore[arg-type]
            return None
    except TypeError:
        pass
    return (
        f"num_workers {short_repr(value)} is out of range: use an int up to {MAX_WORKERS} "
        f"(< 1: {below_one})"
    )


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, ``taskset``),
    at least 1; the default worker count everywhere (daemon, in-process Loader, writer).
    ``os.cpu_count()`` counts the host's, which oversubscribes a pinned process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class _TooDeep(Exception):
    pass


def human_bytes(n: float) -> str:
    """``n`` bytes for a message or a table: ``"512 B"``, ``"38.5 MiB"``, ``"6.0 GiB"``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(
            f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS} are accepted)"
        )
    value = int(text)
    if not _INT_MIN <= value < _INT_END:
        raise ValueError(f"the integer {value} is outside [-2**63, 2**64)")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {short_repr(text)} is not finite")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON (numbers must be finite)")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), iteratively (no recursion limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        d += 1
        if d > MAX_PARAMS_DEPTH:
            raise _TooDeep
        deepest = max(deepest, d)
        stack.extend((c, d) for c in children)
    return deepest


def parse_params(text: str) -> dict[str, Any]:
    """Parse one op's ``params_json`` under the limits above.

    The text must be a JSON object of at most :data:`MAX_PARAMS_BYTES` UTF-8 bytes, nested at
    most :data:`MAX_PARAMS_DEPTH` deep, whose integers have at most :data:`MAX_INT_DIGITS` digits
    and lie in ``[-2**63, 2**64)`` and whose numbers are finite. An empty text means ``{}``.

    Raises:
        ValueError: the text breaks one of these rules; the message says which (it never
            echoes more than :data:`MAX_ECHO_CHARS` characters of the text).
    """
    if not text:
        return {}
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_PARAMS_BYTES:
        raise ValueError(
            f"parameters of {size} bytes exceed the {MAX_PARAMS_BYTES}-byte limit (MAX_PARAMS_BYTES)"
        )
    try:
        params = json.loads(
            text,
            parse_int=_bounded_int,
            parse_float=_finite_float,
            parse_constant=_no_constant,
        )
    except RecursionError:
        raise ValueError(
            f"parameters are nested deeper than {MAX_PARAMS_DEPTH} levels (MAX_PARAMS_DEPTH)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"parameters are not valid JSON ({exc.msg} at character {exc.pos})"
        ) from None
    except ValueError as exc:  # from the hooks above
        raise ValueError(f"parameters rejected: {exc}") from None
    if not isinstance(params, dict):
        raise ValueError(f"parameters must be a JSON object, not {type(params).__name__}")
    try:
        _depth(params)
    except _TooDeep:
        raise ValueError(
            f"parameters are nested deeper than {MAX_PARAMS_DEPTH} levels (MAX_PARAMS_DEPTH)"
        ) from None
    return params
