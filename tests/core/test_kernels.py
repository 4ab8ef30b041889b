"""The reduction kernels (collectives.engines._core, and the NumPy _fallback) as a specification.

Each property first, then the examples that pin it down. Float results are compared
bit for bit (NaN compared as NaN, payload ignored; -0.0 differs from 0.0).
"""
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support import ROOT
from tests.support.profiles import examples

from collectives.core import kernels_numpy as fb
from collectives.core import dtypes as D
from collectives.core.tensors import Buffer, to_buffer

core = pytest.importorskip("collectives.engines._core",
                           reason="build it: COLLECTIVES_ONLY=_core setup.py build_ext")
torch = pytest.importorskip("torch")

IMPLS = [pytest.param(core, id="core"), pytest.param(fb, id="fallback")]
ALL_DTYPES = sorted(D.DTYPE_NAMES)
OPS = [D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR]
VALID = [(dt, op) for dt in ALL_DTYPES for op in OPS if D.op_valid(dt, op)]
TORCH_DTYPE = {
    D.FLOAT16: torch.float16, D.BFLOAT16: torch.bfloat16, D.FLOAT32: torch.float32,
    D.FLOAT64: torch.float64, D.COMPLEX64: torch.complex64, D.COMPLEX128: torch.complex128,
    D.INT8: torch.int8, D.UINT8: torch.uint8, D.INT16: torch.int16, D.INT32: torch.int32,
    D.INT64: torch.int64, D.BOOL: torch.bool,
}
NP_DTYPE = {D.FLOAT16: np.float16, D.FLOAT32: np.float32, D.FLOAT64: np.float64,
            D.COMPLEX64: np.complex64, D.COMPLEX128: np.complex128, D.INT8: np.int8,
            D.UINT8: np.uint8, D.INT16: np.int16, D.INT32: np.int32, D.INT64: np.int64,
            D.BOOL: np.bool_}
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def lengths_for(dtype):
    """0, 1, lengths around vector widths, and around the chunk size."""
    chunk = core.chunk_elems(dtype)
    return [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 255, 257,
            chunk - 1, chunk, chunk + 1, 2 * chunk + 5]


# ---- value generation ----------------------------------------------------------------
SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 3.0e38,
            -3.4e38, 1e-40, -1e-45, 5.96e-8, 2.98e-8, 1e-5]


def random_values(rng, dtype, n):
    """A host tensor of ``dtype``: raw random bits, scaled normals and special values mixed."""
    tdt = TORCH_DTYPE[dtype]
    itemsize = D.ITEMSIZE[dtype]
    if dtype == D.BOOL:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_))
    if dtype in D.INTEGER:
        bits = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
        return torch.from_numpy(bits.view(NP_DTYPE[dtype]).copy())
    width = 2 if dtype in D.COMPLEX else 1
    comp = {D.COMPLEX64: D.FLOAT32, D.COMPLEX128: D.FLOAT64}.get(dtype, dtype)
    csize = D.ITEMSIZE[comp]
    m = n * width
    kind = rng.integers(0, 3)
    if kind == 0:  # raw bits: subnormals, NaN payloads, everything
        raw = rng.integers(0, 256, m * csize, dtype=np.uint8).view(BITS[csize])
        t = torch.from_numpy(raw.copy()).view(TORCH_DTYPE[comp])
    else:
        scale = 10.0 ** rng.uniform(-6, 6)
        vals = rng.standard_normal(m) * scale
        if kind == 2 and m:
            idx = rng.integers(0, m, max(1, m // 4))
            vals[idx] = rng.choice(np.array(SPECIALS), idx.size)
        t = torch.from_numpy(vals).to(TORCH_DTYPE[comp])
    t = t.contiguous()
    if width == 2:
        t = torch.view_as_complex(t.view(n, 2)) if n else torch.empty(0, dtype=tdt)
    return t.reshape(n).contiguous()


def raw(t):
    """The tensor's bits as a NumPy unsigned-int array (complex as two components)."""
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8).reshape(-1)
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                               8: torch.int64}[t.element_size()]).numpy().reshape(-1)


