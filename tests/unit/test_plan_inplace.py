"""``inplace`` ops (``Operation.inplace``): the planner lets an op work on its parent's buffer,
and a decoder before it then writes the caller's destination. The pixels must be those of the
out-of-place run, bit for bit, in every case the planner may not take the shortcut in."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.pipeline import PipelineSpec, compile_pipelines
from beton_serve.transforms import RandomHorizontalFlip
from helpers.fake_pipeline import AddOne, FakeImageDecoder, FakeReader, fake_image

SEED_KEY_EPOCH = (3, 1)


def _flip_mask(ids: np.ndarray, seed_key: np.uint64, p: float = 0.5) -> np.ndarray:
    from beton_serve.pipeline.rng import uniform

    return np.array([uniform(seed_key, np.uint64(i), 0) < p for i in ids])


def _expected(reader: FakeReader, ids: list[int], seed_key: np.uint64) -> np.ndarray:
    imgs = np.stack([fake_image(i) for i in ids])
    mask = _flip_mask(np.asarray(ids, np.uint64), seed_key)
    out = imgs.copy()
    out[mask] = imgs[mask][:, :, ::-1]
    return out


def _position(plan, op) -> int:
    return next(nd.position for nd in plan.nodes if nd.op is op)


def _run(plan, ids, outs=None):
    ws = plan.acquire_workspace()  # its buffers are allocated when a batch first needs them
    keys = plan.seed_keys(*SEED_KEY_EPOCH)
    res = plan.run(ws, np.asarray(ids, np.uint64), keys, outs)
    return ws, keys, res


def test_decoder_then_flip_writes_the_destination_and_flips_it_in_place() -> None:
    reader = FakeReader()
    dec, flip = FakeImageDecoder(), RandomHorizontalFlip()
    plan = compile_pipelines(reader, {"image": [dec, flip], "label": None}, batch_size=8)
    ids = [5, 0, 17, 3, 9, 30, 2]
    outs = [np.zeros((8, *plan.outputs[0].shape), np.uint8)]
    ws, keys, (img,) = _run(plan, ids, outs)
    want = _expected(reader, ids, keys[_position(plan, flip)])
    assert 0 < _flip_mask(np.asarray(ids, np.uint64), keys[_position(plan, flip)]).sum() < 7
    np.testing.assert_array_equal(img, want)
    np.testing.assert_array_equal(outs[0][: len(ids)], want)
    assert np.shares_memory(img, outs[0])
    # neither op needed its own batch buffer (never allocated): the decoder wrote outs, the
    # flip flipped outs
    assert _position(plan, dec) not in ws.buffers
    assert _position(plan, flip) not in ws.buffers
    # the file's images are untouched
    np.testing.assert_array_equal(reader.storage_state[5], fake_image(5))


def test_without_destinations_the_flip_works_in_the_decoders_buffer() -> None:
    reader = FakeReader()
    dec, flip = FakeImageDecoder(), RandomHorizontalFlip()
    plan = compile_pipelines(reader, {"image": [dec, flip], "label": None}, batch_size=4)
    ids = [1, 2, 3, 4]
    ws, keys, (img,) = _run(plan, ids)
    np.testing.assert_array_equal(img, _expected(reader, ids, keys[_position(plan, flip)]))
    assert np.shares_memory(img, ws.buffers[_position(plan, dec)])
    assert _position(plan, flip) not in ws.buffers


def test_a_branch_reading_the_decoders_buffer_keeps_the_flip_out_of_place() -> None:
    reader = FakeReader()
    dec, flip = FakeImageDecoder(), RandomHorizontalFlip()
    pipes = {
        "image": [dec, flip],
        "label": None,
        "plain": PipelineSpec(dec, transforms=[AddOne()]),
    }
    plan = compile_pipelines(reader, pipes, batch_size=6)
    ids = [7, 8, 9, 10, 11, 12]
    outs = [np.zeros((6, *o.shape), o.dtype) for o in plan.outputs]
    _, keys, (img, plain) = _run(plan, ids, outs)
    np.testing.assert_array_equal(img, _expected(reader, ids, keys[_position(plan, flip)]))
    np.testing.assert_array_equal(plain, np.stack([fake_image(i) for i in ids]) + 1)


@pytest.mark.parametrize("with_outs", [True, False])
def test_a_branch_with_no_numba_op_reads_the_decoded_pixels_not_the_flipped_ones(
    with_outs: bool,
) -> None:
    """``PipelineSpec(dec, transforms=[])`` (or only torch ops) ends at the decoder: the flip
    must not work in place on the buffer that output is. Before the planner checked for it, the
    flip flipped it (without destinations) or the branch got a destination nothing wrote
    (uninitialised memory, with them)."""
    from beton_serve.transforms import ToTensor

    reader = FakeReader()
    dec, flip = FakeImageDecoder(), RandomHorizontalFlip(1.0)
    pipes = {
        "image": [dec, flip],
        "label": None,
        "plain": PipelineSpec(dec, transforms=[]),
        "tensor": PipelineSpec(dec, transforms=[ToTensor()]),
    }
    plan = compile_pipelines(reader, pipes, batch_size=6)
    ids = [7, 8, 9, 10, 11, 12]
    outs = [np.zeros((6, *o.shape), o.dtype) for o in plan.outputs] if with_outs else None
    _, _, (img, plain, tensor) = _run(plan, ids, outs)
    decoded = np.stack([fake_image(i) for i in ids])
    np.testing.assert_array_equal(img, decoded[:, :, ::-1])
    np.testing.assert_array_equal(plain, decoded)
    np.testing.assert_array_equal(np.asarray(tensor), decoded)
    if outs is not None:  # each output in its own destination
        for res, dst in zip((img, plain, tensor), outs, strict=True):
            assert np.shares_memory(res, dst)


def test_two_outputs_ending_at_one_op_get_a_destination_each() -> None:
    reader = FakeReader()
    dec = FakeImageDecoder()
    pipes = {"image": [dec], "label": None, "again": PipelineSpec(dec, transforms=[])}
    plan = compile_pipelines(reader, pipes, batch_size=4)
    ids = [3, 1, 4, 1]
    outs = [np.zeros((4, *o.shape), o.dtype) for o in plan.outputs]
    _, _, (a, b) = _run(plan, ids, outs)
    decoded = np.stack([fake_image(i) for i in ids])
    for res, dst in zip((a, b), outs, strict=True):
        np.testing.assert_array_equal(res, decoded)
        np.testing.assert_array_equal(dst, decoded)  # was: the second stayed zero


class ViewDecoder(FakeImageDecoder):
    """Returns views of the file's images (not the buffer it was given): a flip after it must
    not write them."""

    def generate_code(self):
        def decode(batch_indices, dst, metadata, storage_state):
            lo = int(batch_indices[0])
            return storage_state[lo : lo + batch_indices.shape[0]]

        decode.python = True  # a plain Python function (Operation's call convention)
        return decode


def test_a_head_that_returns_another_buffer_is_copied_not_flipped_in_place() -> None:
    reader = FakeReader()
    before = reader.storage_state.copy()
    flip = RandomHorizontalFlip()
    plan = compile_pipelines(reader, {"image": [ViewDecoder(), flip], "label": None}, batch_size=5)
    ids = [10, 11, 12, 13, 14]
    for outs in ([np.zeros((5, *plan.outputs[0].shape), np.uint8)], None):
        _, keys, (img,) = _run(plan, ids, outs)
        np.testing.assert_array_equal(img, _expected(reader, ids, keys[_position(plan, flip)]))
        np.testing.assert_array_equal(reader.storage_state, before)


class InplaceAddOne(AddOne):
    """``AddOne`` that declares itself ``inplace`` (its loop is correct on one buffer)."""

    inplace = True


def test_a_chain_of_inplace_ops_shares_one_buffer() -> None:
    reader = FakeReader()
    dec, a, b, flip = FakeImageDecoder(), InplaceAddOne(), InplaceAddOne(), RandomHorizontalFlip()
    plan = compile_pipelines(reader, {"image": [dec, a, b, flip], "label": None}, batch_size=4)
    ids = [3, 1, 4, 1]
    outs = [np.zeros((4, *plan.outputs[0].shape), np.uint8)]
    ws, keys, (img,) = _run(plan, ids, outs)
    mask = _flip_mask(np.asarray(ids, np.uint64), keys[_position(plan, flip)])
    want = np.stack([fake_image(i) for i in ids]) + 2
    want[mask] = want[mask][:, :, ::-1]
    np.testing.assert_array_equal(img, want)
    for op in (dec, a, b, flip):
        assert _position(plan, op) not in ws.buffers, op


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((9, 7, 5, 3), np.uint8),
        ((9, 224, 223, 3), np.uint8),
        ((6, 8, 9, 1), np.uint8),
        ((6, 8, 9, 4), np.uint8),
        ((4, 70, 90, 4), np.uint8),  # the cv2 branch out of place
        ((5, 8, 9, 6), np.uint8),
        ((5, 8, 9, 3), np.float32),
        ((5, 8, 9), np.uint8),  # not (N, H, W, C): the generic loop
    ],
)
def test_flip_in_place_equals_flip_out_of_place(shape, dtype) -> None:
    fn = RandomHorizontalFlip().generate_code()
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 255, shape).astype(dtype)
    ids = np.arange(shape[0], dtype=np.uint64) * 7
    out = fn(imgs, np.empty_like(imgs), ids, np.uint64(11)).copy()
    mask = _flip_mask(ids, np.uint64(11))
    assert 0 < mask.sum() < shape[0]
    want = imgs.copy()
    want[mask] = imgs[mask][:, :, ::-1]
    np.testing.assert_array_equal(out, want)
    same = imgs.copy()
    res = fn(same, same, ids, np.uint64(11))
    np.testing.assert_array_equal(res, want)
    # a non-contiguous destination that is the input: still right
    big = np.zeros((shape[0], *shape[1:-1], shape[-1] + 1), dtype) if len(shape) == 4 else None
    if big is not None:
        view = big[..., : shape[-1]]
        view[...] = imgs
        res = fn(view, view, ids, np.uint64(11))
        np.testing.assert_array_equal(res, want)


class OutOfPlaceFlip(RandomHorizontalFlip):
    """A user's variant with its own (out-of-place) code: it must not inherit ``inplace``."""

    def generate_code(self):
        inner = super().generate_code()

        def flip(images, dst, batch_indices, seed_key):
            assert dst is not images, "called in place"
            return inner(images, dst, batch_indices, seed_key)

        flip.with_indices = flip.with_seed = flip.python = True
        return flip


def test_a_subclass_with_its_own_code_is_not_inplace_unless_it_says_so() -> None:
    assert RandomHorizontalFlip.inplace and not OutOfPlaceFlip.inplace
    reader = FakeReader()
    flip = OutOfPlaceFlip()
    plan = compile_pipelines(
        reader, {"image": [FakeImageDecoder(), flip], "label": None}, batch_size=4
    )
    ids = [6, 7, 8, 9]
    outs = [np.zeros((4, *plan.outputs[0].shape), np.uint8)]
    _, keys, (img,) = _run(plan, ids, outs)
    np.testing.assert_array_equal(img, _expected(reader, ids, keys[_position(plan, flip)]))

    class Declared(OutOfPlaceFlip):
        inplace = True

    assert Declared.inplace
