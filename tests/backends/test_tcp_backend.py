"""The tcp ('gloo') backend, driven directly on NumPy Buffers across real processes.

Every collective equals a NumPy reference computed in the test process, on any
world size, dtype, op and size (the inputs are small integers, so every
reduction order gives the exact answer); all_reduce is bitwise identical on every
rank for arbitrary floats; point to point follows MPI matching and never
deadlocks; failures (a mismatched call, a peer that exits, a silent peer) raise
DistBackendError on the other ranks within the timeout.
"""
import os
import select
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

pytest.importorskip("collectives.engines._tcp", reason="collectives.engines._tcp is not built")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from collectives.core import dtypes as D  # noqa: E402
from collectives.core.errors import DistBackendError  # noqa: E402
from collectives.core.tensors import Buffer  # noqa: E402
from tests.support.profiles import examples  # noqa: E402
from tests.support.ranks import ROOT, get_pool, ipv4_interfaces  # noqa: E402

NP_OF = {D.FLOAT16: np.float16, D.BFLOAT16: np.uint16, D.FLOAT32: np.float32,
         D.FLOAT64: np.float64, D.COMPLEX64: np.complex64, D.COMPLEX128: np.complex128,
         D.INT8: np.int8, D.UINT8: np.uint8, D.INT16: np.int16, D.INT32: np.int32,
         D.INT64: np.int64, D.BOOL: np.bool_}
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
KINDS = REDUCING + ("broadcast", "all_gather", "gather", "scatter", "all_to_all", "barrier")
# thresholds tiny enough that ring / chain / segmented paths run on small inputs
TINY = {"allreduce_rd_max": 64, "tree_max": 64, "segment": 256, "direct_max": 64, "allreduce_direct_world": 1,
        "duplex_chunk": 100, "allreduce_hd_max": 4096}


# ---- what runs on the ranks -------------------------------------------------------------

def _setup(ctx):
    from collectives.store import TCPStore
    ctx.state["store"] = TCPStore("127.0.0.1", ctx.port, ctx.world_size, ctx.rank == 0,
                                  timedelta(seconds=60))
    ctx.state["backends"] = {}


def _backend(ctx, name, timeout=30.0, options=None):
    from collectives.backends.tcp import TcpBackend
    from collectives.store import PrefixStore
    bs = ctx.state["backends"]
    if name not in bs:
        b = TcpBackend(PrefixStore(name, ctx.state["store"]), ctx.rank, ctx.world_size, timeout, options)
        bs[name] = b
        ctx.state["atexit"].append(b.shutdown)
    return bs[name]


def _values(dtype, count, seed, rank, op):
    """Small integers (exact under every reduction order) as int64."""
    rng = np.random.default_rng([seed, rank])
    if dtype == D.BOOL:
        return rng.integers(0, 2, count)
    if op == D.PRODUCT:
        return rng.choice([1, 2] if dtype == D.UINT8 else [-1, 1, 2], count)
    lo = 0 if dtype == D.UINT8 else -3
    return rng.integers(lo, 4, count)