def assert_same(got, ref, what=""):
    """Bitwise equality; NaN equals any NaN."""
    assert got.dtype == ref.dtype and got.numel() == ref.numel(), what
    g, r = got.contiguous(), ref.contiguous()
    if g.is_complex():
        g, r = torch.view_as_real(g), torch.view_as_real(r)
    if g.is_floating_point():
        gn, rn = torch.isnan(g.float()), torch.isnan(r.float())
        bad = np.flatnonzero(gn.reshape(-1).numpy() != rn.reshape(-1).numpy())
        assert bad.size == 0, f"{what}: NaN mismatch at {bad[:5]}: got {g.reshape(-1)[bad[:5]]}, " \
                              f"ref {r.reshape(-1)[bad[:5]]}"
        keep = ~gn.reshape(-1).numpy()
        gb, rb = raw(g)[keep], raw(r)[keep]
    else:
        gb, rb = raw(g), raw(r)
    bad = np.flatnonzero(gb != rb)
    assert bad.size == 0, f"{what}: {bad.size} elements differ, first at {bad[:5]}: " \
                          f"got {gb[bad[:5]]}, ref {rb[bad[:5]]}"


# ---- references, independent of the kernels -------------------------------------------
def _f32_minmax(a, b, op):
    with np.errstate(invalid="ignore"):
        f = np.minimum if op == D.MIN else np.maximum  # NaN propagates, tie -> second operand
        return f(a, b)


def reference(x, y, dtype, op):
    """op(x, y) from torch/NumPy elementwise ops (documented where it is not torch)."""
    if dtype == D.BOOL:
        xn, yn = x.numpy(), y.numpy()
        f = {D.SUM: np.logical_or, D.MAX: np.logical_or, D.BOR: np.logical_or,
             D.PRODUCT: np.logical_and, D.MIN: np.logical_and, D.BAND: np.logical_and,
             D.BXOR: np.logical_xor}[op]
        return torch.from_numpy(f(xn, yn))
    if op == D.SUM:
        if dtype in D.COMPLEX:
            # componentwise, as torch.distributed reduces complex tensors (view_as_real);
            # torch.add on complex turns a NaN component into NaN+NaNj
            with np.errstate(all="ignore"):
                return torch.from_numpy(x.numpy() + y.numpy())
        return torch.add(x, y)  # integers wrap, halves round once from float32
    if op == D.PRODUCT:
        if dtype in D.COMPLEX:
            # torch and NumPy use FMA in complex products; we round every product
            xr, yr = torch.view_as_real(x).numpy(), torch.view_as_real(y).numpy()
            out = np.empty_like(xr)
            with np.errstate(all="ignore"):
                out[:, 0] = xr[:, 0] * yr[:, 0] - xr[:, 1] * yr[:, 1]
                out[:, 1] = xr[:, 0] * yr[:, 1] + xr[:, 1] * yr[:, 0]
            return torch.from_numpy(out.reshape(-1).view(x.numpy().dtype))
        return torch.mul(x, y)
    if op in (D.MIN, D.MAX):
        if dtype in D.INTEGER:
            return torch.minimum(x, y) if op == D.MIN else torch.maximum(x, y)
        # NumPy's rule (NaN propagates, a tie goes to the second operand), which torch's
        # vectorised loop shares; torch's scalar tail picks the first operand on ties.
        xf, yf = x.float().numpy() if dtype in (D.FLOAT16, D.BFLOAT16) else x.numpy(), \
            y.float().numpy() if dtype in (D.FLOAT16, D.BFLOAT16) else y.numpy()
        return torch.from_numpy(_f32_minmax(xf, yf, op)).to(x.dtype)
    f = {D.BAND: torch.bitwise_and, D.BOR: torch.bitwise_or, D.BXOR: torch.bitwise_xor}[op]
    return f(x, y)


case = st.tuples(st.sampled_from(VALID), st.integers(0, 2**32 - 1), st.integers(0, 10**6))


