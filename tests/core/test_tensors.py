"""Buffer conversion: zero-copy views of the caller's memory, clear errors for what cannot be one."""
import numpy as np
import pytest
from collectives.core import dtypes as D
from collectives.core.tensors import to_buffer
from collectives.core.views import view_numpy

try:
    import torch
except ImportError:  # a NumPy-only install: the tests that need torch skip
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'collectives[torch]')")


@needs_torch
@pytest.mark.parametrize("dtype,code", [("float32", D.FLOAT32), ("bfloat16", D.BFLOAT16),
                                        ("complex64", D.COMPLEX64), ("bool", D.BOOL)])
def test_torch_tensor_buffer_shares_memory(dtype, code):
    t = torch.zeros(7, dtype=getattr(torch, dtype))
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


@needs_torch
def test_zero_d_and_empty():
    assert to_buffer(np.array(3.0)).count == 1
    assert to_buffer(torch.empty(0, 3)).count == 0
    assert view_numpy(0, 0, D.FLOAT32).size == 0


@needs_torch
def test_bfloat16_bits_view():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert to_buffer(t).numpy().tolist() == [0x3F80, 0xC000]


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: np.arange(10.0)[::2], ValueError, "contiguous"),
    pytest.param(lambda: torch.arange(10.0)[::2], ValueError, "contiguous", marks=needs_torch),
    pytest.param(lambda: torch.ones(2, dtype=torch.complex64).conj(), ValueError, "conjugate",
                 marks=needs_torch),
    (lambda: np.array(["a"]), TypeError, "unsupported dtype"),
    (lambda: [1, 2], TypeError, "torch.Tensor or numpy.ndarray"),
], ids=["numpy-strided", "torch-strided", "torch-conj", "numpy-str", "list"])
def test_what_cannot_be_a_buffer_is_named(bad, exc, match):
    bad = bad()
    with pytest.raises(exc, match=match):
        to_buffer(bad, "tensor")


# ---- the compiled Buffer and the front end's C fast path (collectives.engines._buffer) --------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.support.profiles import examples  # noqa: E402

from collectives.core import convert, staging, tensors  # noqa: E402
from collectives.core.tensors import Buffer, _PyBuffer  # noqa: E402

try:
    from collectives.engines import _buffer
except ImportError:  # pragma: no cover - the extensions are built in CI
    _buffer = None

needs_ext = pytest.mark.skipif(_buffer is None, reason="collectives.engines._buffer is not built")
BUFFER_TYPES = [_PyBuffer] + ([_buffer.Buffer] if _buffer is not None else [])
NP_DTYPES = [np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int8, np.uint8,
             np.int16, np.int32, np.int64, np.longlong, np.intc, np.bool_]


def fields(b):
    return (b.ptr, b.count, b.dtype, b.itemsize, b.device, b.obj is not None)


@needs_ext
def test_the_compiled_buffer_is_the_one_in_use():
    assert Buffer is _buffer.Buffer
    assert convert.buffer is _buffer.buffer


@pytest.mark.parametrize("cls", BUFFER_TYPES)
def test_both_buffer_types_behave_alike(cls):
    a = np.arange(6, dtype=np.float64)
    b = cls(a.__array_interface__["data"][0], 6, D.FLOAT64, -1, a)
    assert (b.itemsize, b.nbytes) == (8, 48)
    assert b.slice(2, 4).numpy().tolist() == [2.0, 3.0]
    assert type(b.slice(2, 4)) is cls
    assert b.bytes_view().size == 48
    assert "count=6" in repr(b) and "float64" in repr(b)
    b.count = 3  # attributes stay assignable
    assert b.numpy().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="dtype"):
        cls(0, 1, 99)


@needs_ext
def test_compiled_buffer_exports_host_memory_and_refuses_device_memory():
    a = np.arange(4, dtype=np.int32)
    b = to_buffer(a)
    m = memoryview(b)
    assert (m.nbytes, m.readonly, m.format) == (16, False, "B")
    np.frombuffer(b, np.int32)[1] = 7  # writes go to the array
    assert a[1] == 7
    with pytest.raises(BufferError, match="CUDA"):
        memoryview(_buffer.Buffer(0x1000, 4, D.FLOAT32, 0))
    with pytest.raises(BufferError, match="null"):
        memoryview(_buffer.Buffer(0, 4, D.FLOAT32))
    assert memoryview(_buffer.Buffer(0, 0, D.FLOAT32)).nbytes == 0


def arrays():
    """Arrays of every dtype and layout, the odd ones (views, read-only, byte-swapped) included."""
    @st.composite
    def build(draw):
        dt = np.dtype(draw(st.sampled_from(NP_DTYPES + [np.uint16, np.float32])))
        if draw(st.booleans()):
            dt = dt.newbyteorder(">")
        shape = draw(st.sampled_from([(), (0,), (1,), (5,), (3, 4), (2, 0)]))
        a = np.zeros(shape, dt)
        how = draw(st.sampled_from(["plain", "strided", "readonly", "fortran"]))
        if how == "strided" and a.ndim:
            a = np.zeros((shape[0] * 2,) + shape[1:], dt)[::2]
        elif how == "readonly":
            a.flags.writeable = False
        elif how == "fortran" and a.ndim == 2:
            a = np.asfortranarray(np.zeros(shape[::-1], dt).T)
        return a
    return build()


