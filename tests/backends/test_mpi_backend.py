"""The 'mpi' backend at the Backend level, under mpiexec.

Every op equals the NumPy reduction/permutation of all ranks' inputs; float results
are bitwise identical on every rank; p2p honours tags and ANY_SOURCE; subgroups come
from a collective split; async operations finish in issue order. Without mpi4py,
asking for the backend is a clear error naming the extra to install.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives.core import dtypes as D
from collectives.core.tensors import Buffer
from tests.support.profiles import examples
from tests.support.ranks import ROOT, get_pool, mpiexec_path

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
HAVE_MPI = HAVE_MPI4PY and mpiexec_path() is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpi4py and mpiexec "
                               "(pip install 'collectives[mpi]')")

NP = {D.FLOAT16: np.float16, D.BFLOAT16: np.uint16, D.FLOAT32: np.float32, D.FLOAT64: np.float64,
      D.COMPLEX64: np.complex64, D.COMPLEX128: np.complex128, D.INT8: np.int8, D.UINT8: np.uint8,
      D.INT16: np.int16, D.INT32: np.int32, D.INT64: np.int64, D.BOOL: np.bool_}
REDUCE_OPS = [D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR]
HALF = (D.FLOAT16, D.BFLOAT16)
VALID = [(dt, op) for dt in NP for op in REDUCE_OPS if D.op_valid(dt, op)]
SETTINGS = settings(max_examples=examples(25), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def have_half_kernels():
    from collectives.backends import mpi
    try:
        mpi._reduce_kernel()
    except Exception:
        return False
    return True


HAVE_HALF = have_half_kernels()
NO_HALF = "float16/bfloat16 need reduce_ptr from collectives.engines._core or collectives.core.kernels_numpy"
# every (dtype, op) pair as its own test, a few hypothesis examples each
CASE_PARAMS = [pytest.param(dt, op, id=f"{D.DTYPE_NAMES[dt]}-{D.OP_NAMES[op]}",
                            marks=pytest.mark.skipif(dt in HALF and not HAVE_HALF, reason=NO_HALF))
               for dt, op in VALID]
FEW = settings(max_examples=examples(6), deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ---- values: small integers, so every reduction order gives the exact same result ----

def bf16_bits(f32):
    return (np.asarray(f32, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def make_input(seed, rank, count, dtype):
    """Rank ``rank``'s input: small integers (of any dtype), the same on every call."""
    rng = np.random.default_rng([seed, rank])
    if dtype == D.BOOL:
        return rng.integers(0, 2, count).astype(np.bool_)
    lo = 0 if dtype == D.UINT8 else -3
    v = rng.integers(lo, 4, count)
    if dtype == D.BFLOAT16:
        return bf16_bits(v.astype(np.float32))
    if dtype in D.COMPLEX:
        return (v + 1j * rng.integers(-3, 4, count)).astype(NP[dtype])
    return v.astype(NP[dtype])


def as_values(x, dtype):
    return bf16_value(x) if dtype == D.BFLOAT16 else x


def reference(inputs, dtype, op):
    """The reduction of ``inputs`` (one array per rank) as NumPy computes it."""
    vals = np.stack([as_values(x, dtype) for x in inputs])
    if dtype == D.BOOL:
        fn = {D.SUM: np.any, D.MAX: np.any, D.BOR: np.any, D.PRODUCT: np.all, D.MIN: np.all,
              D.BAND: np.all}.get(op)
        out = fn(vals, axis=0) if fn else np.bitwise_xor.reduce(vals, axis=0)
    else:
        fn = {D.SUM: np.add, D.PRODUCT: np.multiply, D.MIN: np.minimum, D.MAX: np.maximum,
              D.BAND: np.bitwise_and, D.BOR: np.bitwise_or, D.BXOR: np.bitwise_xor}[op]
        out = fn.reduce(vals, axis=0)
    return bf16_bits(out) if dtype == D.BFLOAT16 else out.astype(NP[dtype])


def buf(x, dtype=None):
    """A Buffer over array ``x``; ``dtype`` names bfloat16 for uint16 bit arrays."""
    code = dtype if dtype is not None else {np.dtype(v): k for k, v in NP.items()
                                            if k != D.BFLOAT16}[x.dtype]
    return Buffer(x.__array_interface__["data"][0], x.size, code, -1, x)


# ---- functions run on the ranks --------------------------------------------------------

def setup_backend(ctx):
    from collectives.backends.mpi import create_mpi_backend, world_rank_size
    rank, size = world_rank_size()
    be = create_mpi_backend(None, rank, size, 30.0)
    ctx.state["be"] = be
    ctx.state["atexit"].append(be.shutdown)
    return rank, size


def r_all_reduce(ctx, seed, count, dtype, op):
    x = make_input(seed, ctx.rank, count, dtype)
    ctx.state["be"].all_reduce(buf(x, dtype), op)
    return x