def _array(dtype, ints):
    if dtype == D.BFLOAT16:
        return (ints.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dtype in D.COMPLEX:
        return (ints + 1j * ints[::-1]).astype(NP_OF[dtype]) if len(ints) else np.zeros(0, NP_OF[dtype])
    return ints.astype(NP_OF[dtype])


def _buf(dtype, arr):
    return Buffer(arr.__array_interface__["data"][0], arr.size, dtype, -1, arr)


def _decode(dtype, arr):
    """Exact values as float64/complex128/int64 for comparison."""
    if dtype == D.BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in D.COMPLEX:
        return arr.astype(np.complex128)
    if dtype in D.FLOATING:
        return arr.astype(np.float64)
    return arr.astype(np.int64)


def _a2a_counts(seed, n, count):
    return np.random.default_rng([seed, 999]).integers(0, count + 1, (n, n))


def run_collective(ctx, bname, kind, dtype, op, count, seed, root):
    opts = TINY if bname == "tiny" else None
    b = _backend(ctx, bname, options=opts)
    n, r = ctx.world_size, ctx.rank
    if kind == "barrier":
        b.barrier()
        return None
    if kind == "all_to_all":
        c = _a2a_counts(seed, n, count)
        x = _array(dtype, _values(dtype, int(c[r].sum()), seed, r, op))
        out = np.full(int(c[:, r].sum()), 7, x.dtype)
        b.all_to_all(_buf(dtype, out), _buf(dtype, x), [int(v) for v in c[:, r]], [int(v) for v in c[r]])
        return out
    big = kind in ("reduce_scatter", "scatter")
    x = _array(dtype, _values(dtype, count * n if big else count, seed, r, op))
    if kind == "all_reduce":
        b.all_reduce(_buf(dtype, x), op)
        return x
    if kind == "reduce":
        b.reduce(_buf(dtype, x), op, root)
        return x
    if kind == "broadcast":
        b.broadcast(_buf(dtype, x), root)
        return x
    if kind == "all_gather":
        out = np.zeros(count * n, x.dtype)
        b.all_gather(_buf(dtype, out), _buf(dtype, x))
        return out
    if kind == "gather":
        out = np.zeros(count * n, x.dtype) if r == root else None
        b.gather(None if out is None else _buf(dtype, out), _buf(dtype, x), root)
        return out
    if kind == "scatter":
        out = np.zeros(count, x.dtype)
        b.scatter(_buf(dtype, out), _buf(dtype, x) if r == root else None, root)
        return out
    if kind == "reduce_scatter":
        out = np.zeros(count, x.dtype)
        b.reduce_scatter(_buf(dtype, out), _buf(dtype, x), op)
        return out
    raise AssertionError(kind)


# ---- the reference (in the test process) ----------------------------------------------

def _reduce_ref(dtype, op, stack):
    if dtype == D.BOOL:
        if op in (D.SUM, D.MAX, D.BOR):
            return stack.any(axis=0).astype(np.int64)
        if op in (D.PRODUCT, D.MIN, D.BAND):
            return stack.all(axis=0).astype(np.int64)
        return np.bitwise_xor.reduce(stack, axis=0)
    f = {D.SUM: np.sum, D.PRODUCT: np.prod, D.MIN: np.min, D.MAX: np.max}.get(op)
    if f is not None:
        return f(stack, axis=0)
    g = {D.BAND: np.bitwise_and, D.BOR: np.bitwise_or, D.BXOR: np.bitwise_xor}[op]
    return g.reduce(stack, axis=0)


def reference(kind, dtype, op, count, seed, root, n):
    """Expected results by rank, as exact decoded values (None where nothing is defined)."""
    def inp(r, m):
        return _decode(dtype, _array(dtype, _values(dtype, m, seed, r, op)))
    if kind == "barrier":
        return [None] * n
    if kind == "all_to_all":
        c = _a2a_counts(seed, n, count)
        ins = [inp(r, int(c[r].sum())) for r in range(n)]
        offs = [np.concatenate([[0], np.cumsum(c[r])]) for r in range(n)]
        return [np.concatenate([ins[j][offs[j][r]:offs[j][r + 1]] for j in range(n)]) for r in range(n)]
    big = kind in ("reduce_scatter", "scatter")
    ins = [inp(r, count * n if big else count) for r in range(n)]
    if kind in ("all_reduce", "reduce", "reduce_scatter"):
        red = _reduce_ref(dtype, op, np.stack(ins)) if n else None
        red = _decode(dtype, _array(dtype, np.asarray(red))) if dtype not in D.COMPLEX else red
        if kind == "all_reduce":
            return [red] * n
        if kind == "reduce":
            return [red if r == root else ins[r] for r in range(n)]
        return [red[r * count:(r + 1) * count] for r in range(n)]
    if kind == "broadcast":
        return [ins[root]] * n
    if kind == "all_gather":
        return [np.concatenate(ins)] * n
    if kind == "gather":
        return [np.concatenate(ins) if r == root else None for r in range(n)]
    if kind == "scatter":
        return [ins[root][r * count:(r + 1) * count] for r in range(n)]
    raise AssertionError(kind)


def pool_of(n):
    return get_pool(n, setup=_setup)


def check_collective(n, bname, kind, dtype, op, count, seed, root, timeout=120):
    got = pool_of(n).run(run_collective, bname, kind, dtype, op, count, seed, root, timeout=timeout)
    want = reference(kind, dtype, op, count, seed, root, n)
    for r in range(n):
        if want[r] is None:
            assert got[r] is None or kind == "barrier", (r, got[r])
            continue
        g = _decode(dtype, got[r])
        assert g.shape == want[r].shape, (kind, r, g.shape, want[r].shape)
        np.testing.assert_array_equal(g, want[r], err_msg=f"{kind} rank {r} of {n}")


# ---- collectives against NumPy ------------------------------------------------------------

DTYPES = sorted(NP_OF)
SIZES = [0, 1, 2, 3, 7, 63, 64, 65, 255, 1000, 4097, 16383, 16385, 65537]


@st.composite
def collective_cases(draw):
    n = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    ops = [o for o in (D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR) if D.op_valid(dtype, o)]
    op = draw(st.sampled_from(ops)) if kind in REDUCING else D.SUM
    count = draw(st.sampled_from(SIZES))
    return n, draw(st.sampled_from(["default", "tiny"])), kind, dtype, op, count, \
        draw(st.integers(0, 2**31)), draw(st.integers(0, n - 1))


@pytest.mark.timeout(900)
@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@given(collective_cases())
def test_every_collective_equals_the_numpy_reference(case):
    check_collective(*case)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"])
def test_a_few_megabytes_through_every_algorithm(n, kind):
    count = (3 << 20) // 4 + 5   # ~3 MiB of float32, an odd element count
    for bname in ("default", "tiny"):
        check_collective(n, bname, kind, D.FLOAT32, D.SUM, count, 1234 + n, n - 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_halving_doubling_equals_the_numpy_reference(n):
    """The tiny setting runs all_reduces of 65-4096 B by halving-doubling (above 2 ranks):
    4000 B halve into 2000, 1000 and 500 B; 3001 int8 an odd split; 5 and 6 ranks fold one
    or two ranks in first."""
    for dtype, op, count in ((D.INT32, D.SUM, 1000), (D.FLOAT64, D.MAX, 500),
                             (D.INT8, D.PRODUCT, 3001), (D.UINT8, D.BXOR, 3001)):
        check_collective(n, "tiny", "all_reduce", dtype, op, count, 77 + n, 0)


def all_gather_placed(ctx, bname, count, where):
    """all_gather with the input apart from the output, as this rank's block of it (in
    place) or overlapping the next rank's block: the result is every rank's input as it
    was at the call."""
    b = _backend(ctx, bname, options=TINY if bname == "tiny" else None)
    n, r = ctx.world_size, ctx.rank
    mine = np.arange(count, dtype=np.int32) + 1000 * r
    out = np.full(count * n + count // 2, -1, np.int32)
    if where == "apart":
        x = mine
    else:
        at = r * count if where == "own" else ((r + 1) % n) * count + count // 2
        x = out[at:at + count]
        x[:] = mine
    b.all_gather(_buf(D.INT32, out[:count * n]), _buf(D.INT32, x))
    return out[:count * n].copy()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("where", ["apart", "own", "overlapping"])
def test_all_gather_reads_its_input_wherever_it_lies(n, where):
    """The ring copies an input apart from the output while its first segments travel;
    inputs inside the output are read before anything arrives."""
    for bname in ("default", "tiny"):
        count = 5001 if bname == "tiny" else 70001   # both past the direct exchange
        want = np.concatenate([np.arange(count, dtype=np.int32) + 1000 * r for r in range(n)])
        for got in pool_of(n).run(all_gather_placed, bname, count, where):
            np.testing.assert_array_equal(got, want)


def reduce_scatter_placed(ctx, bname, count, where):
    """reduce_scatter with the output apart from the input, as this rank's block of it or
    overlapping another block; and a reduce, whose input stays as it was off the root."""
    b = _backend(ctx, bname, options=TINY if bname == "tiny" else None)
    n, r = ctx.world_size, ctx.rank
    x = (np.arange(count * n, dtype=np.int32) % 1000) * (r + 1)
    kept = x.copy()
    if where == "apart":
        out = np.full(count, -1, np.int32)
    else:
        at = r * count if where == "own" else ((r + 1) % n) * count + count // 2
        at = min(at, count * n - count)
        out = x[at:at + count]
    b.reduce_scatter(_buf(D.INT32, out), _buf(D.INT32, x), D.SUM)
    got = out.copy()
    y = kept.copy()
    b.reduce(_buf(D.INT32, y), D.SUM, 0)
    return got, r == 0 or np.array_equal(y, kept), y if r == 0 else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("where", ["apart", "own", "overlapping"])
def test_reduce_scatter_reads_its_input_wherever_the_output_lies(n, where):
    """The ring reduces this rank's block straight into the output and reads the input
    where it is; an output that overlaps the input elsewhere works from a copy."""
    scale = n * (n + 1) // 2
    for bname in ("default", "tiny"):
        count = 5001 if bname == "tiny" else 70001   # both past the direct exchange
        total = (np.arange(count * n, dtype=np.int32) % 1000) * scale
        res = pool_of(n).run(reduce_scatter_placed, bname, count, where)
        for r, (got, kept, _) in enumerate(res):
            np.testing.assert_array_equal(got, total[r * count:(r + 1) * count])
            assert kept, f"reduce changed rank {r}'s input"
        np.testing.assert_array_equal(res[0][2], total)


def allreduce_random_floats(ctx, bname, dtype, count, seed):
    b = _backend(ctx, bname, options=TINY if bname == "tiny" else None)
    rng = np.random.default_rng([seed, ctx.rank])
    x = (rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(NP_OF[dtype])
    if count > 3:
        x[3] = np.nan if ctx.rank == 1 else x[3]
    b.all_reduce(_buf(dtype, x), D.MIN if seed % 2 else D.SUM)
    return x.view(np.uint8).tobytes()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 5, 6])
@pytest.mark.parametrize("count", [5, 1001, 70000])
def test_all_reduce_is_bitwise_identical_on_every_rank(n, count):
    for bname in ("default", "tiny"):
        for seed in (1, 2):
            for dtype in (D.FLOAT32, D.FLOAT16):
                got = pool_of(n).run(allreduce_random_floats, bname, dtype, count, seed)
                assert all(g == got[0] for g in got), f"ranks differ (n={n}, {bname}, seed {seed})"


# ---- point to point -----------------------------------------------------------------------

def p2p_any_source(ctx, bname):
    b = _backend(ctx, bname)
    n, r = ctx.world_size, ctx.rank
    if r == 0:
        bufs = [np.zeros(3, np.int64) for _ in range(n - 1)]
        reqs = [b.irecv(_buf(D.INT64, x), None, 5) for x in bufs]
        for q in reqs:
            q.wait()
        return sorted((q.source, tuple(x)) for q, x in zip(reqs, bufs))
    x = np.array([r, r * 10, r * 100], np.int64)
    b.isend(_buf(D.INT64, x), 0, 5).wait()
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4, 6])
def test_irecv_from_any_source_names_the_sender(n):
    got = pool_of(n).run(p2p_any_source, "default")
    assert got[0] == [(r, (r, r * 10, r * 100)) for r in range(1, n)]


