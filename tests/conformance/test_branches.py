"""FFCV's branches, ``PipelineSpec(source=<op of another pipeline>)``, served and in process.

A branch continues from the output of an op that another pipeline lists: two augmented views of
one decode, say. Every form here is read over shm and gRPC from one daemon and compared bit for
bit with the in-process Loader (two epochs, random order, random ops in both the source pipeline
and the branch, so the seeds' positions are checked too). The forms include branches whose only
difference is the op they branch from (the daemon's plan cache must tell them apart), a branch
of a branch listed before its source, and a branch from an op whose other child works in place
(the in-process Loader returned uninitialised memory for it before the planner checked that no
branch reads a buffer an in-place op overwrites).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve.fields.decoders import (
    IntDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.pipeline import PipelineSpec
from beton_serve.transforms import (
    Convert,
    Cutout,
    RandomBrightness,
    RandomHorizontalFlip,
    RandomTranslate,
    ToTensor,
    ToTorchImage,
)
from helpers.daemon import DaemonProcess

from conformance._backends import assert_same_epochs, epochs, make_loader, module_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JPG = "images_jpg"
PAIRS = "image_pairs"


def _two_views() -> dict[str, Any]:
    """SimCLR's pattern: one decode, two augmented views."""
    dec = RandomResizedCropRGBImageDecoder((24, 20))
    return {
        "image": [dec, RandomHorizontalFlip(0.5), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "view": PipelineSpec(
            dec, transforms=[RandomBrightness(0.4), RandomHorizontalFlip(0.5), ToTensor()]
        ),
    }


def _views_of(which: int) -> Callable[[], dict[str, Any]]:
    """A branch from op ``which`` of the image pipeline (0: the decoder, 1: the translate,
    2: the flip); the three differ only in that index."""

    def make() -> dict[str, Any]:
        ops = [SimpleRGBImageDecoder(), RandomTranslate(3, (9, 9, 9)), RandomHorizontalFlip(0.5)]
        return {
            "input": [*ops, ToTensor()],
            "target": None,
            "view": PipelineSpec(ops[which], transforms=[Cutout(5, (1, 2, 3)), ToTensor()]),
        }

    return make


def _beside_inplace() -> dict[str, Any]:
    """The flip works in place on the decoder's buffer unless something else reads it: two
    branches read it, one with no ops at all."""
    dec = SimpleRGBImageDecoder()
    return {
        "input": [dec, RandomHorizontalFlip(1.0), ToTensor()],
        "target": None,
        "plain": PipelineSpec(dec, transforms=[]),
        "plain_tensor": PipelineSpec(dec, transforms=[ToTensor()]),
    }


def _branch_of_a_branch() -> dict[str, Any]:
    """``second`` branches from an op of ``first``, and is listed before it."""
    dec = SimpleRGBImageDecoder()
    flip = RandomHorizontalFlip(0.5)
    return {
        "input": [dec, ToTensor()],
        "target": None,
        "second": PipelineSpec(flip, transforms=[RandomBrightness(0.3), ToTensor()]),
        "first": PipelineSpec(dec, transforms=[RandomTranslate(2, (0, 0, 0)), flip, ToTensor()]),
    }


def _tensor_tail() -> dict[str, Any]:
    """A branch that goes on after its own ToTensor (client-side ops), from a decoder whose own
    pipeline also ends on the client."""
    dec = SimpleRGBImageDecoder()
    return {
        "input": [dec, ToTensor(), ToTorchImage(), Convert(torch.float32)],
        "target": [SimpleRGBImageDecoder(), ToTensor()],
        "view": PipelineSpec(dec, transforms=[ToTensor(), ToTorchImage(), Convert(torch.float16)]),
    }


def _no_decoder_given() -> dict[str, Any]:
    """The source pipeline lists no decoder (the field's default one is prepended)."""
    flip = RandomHorizontalFlip(0.5)
    return {
        "input": [flip, ToTensor()],
        "target": None,
        "view": PipelineSpec(flip, transforms=[Cutout(4, (0, 0, 0)), ToTensor()]),
    }


def _from_a_second_output() -> dict[str, Any]:
    """A branch from an op of ``PipelineSpec('input', ...)`` under another name, the field
    itself skipped."""
    flip = RandomHorizontalFlip(0.5)
    return {
        "input": None,
        "target": [SimpleRGBImageDecoder(), ToTensor()],
        "second": PipelineSpec("input", decoder=SimpleRGBImageDecoder(), transforms=[flip]),
        "view": PipelineSpec(flip, transforms=[RandomBrightness(0.5), ToTensor()]),
    }


def _numpy_views() -> dict[str, Any]:
    """Two branches from the second field's decoder, one with no ops: numpy outputs only."""
    dec = SimpleRGBImageDecoder()
    return {
        "input": [SimpleRGBImageDecoder(), RandomHorizontalFlip(0.5)],
        "target": [dec, RandomHorizontalFlip(0.5)],
        "v1": PipelineSpec(dec, transforms=[RandomHorizontalFlip(0.5)]),
        "v2": PipelineSpec(dec, transforms=[]),
    }


FORMS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "no_decoder_given": (PAIRS, _no_decoder_given),
    "from_a_second_output": (PAIRS, _from_a_second_output),
    "numpy_views": (PAIRS, _numpy_views),
    "two_views": (JPG, _two_views),
    "view_of_decoder": (PAIRS, _views_of(0)),
    "view_of_translate": (PAIRS, _views_of(1)),
    "view_of_flip": (PAIRS, _views_of(2)),
    "beside_inplace": (PAIRS, _beside_inplace),
    "branch_of_a_branch": (PAIRS, _branch_of_a_branch),
    "tensor_tail": (PAIRS, _tensor_tail),
}