def r_random_float_all_reduce(ctx, seed, count, dtype, op):
    rng = np.random.default_rng([seed, ctx.rank])
    v = rng.standard_normal(count).astype(np.float32) * 10.0 ** rng.integers(-3, 4, count)
    x = bf16_bits(v) if dtype == D.BFLOAT16 else v.astype(NP[dtype])
    ctx.state["be"].all_reduce(buf(x, dtype), op)
    return x.tobytes()


def r_broadcast(ctx, seed, count, dtype, root):
    x = make_input(seed, ctx.rank, count, dtype)
    ctx.state["be"].broadcast(buf(x, dtype), root)
    return x


def r_reduce(ctx, seed, count, dtype, op, root):
    x = make_input(seed, ctx.rank, count, dtype)
    ctx.state["be"].reduce(buf(x, dtype), op, root)
    return x


def r_all_gather(ctx, seed, count, dtype, in_place):
    be = ctx.state["be"]
    x = make_input(seed, ctx.rank, count, dtype)
    out = np.zeros(count * be.size, x.dtype)
    if in_place:  # the input is this rank's slot of the output
        out[ctx.rank * count:(ctx.rank + 1) * count] = x
        x = out[ctx.rank * count:(ctx.rank + 1) * count]
    be.all_gather(buf(out, dtype), buf(x, dtype))
    return out


def r_gather(ctx, seed, count, dtype, root):
    be = ctx.state["be"]
    x = make_input(seed, ctx.rank, count, dtype)
    out = np.zeros(count * be.size, x.dtype) if ctx.rank == root else None
    be.gather(buf(out, dtype) if out is not None else None, buf(x, dtype), root)
    return out, x


def r_scatter(ctx, seed, count, dtype, root):
    be = ctx.state["be"]
    inp = make_input(seed, 99, count * be.size, dtype) if ctx.rank == root else None
    out = np.zeros(count, NP[dtype])
    be.scatter(buf(out, dtype), buf(inp, dtype) if inp is not None else None, root)
    return out


def r_reduce_scatter(ctx, seed, count, dtype, op):
    be = ctx.state["be"]
    x = make_input(seed, ctx.rank, count * be.size, dtype)
    out = np.zeros(count, x.dtype)
    be.reduce_scatter(buf(out, dtype), buf(x, dtype), op)
    return out


def r_all_to_all(ctx, seed, counts, dtype):
    """counts[s][d]: elements rank s sends to rank d."""
    be = ctx.state["be"]
    me = ctx.rank
    in_counts = counts[me]
    out_counts = [counts[s][me] for s in range(be.size)]
    x = make_input(seed, me, sum(in_counts), dtype)
    out = np.zeros(sum(out_counts), x.dtype)
    be.all_to_all(buf(out, dtype), buf(x, dtype), out_counts, in_counts)
    return x, out


def r_barrier_order(ctx, delay):
    be = ctx.state["be"]
    if ctx.rank == 0:
        time.sleep(delay)
    t0 = time.time()
    be.barrier()
    return t0, time.time()


def r_tags(ctx):
    """Rank 0 sends tags 1, 2, 3 in that order; rank 1 receives them 3, 1, 2."""
    be = ctx.state["be"]
    if ctx.rank == 0:
        arrs = [np.full(5, t, np.int64) for t in (1, 2, 3)]
        reqs = [be.isend(buf(a), 1, tag=t) for a, t in zip(arrs, (1, 2, 3))]
        for r in reqs:
            r.wait()
        return None
    if ctx.rank == 1:
        got = {}
        reqs = []
        for t in (3, 1, 2):
            a = np.zeros(5, np.int64)
            reqs.append((t, a, be.irecv(buf(a), 0, tag=t)))
        for t, a, r in reqs:
            r.wait()
            got[t] = (a.tolist(), r.source)
        return got
    return None


def r_any_source(ctx):
    """Every rank but 0 sends its rank; rank 0 receives from ANY_SOURCE."""
    be = ctx.state["be"]
    if ctx.rank == 0:
        out = []
        for _ in range(be.size - 1):
            a = np.zeros(2, np.int32)
            r = be.irecv(buf(a), None, tag=7)
            r.wait()
            out.append((int(a[0]), r.source))
        return out
    a = np.array([ctx.rank, 0], np.int32)
    be.isend(buf(a), 0, tag=7).wait()
    return None


def r_tag_above_tag_ub(ctx):
    """A tag above MPI_TAG_UB is a ValueError naming the bound, raised before MPI sees it."""
    be = ctx.state["be"]
    from collectives.backends import mpi as M
    a = np.zeros(1, np.int64)
    out = []
    for post in (lambda: be.isend(buf(a), 1 - ctx.rank, tag=M._TAG_UB + 1),
                 lambda: be.irecv(buf(a), 1 - ctx.rank, tag=M._TAG_UB + 1)):
        try:
            post()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    be.barrier()  # still usable
    return M._TAG_UB, out


