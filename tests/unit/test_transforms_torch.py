"""The torch-side ops (ToTensor onward), run as Python on torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.pipeline import State
from beton_serve.transforms import (
    Convert,
    ModuleWrapper,
    Squeeze,
    ToDevice,
    ToTensor,
    ToTorchImage,
    View,
)

torch = pytest.importorskip("torch")


def jit(shape, dtype=np.uint8) -> State:
    return State(jit_mode=True, device="cpu", shape=shape, dtype=np.dtype(dtype))


def test_to_tensor_zero_copy_and_idempotent() -> None:
    op = ToTensor()
    st, q = op.declare_state_and_memory(jit((4, 5, 3)))
    assert q is None and not st.jit_mode and st.dtype == torch.uint8
    st2, _ = ToTensor().declare_state_and_memory(st)
    assert st2 == st
    x = np.arange(2 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 4, 5, 3)
    t = op.generate_code()(x, None)
    assert isinstance(t, torch.Tensor) and np.shares_memory(t.numpy(), x)
    assert ToTensor().generate_code()(t, None) is t


def test_to_torch_image_view_copy_and_int16() -> None:
    tstate = State(jit_mode=False, device="cpu", shape=(4, 5, 3), dtype=torch.int16)
    op = ToTorchImage()
    st, q = op.declare_state_and_memory(tstate)
    assert st.shape == (3, 4, 5) and st.dtype == torch.float16 and q is None
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 4, 5, 3)).astype(np.float16))
    out = op.generate_code()(x.view(torch.int16), None)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 4, 5)
    assert torch.equal(out, x.permute(0, 3, 1, 2))
    assert out.is_contiguous(memory_format=torch.channels_last)
    op2 = ToTorchImage(channels_last=False, convert_back_int16=False)
    st2, q2 = op2.declare_state_and_memory(tstate)
    assert st2.dtype == torch.int16 and q2.shape == (3, 4, 5)
    dst = torch.empty(4, 3, 4, 5, dtype=torch.int16)
    out2 = op2.generate_code()(x.view(torch.int16), dst)
    assert out2.is_contiguous() and torch.equal(out2, x.view(torch.int16).permute(0, 3, 1, 2))


def test_to_device_cpu_copies_into_buffer_keeping_channels_last() -> None:
    op = ToDevice("cpu")
    _, q = op.declare_state_and_memory(
        State(jit_mode=False, device="cpu", shape=(3, 4, 5), dtype=torch.uint8)
    )
    assert q.device == "cpu" and q.shape == (3, 4, 5)
    x = torch.arange(2 * 4 * 5 * 3, dtype=torch.uint8).reshape(2, 4, 5, 3).permute(0, 3, 1, 2)
    buf = torch.zeros(6, 3, 4, 5, dtype=torch.uint8)
    out = op.generate_code()(x, buf)
    assert torch.equal(out, x) and out.is_contiguous(memory_format=torch.channels_last)
    assert out.data_ptr() == buf.data_ptr()


def test_convert_view_squeeze_module() -> None:
    base = State(jit_mode=False, device="cpu", shape=(1,), dtype=torch.int64)
    st, _ = Convert(torch.float16).declare_state_and_memory(base)
    assert st.dtype == torch.float16
    labels = torch.arange(4).reshape(4, 1)
    assert Convert("float32").generate_code()(labels, None).dtype == torch.float32
    sq = Squeeze()
    st, _ = sq.declare_state_and_memory(base)
    assert st.shape == ()
    assert sq.generate_code()(labels.clone(), None).shape == (4,)
    st, _ = Squeeze(1).declare_state_and_memory(base)
    assert st.shape == ()
    assert Squeeze(1).generate_code()(labels.clone(), None).shape == (4,)
    # View on numpy (jit state) and on torch
    v = View(np.dtype(np.int16))
    st, _ = v.declare_state_and_memory(jit((2,), np.float16))
    assert st.dtype == np.int16 and not st.jit_mode
    a = np.ones((3, 2), np.float16)
    np.testing.assert_array_equal(v.generate_code()(a, None), a.view(np.int16))
    tv = View(torch.float16).generate_code()(torch.from_numpy(a.view(np.int16)), None)
    assert tv.dtype == torch.float16 and torch.equal(tv, torch.from_numpy(a))
    mod = ModuleWrapper(torch.nn.ReLU())
    st, _ = mod.declare_state_and_memory(base)
    assert torch.equal(
        mod.generate_code()(torch.tensor([-1.0, 2.0]), None), torch.tensor([0.0, 2.0])
    )
    with pytest.raises(SpecError):
        mod.declare_state_and_memory(jit((1,)))
    with pytest.raises(NotImplementedError):
        mod.spec_params()
