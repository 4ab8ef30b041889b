"""Buffer conversion: zero-copy views of the caller's memory, clear errors for what cannot be one."""
import numpy as np
import pytest
import torch

from collectives import dtypes as D
from collectives.tensors import to_buffer, view_numpy


@pytest.mark.parametrize("dtype,code", [(torch.float32, D.FLOAT32), (torch.bfloat16, D.BFLOAT16),
                                        (torch.complex64, D.COMPLEX64), (torch.bool, D.BOOL)])
def test_torch_tensor_buffer_shares_memory(dtype, code):
    t = torch.zeros(7, dtype=dtype)
    b = to_buffer(t)
    assert (b.ptr, b.count, b.dtype, b.device) == (t.data_ptr(), 7, code, -1)
    assert b.nbytes == t.numel() * t.element_size()


def test_numpy_buffer_and_slices_view_the_right_elements():
    a = np.arange(10, dtype=np.int32)
    b = to_buffer(a)
    s = b.slice(3, 6)
    assert s.numpy().tolist() == [3, 4, 5]
    s.numpy()[:] = -1
    assert a.tolist() == [0, 1, 2, -1, -1, -1, 6, 7, 8, 9]
    assert b.numpy().tolist() == a.tolist()


def test_zero_d_and_empty():
    assert to_buffer(np.array(3.0)).count == 1
    assert to_buffer(torch.empty(0, 3)).count == 0
    assert view_numpy(0, 0, D.FLOAT32).size == 0


def test_bfloat16_bits_view():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert to_buffer(t).numpy().tolist() == [0x3F80, 0xC000]


@pytest.mark.parametrize("bad,exc,match", [
    (np.arange(10.0)[::2], ValueError, "contiguous"),
    (torch.arange(10.0)[::2], ValueError, "contiguous"),
    (torch.ones(2, dtype=torch.complex64).conj(), ValueError, "conjugate"),
    (np.array(["a"]), TypeError, "unsupported dtype"),
    ([1, 2], TypeError, "torch.Tensor or numpy.ndarray"),
])
def test_what_cannot_be_a_buffer_is_named(bad, exc, match):
    with pytest.raises(exc, match=match):
        to_buffer(bad, "tensor")