def p2p_tags(ctx, bname):
    b = _backend(ctx, bname)
    if ctx.rank == 0:
        msgs = [np.full(k + 1, k, np.int32) for k in range(6)]
        tags = [1, 2, 3, 3, 2, 1]  # same tag twice: must arrive in order
        reqs = [b.isend(_buf(D.INT32, m), 1, t) for m, t in zip(msgs, tags)]
        for q in reqs:
            q.wait()
        return None
    if ctx.rank == 1:
        time.sleep(0.1)  # let everything arrive unexpected first
        out = {k: np.zeros(k + 1, np.int32) for k in range(6)}
        order = [(3, 2), (3, 3), (1, 0), (2, 1), (2, 4), (1, 5)]  # (tag, message index it must get)
        reqs = [(b.irecv(_buf(D.INT32, out[k]), 0, t), k) for t, k in order]
        for q, _ in reqs:
            q.wait()
            assert q.source == 0
        return {k: out[k].tolist() for k in out}
    return None


@pytest.mark.timeout(120)
def test_tags_match_out_of_order_and_same_tag_messages_do_not_overtake():
    got = pool_of(3).run(p2p_tags, "default")
    assert got[1] == {k: [k] * (k + 1) for k in range(6)}


def p2p_big_both_ways(ctx, bname, nbytes):
    b = _backend(ctx, bname)
    n, r = ctx.world_size, ctx.rank
    peer = r ^ 1
    if peer >= n:
        return True
    x = np.full(nbytes, r + 1, np.uint8)
    y = np.zeros(nbytes, np.uint8)  # a receive takes exactly the message's size
    s = b.isend(_buf(D.UINT8, x), peer, 0)   # both sides send first: must not deadlock
    q = b.irecv(_buf(D.UINT8, y), peer, 0)
    q.wait()
    s.wait()
    return bool((y == peer + 1).all() and q.nbytes == nbytes)