def r_recv_timeout(ctx):
    """An irecv with no matching send times out within its timeout; a later send completes it."""
    be = ctx.state["be"]
    from collectives.core.errors import DistBackendError
    if ctx.rank == 1:
        a = np.zeros(1, np.int64)
        r = be.irecv(buf(a), 0, tag=4242)
        t0 = time.monotonic()
        try:
            r.wait(timeout=0.3)
            raised = False
        except DistBackendError as e:
            raised = "did not finish" in str(e)
        took = time.monotonic() - t0
        be.barrier()
        r.wait()
        return raised, took, int(a[0])
    if ctx.rank == 0:
        be.barrier()
        be.isend(buf(np.array([5], np.int64)), 1, tag=4242).wait()
        return None
    be.barrier()
    return None


def r_split(ctx, ranks, seed):
    be = ctx.state["be"]
    sub = be.split(ranks, 30.0)
    if sub is None:
        return None
    x = make_input(seed, ctx.rank, 16, D.INT64)
    sub.all_reduce(buf(x), D.SUM)
    # the subgroup's ranks are positions in ``ranks``; the parent keeps working
    y = np.array([ctx.rank], np.int64)
    sub.broadcast(buf(y), 0)
    sub.shutdown()
    return sub.rank, sub.size, x, int(y[0])


def r_split_then_parent(ctx):
    be = ctx.state["be"]
    sub = be.split([r for r in range(be.size) if r % 2 == 0], 30.0)
    x = np.ones(3, np.float64)
    be.all_reduce(buf(x), D.SUM)
    if sub is not None:
        sub.shutdown()
    return sub is None, x.tolist()


def r_async_order(ctx, seed, n_ops):
    """n_ops async all_reduces on distinct buffers, then a blocking one, waited in reverse."""
    be = ctx.state["be"]
    xs = [make_input(seed + i, ctx.rank, 33, D.INT32) for i in range(n_ops)]
    reqs = [be.submit(be.all_reduce, buf(x), D.SUM) for x in xs]
    last = make_input(seed + n_ops, ctx.rank, 33, D.INT32)
    be.run(be.all_reduce, buf(last), D.SUM)
    for r in reversed(reqs):
        r.wait()
    return xs + [last]


def r_async_mixed(ctx, seed):
    """A non-native submission (progress thread) followed by native ones keeps issue order."""
    be = ctx.state["be"]
    a = make_input(seed, ctx.rank, 10, D.INT64)
    b = make_input(seed + 1, ctx.rank, 10, D.INT64)
    c = np.zeros(be.size * 10, np.int64)

    def slow_reduce(x):
        time.sleep(0.05)
        be.all_reduce(buf(x), D.SUM)

    r1 = be.submit(slow_reduce, a)
    r2 = be.submit(be.all_reduce, buf(b), D.MAX)
    r3 = be.submit(be.all_gather, buf(c), buf(b))
    r4 = be.submit(be.barrier)
    for r in (r4, r3, r2, r1):
        r.wait()
    return a, b, c


def r_async_forms_differ_by_rank(ctx, seed):
    """Even ranks post async ops natively, odd ranks queue them behind a staging step (as the
    front end does for lists that are not back to back); then a blocking op, which on odd
    ranks waits behind the queue. Every rank must pair up with every other."""
    be = ctx.state["be"]
    x = make_input(seed, ctx.rank, 9, D.FLOAT64)
    y = make_input(seed + 1, ctx.rank, 9, D.INT32)
    out = np.zeros(9 * be.size, np.int32)

    def staged_all_reduce(b, op):
        time.sleep(0.02)
        be.all_reduce(b, op)

    def staged_all_gather(o, i):
        be.all_gather(o, i)

    if ctx.rank % 2 == 0:
        reqs = [be.submit(be.all_reduce, buf(x), D.SUM), be.submit(be.all_gather, buf(out), buf(y))]
    else:
        reqs = [be.submit(staged_all_reduce, buf(x), D.SUM),
                be.submit(staged_all_gather, buf(out), buf(y))]
    z = make_input(seed + 2, ctx.rank, 4, D.INT64)
    be.run(be.broadcast, buf(z), be.size - 1)
    for r in reqs:
        r.wait()
    return x, out, z


def r_async_every_op(ctx, seed):
    """Each op's async form equals its blocking form."""
    be = ctx.state["be"]
    n, size, me = 6, be.size, ctx.rank
    x = make_input(seed, me, n, D.FLOAT32)
    res = {}
    a = x.copy()
    be.submit(be.all_reduce, buf(a), D.SUM).wait()
    res["all_reduce"] = a
    a = x.copy()
    be.submit(be.broadcast, buf(a), size - 1).wait()
    res["broadcast"] = a
    a = x.copy()
    be.submit(be.reduce, buf(a), D.MAX, 0).wait()
    res["reduce"] = a
    out = np.zeros(n * size, np.float32)
    be.submit(be.all_gather, buf(out), buf(x)).wait()
    res["all_gather"] = out
    out = np.zeros(n * size, np.float32) if me == 0 else None
    be.submit(be.gather, buf(out) if me == 0 else None, buf(x), 0).wait()
    res["gather"] = out
    big = make_input(seed, 99, n * size, D.FLOAT32)
    a = np.zeros(n, np.float32)
    be.submit(be.scatter, buf(a), buf(big) if me == 0 else None, 0).wait()
    res["scatter"] = a
    xs = make_input(seed, me, n * size, D.FLOAT32)
    a = np.zeros(n, np.float32)
    be.submit(be.reduce_scatter, buf(a), buf(xs), D.SUM).wait()
    res["reduce_scatter"] = a
    a = np.zeros(n * size, np.float32)
    be.submit(be.all_to_all, buf(a), buf(xs), [n] * size, [n] * size).wait()
    res["all_to_all"] = a
    be.submit(be.barrier).wait()
    return res