def pick_length(dtype, seed, sizer):
    rng = np.random.default_rng(seed)
    if sizer % 10 == 0:  # now and then a few MB
        return int(rng.integers(1, (4 << 20) // D.ITEMSIZE[dtype]))
    choices = lengths_for(dtype)
    return int(choices[sizer % len(choices)])


FAST = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- reduce_into ---------------------------------------------------------------------
@FAST
@given(case)
def test_reduce_into_equals_reference_bitwise(c):
    """dst = op(dst, src) equals torch/NumPy for every valid dtype x op, any length and values."""
    (dtype, op), seed, sizer = c
    rng = np.random.default_rng(seed)
    n = pick_length(dtype, seed, sizer)
    x, y = random_values(rng, dtype, n), random_values(rng, dtype, n)
    ref = reference(x, y, dtype, op)
    got = x.clone()
    if dtype != D.BFLOAT16 and sizer % 2:  # NumPy views of the same memory
        core.reduce_into(got.numpy(), y.numpy(), op)
    else:
        core.reduce_into(got, y, op)
    assert_same(got, ref, f"{D.DTYPE_NAMES[dtype]} {D.OP_NAMES[op]} n={n}")


@pytest.mark.parametrize("dtype,op", VALID)
def test_every_dtype_op_at_vector_edges(dtype, op):
    """Every valid combination, at each length around vector widths and the chunk size."""
    rng = np.random.default_rng(dtype * 31 + op)
    for n in lengths_for(dtype):
        x, y = random_values(rng, dtype, n), random_values(rng, dtype, n)
        got = x.clone()
        core.reduce_into(got, y, op)
        assert_same(got, reference(x, y, dtype, op), f"n={n}")


@pytest.mark.parametrize("dtype", [D.FLOAT16, D.BFLOAT16, D.FLOAT32, D.FLOAT64])
def test_half_types_round_like_torch_on_every_bit_pattern(dtype):
    """All 65536 x a few half-type bit patterns: SUM and PRODUCT equal torch bit for bit."""
    if D.ITEMSIZE[dtype] == 2:
        bits = np.arange(1 << 16, dtype=np.uint16)
        x = torch.from_numpy(bits.copy()).view(TORCH_DTYPE[dtype])
    else:
        x = random_values(np.random.default_rng(dtype), dtype, 1 << 16)
    for other in (1.0, -0.5, 3.0e-3, 1.0e-5, 300.0, float("inf")):
        y = torch.full_like(x, other)
        for op, f in ((D.SUM, torch.add), (D.PRODUCT, torch.mul)):
            got = x.clone()
            core.reduce_into(got, y, op)
            assert_same(got, f(x, y), f"{D.DTYPE_NAMES[dtype]} {D.OP_NAMES[op]} with {other}")


def test_min_max_propagate_nan_and_pick_second_on_ties():
    """MIN/MAX: NaN in either operand gives NaN; 0.0 vs -0.0 returns the second operand."""
    a = np.array([np.nan, 1.0, 2.0, 0.0, -0.0, np.inf], np.float32)
    b = np.array([1.0, np.nan, 1.0, -0.0, 0.0, np.nan], np.float32)
    lo = core.reduce_into(a.copy(), b, D.MIN)
    hi = core.reduce_into(a.copy(), b, D.MAX)
    assert np.isnan(lo[[0, 1, 5]]).all() and np.isnan(hi[[0, 1, 5]]).all()
    assert lo[2] == 1.0 and hi[2] == 2.0
    assert np.signbit(lo[3]) and not np.signbit(lo[4])
    assert np.signbit(hi[3]) and not np.signbit(hi[4])


def test_bfloat16_nan_is_canonical_and_rounding_is_nearest_even():
    """bfloat16 results: NaN stored as 0x7FC0; ties round to even (torch's c10::BFloat16)."""
    x = torch.tensor([0x7F81, 0x3F80, 0x3F80, 0x3F81], dtype=torch.int16).view(torch.bfloat16)
    # 1.0 + 2^-8 is a tie between 1.0 and 1.0078125 -> 1.0 (even); 1.0078125 + 2^-8 -> 1.015625
    y = torch.tensor([0x3F80, 0x3B80, 0x3B80, 0x3B80], dtype=torch.int16).view(torch.bfloat16)
    got = x.clone()
    core.reduce_into(got, y, D.SUM)
    assert [v & 0xFFFF for v in got.view(torch.int16).tolist()] == [0x7FC0, 0x3F80, 0x3F80, 0x3F82]


def test_integer_sum_and_product_wrap_around():
    """Integer SUM/PRODUCT wrap modulo 2**bits, as torch and NumPy do."""
    a = np.array([127, -128, 100, -1], np.int8)
    assert core.reduce_into(a.copy(), np.array([1, -1, 100, -1], np.int8), D.SUM).tolist() == \
        [-128, 127, -56, -2]
    assert core.reduce_into(a.copy(), np.array([2, 2, 3, -128], np.int8), D.PRODUCT).tolist() == \
        [-2, 0, 44, -128]
    big = np.array([2**62, -(2**63)], np.int64)
    assert core.reduce_into(big.copy(), big, D.SUM).tolist() == [-(2**63), 0]
    u = np.array([255], np.uint8)
    assert core.reduce_into(u.copy(), u, D.PRODUCT).tolist() == [1]
    s = np.array([-32768, 32767], np.int16)
    assert core.reduce_into(s.copy(), s, D.PRODUCT).tolist() == [0, 1]


def test_bool_sum_is_or_and_product_is_and():
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    assert core.reduce_into(a.copy(), b, D.SUM).tolist() == [False, True, True, True]
    assert core.reduce_into(a.copy(), b, D.PRODUCT).tolist() == [False, False, False, True]
    assert core.reduce_into(a.copy(), b, D.BXOR).tolist() == [False, True, True, False]


def test_reduce_into_returns_dst_and_accepts_same_buffer():
    a = np.arange(10, dtype=np.float64)
    assert core.reduce_into(a, a, D.SUM) is a
    assert a.tolist() == [2.0 * i for i in range(10)]


# ---- reduce_many ---------------------------------------------------------------------
@FAST
@given(case, st.integers(1, 6), st.one_of(st.none(), st.integers(0, 5)))
def test_reduce_many_equals_repeated_reduce(c, k, dst_at):
    """reduce_many(dst, [s0..sk], op) == s0 reduced with s1, then s2, ... (halves round each
    step), also when dst is one of the sources (``dst_at``; from the third on, each chunk is
    folded on the stack: n spans several chunks)."""
    (dtype, op), seed, sizer = c
    rng = np.random.default_rng(seed)
    n = pick_length(dtype, seed, sizer)
    srcs = [random_values(rng, dtype, n) for _ in range(k)]
    expect = srcs[0].clone()
    for s in srcs[1:]:
        core.reduce_into(expect, s, op)
    if dst_at is not None:
        j = dst_at % k
        dst = srcs[j].clone()
        core.reduce_many(dst, srcs[:j] + [dst] + srcs[j + 1:], op)
    else:
        dst = torch.empty_like(srcs[0])
        core.reduce_many(dst, srcs, op)
    assert_same(dst, expect, f"k={k} n={n}")


def test_reduce_many_numpy_sources_mixed_with_torch():
    srcs = [np.full(1000, i, np.int32) for i in range(1, 5)]
    dst = torch.zeros(1000, dtype=torch.int32)
    core.reduce_many(dst, [torch.from_numpy(srcs[0])] + srcs[1:], D.SUM)
    assert (dst == 10).all()


# ---- scale -----------------------------------------------------------------------------
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(D.FLOATING | D.COMPLEX)), st.integers(0, 2**32 - 1),
       st.sampled_from([0.5, 0.25, 1 / 3, 1 / 7, -2.0, 1e-3, 3.0, 0.1]), st.integers(0, 10**6))
