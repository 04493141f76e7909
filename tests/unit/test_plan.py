"""Planner/compiler: FFCV's pipelines semantics, jit prefix vs client tail, errors, caching."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.pipeline import (
    AllocationQuery,
    Operation,
    PipelineSpec,
    PlanCache,
    compile_pipelines,
)
from helpers.fake_pipeline import (
    AddIndex,
    AddOne,
    FakeImageDecoder,
    FakeLabelDecoder,
    FakeReader,
    NumpyToTorch,
    OtherDecoder,
    TorchDouble,
    fake_image,
)


def _run(plan, ids, outs=None):
    ws = plan.acquire_workspace()
    try:
        res = plan.run(ws, np.asarray(ids, np.uint64), plan.seed_keys(0, 0), outs)
        return [np.array(r) for r in res]
    finally:
        plan.release_workspace(ws)


def test_order_default_decoder_and_run():
    r = FakeReader()
    plan = compile_pipelines(r, {"label": [AddIndex()], "image": [AddOne()]}, batch_size=4)
    assert [o.name for o in plan.outputs] == ["image", "label"]  # file order, not dict order
    assert plan.outputs[0].shape == (4, 5, 3) and plan.outputs[0].dtype == np.uint8
    assert plan.outputs[1].shape == (1,) and plan.outputs[1].dtype == np.int64
    assert plan.client_tail == {"image": [], "label": []}
    img, lab = _run(plan, [3, 7])
    np.testing.assert_array_equal(img, np.stack([fake_image(3), fake_image(7)]) + 1)
    np.testing.assert_array_equal(lab[:, 0], [30 + 3000, 70 + 7000])


def test_first_op_of_default_class_becomes_decoder_and_none_skips():
    r = FakeReader()
    dec = FakeImageDecoder()
    plan = compile_pipelines(r, {"image": [dec], "label": None}, batch_size=2)
    assert [o.name for o in plan.outputs] == ["image"]
    assert plan.nodes[0].op is dec
    assert len(plan.nodes) == 1


def test_branch_from_op_and_extra_outputs_in_dict_order():
    r = FakeReader()
    add = AddOne()
    pipes = {
        "image": [add],
        "label": None,
        "twice": PipelineSpec(add, transforms=[AddOne()]),
        "again": PipelineSpec("image", transforms=[]),
    }
    plan = compile_pipelines(r, pipes, batch_size=3)
    assert [o.name for o in plan.outputs] == ["image", "twice", "again"]
    decoders = [n for n in plan.nodes if n.parent is None]
    assert len(decoders) == 2  # "twice" did not decode again, "again" did
    img, twice, again = _run(plan, [1, 2])
    np.testing.assert_array_equal(twice, img + 1)
    np.testing.assert_array_equal(again, img - 1)


def test_client_tail_is_declared_and_the_front_end_runs_it():
    torch = pytest.importorskip("torch")
    from beton_serve.loader import Loader

    r = FakeReader()
    to_t, dbl = NumpyToTorch(), TorchDouble()
    pipes = {"label": [to_t, dbl], "image": None}
    plan = compile_pipelines(r, pipes, batch_size=4)
    assert plan.client_tail == {"label": [to_t, dbl]}
    assert plan.state_of(dbl).jit_mode is False
    # The plan runs the jit stage only; the Loader's front end (beton_client.frontend, the one
    # tail implementation of every backend) runs the rest in the consumer's thread.
    with Loader(FakeReader(), 3, num_workers=1, pipelines=pipes, indices=[1, 5, 6]) as ld:
        (out,) = next(iter(ld))
    assert isinstance(out, torch.Tensor)
    assert out[:, 0].tolist() == [20, 100, 120]


@pytest.mark.parametrize(
    "pipes,match",
    [
        ({"nope": [AddOne()]}, "no field is named 'nope'"),
        ({"x": PipelineSpec("nope")}, "unknown field 'nope'"),
        ({"image": [OtherDecoder()]}, "OtherDecoder cannot decode field 'image'.*FakeImageDecoder"),
        ({"x": PipelineSpec(AddOne())}, "branch from an op that no pipeline contains"),
        ({"image": ["not an op"]}, "neither an Operation"),
    ],
)
def test_construction_errors_name_the_problem(pipes, match):
    with pytest.raises(SpecError, match=match):
        compile_pipelines(FakeReader(), {"image": None, "label": None, **pipes}, batch_size=2)


def test_same_op_twice_is_an_error():
    op = AddOne()
    with pytest.raises(SpecError, match="#271"):
        pipes = {"image": [op], "label": None, "x": PipelineSpec("image", transforms=[op])}
        compile_pipelines(FakeReader(), pipes, batch_size=2)


def test_torch_op_before_to_tensor_is_an_error():
    pytest.importorskip("torch")

    class Convert(TorchDouble):
        torch_op = True  # the trait the planner reads (issue 12), not the class name

    with pytest.raises(SpecError, match=r"Convert#1 .*move it after ToTensor"):
        compile_pipelines(FakeReader(), {"label": [Convert()], "image": None}, batch_size=2)


def test_torch_module_is_wrapped_and_rejected_before_to_tensor():
    torch = pytest.importorskip("torch")
    transforms = pytest.importorskip("beton_serve.transforms")
    if not hasattr(transforms, "ModuleWrapper"):
        pytest.skip("beton_serve.transforms.ModuleWrapper is not available yet")
    with pytest.raises(SpecError, match=r"ModuleWrapper#1.*after ToTensor"):
        compile_pipelines(
            FakeReader(), {"label": [torch.nn.Identity()], "image": None}, batch_size=2
        )


def test_direct_output_and_copy_into_destinations():
    r = FakeReader()
    plan = compile_pipelines(r, {"image": [AddOne()], "label": [AddIndex()]}, batch_size=4)
    outs = [np.zeros((4, *o.shape), o.dtype) for o in plan.outputs]
    img, lab = plan.run(
        plan.acquire_workspace(), np.array([2, 3], np.uint64), plan.seed_keys(0, 0), outs
    )
    assert np.shares_memory(img, outs[0]) and np.shares_memory(lab, outs[1])
    np.testing.assert_array_equal(outs[0][1], fake_image(3) + 1)
    np.testing.assert_array_equal(outs[1][:2, 0], [2020, 3030])
    assert not outs[0][2:].any()


def test_cache_reuses_compiled_functions_and_refresh():
    r = FakeReader()
    cache = PlanCache()
    p1 = compile_pipelines(r, {"image": [AddOne()], "label": None}, batch_size=2, cache=cache)
    p2 = compile_pipelines(r, {"image": [AddOne()], "label": None}, batch_size=2, cache=cache)
    assert len(cache) == 1
    assert p1.fn_of(p1.nodes[1].op) is p2.fn_of(p2.nodes[1].op)

    class Undescribed(AddIndex):
        spec_params = Operation.spec_params

    # an op without a wire description: not cached, compiled anew
    p3 = compile_pipelines(r, {"label": [Undescribed()], "image": None}, batch_size=2, cache=cache)
    assert len(cache) == 1 and p3.outputs[0].name == "label"
    gen = p1.generation
    assert p1.refresh(1) is False and p1.generation == gen
    old = p1.fn_of(p1.nodes[1].op)
    p1.refresh(2, recompile=True)
    # regenerated: the same code and frozen values, so Compiler.compile hands back the same
    # dispatcher (in-process reuse); a changed frozen value gives another one (test_compiler_reuse)
    assert p1.fn_of(p1.nodes[1].op) is old


def test_refresh_picks_up_new_output_size():
    r = FakeReader()
    dec = FakeImageDecoder()
    plan = compile_pipelines(r, {"image": [dec], "label": None}, batch_size=2)
    r.handlers["image"].shape = (2, 2, 3)
    r.storage_state = np.ascontiguousarray(r.storage_state[:, :2, :2])
    plan._storage_state = r.storage_state
    assert plan.refresh(1) is True
    assert plan.outputs[0].shape == (2, 2, 3)
    (img,) = _run(plan, [4])
    np.testing.assert_array_equal(img[0], fake_image(4)[:2, :2])


def test_default_label_decoder_class_used():
    plan = compile_pipelines(FakeReader(), {"image": None, "label": [AddIndex()]}, batch_size=2)
    assert isinstance(plan.nodes[0].op, FakeLabelDecoder)


class AddShared(Operation):
    """Uses FFCV's shared-state hooks: a (1,) int64 buffer filled once per batch with len(batch)."""

    def declare_state_and_memory(self, previous_state):
        return previous_state, None

    def declare_shared_memory(self, previous_state):
        return AllocationQuery((1,), np.int64)

    def generate_code_for_shared_state(self):
        def init(shared, indices):
            shared[0] = len(indices)

        init.with_indices = True
        return init

    def generate_code(self):
        def add(inp, dst, shared):
            for i in range(inp.shape[0]):
                inp[i, 0] += shared[0]
            return inp

        return add