def r_half_pair(ctx, seed, count, dtype, op):
    """Two ranks' random half-precision values; rank 0 also returns the inputs."""
    rng = np.random.default_rng([seed, ctx.rank])
    v = (rng.standard_normal(count) * 100).astype(np.float32)
    x = bf16_bits(v) if dtype == D.BFLOAT16 else v.astype(np.float16)
    orig = x.copy()
    ctx.state["be"].all_reduce(buf(x, dtype), op)
    return orig, x


def r_direct_and_mpi4py_alike(ctx, seed, count):
    """The call log's hot calls made by address, then through mpi4py (``unbind_direct``), on
    a backend of its own: each form's results, an MPI error's class, and whether the first
    form was by address."""
    from mpi4py import MPI

    from collectives.backends.mpi import create_mpi_backend
    be = create_mpi_backend(None, ctx.rank, ctx.world_size, 30.0)
    try:
        log = be._fp_log
        out = {"by_address": getattr(log, "direct", False)}
        for form in ("direct", "mpi4py"):
            if form == "mpi4py" and out["by_address"]:
                log.unbind_direct()
            x = make_input(seed, ctx.rank, count, D.FLOAT32)
            be.all_reduce(buf(x), D.SUM)
            h = make_input(seed + 1, ctx.rank, count, D.FLOAT16)
            be.all_reduce(buf(h), D.MAX)  # a user-defined MPI op, made on first use
            y = make_input(seed + 2, ctx.rank, count, D.INT64)
            be.broadcast(buf(y), ctx.world_size - 1)
            g = np.zeros(count * ctx.world_size, np.int32)
            be.all_gather(buf(g), buf(make_input(seed + 3, ctx.rank, count, D.INT32)))
            be.barrier()
            try:
                be.broadcast(buf(x), ctx.world_size)  # no such root: MPI's error, raised
                err = None
            except MPI.Exception as e:
                err = e.Get_error_class()
            out[form] = (x, h, y, g, err)
        return out
    finally:
        be.shutdown()


# ---- the tests ---------------------------------------------------------------------

def pool(n):
    return get_pool(n, setup=setup_backend, launcher="mpiexec")


@needs_mpi
@pytest.mark.timeout(120)
def test_ranks_and_size_come_from_mpi():
    assert pool(3).run(setup_backend) == [(0, 3), (1, 3), (2, 3)]


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,op", CASE_PARAMS)
@FEW
@given(world=st.integers(1, 4), count=st.integers(0, 70), seed=st.integers(0, 2**31))
def test_all_reduce_equals_numpy_reduction_of_all_inputs(dtype, op, world, count, seed):
    outs = pool(world).run(r_all_reduce, seed, count, dtype, op)
    expect = reference([make_input(seed, r, count, dtype) for r in range(world)], dtype, op)
    for out in outs:
        np.testing.assert_array_equal(out, expect)


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", [D.FLOAT16, D.BFLOAT16, D.FLOAT32, D.FLOAT64])
@pytest.mark.parametrize("op", [D.SUM, D.PRODUCT])
def test_float_all_reduce_is_bitwise_identical_on_every_rank(world, dtype, op):
    if dtype in HALF and not HAVE_HALF:
        pytest.skip(NO_HALF)
    for count in (1, 1000, 70000):
        outs = pool(world).run(r_random_float_all_reduce, 7 + count, count, dtype, op)
        assert all(o == outs[0] for o in outs), f"ranks disagree at count={count}"


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", [D.SUM, D.PRODUCT, D.MIN, D.MAX])
def test_half_all_reduce_of_two_ranks_is_our_kernel(dtype, op):
    """With two ranks the result is kernel(a, b): what every other backend computes."""
    if not HAVE_HALF:
        pytest.skip(NO_HALF)
    from collectives.backends.mpi import _reduce_kernel
    (a, out0), (b, out1) = pool(2).run(r_half_pair, 11, 5000, dtype, op)
    expect = a.copy()
    _reduce_kernel()(expect.ctypes.data, b.ctypes.data, expect.size, dtype, op)
    assert out0.tobytes() == expect.tobytes() and out1.tobytes() == expect.tobytes()
    if dtype == D.FLOAT16 and op == D.SUM:  # and the kernel rounds as IEEE does
        np.testing.assert_array_equal(expect, (a.astype(np.float32) + b).astype(np.float16))