def test_scale_equals_torch_mul(dtype, seed, factor, sizer):
    """scale(dst, f) == dst.mul_(f) in torch, bit for bit (complex: times f + 0j), but for
    the sign of a complex zero: torch's own complex product gives -0.0 or +0.0 for the same
    input by the element's place in the tensor (its vector loop and its tail round
    ``re * f - im * 0`` differently where ``re * f`` underflows to -0.0), so complex zeros
    are compared as zeros."""
    rng = np.random.default_rng(seed)
    n = pick_length(dtype, seed, sizer)
    x = random_values(rng, dtype, n)
    got = x.clone()
    core.scale(got, factor)
    ref = x.clone().mul_(factor)
    if got.is_complex():
        got, ref = got + 0.0, ref + 0.0  # -0.0 + 0.0 == +0.0; every other value unchanged
    assert_same(got, ref, f"{D.DTYPE_NAMES[dtype]} * {factor}")


# ---- _fallback agrees with _core ---------------------------------------------------------
@FAST
@given(case, st.integers(1, 4))
def test_fallback_agrees_with_core(c, k):
    (dtype, op), seed, sizer = c
    rng = np.random.default_rng(seed)
    n = pick_length(dtype, seed, sizer) if sizer % 10 else 4097
    srcs = [random_values(rng, dtype, n) for _ in range(k + 1)]
    a, b = srcs[0].clone(), srcs[0].clone()
    core.reduce_into(a, srcs[1], op)
    fb.reduce_into(b, srcs[1], op)
    assert_same(b, a, "reduce_into")
    a, b = torch.empty_like(srcs[0]), torch.empty_like(srcs[0])
    core.reduce_many(a, srcs, op)
    fb.reduce_many(b, srcs, op)
    assert_same(b, a, "reduce_many")
    if dtype in D.FLOATING or dtype in D.COMPLEX:
        a, b = srcs[0].clone(), srcs[0].clone()
        core.scale(a, 0.3)
        fb.scale(b, 0.3)
        assert_same(b, a, "scale")


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "baseline"])
def test_every_instruction_set_gives_the_same_bits(isa):
    """The AVX-512 (with and without AVX512_BF16), AVX2 and portable kernels agree."""
    best = core.kernel_isa()
    reference_isa = "baseline" if isa == best else best
    rng = np.random.default_rng(7)
    try:
        assert core._force_isa(reference_isa)
        cases = []
        for dtype, op in VALID:
            for n in (1, 17, 1000, core.chunk_elems(dtype) + 3):
                x, y = random_values(rng, dtype, n), random_values(rng, dtype, n)
                got = x.clone()
                core.reduce_into(got, y, op)
                cases.append((dtype, op, x, y, got))
        if not core._force_isa(isa):
            pytest.skip(f"this CPU lacks {isa}")
        for dtype, op, x, y, expect in cases:
            got = x.clone()
            core.reduce_into(got, y, op)
            assert_same(got, expect, f"{isa} {D.DTYPE_NAMES[dtype]} {D.OP_NAMES[op]} n={x.numel()}")
            if dtype in D.FLOATING or dtype in D.COMPLEX:
                a, b = x.clone(), x.clone()
                core.scale(a, 0.3)
                assert_same(a, b.mul_(0.3), f"{isa} scale {D.DTYPE_NAMES[dtype]}")
    finally:
        assert core._force_isa(best)


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "baseline"])
def test_bfloat16_fast_path_falls_back_on_denormal_and_nan_results(isa):
    """Vectors whose result holds a denormal or NaN round exactly like the others (torch)."""
    best = core.kernel_isa()
    try:
        if not core._force_isa(isa):
            pytest.skip(f"this CPU lacks {isa}")
        x = torch.randn(4096).to(torch.bfloat16)
        y = torch.randn(4096).to(torch.bfloat16)
        x[100] = 1e-39  # denormal in bfloat16 too
        x[1000] = 1.5e-38
        y[1000] = -1.4e-38  # difference is denormal
        x[2000] = float("nan")
        y[3000] = float("inf")
        x[3000] = float("-inf")  # inf - inf = NaN
        for op, f in ((D.SUM, torch.add), (D.PRODUCT, torch.mul)):
            got = x.clone()
            core.reduce_into(got, y, op)
            assert_same(got, f(x, y), f"{isa} {D.OP_NAMES[op]}")
        got = x.clone()
        core.reduce_into(got, y, D.SUM)
        assert got.view(torch.int16)[2000].item() == 0x7FC0
    finally:
        assert core._force_isa(best)