@pytest.mark.faults
@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_both_sides_isend_a_large_message_then_irecv_without_deadlock(n):
    assert all(pool_of(n).run(p2p_big_both_ways, "default", 48 << 20, timeout=150))


def p2p_ring(ctx, bname, nbytes, rounds):
    b = _backend(ctx, bname)
    n, r = ctx.world_size, ctx.rank
    ok = True
    for k in range(rounds):
        x = np.full(nbytes, (r + k) % 251, np.uint8)
        y = np.zeros(nbytes, np.uint8)
        reqs = [b.irecv(_buf(D.UINT8, y), (r - 1) % n, k), b.isend(_buf(D.UINT8, x), (r + 1) % n, k)]
        for q in reqs:
            q.wait()
        ok &= bool((y == ((r - 1) % n + k) % 251).all())
    return ok


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3, 6])
def test_rings_of_isend_irecv_complete(n):
    assert all(pool_of(n).run(p2p_ring, "default", 3 << 20, 3, timeout=150))
    assert all(pool_of(n).run(p2p_ring, "default", 0, 2))


def p2p_truncation(ctx, bname):
    b = _backend(ctx, bname)
    if ctx.rank == 0:
        b.isend(_buf(D.UINT8, np.zeros(100, np.uint8)), 1, 9).wait()
        return None
    try:
        b.irecv(_buf(D.UINT8, np.zeros(10, np.uint8)), 0, 9).wait()
    except DistBackendError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_a_message_larger_than_the_receive_buffer_fails_the_receive():
    got = pool_of(2).run(p2p_truncation, "default")
    assert "100 bytes" in got[1] and "irecv from rank 0" in got[1]