@needs_mpi
@pytest.mark.timeout(300)
@SETTINGS
@given(world=st.integers(1, 4), dtype=st.sampled_from(list(NP)), count=st.integers(0, 50),
       root=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_broadcast_gives_every_rank_the_roots_buffer(world, dtype, count, root, seed):
    root %= world
    outs = pool(world).run(r_broadcast, seed, count, dtype, root)
    for out in outs:
        np.testing.assert_array_equal(out, make_input(seed, root, count, dtype))


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,op", CASE_PARAMS)
@FEW
@given(world=st.integers(1, 4), count=st.integers(0, 50), root=st.integers(0, 3),
       seed=st.integers(0, 2**31))
def test_reduce_reaches_root_and_leaves_other_ranks_unchanged(dtype, op, world, count, root, seed):
    root %= world
    outs = pool(world).run(r_reduce, seed, count, dtype, op, root)
    inputs = [make_input(seed, r, count, dtype) for r in range(world)]
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, reference(inputs, dtype, op) if r == root else inputs[r])


@needs_mpi
@pytest.mark.timeout(300)
@SETTINGS
@given(world=st.integers(1, 4), dtype=st.sampled_from(list(NP)), count=st.integers(0, 40),
       in_place=st.booleans(), seed=st.integers(0, 2**31))
def test_all_gather_concatenates_inputs_in_rank_order(world, dtype, count, in_place, seed):
    outs = pool(world).run(r_all_gather, seed, count, dtype, in_place)
    expect = np.concatenate([make_input(seed, r, count, dtype) for r in range(world)])
    for out in outs:
        np.testing.assert_array_equal(out, expect)


@needs_mpi
@pytest.mark.timeout(300)
@SETTINGS
@given(world=st.integers(1, 4), dtype=st.sampled_from(list(NP)), count=st.integers(0, 40),
       root=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_gather_and_scatter_move_slices_by_rank(world, dtype, count, root, seed):
    root %= world
    p = pool(world)
    gathered = p.run(r_gather, seed, count, dtype, root)
    expect = np.concatenate([make_input(seed, r, count, dtype) for r in range(world)])
    for r, (out, inp) in enumerate(gathered):
        if r == root:
            np.testing.assert_array_equal(out, expect)
        else:
            assert out is None
        np.testing.assert_array_equal(inp, make_input(seed, r, count, dtype))
    scattered = p.run(r_scatter, seed, count, dtype, root)
    src = make_input(seed, 99, count * world, dtype)
    for r, out in enumerate(scattered):
        np.testing.assert_array_equal(out, src[r * count:(r + 1) * count])


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,op", CASE_PARAMS)
@FEW
@given(world=st.integers(1, 4), count=st.integers(0, 30), seed=st.integers(0, 2**31))
def test_reduce_scatter_gives_rank_r_the_reduction_of_slice_r(dtype, op, world, count, seed):
    outs = pool(world).run(r_reduce_scatter, seed, count, dtype, op)
    full = reference([make_input(seed, r, count * world, dtype) for r in range(world)], dtype, op)
    for r, out in enumerate(outs):
        np.testing.assert_array_equal(out, full[r * count:(r + 1) * count])


@needs_mpi
@pytest.mark.timeout(300)
@SETTINGS
@given(world=st.integers(1, 4), data=st.data(), even=st.booleans(),
       dtype=st.sampled_from([D.FLOAT32, D.INT64, D.BFLOAT16, D.COMPLEX128, D.BOOL]),
       seed=st.integers(0, 2**31))
def test_all_to_all_delivers_each_slice_to_its_rank(world, data, even, dtype, seed):
    if even:
        n = data.draw(st.integers(0, 10))
        counts = [[n] * world for _ in range(world)]
    else:
        counts = data.draw(st.lists(st.lists(st.integers(0, 9), min_size=world, max_size=world),
                                    min_size=world, max_size=world))
    check_all_to_all(pool(world).run(r_all_to_all, seed, counts, dtype), counts)


def check_all_to_all(res, counts):
    inputs = [x for x, _ in res]
    for d, (_, out) in enumerate(res):
        pieces = []
        for s in range(len(res)):
            start = sum(counts[s][:d])
            pieces.append(inputs[s][start:start + counts[s][d]])
        np.testing.assert_array_equal(out, np.concatenate(pieces))


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("counts", [[[0, 2], [2, 2]], [[1, 1, 1], [0, 2, 1], [1, 1, 1]]])
def test_all_to_all_where_only_some_ranks_see_even_counts(counts):
    """A rank whose own counts are even must still pair with ranks whose counts are not."""
    check_all_to_all(pool(len(counts)).run(r_all_to_all, 0, counts, D.FLOAT32), counts)


@needs_mpi
@pytest.mark.timeout(300)
@FEW
@given(world=st.integers(1, 3), count=st.integers(0, 40), seed=st.integers(0, 2**31))
def test_calls_by_address_equal_mpi4py_calls_and_raise_its_errors(world, count, seed):
    from mpi4py import MPI

    from collectives.backends.mpi.fingerprint import CallLog
    inp = {k: [make_input(seed + i, r, count, dt) for r in range(world)]
           for i, (k, dt) in enumerate([("x", D.FLOAT32), ("h", D.FLOAT16), ("y", D.INT64),
                                        ("g", D.INT32)])}
    expect = (reference(inp["x"], D.FLOAT32, D.SUM), reference(inp["h"], D.FLOAT16, D.MAX),
              inp["y"][world - 1], np.concatenate(inp["g"]), MPI.ERR_ROOT)
    for out in pool(world).run(r_direct_and_mpi4py_alike, seed, count):
        assert out["by_address"] == (CallLog is not None)  # by address wherever the log is in C
        for form in ("direct", "mpi4py"):
            for got, want in zip(out[form][:4], expect[:4]):
                np.testing.assert_array_equal(got, want)
            assert out[form][4] == expect[4], form


@needs_mpi
@pytest.mark.timeout(120)
def test_barrier_waits_for_the_last_rank():
    res = pool(3).run(r_barrier_order, 0.3)
    entered_last = max(t0 for t0, _ in res)
    assert all(t1 >= entered_last - 0.01 for _, t1 in res)


@needs_mpi
@pytest.mark.timeout(120)
def test_receives_match_sends_by_tag_not_by_order():
    got = pool(2).run(r_tags)[1]
    assert got == {t: ([t] * 5, 0) for t in (1, 2, 3)}


@needs_mpi
@pytest.mark.timeout(120)
def test_a_tag_above_the_mpi_bound_is_refused_by_name():
    for ub, msgs in pool(2).run(r_tag_above_tag_ub):
        assert ub >= 32767
        assert msgs == [f"tag must be <= {ub} (this MPI's MPI_TAG_UB), got {ub + 1}"] * 2


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_any_source_receive_reports_the_sender(world):
    got = pool(world).run(r_any_source)[0]
    assert sorted(got) == [(r, r) for r in range(1, world)]


@pytest.mark.faults
@needs_mpi
@pytest.mark.timeout(120)
def test_a_request_wait_is_bounded_by_its_timeout():
    raised, took, value = pool(3).run(r_recv_timeout)[1]
    assert raised and 0.25 < took < 5 and value == 5


@needs_mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [[0, 2], [1, 2, 3], [3], [0, 1, 2, 3]])
def test_split_builds_subgroups_with_their_own_ranks(ranks):
    res = pool(4).run(r_split, ranks, 5)
    total = sum(make_input(5, r, 16, D.INT64) for r in ranks)
    for r, out in enumerate(res):
        if r not in ranks:
            assert out is None
            continue
        sub_rank, sub_size, x, first = out
        assert (sub_rank, sub_size) == (ranks.index(r), len(ranks))
        np.testing.assert_array_equal(x, total)
        assert first == ranks[0]
    assert pool(4).run(r_split_then_parent) == [(False, [4.0] * 3), (True, [4.0] * 3),
                                                (False, [4.0] * 3), (True, [4.0] * 3)]


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_async_all_reduces_complete_in_issue_order(world):
    res = pool(world).run(r_async_order, 3, 6)
    for i in range(7):
        expect = sum(make_input(3 + i, r, 33, D.INT32) for r in range(world))
        for out in res:
            np.testing.assert_array_equal(out[i], expect)


