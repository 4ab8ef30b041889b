"""flatten/unflatten (bucketing many small tensors into one message) as a specification."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.profiles import examples

from collectives.core import kernels_numpy as fb

core = pytest.importorskip("collectives.engines._core",
                           reason="build it: COLLECTIVES_ONLY=_core setup.py build_ext")
torch = pytest.importorskip("torch")

IMPLS = [pytest.param(core, id="core"), pytest.param(fb, id="fallback")]
NP_TYPES = [np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int8, np.uint8,
            np.int16, np.int32, np.int64, np.bool_]
TORCH_TYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
               torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def make_tensor(rng, use_torch, kind, shape):
    """A contiguous array/tensor of random bytes (NaN bit patterns included)."""
    n = int(np.prod(shape, dtype=np.int64))
    if use_torch:
        dt = TORCH_TYPES[kind % len(TORCH_TYPES)]
        size = torch.empty(0, dtype=dt).element_size()
        raw = rng.integers(0, 256, n * size, dtype=np.uint8)
        if dt == torch.bool:
            raw &= 1
        if n == 0:
            return torch.empty(shape, dtype=dt)
        return torch.from_numpy(raw).view(dt).reshape(shape).clone()
    dt = np.dtype(NP_TYPES[kind % len(NP_TYPES)])
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    if dt == np.bool_:
        raw &= 1
    return raw.view(dt).reshape(shape).copy()


def as_bytes(t):
    if isinstance(t, np.ndarray):
        return t.tobytes()
    if t.numel() == 0:
        return b""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


shape = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
item = st.tuples(st.booleans(), st.integers(0, 20), shape)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(item, min_size=0, max_size=8), seed=st.integers(0, 2**32 - 1))
def test_flatten_then_unflatten_is_the_identity(impl, items, seed):
    """flatten concatenates the bytes in order; unflatten into fresh buffers restores each one."""
    rng = np.random.default_rng(seed)
    bufs = [make_tensor(rng, use_torch, kind, shp) for use_torch, kind, shp in items]
    flat = impl.flatten(bufs)
    assert isinstance(flat, np.ndarray) and flat.dtype == np.uint8
    assert flat.tobytes() == b"".join(as_bytes(b) for b in bufs)
    targets = [np.zeros_like(b) if isinstance(b, np.ndarray) else torch.zeros_like(b) for b in bufs]
    assert impl.unflatten(flat, targets) is targets
    for b, t in zip(bufs, targets):
        assert as_bytes(t) == as_bytes(b)


@pytest.mark.parametrize("impl", IMPLS)
def test_flatten_reuses_out_and_accepts_a_torch_flat(impl):
    a, b = np.arange(3, dtype=np.float32), torch.arange(5, dtype=torch.int16)
    out = np.empty(22, np.uint8)
    assert impl.flatten([a, b], out=out) is out
    back = [np.zeros(3, np.float32), torch.zeros(5, dtype=torch.int16)]
    impl.unflatten(torch.from_numpy(out.copy()), back)
    assert back[0].tolist() == [0, 1, 2] and back[1].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_large_bucket(impl):
    rng = np.random.default_rng(0)
    bufs = [make_tensor(rng, i % 2 == 0, i, (int(rng.integers(1, 300_000)),)) for i in range(6)]
    flat = impl.flatten(bufs)
    assert flat.nbytes == sum(b.nbytes if isinstance(b, np.ndarray) else b.numel() * b.element_size()
                              for b in bufs)
    back = [np.empty_like(b) if isinstance(b, np.ndarray) else torch.empty_like(b) for b in bufs]
    impl.unflatten(flat, back)
    assert all(as_bytes(x) == as_bytes(y) for x, y in zip(bufs, back))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call,exc,words", [
    (lambda m: m.flatten([np.ones(4), np.ones((4, 4))[:, 1]]), ValueError, ["buffers[1]", "contiguous"]),
    (lambda m: m.flatten([np.ones(4), [1.0]]), TypeError, ["buffers[1]"]),
    (lambda m: m.flatten(np.ones(3)[0]), TypeError, ["buffers"]),
    (lambda m: m.flatten([np.ones(4)], out=np.empty(31, np.uint8)), ValueError, ["out", "32"]),
    (lambda m: m.flatten([np.ones(4)], out=b"x" * 32), TypeError, ["out"]),
    (lambda m: m.unflatten(np.zeros(31, np.uint8), [np.ones(4)]), ValueError, ["flat", "32", "31"]),
    (lambda m: m.unflatten(np.zeros(8, np.uint8), [np.frombuffer(b"\0" * 8, np.uint8)]), ValueError,
     ["buffers[0]", "writeable"]),
    (lambda m: m.unflatten(np.zeros(64, np.uint8)[::2], [np.ones(4)]), ValueError, ["flat", "contiguous"]),
    (lambda m: m.unflatten(np.zeros(8, np.uint8), [torch.ones(4, 2).t()]), ValueError,
     ["buffers[0]", "contiguous"]),
])
def test_misuse_raises_naming_the_argument(impl, call, exc, words):
    with pytest.raises(exc) as info:
        call(impl)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_unflatten_checks_everything_before_copying():
    keep = np.ones(4)
    with pytest.raises(ValueError):
        core.unflatten(np.zeros(40, np.uint8), [keep, np.ones(2)])
    assert (keep == 1).all()