def threads_mix(ctx, bname, rounds):
    """Async collectives on the progress thread, p2p driven by another thread, and
    blocking collectives in the main thread, all in flight at once."""
    b = _backend(ctx, bname)
    n, r = ctx.world_size, ctx.rank
    errors = []

    def p2p():
        try:
            for _ in range(rounds):
                x = np.full(50000, r, np.int32)
                y = np.zeros(50000, np.int32)
                qs = [b.irecv(_buf(D.INT32, y), (r - 1) % n, 77), b.isend(_buf(D.INT32, x), (r + 1) % n, 77)]
                for q in qs:
                    q.wait()
                if not (y == (r - 1) % n).all():
                    errors.append("p2p data")
        except Exception as e:  # reported below
            errors.append(repr(e))

    t = threading.Thread(target=p2p)
    t.start()
    results = []
    for k in range(rounds):
        a = np.full(1000 + k, r + k, np.int64)
        req = b.submit(b.all_reduce, _buf(D.INT64, a), D.SUM)
        c = np.full(70000, r, np.float64)
        b.run(b.all_reduce, _buf(D.FLOAT64, c), D.MAX)   # goes behind the queued one
        req.wait()
        results.append(bool((a == sum(q + k for q in range(n))).all() and (c == n - 1).all()))
    t.join(60)
    return all(results) and not errors and not t.is_alive(), errors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_blocking_async_and_p2p_threads_in_flight_at_once(n):
    got = pool_of(n).run(threads_mix, "default", 20, timeout=150)
    assert all(g[0] for g in got), got


# ---- failures -----------------------------------------------------------------------------

def mismatched_call(ctx, bname, variant):
    b = _backend(ctx, bname, timeout=20)
    x = np.ones(8, np.float32)
    t0 = time.monotonic()
    try:
        if ctx.rank == 0:
            b.all_reduce(_buf(D.FLOAT32, x), D.SUM)
        elif variant == "op":
            b.broadcast(_buf(D.FLOAT32, x), 0)
        else:
            b.all_reduce(_buf(D.FLOAT32, np.ones(16, np.float32)), D.SUM)
    except DistBackendError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["op", "size"])