@needs_mpi
@pytest.mark.timeout(120)
def test_native_async_ops_queue_behind_progress_thread_work():
    world = 3
    res = pool(world).run(r_async_mixed, 21)
    a = sum(make_input(21, r, 10, D.INT64) for r in range(world))
    b = np.max([make_input(22, r, 10, D.INT64) for r in range(world)], axis=0)
    for out_a, out_b, out_c in res:
        np.testing.assert_array_equal(out_a, a)
        np.testing.assert_array_equal(out_b, b)
        np.testing.assert_array_equal(out_c, np.tile(b, world))


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_async_ops_match_whether_posted_natively_or_queued(world):
    """MPI never matches blocking with non-blocking collectives: async_op decides the form."""
    res = pool(world).run(r_async_forms_differ_by_rank, 31)
    x = sum(make_input(31, r, 9, D.FLOAT64) for r in range(world))
    g = np.concatenate([make_input(32, r, 9, D.INT32) for r in range(world)])
    z = make_input(33, world - 1, 4, D.INT64)
    for out_x, out_g, out_z in res:
        np.testing.assert_array_equal(out_x, x)
        np.testing.assert_array_equal(out_g, g)
        np.testing.assert_array_equal(out_z, z)


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 4])
def test_every_async_op_equals_its_blocking_definition(world):
    res = pool(world).run(r_async_every_op, 8)
    n = 6
    xs = [make_input(8, r, n, D.FLOAT32) for r in range(world)]
    big = [make_input(8, r, n * world, D.FLOAT32) for r in range(world)]
    src = make_input(8, 99, n * world, D.FLOAT32)
    for me, out in enumerate(res):
        np.testing.assert_array_equal(out["all_reduce"], sum(xs))
        np.testing.assert_array_equal(out["broadcast"], xs[world - 1])
        np.testing.assert_array_equal(out["reduce"], np.max(xs, axis=0) if me == 0 else xs[me])
        np.testing.assert_array_equal(out["all_gather"], np.concatenate(xs))
        if me == 0:
            np.testing.assert_array_equal(out["gather"], np.concatenate(xs))
        np.testing.assert_array_equal(out["scatter"], src[me * n:(me + 1) * n])
        np.testing.assert_array_equal(out["reduce_scatter"], sum(big)[me * n:(me + 1) * n])
        np.testing.assert_array_equal(out["all_to_all"],
                                      np.concatenate([b[me * n:(me + 1) * n] for b in big]))


