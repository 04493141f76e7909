"""Splitting an FFCV-style pipeline, and the client-side (torch) implementations of its tail.

The split (DESIGN.md §7, docs/custom-ops.md). Walking one pipeline from its decoder:

* the **prefix** runs in the daemon: built-in ops travel as ``(spec_name, JSON params)``; a
  user's op (any other ``Operation``, i.e. anything with ``generate_code``) travels as
  ``@import``: its ``spec_name``/``spec_params()`` if it has them (a plugin), its import path and
  recorded constructor arguments if it has them (``Operation.import_spec()``), and why not
  otherwise. The daemon runs it as a plugin, or imports its module from its own disk when it
  trusts the peer, or hands it back: then the client runs that op and the rest of the pipeline
  itself (``_tail``, compiled locally by ``_local_jit``). A built-in op whose parameters are
  too large to send (:data:`MAX_IMPORT_BYTES`) travels as an ``@import`` marked ``local``, which
  the daemon hands back at once;
* the **tail** starts at the first op that works on torch tensors (``ToTensor``, ``ToDevice``,
  ``ToTorchImage``, ``Convert``, ``Squeeze``, ``View``, ``ModuleWrapper``) or that is no
  ``Operation`` (a ``torch.nn.Module``, a lambda); it runs here, on the received batch, in order,
  with FFCV's semantics (``_tail``). Each tail op travels as an ``@client`` placeholder, so the
  daemon's graph has the in-process graph's nodes and positions (random ops' seeds derive from
  them: ``beton_serve.pipeline.rng``);
* a **branch** (FFCV's ``PipelineSpec(source=<op>)``) travels as its own ops plus the name of the
  pipeline whose op it continues from and that op's index there (``branch_of``, ``branch_op``),
  when that op is in the pipeline's prefix; its ``field`` on the wire is :data:`BRANCH_FIELD`.

Ops are recognised by duck typing (``spec_name``, else the class name), so this module never
imports ``beton_serve``; torch is imported only when a tail is built.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from beton_client._torch import import_torch
from beton_client.errors import BetonClientError, SpecError

__all__ = [
    "BRANCH_FIELD",
    "CLIENT_OP",
    "IMPORT_OP",
    "LOCAL_MARKER",
    "PipelinePlan",
    "SpecOp",
    "TailOp",
    "build_tail",
    "device_of",
    "split_pipelines",
]

#: Wire names shared with the daemon (``beton_serve.pipeline.registry``, ``daemon._on_demand``).
IMPORT_OP = "@import"
CLIENT_OP = "@client"
LOCAL_MARKER = "@local"
#: The ``field`` a branch's ``PipelineSpec`` carries on the wire: no file has a field of that
#: name, so a daemon that predates branches (and ignores ``branch_of``) refuses the pipeline
#: instead of decoding a field with the branch's ops.
BRANCH_FIELD = "@branch"
#: Constructor arguments of a user's op, or parameters of a built-in op, larger than this (as
#: JSON) are not sent: the op runs here instead (well under ``beton_wire.limits.MAX_PARAMS_BYTES``).
MAX_IMPORT_BYTES = 256 << 10

#: Ops that run on torch tensors, hence in the client (by spec name / class name).
TORCH_OPS = frozenset(
    {"ToTensor", "ToDevice", "ToTorchImage", "Convert", "Squeeze", "View", "ModuleWrapper"}
)
#: Ops the client implements on torch tensors (TORCH_OPS plus the ones usable on both sides).
CLIENT_IMPLEMENTED = TORCH_OPS | {"NormalizeImage"}


def _op_name(op: Any) -> str:
    name = getattr(op, "spec_name", None)
    return str(name) if name else type(op).__name__


def _params(op: Any) -> dict[str, Any]:
    fn = getattr(op, "spec_params", None)
    if not callable(fn):
        return {}
    try:
        params = fn()
    except NotImplementedError:
        return {}
    return dict(params) if isinstance(params, Mapping) else {}


def _wire_params(op: Any, pipeline: str) -> str:
    try:
        params = op.spec_params()
    except NotImplementedError as exc:
        raise SpecError(f"pipeline {pipeline!r}: {exc}") from None
    try:
        return json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise SpecError(
            f"pipeline {pipeline!r}: {_op_name(op)}.spec_params() is not JSON-safe ({exc})"
        ) from None


def _travels(op: Any) -> bool:
    return bool(getattr(op, "spec_name", None)) and callable(getattr(op, "spec_params", None))


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """One pipeline after the split.

    Attributes:
        name: the output name.
        field: the field it reads (a branch: its own name; it reads its source op's output).
        ops: what is sent: ``(spec name, JSON params)`` per op of ``user_ops`` (the tail's as
            ``@client`` placeholders).
        tail: the client-side ops, in order (the user's objects): ``user_ops[boundary:]``.
        skip: ``True`` for ``pipelines={name: None}``.
        user_ops: every op of the pipeline as the user listed it (decoder included when given).
        boundary: the index in ``user_ops`` where the tail starts.
        decoder_given: whether ``user_ops[0]`` is the decoder (else the daemon prepends the
            field's default decoder, as ``build_graph`` does in process): positions depend on it.
        branch: FFCV's ``PipelineSpec(source=<op>)``, branching from another pipeline's op
            (``None`` otherwise).
        spec: the ``PipelineSpec``-like object given, if any (the in-process backend uses it).
        branch_of: for a branch, the output whose pipeline holds the ``branch`` op (else ``""``).
        branch_op: for a branch, that op's index in the other pipeline's ``user_ops``.
    """

    name: str
    field: str
    ops: tuple[tuple[str, str], ...]
    tail: tuple[Any, ...]
    skip: bool = False
    user_ops: tuple[Any, ...] = ()
    boundary: int = 0
    decoder_given: bool = False
    branch: Any = None
    spec: Any = None
    branch_of: str = ""
    branch_op: int = 0


def _is_operation(op: Any) -> bool:
    return callable(getattr(op, "generate_code", None)) and callable(
        getattr(op, "declare_state_and_memory", None)
    )


def is_builtin(op: Any) -> bool:
    """An op of beton-serve itself (the daemon's registry has it by its ``spec_name``)."""
    return type(op).__module__.startswith("beton_serve.") and _travels(op)


def is_decoder(op: Any) -> bool:
    """The rule of ``beton_serve.pipeline._graph`` (over the class's MRO: subclasses of a
    decoder are decoders)."""
    return any(
        c.__module__.startswith("beton_serve.fields") or c.__name__.endswith("Decoder")
        for c in type(op).__mro__
        if c.__name__ not in ("Operation", "ABC", "object")
    )


def _user_op_params(op: Any, first: bool) -> str:
    """The ``@import`` params of a user's op (see the module docstring)."""
    why: list[str] = []
    spec = None
    # Only a spec_name the op's own class (or the op) declares: a subclass of a built-in
    # inherits its name, and the daemon would build the built-in without the subclass's code.
    own = "spec_name" in type(op).__dict__ or "spec_name" in getattr(op, "__dict__", {})
    if own and _travels(op):
        try:
            spec = {"name": str(op.spec_name), "params": dict(op.spec_params())}
            json.dumps(spec, allow_nan=False)
        except (NotImplementedError, TypeError, ValueError, RecursionError) as exc:
            why.append(f"plugin: {type(op).__name__}.spec_params() is unusable ({exc})")
            spec = None
    imp = None
    fn = getattr(op, "import_spec", None)
    if callable(fn):
        try:
            imp = fn()
        except NotImplementedError as exc:
            why.append(f"import: {exc}")
        if imp is not None and len(json.dumps(imp)) > MAX_IMPORT_BYTES:
            why.append(
                f"import: {type(op).__name__}'s constructor arguments take more than "
                f"{MAX_IMPORT_BYTES} bytes as JSON"
            )
            imp = None
    else:
        why.append(
            f"import: {type(op).__name__} is not a beton_serve Operation, so its constructor "
            "arguments were not recorded"
        )
    return json.dumps(
        {"spec": spec, "import": imp, "why": why, "decoder": bool(first and is_decoder(op))},
        sort_keys=True,
        allow_nan=False,
    )


def _prefix_wire(op: Any, pipeline: str, first: bool) -> tuple[str, str]:
    """How one prefix op travels: ``(spec_name, params)``, or ``@import``.

    A built-in op whose parameters take more than :data:`MAX_IMPORT_BYTES` as JSON (a
    ``Poison`` mask of a 224x224 image is ~4 MB) is not sent: it travels as an ``@import`` with
    ``local`` set, which the daemon hands back, so this process runs it and the rest of the
    pipeline (route c), as it would a user's op with arguments that large.
    """
    if not (is_builtin(op) or isinstance(op, SpecOp) or not _is_operation(op)):
        return IMPORT_OP, _user_op_params(op, first)
    params = _wire_params(op, pipeline)
    if len(params) <= MAX_IMPORT_BYTES or not is_builtin(op) or (first and is_decoder(op)):
        return _op_name(op), params  # (a decoder must run in the daemon: the limit refuses it)
    why = (
        f"{_op_name(op)}'s parameters take {len(params)} bytes as JSON; ops whose parameters "
        f"take more than {MAX_IMPORT_BYTES} are not sent to the daemon"
    )
    body = {"spec": None, "import": None, "local": True, "why": [why], "decoder": False}
    return IMPORT_OP, json.dumps(body, sort_keys=True)


def split_pipelines(pipelines: Mapping[str, Any] | None) -> list[PipelinePlan]:
    """Split every pipeline into its daemon prefix and client tail (see the module docstring).

    Accepts FFCV's forms: ``{name: [ops]}``, ``{name: None}`` and ``PipelineSpec``-like objects
    (``source``, ``decoder``, ``transforms``).

    Raises:
        SpecError: an op is neither an ``Operation`` nor callable, a built-in op's parameters
            are not JSON-safe, or a branch cannot start where it does (:func:`_place_branches`).
    """
    out: list[PipelinePlan] = []
    for name, value in (pipelines or {}).items():
        if value is None:
            out.append(PipelinePlan(name, name, (), (), skip=True))
            continue
        field = name
        branch = spec = None
        if hasattr(value, "decoder") and hasattr(value, "transforms"):
            spec = value
            source = getattr(value, "source", name)
            if isinstance(source, str):
                field = source
            else:
                branch = source
            ops = (
                [value.decoder, *value.transforms]
                if value.decoder is not None
                else list(value.transforms)
            )
        else:
            ops = list(value)
        boundary = len(ops)
        for i, op in enumerate(ops):
            if _op_name(op) in TORCH_OPS or not (_is_operation(op) or _travels(op)):
                boundary = i
                break
        prefix, tail = ops[:boundary], ops[boundary:]
        for op in tail:
            if (
                not callable(op)
                and not _is_operation(op)
                and _op_name(op) not in CLIENT_IMPLEMENTED
            ):
                raise SpecError(f"pipeline {name!r}: {op!r} is neither an op nor callable")
        wire = tuple(_prefix_wire(op, name, i == 0) for i, op in enumerate(prefix))
        wire += tuple((CLIENT_OP, "{}") for _ in tail)
        out.append(
            PipelinePlan(
                name,
                field,
                wire,
                tuple(tail),
                user_ops=tuple(ops),
                boundary=boundary,
                decoder_given=bool(ops) and is_decoder(ops[0]),
                branch=branch,
                spec=spec,
            )
        )
    return _place_branches(out)


def _place_branches(plans: list[PipelinePlan]) -> list[PipelinePlan]:
    """Name, for each branch, the pipeline and the index of the op it continues from.

    A branch starts from an op of another pipeline's Numba stage, before its boundary: both
    backends (the daemon and the in-process engine) build only that stage as a graph.

    Raises:
        SpecError: a branch from an op no other pipeline lists, or from one after its
            pipeline's Numba stage.
    """
    out = list(plans)
    for k, p in enumerate(plans):
        if p.branch is None:
            continue
        found = next(
            (
                (q, i)
                for q in plans
                if q is not p
                for i, op in enumerate(q.user_ops)
                if op is p.branch
            ),
            None,
        )
        what = f"pipeline {p.name!r}: PipelineSpec(source=<op>) branches from {_op_name(p.branch)}"
        if found is None:
            raise SpecError(f"{what}, which no other pipeline lists")
        q, at = found
        if at >= q.boundary:
            raise SpecError(
                f"{what}, which pipeline {q.name!r} runs after its Numba stage (at or after its "
                "ToTensor, torch module or other callable); a branch starts from an op before "
                "that (the decoder or a Numba op)"
            )
        out[k] = dataclasses.replace(p, branch_of=q.name, branch_op=at)
    return out


def explain_refusal(exc: BetonClientError, target: str) -> BetonClientError:
    """``exc`` (a daemon's refusal of ``OpenStream``), reworded when the daemon predates served
    branches: such a daemon ignores ``branch_of`` and looks the placeholder field
    :data:`BRANCH_FIELD` up in its file, so it answers "has no field '@branch'"."""
    if exc.code != "INVALID_ARGUMENT" or f"has no field {BRANCH_FIELD!r}" not in str(exc):
        return exc
    where = f" at {target}" if target else ""
    return type(exc)(
        f"the daemon{where} predates served branches (PipelineSpec(source=<op>)): upgrade "
        f"beton-serve where it runs, or read these pipelines in process ({exc})",
        code=exc.code,
        server_error=exc.server_error,
    )


def device_of(plans: Sequence[PipelinePlan]) -> str:
    """The device the client wants tensors on: the first ``ToDevice``'s, else ``"cpu"``."""
    for p in plans:
        for op in p.tail:
            if _op_name(op) == "ToDevice":
                dev = _params(op).get("device", getattr(op, "device", "cpu"))
                text = str(dev)
                if text.startswith("cuda"):
                    return text if ":" in text else "cuda:0"
                return "cpu"
    return "cpu"


class SpecOp:
    """An op described by the daemon (``spec_name`` + params), e.g. a default pipeline's ToTensor."""

    def __init__(self, name: str, params: Mapping[str, Any]) -> None:
        self.spec_name = name
        self._params = dict(params)

    @classmethod
    def from_wire(cls, msg: Any) -> SpecOp:
        """From a ``beton_wire.v1.OpSpec``."""
        try:
            params = json.loads(msg.params_json or "{}")
        except json.JSONDecodeError:
            params = {}
        return cls(msg.name, params if isinstance(params, dict) else {})

    def spec_params(self) -> dict[str, Any]:
        return dict(self._params)

    def __repr__(self) -> str:
        return f"{self.spec_name}({self._params})"


# -- client-side implementations ---------------------------------------------------------------

TailOp = Callable[[Any], Any]


def _torch_dtype(torch: Any, value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return value
    text = str(value)
    if text.startswith("torch."):
        text = text[len("torch.") :]
    dt = getattr(torch, text, None)
    if isinstance(dt, torch.dtype):
        return dt
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(value))).dtype
    except TypeError:
        raise SpecError(f"unknown dtype {value!r}") from None


def _get(op: Any, params: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in params:
            return params[n]
    for n in names:
        if hasattr(op, n):
            return getattr(op, n)
    return default


def _to_tensor(torch: Any) -> TailOp:
    def run(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            # FFCV's ToTensor after ToTorchImage is a no-op on a tensor: keep it as is.
            return x
        return torch.from_numpy(np.asarray(x))

    return run


def _to_device(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    device = torch.device(str(_get(op, p, "device", default="cpu")))
    non_blocking = bool(_get(op, p, "non_blocking", default=True))

    def run(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            x = torch.from_numpy(np.asarray(x))
        if device.type == "cpu":
            return x if x.device.type == "cpu" else x.to(device)
        if x.device.type == "cpu":
            # No CUDA IPC: copy the shm view into pinned memory once, then to the GPU
            # asynchronously; the shm slot is free as soon as pin_memory() returns.
            return x.pin_memory().to(device, non_blocking=non_blocking)
        return x.to(device, non_blocking=non_blocking)

    return run


def _to_torch_image(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    channels_last = bool(_get(op, p, "channels_last", default=True))
    back_int16 = bool(_get(op, p, "convert_back_int16", "convert_int16", default=True))

    def run(x: Any) -> Any:
        if back_int16 and x.dtype == torch.int16:
            x = x.view(torch.float16)
        x = x.permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels-last, no copy
        if not channels_last:
            x = x.contiguous()
        return x

    return run


def _convert(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    dtype = _torch_dtype(torch, _get(op, p, "target_dtype", "dtype"))

    def run(x: Any) -> Any:
        return x.type(dtype)

    return run


def _squeeze(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    dims = tuple(_get(op, p, "dims", default=()) or ())

    def run(x: Any) -> Any:
        if not dims:
            return x.squeeze()
        for d in sorted(dims, reverse=True):
            x = x.squeeze(d)
        return x

    return run


def _view(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    dtype = _torch_dtype(torch, _get(op, p, "target_dtype", "dtype"))

    def run(x: Any) -> Any:
        return x.view(dtype)

    return run


def _normalize(torch: Any, op: Any, p: Mapping[str, Any]) -> TailOp:
    mean = np.asarray(_get(op, p, "mean"), dtype=np.float64).reshape(-1)
    std = np.asarray(_get(op, p, "std"), dtype=np.float64).reshape(-1)
    out_np = np.dtype(_get(op, p, "type", "dtype", "original_dtype", default="float32"))
    # The same 256-entry lookup table FFCV builds (computed in float64, then cast), so results
    # match the daemon's and FFCV's bit for bit on uint8 input.
    table_np = ((np.arange(256, dtype=np.float64)[None, :] - mean[:, None]) / std[:, None]).astype(
        out_np
    )
    tables: dict[Any, Any] = {}

    def run(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            x = torch.from_numpy(np.asarray(x))
        table = tables.get(x.device)
        if table is None:
            table = torch.from_numpy(table_np).to(x.device)
            tables[x.device] = table
        if x.dtype != torch.uint8:
            raise SpecError(f"NormalizeImage after ToTensor needs uint8 images, got {x.dtype}")
        c = table.shape[0]
        if x.ndim == 4 and x.shape[1] == c:  # NCHW (after ToTorchImage)
            idx = x.long() + (torch.arange(c, device=x.device) * 256).view(1, c, 1, 1)
            out = table.reshape(-1)[idx]
            return out.contiguous(memory_format=torch.channels_last)
        if x.shape[-1] == c:  # NHWC
            idx = x.long() + torch.arange(c, device=x.device) * 256
            return table.reshape(-1)[idx]
        raise SpecError(f"NormalizeImage has {c} channels but the batch has shape {tuple(x.shape)}")

    return run


_IMPLS: dict[str, Callable[..., TailOp]] = {
    "ToDevice": _to_device,
    "ToTorchImage": _to_torch_image,
    "Convert": _convert,
    "Squeeze": _squeeze,
    "View": _view,
    "NormalizeImage": _normalize,
}


def build_tail(ops: Sequence[Any]) -> list[TailOp]:
    """Turn a pipeline's tail into callables on torch tensors (imports torch if the tail is not
    empty).

    Raises:
        SpecError: torch is missing, or an op's parameters are unusable.
    """
    if not ops:
        return []
    try:
        torch = import_torch()
    except ImportError:
        raise SpecError(
            "this pipeline has ops after the transport boundary (ToTensor, ToDevice, torch "
            "modules), which need torch: pip install torch"
        ) from None
    out: list[TailOp] = []
    for op in ops:
        name = _op_name(op)
        if name == "ToTensor":
            out.append(_to_tensor(torch))
        elif name == "ModuleWrapper":
            module = getattr(op, "module", None)
            if module is None or not callable(module):
                raise SpecError("ModuleWrapper has no callable .module")
            out.append(module)
        elif name in _IMPLS:
            out.append(_IMPLS[name](torch, op, _params(op)))
        elif callable(op):
            out.append(op)  # a torch.nn.Module or any callable: runs here, on the batch
        else:
            raise SpecError(f"{name} cannot run in the client")
    return out