def test_a_mismatched_collective_raises_on_both_sides(variant):
    got = pool_of(2).run(mismatched_call, f"mismatch-{variant}", variant)
    for r, (msg, dt) in enumerate(got):
        assert msg is not None, f"rank {r} did not raise"
        assert "called" in msg and "as collective #1" in msg, msg
        assert dt < 10, dt
    if variant == "op":
        assert "broadcast" in got[0][0] and "all_reduce" in got[1][0]


def silent_peer(ctx, bname):
    b = _backend(ctx, bname, timeout=1.5)
    if ctx.rank == 1:
        return None
    t0 = time.monotonic()
    try:
        b.all_reduce(_buf(D.FLOAT32, np.ones(4, np.float32)), D.SUM)
    except DistBackendError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0


@pytest.mark.timeout(60)
def test_a_silent_peer_makes_the_wait_time_out():
    msg, dt = pool_of(2).run(silent_peer, "silent")[0]
    assert "Timed out waiting 1500ms" in msg and "all_reduce #1" in msg and "rank 1" in msg, msg
    assert 1.4 < dt < 5, dt


def clean_close(ctx, bname):
    b = _backend(ctx, bname)
    b.barrier()
    if ctx.rank == 1:
        b.shutdown()
        return None
    t0 = time.monotonic()
    try:
        b.irecv(_buf(D.UINT8, np.zeros(4, np.uint8)), 1, 0).wait()
    except DistBackendError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0


@pytest.mark.timeout(60)
def test_shutdown_lets_peers_see_a_clean_close():
    msg, dt = pool_of(2).run(clean_close, "close")[0]
    assert "rank 1 shut down" in msg and "clean close" in msg, msg
    assert dt < 5


def report_then_close(ctx, bname, reset):
    """Rank 0 fails the group's next collective (fail_next: a hierarchical leader whose host
    found a mismatch) and shuts down before rank 1 begins that collective, so rank 1 takes
    in the error frame, the close frame and the end of the stream in one read. ``reset``:
    rank 0 also closes its sockets with a message of rank 1's unread (as a process that
    exits does), its kernel resets the connection, and rank 1's first send of that
    collective fails before rank 1 has read anything. Returns rank 1's error."""
    import gc

    from collectives.backends.tcp import TcpBackend
    from collectives.store import PrefixStore
    store = ctx.state["store"]
    b = TcpBackend(PrefixStore(bname, store), ctx.rank, ctx.world_size, 30.0)
    try:
        b.barrier()
        if ctx.rank == 1:
            if reset:  # a message rank 0 leaves unread
                b.isend(_buf(D.UINT8, np.ones(1 << 16, np.uint8)), 0, 9).wait()
            store.set(f"{bname}/sent", b"1")
            store.wait([f"{bname}/closed"])
            try:
                b.all_reduce(_buf(D.FLOAT32, np.ones(4, np.float32)), D.SUM)
            except DistBackendError as e:
                return str(e)
            return "no error"
        store.wait([f"{bname}/sent"])
        b.fail_next("the calls of host 0 differ")
        b.shutdown()
        if reset:
            del b
            gc.collect()  # the engine is freed: its sockets close
        store.set(f"{bname}/closed", b"1")
        return None
    finally:
        if ctx.rank == 1:
            b.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_a_peer_that_reports_a_failure_and_closes_is_named_by_its_report(reset):
    """The report explains the close that follows it: rank 1 raises rank 0's words, not
    "rank 0 shut down its backend (clean close)" (once a flaky hierarchical mismatch test)
    nor, where its send failed first on the reset connection, "Broken pipe"."""
    msg = pool_of(2).run(report_then_close, f"report_then_close_{reset}", reset)[1]
    assert "rank 0 reported: the calls of host 0 differ" in msg, msg
    assert "clean close" not in msg and "Broken pipe" not in msg, msg