# ---- inputs: NumPy, torch, Buffer, pointers ----------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_and_torch_inputs_are_used_in_place(impl):
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    t = torch.ones(100)
    impl.reduce_into(a, t, D.SUM)  # shapes may differ; counts match
    assert a[9, 9] == 100.0
    impl.reduce_into(t, a, D.MAX)
    assert t[99].item() == 100.0
    bf = torch.ones(33, dtype=torch.bfloat16)
    impl.reduce_into(bf, torch.full((33,), 2.0, dtype=torch.bfloat16), D.PRODUCT)
    assert (bf == 2).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_pointer_entry_points(impl):
    a = np.arange(64, dtype=np.float64)
    b = np.ones(64)
    c = np.full(64, 2.0)
    impl.reduce_ptr(a.ctypes.data, b.ctypes.data, 64, D.FLOAT64, D.SUM)
    assert a[5] == 6.0
    out = np.empty(64)
    impl.reduce_many_ptr(out.ctypes.data, [a.ctypes.data, b.ctypes.data, c.ctypes.data], 64,
                         D.FLOAT64, D.PRODUCT)
    assert out[5] == 12.0
    impl.scale_ptr(out.ctypes.data, 64, D.FLOAT64, 0.5)
    assert out[5] == 6.0
    dst = np.zeros(64)
    impl.copy_ptr(dst.ctypes.data, out.ctypes.data, out.nbytes)
    assert np.array_equal(dst, out)
    impl.reduce_ptr(0, 0, 0, D.FLOAT64, D.SUM)  # empty: no access
    x, y = to_buffer(np.ones(8, np.int16)), to_buffer(np.full(8, 3, np.int16))
    assert impl.reduce_buffers(x, y, D.BXOR) is x
    assert x.numpy().tolist() == [2] * 8
    bits = Buffer(a.ctypes.data, 64, D.FLOAT64, -1, a)
    impl.reduce_into(bits, np.ones(64), D.SUM)
    assert a[0] == 2.0


