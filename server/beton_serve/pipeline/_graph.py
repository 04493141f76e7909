"""From FFCV's ``pipelines`` dict to a graph of op nodes (ffcv-format.md §5.5, §6.3).

The graph is a forest: each root is a decoder reading one field, and each output is the path
from a root to its leaf. A :class:`PipelineSpec` whose source is an op makes its output branch
from that op's node, so the shared prefix runs once per batch.

Rules (FFCV's, with errors where FFCV fails obscurely):

* output order: the file's fields in file order (skipping those mapped to ``None``), then the
  extra keys of ``pipelines`` in dict order;
* a field missing from ``pipelines`` or mapped to ``[]`` gets ``[DefaultDecoder(), ToTensor()]``;
  only such fully default pipelines get ``ToTensor`` appended;
* the first op becomes the decoder when it is an instance of the field's default decoder class
  (``field.get_decoder_class()``, subclasses count); otherwise a default decoder is prepended.
  A first op that is itself a decoder of another kind is rejected (FFCV would run it as a
  transform after the default decoder and crash inside Numba);
* ``torch.nn.Module`` instances are wrapped in ``ModuleWrapper``;
* an op instance may appear only once across all pipelines (FFCV issue #271).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from beton_wire.limits import no_such_field

from beton_serve.errors import SpecError
from beton_serve.pipeline._boundary import ModuleWrapper, ToTensor
from beton_serve.pipeline.operation import Operation
from beton_serve.pipeline.pipeline_spec import PipelineSpec

__all__ = ["Node", "OutputPath", "build_graph"]


@dataclass(eq=False)
class Node:
    """One op of the graph.

    Attributes:
        op: the operation.
        field_name: the field its root decoder reads.
        parent: the node whose output is this op's input (``None`` for a decoder).
        position: the op's index in the plan (depth-first in output order); seeds use it.
        output: the name of the output whose pipeline lists this op.
        children: the positions of the nodes whose input is this op's output. Positions, not
            nodes: a node that held its children while they hold their parent would be a
            reference cycle, and a dropped Loader's graph (its decoders hold the file's mapped
            metadata) would then wait for the garbage collector instead of being freed at once.
    """

    op: Operation
    field_name: str
    parent: Node | None
    position: int
    output: str
    children: list[int] = field(default_factory=list)

    @property
    def is_decoder(self) -> bool:
        return self.parent is None

    @property
    def name(self) -> str:
        return f"{type(self.op).__name__}#{self.position} (pipeline '{self.output}')"


@dataclass(eq=False)
class OutputPath:
    """One output: ``nodes`` is the full chain from its root decoder to its leaf."""

    name: str
    nodes: list[Node]
    own_start: int  # index in ``nodes`` of the first op this output's own pipeline lists


def _is_decoder_class(op: Any) -> bool:
    cls = type(op)
    return cls.__module__.startswith("beton_serve.fields") or cls.__name__.endswith("Decoder")


def _wrap(op: Any, where: str) -> Operation:
    if isinstance(op, Operation):
        return op
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(op, torch.nn.Module):
        return ModuleWrapper(op)
    if callable(op):
        # a plain callable on the torch batch (a lambda), as the served Loader's tail runs it
        return ModuleWrapper(op)
    raise SpecError(
        f"{where}: {op!r} is neither an Operation, a torch.nn.Module nor a callable; "
        "wrap it in an Operation subclass"
    )


def _default_to_tensor() -> Operation:
    return ToTensor()


def build_graph(
    field_names: Sequence[str],
    handlers: Mapping[str, Any],
    pipelines: Mapping[str, Sequence[Any] | PipelineSpec | None],
) -> tuple[list[OutputPath], list[Node]]:
    """Build the op graph of ``pipelines`` over a file with ``field_names``.

    Returns:
        ``(outputs in FFCV order, every node in position order)``.

    Raises:
        SpecError: an unknown field, a list under a non-field key, a decoder that does not fit
            its field, an op used twice, a branch from an op no pipeline contains.
    """
    specs: list[tuple[str, PipelineSpec, bool]] = []  # (output, spec, fully default)
    for fname in field_names:
        if fname in pipelines and pipelines[fname] is None:
            continue
        raw = pipelines.get(fname, [])
        if isinstance(raw, PipelineSpec):
            specs.append((fname, raw, False))
        else:
            ops = list(raw or [])
            specs.append((fname, PipelineSpec(fname, transforms=ops), not ops))
    for key, raw in pipelines.items():
        if key in field_names:
            continue
        if not isinstance(raw, PipelineSpec):
            raise SpecError(no_such_field(key, list(field_names)))
        specs.append((key, raw, False))

    seen: dict[int, str] = {}
    node_of: dict[int, Node] = {}
    nodes: list[Node] = []
    paths: dict[str, OutputPath] = {}

    def add(op: Operation, fname: str, parent: Node | None, out: str) -> Node:
        prev = seen.get(id(op))
        if prev is not None:
            raise SpecError(
                f"{type(op).__name__} instance is used in pipelines '{prev}' and '{out}'; "
                "use a new instance in each pipeline, or PipelineSpec(source=op) to branch (FFCV #271)"
            )
        seen[id(op)] = out
        node = Node(op, fname, parent, len(nodes), out)
        nodes.append(node)
        node_of[id(op)] = node
        if parent is not None:
            parent.children.append(node.position)
        return node

    pending = list(specs)
    while pending:
        progressed = False
        rest = []
        for out, spec, default in pending:
            where = f"pipelines[{out!r}]"
            ops = [_wrap(op, where) for op in spec.transforms]
            if isinstance(spec.source, Operation):
                decoders = [type(op).__name__ for op in ops if _is_decoder_class(op)]
                if spec.decoder is not None or decoders:
                    raise SpecError(
                        f"{where}: PipelineSpec(source=<op>) continues from that op's output, so "
                        f"it takes no decoder ({decoders or [type(spec.decoder).__name__]})"
                    )
                parent = node_of.get(id(spec.source))
                if parent is None:
                    rest.append((out, spec, default))
                    continue
                chain: list[Node] = []
                p: Node | None = parent
                while p is not None:
                    chain.append(p)
                    p = p.parent
                chain.reverse()
                own_start = len(chain)
                cur = parent
                for op in ops:
                    cur = add(op, parent.field_name, cur, out)
                    chain.append(cur)
                paths[out] = OutputPath(out, chain, own_start)
                progressed = True
                continue
            fname = spec.source
            if fname not in handlers:
                raise SpecError(
                    f"{where}: unknown field {fname!r}; the file has {list(field_names)}"
                )
            handler = handlers[fname]
            default_cls = handler.get_decoder_class()
            if spec.decoder is not None:
                ops = [spec.decoder, *ops]
            if ops and isinstance(ops[0], default_cls):
                decoder, ops = ops[0], ops[1:]
            elif ops and _is_decoder_class(ops[0]):
                raise SpecError(
                    f"{where}: {type(ops[0]).__name__} cannot decode field {fname!r} "
                    f"({type(handler).__name__}); use {default_cls.__name__} or a subclass of it"
                )
            else:
                decoder = default_cls()
            if default:
                ops = [_default_to_tensor()]
            cur = add(decoder, fname, None, out)
            chain = [cur]
            for op in ops:
                cur = add(op, fname, cur, out)
                chain.append(cur)
            paths[out] = OutputPath(out, chain, 0)
            progressed = True
        if not progressed:
            names = [o for o, _, _ in rest]
            raise SpecError(
                f"pipelines {names} branch from an op that no pipeline contains; "
                "PipelineSpec(source=op) needs op to be listed in another pipeline"
            )
        pending = rest
    return [paths[out] for out, _, _ in specs], nodes