def outcome(fn, a):
    try:
        b = fn(a, "tensor")
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return fields(b)


@needs_ext
@settings(max_examples=examples(300), deadline=None)
@given(arrays())
def test_fast_buffer_agrees_with_to_buffer(a):
    """The C path gives what to_buffer gives: the same Buffer or the same error."""
    assert outcome(_buffer.buffer, a) == outcome(to_buffer, a)


@needs_torch
@needs_ext
@pytest.mark.parametrize("make", [
    lambda: torch.arange(5.0), lambda: torch.zeros(2, 3, dtype=torch.bfloat16),
    lambda: torch.arange(10.0)[::2], lambda: torch.ones(2, dtype=torch.complex64).conj(),
    lambda: torch.zeros(0), lambda: torch.arange(4)[1:],
])
def test_fast_buffer_agrees_with_to_buffer_for_torch(make):
    t = make()
    convert.buffer(torch.zeros(1))  # the first torch tensor teaches the C path the torch types
    assert outcome(_buffer.buffer, t) == outcome(to_buffer, t)


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(0, 6), st.integers(0, 6), st.integers(1, 4), st.integers(-30, 30),
       st.sampled_from([D.FLOAT32, D.INT16]), st.booleans())
def test_disjoint_gather_agrees_with_the_python_check(n_in, extra, size, offset, dt, same_dtype):
    base = 0x10000
    inp = Buffer(base + 4 * offset, n_in, dt)
    out = Buffer(base, n_in * size + (extra if extra % 3 == 0 else 0),
                 dt if same_dtype else D.FLOAT64)
    want = tensors._py_disjoint_gather(out, inp, size)
    assert bool(tensors.disjoint_gather(out, inp, size)) == bool(want)


@needs_ext
@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.integers(-8, 40), st.integers(0, 6)), min_size=1, max_size=5),
       st.integers(-8, 40), st.integers(0, 6), st.integers(0, 4))
def test_separate_blocks_agrees_with_the_python_check(blocks, in_at, in_count, rank):
    """Back-to-back lists, overlaps with the input, the input as this rank's own entry."""
    base = 0x10000
    outs = [Buffer(base + 4 * at, count, D.FLOAT32) for at, count in blocks]
    inp = Buffer(base + 4 * in_at, in_count, D.FLOAT32)
    want = staging._py_separate_blocks(outs, inp, rank)
    assert bool(_buffer.separate_blocks(outs, inp, rank)) == bool(want)


@needs_torch
@needs_ext
@pytest.mark.parametrize("tensors,kw", [
    (lambda: [np.ones(3, np.float32), torch.zeros(3)], {}),
    (lambda: [np.ones(3, np.float32), np.ones(3, np.float64)], {}),
    (lambda: [np.ones(3, np.float32), np.ones(4, np.float32)], {"count": 3}),
    (lambda: [np.ones(3, np.float32)], {"length": 2}),
    (lambda: [np.ones(3, np.float32), np.arange(6.0, dtype=np.float32)[::2]], {}),
    (lambda: (torch.ones(2), torch.ones(2, dtype=torch.float64)), {"dtype": D.FLOAT32}),
    (lambda: np.ones(3), {}),
    (lambda: [], {}),
], ids=["mixed-torch", "dtypes", "count", "length", "strided", "torch-tuple", "not-a-list", "empty"])
def test_fast_buffers_agrees_with_the_python_list_path(tensors, kw):
    """The same Buffers, or the same exception and message, for lists of tensors."""
    tensors = tensors()
    def run(f):
        try:
            return [(b.ptr, b.count, b.dtype) for b in f(tensors, "tensor_list", **kw)]
        except (TypeError, ValueError) as e:
            return type(e), str(e)
    assert run(_buffer.buffers) == run(convert._py_buffers)


def test_numpy_and_torch_dtypes_follow_the_one_list_of_codes():
    """tensors' two dtype tables come from dtypes.DTYPE_NAMES: every code but bfloat16 has
    the NumPy dtype of its name, every code the torch dtype, each of the code's item size."""
    from collectives.core.tensors import _torch_table
    from collectives.core.views import _NP_CODES
    assert sorted(_NP_CODES.values()) == sorted(set(D.DTYPE_NAMES) - {D.BFLOAT16})
    for dt, code in _NP_CODES.items():
        assert (dt.name, dt.itemsize) == (D.DTYPE_NAMES[code], D.ITEMSIZE[code])
    assert _NP_CODES[np.dtype(np.bool_)] == D.BOOL
    torch = pytest.importorskip("torch", reason="the torch table needs torch")
    assert sorted(_torch_table().values()) == sorted(D.DTYPE_NAMES)
    for dt, code in _torch_table().items():
        assert (str(dt), dt.itemsize) == (f"torch.{D.DTYPE_NAMES[code]}", D.ITEMSIZE[code])
    assert _torch_table()[torch.bfloat16] == D.BFLOAT16