@pytest.mark.parametrize("impl", IMPLS)
def test_op_accepts_int_like_objects(impl):
    import torch.distributed as tdist

    class IntOnly:
        def __int__(self):
            return D.MAX

    a = np.array([1, 5], np.int32)
    impl.reduce_into(a, np.array([3, 3], np.int32), tdist.ReduceOp.SUM)
    assert a.tolist() == [4, 8]
    impl.reduce_into(a, np.array([6, 6], np.int32), IntOnly())
    assert a.tolist() == [6, 8]
    impl.reduce_into(a, np.array([1, 1], np.int32), np.int64(D.MIN))
    assert a.tolist() == [1, 1]
    try:
        from collectives.core.reduce_op import RedOpType
    except ImportError:
        return
    impl.reduce_into(a, np.array([2, 2], np.int32), RedOpType.PRODUCT)
    assert a.tolist() == [2, 2]


# ---- misuse raises before any work --------------------------------------------------------
def _f32(n=4):
    return np.ones(n, np.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("call,exc,words", [
    (lambda m: m.reduce_into(_f32(), _f32(), D.BAND), ValueError, ["BAND", "float32"]),
    (lambda m: m.reduce_into(np.ones(4, np.complex64), np.ones(4, np.complex64), D.MAX),
     ValueError, ["MAX", "complex64"]),
    (lambda m: m.reduce_into(_f32(4), _f32(5), D.SUM), ValueError, ["src", "5", "4"]),
    (lambda m: m.reduce_into(_f32(), np.ones(4), D.SUM), TypeError, ["src", "float64", "float32"]),
    (lambda m: m.reduce_into(np.ones((4, 4), np.float32)[:, 0], _f32(), D.SUM), ValueError,
     ["dst", "contiguous"]),
    (lambda m: m.reduce_into(_f32(), np.ones(8, np.float32)[::2], D.SUM), ValueError,
     ["src", "contiguous"]),
    (lambda m: m.reduce_into(torch.ones(4, 4).t(), torch.ones(16), D.SUM), ValueError,
     ["dst", "contiguous"]),
    (lambda m: m.reduce_into(_f32(), _f32(), D.AVG), ValueError, ["AVG", "scale"]),
    (lambda m: m.reduce_into(_f32(), _f32(), D.PREMUL_SUM), ValueError, ["PREMUL_SUM", "scale"]),
    (lambda m: m.reduce_into(_f32(), _f32(), 9), ValueError, ["op"]),
    (lambda m: m.reduce_into(_f32(), _f32(), "sum"), TypeError, ["op"]),
    (lambda m: m.reduce_into(_f32(), _f32(), 1.0), TypeError, ["op"]),
    (lambda m: m.reduce_into(_f32(), _f32(), None), TypeError, ["op"]),
    (lambda m: m.reduce_into([1.0], _f32(1), D.SUM), TypeError, ["dst"]),
    (lambda m: m.reduce_into(np.ones(4, np.uint32), np.ones(4, np.uint32), D.SUM), TypeError,
     ["dst", "uint32"]),
    (lambda m: m.reduce_into(np.ones(4, ">f4"), np.ones(4, ">f4"), D.SUM), TypeError, ["dst"]),
    (lambda m: m.reduce_into(np.frombuffer(b"\0" * 16, np.float32), _f32(), D.SUM), ValueError,
     ["dst", "writeable"]),
    (lambda m: m.reduce_many(_f32(), [], D.SUM), ValueError, ["srcs"]),
    (lambda m: m.reduce_many(_f32(), [_f32(), _f32(3)], D.SUM), ValueError, ["srcs[1]"]),
    (lambda m: m.reduce_many(_f32(), [_f32(), np.ones(4)], D.SUM), TypeError, ["srcs[1]"]),
    (lambda m: m.reduce_many(_f32(), 3, D.MIN), TypeError, ["srcs"]),
    (lambda m: m.scale(np.ones(4, np.int32), 0.5), ValueError, ["dst", "int32"]),
    (lambda m: m.scale(_f32(), 1j), TypeError, ["factor"]),
    (lambda m: m.scale(_f32(), "2"), TypeError, ["factor"]),
    (lambda m: m.reduce_ptr(0, 0, 4, D.FLOAT32, D.SUM), ValueError, ["dst_ptr", "null"]),
    (lambda m: m.reduce_ptr(8, 8, -1, D.FLOAT32, D.SUM), ValueError, ["count"]),
    (lambda m: m.reduce_ptr(8, 8, 1, 12, D.SUM), ValueError, ["dtype"]),
    (lambda m: m.reduce_ptr(8, 8, 1, D.FLOAT32, D.BOR), ValueError, ["BOR", "float32"]),
    (lambda m: m.reduce_ptr(8.0, 8, 1, D.FLOAT32, D.SUM), TypeError, ["dst_ptr"]),
    (lambda m: m.reduce_many_ptr(8, [], 1, D.FLOAT32, D.SUM), ValueError, ["src_ptrs"]),
    (lambda m: m.scale_ptr(8, 1, D.INT64, 2.0), ValueError, ["int64"]),
    (lambda m: m.reduce_buffers(_f32(), _f32(), D.SUM), TypeError, ["dst", "Buffer"]),
    (lambda m: m.reduce_into(torch.ones(4, dtype=torch.complex64),
                             torch.ones(4, dtype=torch.complex64).conj(), D.SUM), ValueError,
     ["src", "resolve_conj"]),
    (lambda m: m.reduce_into(torch.ones(4), torch.ones(4, dtype=torch.float64), D.SUM), TypeError,
     ["src", "float64"]),
])
def test_misuse_raises_naming_the_argument(impl, call, exc, words):
    with pytest.raises(exc) as info:
        call(impl)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_overlap_is_refused_but_dst_may_be_any_source(impl):
    a = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match="overlap"):
        impl.reduce_into(a[:8], a[4:12], D.SUM)
    with pytest.raises(ValueError, match="srcs\\[1\\] partially overlaps dst"):
        impl.reduce_many(a[:8], [a[8:], a[4:12]], D.SUM)
    impl.reduce_many(a[:8], [a[:8], a[8:]], D.SUM)
    assert a[0] == 8.0
    b = np.arange(3 * 40000, dtype=np.int32).reshape(3, -1)  # several chunks per source
    want = b.sum(axis=0)
    impl.reduce_many(b[2], [b[0], b[1], b[2]], D.SUM)
    assert (b[2] == want).all()