DYING_RANK = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import numpy as np
    from collectives.store import TCPStore
    from collectives.backends.tcp import TcpBackend
    from collectives.core.errors import DistBackendError
    from collectives.core.tensors import to_buffer
    rank, n, port, nbytes = (int(a) for a in sys.argv[1:5])
    store = TCPStore("127.0.0.1", port, n, rank == 0, timedelta(seconds=30))
    b = TcpBackend(store, rank, n, 20.0)
    x = np.ones(nbytes // 4, np.float32)
    b.all_reduce(to_buffer(x), 0)
    if rank == 1:
        os._exit(3)   # dies without shutdown while the others start the next collective
    t0 = time.monotonic()
    try:
        for _ in range(3):
            b.all_reduce(to_buffer(x), 0)
        print("NO ERROR")
    except DistBackendError as e:
        print("RAISED %.3f %s" % (time.monotonic() - t0, e))
    sys.stdout.flush()
    # stay until every survivor has raised: one that leaves first resets its connections,
    # and a slower survivor would then name it instead of rank 1
    try:
        store.add("raised", 1)
        deadline = time.monotonic() + 20
        while store.add("raised", 0) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:
        pass
    os._exit(0)
""")


@pytest.mark.faults
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,nbytes", [(2, 64), (3, 64), (4, 8 << 20)])
def test_a_peer_that_exits_makes_the_others_raise_within_the_timeout(n, nbytes):
    from tests.support.ranks import free_port
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", DYING_RANK, str(r), str(n), str(port), str(nbytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outs[1][0] == 3, outs[1]
    for r, (_, out, err) in enumerate(outs):
        if r == 1:
            continue
        assert out.startswith("RAISED"), (r, out, err)
        assert float(out.split()[1]) < 20, out
        assert "rank 1" in out, out


# ---- the address peers connect to --------------------------------------------------------

def _mesh_of_threads(size):
    """connect_mesh on ``size`` threads of this process over one HashStore: (the
    host:port each rank published, each rank's fds)."""
    from collectives.backends.tcp import connect_mesh
    from collectives.store import HashStore
    store = HashStore()
    fds, errors = [None] * size, []

    def rank(r):
        try:
            fds[r] = connect_mesh(store, r, size, 10.0)[0]
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return [store.get(f"tcp/0/addr/{r}").decode() for r in range(size)], fds


@pytest.mark.timeout(60)
@pytest.mark.parametrize("var", ["COLLECTIVES_IFNAME", "GLOO_SOCKET_IFNAME"])
def test_the_interface_variable_sets_the_address_peers_connect_to(var, monkeypatch):
    """Every interface with an IPv4 address, named by our variable or by torch's gloo one
    (there the first of a list); the ranks publish its address and connect through it."""
    ifaces = ipv4_interfaces()
    assert "lo" in ifaces, ifaces
    for other in ("COLLECTIVES_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(other, raising=False)
    for name, addr in ifaces.items():
        monkeypatch.setenv(var, name if var == "COLLECTIVES_IFNAME" else f"{name},lo")
        published, fds = _mesh_of_threads(3)
        assert {a.rpartition(":")[0] for a in published} == {addr}, (name, published)
        try:
            os.write(fds[0][2], b"x")  # rank 0's socket to rank 2 reaches rank 2
            assert select.select([fds[2][0]], [], [], 5)[0]
            assert os.read(fds[2][0], 1) == b"x"
        finally:
            for row in fds:
                for fd in row:
                    if fd >= 0:
                        os.close(fd)


def test_collectives_ifname_wins_over_torchs_and_a_bad_name_raises_before_the_store(monkeypatch):
    from collectives.backends.tcp import advertised_host, connect_mesh
    from collectives.store import HashStore
    ifaces = ipv4_interfaces()
    others = [n for n in ifaces if n != "lo"]
    monkeypatch.setenv("COLLECTIVES_IFNAME", "lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", others[0] if others else "no-such-if0")
    assert advertised_host() == "127.0.0.1"
    monkeypatch.delenv("COLLECTIVES_IFNAME")
    for var in ("GLOO_SOCKET_IFNAME", "COLLECTIVES_IFNAME"):
        monkeypatch.setenv(var, "no-such-if0,lo")  # the first of a list is the one used
        store = HashStore()
        with pytest.raises(ValueError, match=f"{var} names interface 'no-such-if0', which has no IPv4"):
            connect_mesh(store, 1, 2, 5.0)
        assert store.num_keys() == 0  # raised before any rank could wait for this one
        monkeypatch.delenv(var)