@pytest.fixture(scope="module")
def daemon(fixtures_dir: Path) -> Iterator[DaemonProcess]:
    with module_daemon([fixtures_dir / f"{f}.beton" for f in (JPG, PAIRS)]) as d:
        yield d


def _read(backend: str, path: Path, make: Callable[[], dict[str, Any]], address: str) -> list:
    with make_loader(
        backend, path, make(), address=address, batch_size=5, order="RANDOM", seed=4
    ) as ld:
        return epochs(ld, 2)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_branches_served_equal_in_process(
    fixtures_dir: Path, daemon: DaemonProcess, form: str, transport: str
) -> None:
    file, make = FORMS[form]
    path = fixtures_dir / f"{file}.beton"
    want = _read("inproc", path, make, daemon.address)
    got = _read(transport, path, make, daemon.address)
    assert_same_epochs(got, want, f"{transport} vs in-process, {form}")


def _with_plain_decode(
    fixtures_dir: Path, backend: str, pipes: dict[str, Any], address: str
) -> tuple[list[tuple[np.ndarray, ...]], list[np.ndarray]]:
    """Every batch of ``pipes`` over the pairs file on ``backend`` (copied), and the same
    batches of a plain decode in process, to compare pixels with."""
    path = fixtures_dir / f"{PAIRS}.beton"
    with make_loader(backend, path, pipes, address=address, batch_size=4) as ld:
        batches = [tuple(np.asarray(x).copy() for x in b) for b in ld]
    with make_loader(
        "inproc", path, {"input": [SimpleRGBImageDecoder()], "target": None}, batch_size=4
    ) as ld:
        plain = [np.array(b[0]) for b in ld]
    assert len(batches) == len(plain) > 0
    return batches, plain


@pytest.mark.parametrize("backend", ["inproc", "shm"])
def test_a_branch_beside_an_inplace_op_sees_the_decoded_pixels(
    fixtures_dir: Path, daemon: DaemonProcess, backend: str
) -> None:
    batches, plain = _with_plain_decode(fixtures_dir, backend, _beside_inplace(), daemon.address)
    for (flipped, view, view_t), want in zip(batches, plain, strict=True):
        assert np.array_equal(view, want) and np.array_equal(view_t, want)
        assert np.array_equal(flipped, want[:, :, ::-1])


def _changed_only_to(x: np.ndarray, want: np.ndarray, fill: tuple[int, int, int]) -> bool:
    """Every pixel of ``x`` is ``want``'s or ``fill``, and each image has some ``fill``."""
    changed = (x != want).any(-1)
    return bool((x[changed] == fill).all() and (x == fill).all(-1).any((1, 2)).all())


RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.mark.parametrize("backend", ["inproc", "shm", "grpc"])
def test_ops_that_write_their_input_get_their_own_copy_on_a_branch(
    fixtures_dir: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``Cutout`` (like the colour jitters, ``RandomTranslate``, ``Poison``) declares no
    buffer and writes its input. On two branches of one decode both views came out identical,
    each with both views' squares, and a branch's squares landed in the trunk's output (found by
    an audit in session 48; FFCV 1.0.2 aliases alike). Each now writes its own copy."""
    dec, flip = SimpleRGBImageDecoder(), RandomHorizontalFlip(1.0)
    pipes = {
        "input": [dec, Cutout(4, RED)],
        "target": None,
        "view": PipelineSpec(dec, transforms=[Cutout(4, BLUE)]),
        "plain": PipelineSpec(dec, transforms=[]),
        "flipped": PipelineSpec(dec, transforms=[flip]),
        "flipped_cut": PipelineSpec(flip, transforms=[Cutout(4, BLUE)]),
    }
    batches, plain = _with_plain_decode(fixtures_dir, backend, pipes, daemon.address)
    for (red, blue, view, flipped, flipped_cut), want in zip(batches, plain, strict=True):
        assert np.array_equal(view, want)
        assert np.array_equal(flipped, want[:, :, ::-1])
        assert _changed_only_to(red, want, RED)
        assert _changed_only_to(blue, want, BLUE)
        assert _changed_only_to(flipped_cut, want[:, :, ::-1], BLUE)


def test_a_branch_from_an_op_after_the_tensor_boundary_is_refused(
    fixtures_dir: Path, daemon: DaemonProcess
) -> None:
    """Both Loaders branch only from a Numba-stage op (before ToTensor): from a torch op both
    refuse, with a SpecError that says where the op runs (in process it said "an op that no
    pipeline contains")."""
    path = fixtures_dir / f"{PAIRS}.beton"

    def make() -> dict[str, Any]:
        ops = [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()]
        return {
            "input": ops,
            "target": None,
            "view": PipelineSpec(ops[2], transforms=[Convert(torch.float16)]),
        }

    for backend in ("inproc", "shm", "grpc"):
        with pytest.raises(Exception, match=r"branch") as err:
            _read(backend, path, make, daemon.address)
        assert type(err.value).__name__ == "SpecError", backend
        assert "which pipeline 'input' runs after its Numba stage" in str(err.value), backend


def _raw_branch(**branch: Any) -> Any:
    """A raw OpenStream request over image_pairs: ``input`` decoded and flipped, ``target``
    skipped, and a pipeline ``view`` with ``branch`` set on its PipelineSpec."""
    from beton_wire.v1 import beton_pb2 as pb

    def op(name: str, params: str = "{}") -> Any:
        return pb.OpSpec(name=name, params_json=params)

    flip = op("RandomHorizontalFlip", '{"flip_prob": 0.5}')
    return pb.OpenStreamRequest(
        dataset=PAIRS,
        batch_size=4,
        batches_ahead=2,
        pipelines=[
            pb.PipelineSpec(name="input", ops=[op("SimpleRGBImageDecoder"), flip]),
            pb.PipelineSpec(name="target", skip=True),
            pb.PipelineSpec(name="view", ops=[flip], **branch),
        ],
        host=pb.HostIdentity(pid=os.getpid(), uid=os.getuid()),
    )


@pytest.mark.parametrize(
    ("branch", "says"),
    [
        # what a daemon that predates branches sees: a field that no file has
        ({"field": "@branch"}, "@branch"),
        ({"field": "@branch", "branch_of": "nothing"}, "does not have"),
        ({"field": "@branch", "branch_of": "input", "branch_op": 2}, "does not have"),
        ({"field": "@branch", "branch_of": "input", "branch_op": 2**32 - 1}, "does not have"),
        ({"field": "@branch", "branch_of": "view"}, "does not have"),
        ({"field": "@branch", "branch_of": "target"}, "does not have"),
    ],
)
def test_malformed_branches_are_refused(daemon: DaemonProcess, branch: dict, says: str) -> None:
    import grpc
    from beton_wire.v1 import beton_pb2_grpc as pb_grpc

    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.BetonServeStub(ch).OpenStream(_raw_branch(**branch), timeout=60)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert says in (err.details() or ""), err.details()
    assert daemon.proc.poll() is None


def test_a_branch_whose_family_runs_ops_in_the_client_is_refused_served(
    fixtures_dir: Path, daemon: DaemonProcess
) -> None:
    """``Poison`` works on its input's buffer: in process, a branch from the decoder before it
    reads the poisoned pixels. With a mask too large to send, Poison runs in the training process
    (route c), where it cannot reach the branch's input, so the daemon refuses the family instead
    of serving other pixels; a route-c op in an unrelated pipeline does not stop a branch."""
    from beton_serve.transforms import Poison, ReplaceLabel

    path = fixtures_dir / f"{JPG}.beton"
    rng = np.random.default_rng(0)
    mask, alpha = rng.uniform(0, 255, (100, 100, 3)), rng.uniform(0, 1, (100, 100))

    def poisoned() -> dict[str, Any]:
        dec = RandomResizedCropRGBImageDecoder((100, 100))
        return {
            "image": [dec, Poison(mask, alpha, list(range(0, 64, 3))), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
            "view": PipelineSpec(dec, transforms=[RandomHorizontalFlip(0.5), ToTensor()]),
        }

    def unrelated() -> dict[str, Any]:
        dec = RandomResizedCropRGBImageDecoder((20, 20))
        return {
            "image": [dec, RandomHorizontalFlip(0.5), ToTensor()],
            "label": [IntDecoder(), ReplaceLabel(list(range(1, 120_000, 2)), 3), ToTensor()],
            "view": PipelineSpec(dec, transforms=[RandomHorizontalFlip(0.5), ToTensor()]),
        }

    assert _read("inproc", path, poisoned, daemon.address)
    with pytest.raises(Exception, match=r"ops of pipeline 'image' run in the client") as err:
        _read("shm", path, poisoned, daemon.address)
    assert type(err.value).__name__ == "SpecError"
    want = _read("inproc", path, unrelated, daemon.address)
    assert_same_epochs(_read("grpc", path, unrelated, daemon.address), want, "unrelated route c")


def test_branches_in_a_cycle_and_a_decoder_in_a_branch_are_refused(daemon: DaemonProcess) -> None:
    import grpc
    from beton_wire.v1 import beton_pb2 as pb
    from beton_wire.v1 import beton_pb2_grpc as pb_grpc

    flip = pb.OpSpec(name="RandomHorizontalFlip", params_json='{"flip_prob": 0.5}')
    decoder = pb.OpSpec(name="SimpleRGBImageDecoder", params_json="{}")
    cycle = [
        pb.PipelineSpec(name="a", field="@branch", ops=[flip], branch_of="b"),
        pb.PipelineSpec(name="b", field="@branch", ops=[flip], branch_of="a"),
    ]
    with_decoder = [pb.PipelineSpec(name="d", field="@branch", ops=[decoder], branch_of="input")]
    for extra in (cycle, with_decoder):
        req = _raw_branch(field="@branch", branch_of="input")
        req.pipelines.extend(extra)
        with grpc.insecure_channel(daemon.address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.BetonServeStub(ch).OpenStream(req, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        if extra is with_decoder:
            assert "takes no decoder" in (info.value.details() or "")
    assert daemon.proc.poll() is None


def test_a_branch_with_a_decoder_is_refused(fixtures_dir: Path, daemon: DaemonProcess) -> None:
    path = fixtures_dir / f"{PAIRS}.beton"

    def make() -> dict[str, Any]:
        dec = SimpleRGBImageDecoder()
        return {
            "input": [dec],
            "target": None,
            "view": PipelineSpec(dec, transforms=[SimpleRGBImageDecoder(), ToTensor()]),
        }

    for backend in ("inproc", "shm"):
        with pytest.raises(Exception, match=r"takes no decoder") as err:
            _read(backend, path, make, daemon.address)
        assert type(err.value).__name__ == "SpecError", backend


class _AddOneInPlace(torch.nn.Module):
    """A torch op that changes its input tensor in place (``x.add_(1)``), as user modules may."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)


@pytest.mark.parametrize("backend", ["inproc", "shm", "grpc"])
def test_an_inplace_torch_op_on_one_output_leaves_a_branch_of_it_alone(
    fixtures_dir: Path, daemon: DaemonProcess, backend: str
) -> None:
    """``ToTensor`` hands out a view of the Numba stage's buffer; an in-place torch op on that
    view must not reach a branch of the same op (nor the other way round)."""
    dec = SimpleRGBImageDecoder()
    pipes = {
        "input": [dec, ToTensor(), _AddOneInPlace()],
        "target": None,
        "plain": PipelineSpec(dec, transforms=[ToTensor()]),
        "plain_np": PipelineSpec(dec, transforms=[]),
        "plus": PipelineSpec(dec, transforms=[ToTensor(), _AddOneInPlace()]),
    }
    batches, plain = _with_plain_decode(fixtures_dir, backend, pipes, daemon.address)
    for (plus1, view, view_np, plus2), want in zip(batches, plain, strict=True):
        assert np.array_equal(view, want) and np.array_equal(view_np, want)
        assert np.array_equal(plus1, want + np.uint8(1))
        assert np.array_equal(plus2, want + np.uint8(1))


def test_a_daemon_that_predates_branches_is_named_as_such(daemon: DaemonProcess) -> None:
    """A daemon older than served branches ignores ``branch_of`` and sees a pipeline of the
    placeholder field ``@branch``, which no file has: the client's error says to upgrade it
    (the request below is exactly what such a daemon reads)."""
    import grpc
    from beton_client._ops import explain_refusal
    from beton_client.errors import SpecError, from_rpc_error
    from beton_wire.v1 import beton_pb2_grpc as pb_grpc

    def refusal(err: Any) -> Exception:  # as the Loader raises it (``_loader.DaemonBackend.open``)
        return explain_refusal(from_rpc_error(err, target=daemon.address), daemon.address)

    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.BetonServeStub(ch).OpenStream(_raw_branch(field="@branch"), timeout=60)
    err = refusal(info.value)
    assert isinstance(err, SpecError)
    assert f"the daemon at {daemon.address} predates served branches" in str(err), str(err)
    assert "has no field '@branch'" in str(err)  # the daemon's own words, kept
    # any other unknown field keeps the daemon's message as it is
    with grpc.insecure_channel(daemon.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.BetonServeStub(ch).OpenStream(_raw_branch(field="nope"), timeout=60)
    other = refusal(info.value)
    assert "predates" not in str(other) and "has no field 'nope'" in str(other), str(other)