# ---- without mpi4py --------------------------------------------------------------------

HIDE_MPI4PY = "import sys; sys.modules['mpi4py'] = None\n"
BROKEN_MPI4PY = "raise ImportError('libmpi.so.12: cannot open shared object file')\n"


def run_without_mpi(code, broken_dir=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (broken_dir, ROOT) if p))
    for k in ("PMI_RANK", "PMI_SIZE", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


CHECK_FACTORY = textwrap.dedent("""
    from collectives.backends import get_backend_factory
    from collectives.backends import mpi
    print("available", mpi.is_available())
    try:
        get_backend_factory("mpi")(None, 0, 1, 30.0)
    except RuntimeError as e:
        print("error", type(e).__name__, e)
""")

CHECK_FRONT_END = textwrap.dedent("""
    import collectives as dist
    try:
        dist.init_process_group("mpi")
    except Exception as e:
        print("error", type(e).__name__, e)
""")


@pytest.mark.timeout(120)
def test_without_mpi4py_the_backend_names_the_extra_to_install():
    p = run_without_mpi(HIDE_MPI4PY + CHECK_FACTORY)
    assert p.returncode == 0, p.stderr
    assert "available False" in p.stdout
    assert 'pip install "collectives[mpi]"' in p.stdout, p.stdout


@pytest.mark.timeout(120)
def test_a_broken_mpi4py_is_the_same_clear_error(tmp_path):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text(BROKEN_MPI4PY)
    p = run_without_mpi(CHECK_FACTORY, str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "available True" in p.stdout  # only looked for, never imported
    assert 'pip install "collectives[mpi]"' in p.stdout and "libmpi" in p.stdout, p.stdout


@pytest.mark.timeout(120)
def test_init_process_group_mpi_without_mpi4py_is_a_clear_error():
    p = run_without_mpi(HIDE_MPI4PY + CHECK_FRONT_END)
    assert "Traceback" not in p.stderr and 'pip install "collectives[mpi]"' in p.stdout, \
        p.stdout + p.stderr


@pytest.mark.timeout(60)
def test_is_available_does_not_initialise_mpi():
    p = run_without_mpi("import sys; from collectives.backends import mpi; "
                        "print(mpi.is_available(), 'mpi4py.MPI' in sys.modules)")
    assert p.stdout.split() == [str(HAVE_MPI4PY), "False"], p.stderr


@needs_mpi
@pytest.mark.timeout(60)
def test_a_singleton_world_asked_for_more_ranks_says_to_use_mpiexec():
    p = run_without_mpi("from collectives.backends.mpi import create_mpi_backend\n"
                        "try:\n    create_mpi_backend(None, 0, 4, 30.0)\n"
                        "except RuntimeError as e:\n    print(e)\n")
    assert "mpiexec -n 4" in p.stdout, p.stdout + p.stderr



# ---- through the front end, under a plain mpiexec ----------------------------------------

FRONT_END_PROGRAM = textwrap.dedent("""
    import os, sys
    import numpy as np
    import collectives as dist
    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = np.full(3, rank + 1, np.int64)
    dist.all_reduce(x)
    assert x.tolist() == [world * (world + 1) // 2] * 3, x
    # the upper half as a subgroup: global ranks in the API, a split communicator underneath
    half = world // 2
    upper = dist.new_group(list(range(half, world)))
    y = np.array([rank], np.int64)
    if rank >= half:
        dist.broadcast(y, src=world - 1, group=upper)
        assert y[0] == world - 1 and dist.get_rank(upper) == rank - half, (y, dist.get_rank(upper))
    else:
        assert upper == dist.GroupMember.NON_GROUP_MEMBER
    # members only (MPI_Comm_create_group), which the other ranks never call
    if rank % 2 == 1:
        odd = dist.new_group(list(range(1, world, 2)), use_local_synchronization=True)
        z = np.array([rank], np.int64)
        dist.all_reduce(z, group=odd)
        assert z[0] == sum(range(1, world, 2)) and dist.get_rank(odd) == rank // 2, z
    # any-source receive reports the sender's global rank
    if rank == 0:
        got = set()
        for _ in range(world - 1):
            buf = np.zeros(1, np.int64)
            src = dist.recv(buf)
            assert buf[0] == src * 10, (buf, src)
            got.add(src)
        assert got == set(range(1, world)), got
    else:
        dist.send(np.array([rank * 10], np.int64), dst=0)
    w = dist.all_reduce(np.ones(2, np.float32), async_op=True)
    w.wait()
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, world, flush=True)
""")

STORE_GROUP_PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    if sys.argv[1] == "init-mpi":
        from mpi4py import MPI  # noqa: F401  (MPI_Init is collective over every process)
    import collectives as dist
    dist.init_process_group("gloo")   # env:// under mpiexec: the world has a store
    rank, world = dist.get_rank(), dist.get_world_size()
    members = [0, world - 1]
    x = np.array([rank + 1.0])
    try:
        g = dist.new_group(members, backend="mpi")  # members build a communicator via the store
    except RuntimeError as e:
        print("error", e, flush=True)
    else:
        if rank in members:
            dist.all_reduce(x, group=g)
            assert x[0] == 1.0 + world, x
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, flush=True)
""")


def run_under_mpiexec(program, n, extra_env=None, args=()):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    env.update(extra_env or {})
    proc = subprocess.Popen([mpiexec_path(), "-n", str(n), sys.executable, "-c", program, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} timed out after 120 s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_mpiexec_program_runs_with_init_process_group_mpi_and_no_master_addr(n):
    p = run_under_mpiexec(FRONT_END_PROGRAM, n)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("ok") == n, p.stdout  # every rank got to the end (lines may interleave)


@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("init_mpi", [True, False])
def test_an_mpi_subgroup_of_a_gloo_world_builds_its_communicator_through_the_store(init_mpi):
    """With MPI initialised on every process, the members' communicator comes from the world
    ranks they swap through the store; without, members get a clear error instead of hanging
    in MPI_Init (which is collective over every process mpiexec started)."""
    from tests.support.ranks import free_port
    p = run_under_mpiexec(STORE_GROUP_PROGRAM, 3, {"MASTER_ADDR": "127.0.0.1",
                                                   "MASTER_PORT": str(free_port())},
                          args=["init-mpi" if init_mpi else "no-init"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("ok") == 3, p.stdout
    if init_mpi:
        assert "error" not in p.stdout, p.stdout
    else:
        assert p.stdout.count("from mpi4py import MPI") == 2, p.stdout


STUCK_PROGRAM = textwrap.dedent("""
    import datetime, sys, time
    import numpy as np
    import collectives as dist
    dist.init_process_group("mpi", timeout=datetime.timedelta(seconds=0.5))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = np.ones(4, np.float32)
    out = np.zeros(4 * world, np.float32)
    go = np.ones(1, np.int8)
    start = time.monotonic()
    while go[0]:  # 2 s of quick blocking calls, each far under the timeout
        dist.all_reduce(x)
        dist.all_gather_into_tensor(out, x)
        dist.barrier()
        go[0] = time.monotonic() - start < 2.0
        dist.broadcast(go, src=0)
    print("healthy", rank, flush=True)
    if rank == world - 1:
        time.sleep(100)  # never arrives
    elif sys.argv[1] == "barrier":
        dist.barrier()
    else:
        dist.all_reduce(x)
    print("returned", rank, flush=True)
""")


@pytest.mark.faults
@needs_mpi
@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,call,extensions", [
    (2, "all_reduce", True), (3, "all_reduce", True), (2, "barrier", True),
    # the Python call log: the barrier waits in the log's comparison, a frame below barrier's
    (2, "barrier", False), (3, "all_reduce", False)])
def test_a_blocking_collective_a_peer_never_calls_ends_the_job_after_the_timeout(
        n, call, extensions):
    """MPI cannot time out a blocking call: the watchdog ends the job with MPI_Abort, naming
    the call, once it has run past the group timeout; quick calls never trip it."""
    start = time.monotonic()
    p = run_under_mpiexec(STUCK_PROGRAM, n, None if extensions else
                          {"COLLECTIVES_NO_EXTENSIONS": "1"}, args=(call,))
    took = time.monotonic() - start
    out = p.stdout + p.stderr
    assert p.stdout.count("healthy") == n, out  # no call of the healthy phase was cut short
    assert "returned" not in p.stdout, out
    assert p.returncode != 0, out
    # either waiting rank may be the first to abort
    assert re.search(rf"the mpi {call} \(group rank [0-{n - 2}] of {n}\)", p.stderr), out
    assert "past the group timeout (0.5 s)" in p.stderr and "MPI_Abort" in p.stderr, out
    assert 'File "<string>", line' in p.stderr, out  # where the stuck call was made
    assert took < 60, f"took {took:.1f} s: the sleeping rank was not ended with the job\n{out}"


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_watchdog_thread_runs_unless_switched_off(setting):
    program = textwrap.dedent("""
        import threading
        import collectives as dist
        dist.init_process_group("mpi")
        print("threads", sorted(t.name for t in threading.enumerate()), flush=True)
        dist.destroy_process_group()
    """)
    p = run_under_mpiexec(program, 1, {"COLLECTIVES_MPI_WATCHDOG": setting})
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("collectives-mpi-watchdog" in p.stdout) == (setting == "1"), p.stdout
