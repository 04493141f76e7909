"""The client's tail (``beton_client._tail``) and the pieces of custom-op routing (issue 13 §2).

* The client's torch implementations of the built-in conversion ops equal the ops' own
  ``generate_code`` (what the in-process Loader runs) bit for bit, so there is one tail semantics.
* Custom ops after ToTensor run FFCV's way: states carried, buffers allocated per query (batch
  dimension added) and reused, ``with_indices``; a Numba op handed back is compiled here.
* ``Operation`` records JSON-safe constructor arguments; the daemon's import policy and op
  resolution; positions match the in-process graph.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from beton_client._ops import CLIENT_OP, IMPORT_OP, split_pipelines
from beton_client._tail import OutputTail, output_positions
from beton_serve.daemon._messages import OpRequest
from beton_serve.daemon._on_demand import (
    CLIENT_OP as SERVER_CLIENT_OP,
)
from beton_serve.daemon._on_demand import (
    IMPORT_OP as SERVER_IMPORT_OP,
)
from beton_serve.daemon._on_demand import (
    OpImportPolicy,
    resolve_ops,
)
from beton_serve.errors import SpecError as ServerSpecError
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.pipeline import registry
from beton_serve.pipeline.allocation_query import AllocationQuery
from beton_serve.pipeline.operation import Operation
from beton_serve.transforms import (
    Convert,
    NormalizeImage,
    RandomHorizontalFlip,
    Squeeze,
    ToTensor,
    ToTorchImage,
    View,
)

RNG = np.random.default_rng(11)


def _run(ops, x, *, fast: bool, ids=None, epoch=0, seed=0):
    tail = OutputTail("out", x.shape[1:], x.dtype, ops, [None] * len(ops), batch_size=len(x))
    if not fast:  # run every built-in through its own generate_code, as in process
        tail = OutputTail(
            "out",
            x.shape[1:],
            x.dtype,
            ops,
            [None] * len(ops),
            batch_size=len(x),
            builtin_fast_path=False,
        )
    ids = np.arange(len(x), dtype=np.uint64) if ids is None else ids
    return tail(x, ids, epoch, seed)


IMAGES = RNG.integers(0, 256, (5, 6, 7, 3), dtype=np.uint8)
MEAN, STD = np.array([120.0, 110.0, 100.0]), np.array([60.0, 55.0, 50.0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: [ToTensor()],
        lambda: [ToTensor(), ToTorchImage()],
        lambda: [ToTensor(), ToTorchImage(channels_last=False)],
        lambda: [ToTensor(), ToTorchImage(), Convert(torch.float16)],
        lambda: [ToTensor(), ToTorchImage(), Convert(torch.float64)],
        lambda: [ToTensor(), ToTorchImage(), NormalizeImage(MEAN, STD, np.float32)],
        lambda: [ToTensor(), ToTorchImage(), NormalizeImage(MEAN, STD, np.float16)],
        lambda: [ToTensor(), View(torch.int8)],
    ],
    ids=["totensor", "torchimage", "torchimage-copy", "f16", "f64", "norm32", "norm16", "view"],
)
def test_builtin_fast_path_equals_generate_code(make):
    fast = _run(make(), IMAGES.copy(), fast=True)
    ffcv = _run(make(), IMAGES.copy(), fast=False)
    assert fast.dtype == ffcv.dtype and fast.shape == ffcv.shape
    assert torch.equal(fast, ffcv)


def test_squeeze_fast_path_equals_generate_code():
    labels = RNG.integers(0, 100, (6, 1)).astype(np.int64)
    fast = _run([ToTensor(), Squeeze()], labels.copy(), fast=True)
    ffcv = _run([ToTensor(), Squeeze()], labels.copy(), fast=False)
    assert torch.equal(fast, ffcv) and fast.shape == (6,)


class Shift(Operation):
    """After ToTensor: out = in + sample id, into a buffer it asks for (with_indices)."""

    calls: list = []

    def generate_code(self):
        def shift(inp, dst, indices):
            Shift.calls.append(dst.data_ptr())
            dst.copy_(inp + torch.from_numpy(indices.astype(np.int64)).view(-1, 1, 1, 1))
            return dst

        shift.with_indices = True
        return shift

    def declare_state_and_memory(self, previous_state):
        assert not previous_state.jit_mode and previous_state.shape == (3, 6, 7)
        return previous_state, AllocationQuery(
            previous_state.shape, previous_state.dtype, previous_state.device
        )


def test_custom_op_after_totensor_runs_ffcv_style_with_a_reused_buffer():
    ops = [ToTensor(), ToTorchImage(), Convert(torch.int64), Shift()]
    tail = OutputTail("img", IMAGES.shape[1:], IMAGES.dtype, ops, [None] * 4, batch_size=5)
    ids = np.array([10, 20, 30], dtype=np.uint64)
    Shift.calls.clear()
    out1 = tail(IMAGES[:3], ids, 0, 0).clone()
    tail(IMAGES[:3], ids, 0, 0)
    ref = torch.from_numpy(IMAGES[:3]).permute(0, 3, 1, 2).long() + torch.tensor([10, 20, 30]).view(
        -1, 1, 1, 1
    )
    assert torch.equal(out1, ref)
    assert len(Shift.calls) == 2 and Shift.calls[0] == Shift.calls[1]  # one buffer, reused
    assert tail.state.shape == (3, 6, 7) and tail.state.dtype == torch.int64


class Invert(Operation):
    """A Numba op (jit state in and out)."""

    def generate_code(self):
        def invert(images, dst):
            for i in range(images.shape[0]):
                dst[i] = 255 - images[i]
            return dst

        return invert

    def declare_state_and_memory(self, previous_state):
        return previous_state, AllocationQuery(previous_state.shape, previous_state.dtype)


def test_handed_back_numba_op_is_compiled_here_then_seeded_ops_follow():
    flip = RandomHorizontalFlip(0.5)
    ops = [Invert(), flip, ToTensor()]
    tail = OutputTail("img", IMAGES.shape[1:], IMAGES.dtype, ops, [1, 2, 3], batch_size=5)
    ids = np.arange(5, dtype=np.uint64) + 100
    out = tail(IMAGES, ids, 3, 42).clone()
    assert tail.steps[0].jit and tail.steps[1].jit and not tail.steps[2].jit
    # Reference: the same ops through the in-process compiler, with the seed key of position 2.
    from beton_serve.pipeline.compiler import Compiler
    from beton_serve.pipeline.rng import derive_seed_key

    inv = 255 - IMAGES
    fn = flip.generate_code()
    cfn = fn if getattr(fn, "python", False) else Compiler.compile(fn)
    dst = np.empty_like(IMAGES)
    ref = cfn(inv, dst, ids, derive_seed_key(42, 3, 2))
    assert torch.equal(out, torch.from_numpy(ref))


class NotNumba(Operation):
    """A jit-stage op Numba cannot compile (an import inside the function)."""

    def generate_code(self):
        def bad(images, dst):
            import os

            return os

        return bad

    def declare_state_and_memory(self, previous_state):
        return previous_state, None


def test_handed_back_op_that_cannot_compile_can_run_nowhere():
    from beton_client.errors import SpecError

    tail = OutputTail(
        "img",
        IMAGES.shape[1:],
        IMAGES.dtype,
        [NotNumba()],
        [1],
        batch_size=5,
        why=["import: the daemon cannot import module 'x'"],
    )
    with pytest.raises(SpecError, match=r"can run nowhere.*cannot import module.*numba"):
        tail(IMAGES, np.arange(5, dtype=np.uint64), 0, 0)


# -- the split and the positions ------------------------------------------------------------


def test_split_sends_user_ops_as_imports_and_the_tail_as_placeholders():
    (p,) = split_pipelines(
        {"image": [SimpleRGBImageDecoder(), Invert(), ToTensor(), ToTorchImage(), Shift()]}
    )
    names = [n for n, _ in p.ops]
    assert names == ["SimpleRGBImageDecoder", IMPORT_OP, CLIENT_OP, CLIENT_OP, CLIENT_OP]
    params = json.loads(p.ops[1][1])
    assert params["import"]["qualname"] == "Invert" and params["decoder"] is False
    assert len(p.tail) == 3 and p.boundary == 2 and p.decoder_given
    assert (IMPORT_OP, CLIENT_OP) == (SERVER_IMPORT_OP, SERVER_CLIENT_OP)
    assert registry.IMPORT_OP == IMPORT_OP and registry.CLIENT_OP == CLIENT_OP


def test_positions_follow_the_in_process_graph():
    plans = split_pipelines(
        {
            "image": [RandomHorizontalFlip(), ToTensor()],  # default decoder prepended
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        }
    )
    # outputs in file order, with a field the pipelines do not name ([decoder, ToTensor])
    pos = output_positions(plans, ["other", "image", "label"])
    assert pos == {"other": (0, 1), "image": (2, 3), "label": (5, 5)}


# -- recorded constructor arguments ---------------------------------------------------------


class WithArgs(Operation):
    def __init__(self, size, *, name="x", scale=1.5):
        super().__init__()
        self.size = size

    def generate_code(self):
        return lambda inp, dst: inp

    def declare_state_and_memory(self, previous_state):
        return previous_state, None


class Child(WithArgs):
    def __init__(self, k):
        super().__init__((k, k), name="child")


def test_constructor_arguments_are_recorded_when_json_safe():
    spec = WithArgs((3, 4), name="y").import_spec()
    assert spec == {
        "module": __name__,
        "qualname": "WithArgs",
        "args": [[3, 4]],
        "kwargs": {"name": "y"},
    }
    assert Child(5).import_spec()["args"] == [5]  # the subclass's own call, not super()'s
    with pytest.raises(NotImplementedError, match="not JSON-safe"):
        WithArgs(np.float32(1.0)).import_spec()
    with pytest.raises(NotImplementedError, match="not JSON-safe"):
        WithArgs(float("nan")).import_spec()
    script = type("InScript", (WithArgs,), {"__module__": "__main__"})
    with pytest.raises(NotImplementedError, match="__main__"):
        script(1).import_spec()


class Derived(Operation):
    """Keeps a value derived from its argument under another name, and a large table."""

    def __init__(self, c, table_size=0):
        super().__init__()
        self._twice = 2 * c
        self._table = np.zeros(table_size, np.float64)
        self._nan = np.array([np.nan, 1.0])
        self._opaque = object()  # cannot be compared: counts as unchanged

    def generate_code(self):
        return lambda inp, dst: inp

    def declare_state_and_memory(self, previous_state):
        return previous_state, None


def test_an_attribute_the_constructor_derived_and_changed_keeps_the_op_out_of_the_daemon():
    """The daemon rebuilds ``Derived(5)`` with ``_twice == 10``: a changed ``_twice`` must not
    travel by import, whatever its name; a small or large array changed in place neither."""
    assert Derived(5).import_spec()["args"] == [5]
    op = Derived(5)
    op._twice = 100
    with pytest.raises(NotImplementedError, match=r"Derived\._twice was changed after the op"):
        op.import_spec()
    op = Derived(5)
    op._nan[1] = 2.0
    with pytest.raises(NotImplementedError, match=r"Derived\._nan was changed"):
        op.import_spec()
    big = Derived(5, table_size=1 << 18)  # 2 MiB: remembered by its digest
    assert big.import_spec()["kwargs"] == {"table_size": 1 << 18}
    big._table[12345] = 1.0
    with pytest.raises(NotImplementedError, match=r"Derived\._table was changed"):
        big.import_spec()
    op = Derived(5)
    op._opaque = object()
    op.accept_field("handler")  # what the planner sets is not the op's parameter
    op.accept_globals(np.arange(3), None)
    assert op.import_spec()["args"] == [5]


def test_registry_imports_only_when_the_daemon_allowed_it():
    spec = WithArgs(7, scale=2.0).import_spec()
    with pytest.raises(ServerSpecError, match="not allowed"):
        registry.op_from_spec(registry.IMPORT_OP, {"import": spec, "import_allowed": 1})
    op = registry.op_from_spec(registry.IMPORT_OP, {"import": spec, "import_allowed": True})
    assert type(op) is WithArgs and op.size == 7
    missing = dict(spec, module="no_such_module_for_beton_tests")
    with pytest.raises(ServerSpecError, match="cannot import module"):
        registry.default_registry().build_imported(missing)
    with pytest.raises(ServerSpecError, match="not an Operation"):
        registry.default_registry().build_imported(dict(spec, qualname="OpImportPolicy"))


def test_import_policy():
    policy = OpImportPolicy(uid=1000)
    assert policy.refusal(owner_peer=True, peer_uid=None) is None
    assert policy.refusal(owner_peer=False, peer_uid=1000) is None
    why = policy.refusal(owner_peer=False, peer_uid=1001)
    assert why is not None and "uid 1001" in why and "--allow-op-imports" in why
    assert "unverified" in (policy.refusal(owner_peer=False, peer_uid=None) or "")
    assert (
        OpImportPolicy(allow_any_peer=True, uid=1000).refusal(owner_peer=False, peer_uid=5) is None
    )


def _build(name, params):
    if name in (SERVER_CLIENT_OP, "IntDecoder"):
        return (name, dict(params))
    if name == SERVER_IMPORT_OP:
        return ("imported", params["import"]["qualname"])
    raise ServerSpecError(f"unknown op {name!r}")


def _user(qualname="Invert", *, decoder=False, why=()):
    imp = {"module": __name__, "qualname": qualname, "args": [], "kwargs": {}}
    return OpRequest(
        name=SERVER_IMPORT_OP,
        params={"spec": None, "import": imp, "why": list(why), "decoder": decoder},
    )


def test_resolve_ops_routes():
    ops = (
        OpRequest(name="IntDecoder", params={}),
        _user(),
        OpRequest(name="IntDecoder", params={}),
    )
    built, local = resolve_ops(ops, build=_build, import_refusal=None)
    assert built[1] == ("imported", "Invert") and local is None
    built, local = resolve_ops(ops, build=_build, import_refusal="uid 5 is not the daemon's")
    assert [b[0] for b in built] == ["IntDecoder", SERVER_CLIENT_OP, SERVER_CLIENT_OP]
    assert local is not None and local[1]["from"] == 1
    assert any("uid 5" in w for w in local[1]["why"])
    assert any("plugin" in w for w in local[1]["why"])
    with pytest.raises(ServerSpecError, match="can run nowhere"):
        resolve_ops((_user(decoder=True),), build=_build, import_refusal="no")


def test_import_beton_client_still_imports_no_numba():
    import subprocess

    code = (
        "import sys, beton_client, beton_client._tail; "
        "bad = [m for m in ('numba', 'cv2', 'torch', 'beton_serve') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