def test_misuse_leaves_dst_untouched():
    a = _f32()
    with pytest.raises(ValueError):
        core.reduce_many(a, [_f32(), _f32(), _f32(3)], D.SUM)
    assert (a == 1).all()


def test_op_valid_matches_dtypes_table():
    for dt in ALL_DTYPES:
        for op in OPS:
            assert core.op_valid(dt, op) == D.op_valid(dt, op) == fb.op_valid(dt, op)
    assert core.CHUNK_BYTES == fb.CHUNK_BYTES == 64 * 1024
    assert core.chunk_elems(D.FLOAT32) == 16384 == fb.chunk_elems(D.FLOAT32)


# ---- the GIL is released --------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_kernels_release_the_gil():
    """Another thread gets the GIL while one long reduce_many call runs."""
    src = np.ones(1 << 20, np.float32)
    dst = np.empty_like(src)
    # one call long enough (>= ~0.25 s here) that 20 ms of sleep ends well inside it: the
    # same 4 MiB source read from cache is fast on a quiet machine, so size it by a timing
    t0 = time.perf_counter()
    core.reduce_many(dst, [src] * 50, D.SUM)
    per_src = max((time.perf_counter() - t0) / 50, 1e-6)
    count = min(max(400, int(0.25 / per_src)), 20000)
    srcs = [src] * count
    for _attempt in range(3):
        entering, done = threading.Event(), threading.Event()

        def work(entering=entering, done=done):
            entering.set()
            core.reduce_many(dst, srcs, D.SUM)
            done.set()

        th = threading.Thread(target=work)
        th.start()
        entering.wait()
        time.sleep(0.02)  # returns only once this thread can take the GIL back
        woke_during_kernel = not done.is_set()
        th.join()
        if woke_during_kernel:
            break
    assert woke_during_kernel, "the main thread could not run while reduce_many ran"
    assert dst[0] == float(count)


# ---- importing without torch ----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_import_and_reduce_without_torch():
    code = textwrap.dedent("""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is hidden for this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        import numpy as np
        import collectives
        from collectives.engines import _core
        from collectives.core import dtypes, kernels_numpy as _fallback
        for impl in (_core, _fallback):
            a = np.arange(5, dtype=np.float32)
            impl.reduce_into(a, np.ones(5, np.float32), dtypes.SUM)
            assert a.tolist() == [1, 2, 3, 4, 5], a
            flat = impl.flatten([a, np.arange(3, dtype=np.int8)])
            assert flat.nbytes == 23
            try:
                impl.reduce_into([1], a, dtypes.SUM)
            except TypeError as e:
                assert "dst" in str(e)
        assert "torch" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_python_dtype_and_op_codes_equal_the_c_headers():
    """collectives/core/dtypes.py repeats reduce_kernels.h's codes for the pure-Python path."""
    assert core.C_CODES["NUM_DTYPES"] == len(D.DTYPE_NAMES) == len(D.ITEMSIZE)
    for name, code in core.C_CODES.items():
        if name != "NUM_DTYPES":
            assert getattr(D, name) == code, name