def test_shared_state_is_filled_once_per_batch_and_passed_last():
    plan = compile_pipelines(FakeReader(), {"image": None, "label": [AddShared()]}, batch_size=4)
    (lab,) = _run(plan, [1, 2, 3])
    np.testing.assert_array_equal(lab[:, 0], [13, 23, 33])


class _RaisesInDeclare(Operation):
    def declare_state_and_memory(self, previous_state):
        raise RuntimeError("my op's own bug")

    def generate_code(self):
        return lambda inp, dst: inp


class _HalfWidth(Operation):
    """Declares its input's shape, returns half of it (a user op's bug)."""

    def declare_state_and_memory(self, previous_state):
        return previous_state, None

    def generate_code(self):
        def half(inp, dst):
            return inp[:, :2]

        return half


def test_a_user_op_that_fails_its_declaration_is_named() -> None:
    """It reached a served client as "internal error: RuntimeError" (the daemon logging an
    ERROR traceback), and in process as a bare RuntimeError."""
    with pytest.raises(SpecError, match=r"_RaisesInDeclare.*declare_state_and_memory raised "):
        compile_pipelines(FakeReader(), {"image": [_RaisesInDeclare()]}, batch_size=2)


def test_a_batch_of_another_shape_than_declared_is_the_op_s_failure() -> None:
    from beton_serve.pipeline._plan import OpFailure

    plan = compile_pipelines(FakeReader(), {"image": [_HalfWidth()], "label": None}, batch_size=2)
    outs = [np.zeros((2, *o.shape), o.dtype) for o in plan.outputs]
    with pytest.raises(OpFailure, match=r"_HalfWidth.*returned a batch of \(2, 2, 5, 3\)") as info:
        _run(plan, [1, 2], outs)
    assert "but declared (2, 4, 5, 3) uint8" in str(info.value)
