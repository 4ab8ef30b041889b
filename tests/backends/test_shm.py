"""The shared-memory backend at the Backend level, and the default backend's transport choice.

Every collective equals its NumPy reference for any world size 1-6, dtype, op and
size (0, 1, odd, around the one-shot/two-shot and chunk thresholds); all_reduce
results are bitwise identical on every rank; p2p honours tags, any-source and
issue order and never deadlocks; a group spanning (faked) hosts is hierarchical;
a SIGKILLed peer makes the others raise DistBackendError within the timeout; and
no segment is ever left in /dev/shm.
"""
import glob
import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectives.core import dtypes as D
from collectives.core.tensors import to_buffer
from tests.support import ROOT
from tests.support.profiles import examples
from tests.support.ranks import RankPool, free_port, get_pool
from tests.support.marks import quick_only

pytest.importorskip("collectives.engines._shm", reason="build the _shm extension (COLLECTIVES_ONLY=_shm)")

NP = {D.FLOAT16: np.float16, D.FLOAT32: np.float32, D.FLOAT64: np.float64,
      D.COMPLEX64: np.complex64, D.INT8: np.int8, D.UINT8: np.uint8, D.INT32: np.int32,
      D.INT64: np.int64, D.BOOL: np.bool_}
REDUCE_OPS = [D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR]
VALID = [(dt, op) for dt in NP for op in REDUCE_OPS if D.op_valid(dt, op)]
TIMEOUT = 20.0
SMALL_HALF = 16384  # a small slot so modest sizes exercise chunking and two-shot
ENV_SMALL = {"COLLECTIVES_SHM_HALF_BYTES": str(SMALL_HALF), "COLLECTIVES_SHM_ONESHOT_MAX": "2048",
             "COLLECTIVES_SHM_CHUNK_BYTES": "8192"}
# sizes (in elements) around the thresholds of the small-slot configuration
SIZES = [0, 1, 2, 3, 7, 255, 256, 257, 511, 513, 1023, 2049, 4097, 12345]
SETTINGS = settings(max_examples=examples(30), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def shm_segments():
    return set(glob.glob("/dev/shm/collectives-*"))


# ---- run on the ranks --------------------------------------------------------------

def setup_backend(ctx, kind):
    from collectives.store import TCPStore
    store = TCPStore("127.0.0.1", ctx.port, ctx.world_size, ctx.rank == 0,
                     timeout=timedelta(seconds=60))
    if kind == "shm":
        from collectives.backends.shm import ShmBackend
        be = ShmBackend(store, ctx.rank, ctx.world_size, TIMEOUT)
    else:
        from collectives.backends.select import create_default_backend
        be = create_default_backend(store, ctx.rank, ctx.world_size, TIMEOUT)
    ctx.state["store"] = store
    ctx.state["be"] = be
    ctx.state["atexit"].append(be.shutdown)
    return type(be).__name__


def make_input(seed, rank, count, dtype):
    """Small integers of any dtype: every reduction order gives the same exact result."""
    rng = np.random.default_rng([seed, rank])
    if dtype == D.BOOL:
        return rng.integers(0, 2, count).astype(np.bool_)
    lo = 0 if dtype == D.UINT8 else -2
    v = rng.integers(lo, 3, count)
    if dtype in D.COMPLEX:
        return (v + 1j * rng.integers(-2, 3, count)).astype(NP[dtype])
    return v.astype(NP[dtype])


def np_reduce(arrays, op):
    fn = {D.SUM: np.add, D.PRODUCT: np.multiply, D.MIN: np.minimum, D.MAX: np.maximum,
          D.BAND: np.bitwise_and, D.BOR: np.bitwise_or, D.BXOR: np.bitwise_xor}[op]
    if arrays[0].dtype == np.bool_ and op == D.SUM:
        fn = np.logical_or
    if arrays[0].dtype == np.bool_ and op == D.PRODUCT:
        fn = np.logical_and
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a).astype(arrays[0].dtype)
    return out


def run_op(ctx, name, seed, dtype, count, op, root):
    """Run one collective on the rank's backend; return True or a mismatch description."""
    be, n, r = ctx.state["be"], ctx.world_size, ctx.rank
    ins = [make_input(seed, q, count, dtype) for q in range(n)]
    mine = ins[r].copy()
    if name == "all_reduce":
        be.all_reduce(to_buffer(mine), op)
        got, want = mine, np_reduce(ins, op)
    elif name == "reduce":
        be.reduce(to_buffer(mine), op, root)
        got, want = mine, np_reduce(ins, op) if r == root else ins[r]
    elif name == "broadcast":
        be.broadcast(to_buffer(mine), root)
        got, want = mine, ins[root]
    elif name == "all_gather":
        got = np.empty(n * count, NP[dtype])
        be.all_gather(to_buffer(got), to_buffer(mine))
        want = np.concatenate(ins)
    elif name == "all_gather_list":  # one separate array per rank (torch's list form)
        outs = [np.empty(count, NP[dtype]) for _ in range(n)]
        be.all_gather_list([to_buffer(o) for o in outs], to_buffer(mine))
        got, want = np.concatenate(outs), np.concatenate(ins)
    elif name == "all_gather_mixed":  # odd ranks gather into one array, even ones into a list
        got = np.empty(n * count, NP[dtype])
        if r % 2:
            be.all_gather(to_buffer(got), to_buffer(mine))
        else:
            outs = [np.empty(count, NP[dtype]) for _ in range(n)]
            be.all_gather_list([to_buffer(o) for o in outs], to_buffer(mine))
            got = np.concatenate(outs)
        want = np.concatenate(ins)
    elif name == "all_gather_in_place":  # the input is this rank's block of the output
        got = np.empty(n * count, NP[dtype])
        got[r * count:(r + 1) * count] = mine
        be.all_gather(to_buffer(got), to_buffer(got[r * count:(r + 1) * count]))
        want = np.concatenate(ins)
    elif name == "gather":
        got = np.empty(n * count, NP[dtype]) if r == root else None
        be.gather(to_buffer(got) if got is not None else None, to_buffer(mine), root)
        want = np.concatenate(ins) if r == root else None
    elif name == "scatter":
        got = np.empty(count, NP[dtype])
        src = np.concatenate([make_input(seed + 1, q, count, dtype) for q in range(n)])
        be.scatter(to_buffer(got), to_buffer(src.copy()) if r == root else None, root)
        want = src[r * count:(r + 1) * count]
    elif name in ("reduce_scatter", "reduce_scatter_in_place"):
        full = [make_input(seed, q, n * count, dtype) for q in range(n)]
        inp = full[r].copy()
        # in place: the output is this rank's own slice of the input
        got = inp[r * count:(r + 1) * count] if name.endswith("in_place") else np.empty(count, NP[dtype])
        be.reduce_scatter(to_buffer(got), to_buffer(inp), op)
        want = np_reduce(full, op)[r * count:(r + 1) * count]
    elif name == "all_to_all":
        # uneven: rank q sends (q + 2 * dst + seed) % (count + 1) elements to dst
        cnt = [[(q + 2 * d + seed) % (count + 1) for d in range(n)] for q in range(n)]
        sends = [make_input(seed, q, sum(cnt[q]), dtype) for q in range(n)]
        offs = [np.concatenate([[0], np.cumsum(cnt[q])]).astype(int) for q in range(n)]
        want = np.concatenate([sends[q][offs[q][r]:offs[q][r + 1]] for q in range(n)])
        got = np.empty(len(want), NP[dtype])
        be.all_to_all(to_buffer(got), to_buffer(sends[r].copy()), [cnt[q][r] for q in range(n)],
                      cnt[r])
    else:
        raise ValueError(name)
    if want is None:
        return True
    if got.dtype != want.dtype or not np.array_equal(got, want):  # -0.0 == 0.0 (complex products)
        return f"{name} rank {r}: got {got[:8]} want {want[:8]}"
    return True


def run_float_all_reduce(ctx, seed, count, dtype):
    """Random floats: the result's bytes (must equal on every rank)."""
    rng = np.random.default_rng([seed, ctx.rank])
    a = rng.standard_normal(count).astype(NP[dtype])
    ctx.state["be"].all_reduce(to_buffer(a), D.SUM)
    return a.tobytes()


def run_barrier_rounds(ctx, k):
    for _ in range(k):
        ctx.state["be"].barrier()
    return True


def run_p2p(ctx, pattern, nbytes):
    """Point-to-point patterns; returns True or a description of what went wrong."""
    be, n, r = ctx.state["be"], ctx.world_size, ctx.rank

    def payload(src, dst, k):
        return (np.arange(nbytes, dtype=np.int64) * 7 + src * 1000 + dst * 10 + k).astype(np.uint8)

    if pattern == "exchange_large":  # everyone sends first, large, then receives: no deadlock
        reqs = [be.isend(to_buffer(payload(r, d, 0)), d, 5) for d in range(n) if d != r]
        bufs = {s: np.empty(nbytes, np.uint8) for s in range(n) if s != r}
        reqs += [be.irecv(to_buffer(bufs[s]), s, 5) for s in bufs]
        for q in reqs:
            q.wait()
        for s, b in bufs.items():
            if not np.array_equal(b, payload(s, r, 0)):
                return f"from {s} wrong"
        return True
    if pattern == "tags_order":  # rank 0 -> 1: tags matched exactly, same tag in issue order
        if r == 0:
            reqs = [be.isend(to_buffer(payload(0, 1, k)), 1, tag)
                    for k, tag in enumerate([1, 2, 1, 2, 3])]
            for q in reqs:
                q.wait()
        elif r == 1:
            got = {}
            for k, tag in [(4, 3), (1, 2), (0, 1), (2, 1), (3, 2)]:  # received in another order
                b = np.empty(nbytes, np.uint8)
                req = be.irecv(to_buffer(b), 0, tag)
                req.wait()
                got[k] = b
            for k in range(5):
                if not np.array_equal(got[k], payload(0, 1, k)):
                    return f"message {k} wrong"
        return True
    if pattern == "any_source":  # every other rank sends to 0; 0 receives from any
        if r == 0:
            seen = []
            for _ in range(n - 1):
                b = np.empty(nbytes, np.uint8)
                req = be.irecv(to_buffer(b), None, 9)
                req.wait()
                if not np.array_equal(b, payload(req.source, 0, 0)):
                    return f"from {req.source} wrong"
                seen.append(req.source)
            if sorted(seen) != list(range(1, n)):
                return f"sources {seen}"
        else:
            be.isend(to_buffer(payload(r, 0, 0)), 0, 9).wait()
        return True
    if pattern == "ring":  # many messages around a ring, posted before any wait
        reqs, bufs = [], []
        for k in range(20):
            reqs.append(be.isend(to_buffer(payload(r, (r + 1) % n, k)), (r + 1) % n, k % 3))
            b = np.empty(nbytes, np.uint8)
            bufs.append(b)
            reqs.append(be.irecv(to_buffer(b), (r - 1) % n, k % 3))
        for q in reqs:
            q.wait()
        for k, b in enumerate(bufs):
            if not np.array_equal(b, payload((r - 1) % n, r, k)):
                return f"message {k} wrong"
        return True
    raise ValueError(pattern)


def segment_name(ctx):
    return ctx.state["be"].segment_name


DIE_AFTER = 0.3  # seconds into the call when the victim's timer ends it
LATE_BY = 1.2    # seconds the late survivor waits before it enters the call


def die_in_collective(ctx, victim, op="all_reduce"):
    """The victim arms a SIGALRM timer (its default action ends the process from the kernel,
    wherever the process is) and enters ``op``: it dies DIE_AFTER s into the call, having
    posted its part. One survivor, (victim + 1) % world, enters LATE_BY s late, so the victim
    is still waiting for it inside the call when it dies. A survivor returns what it saw in
    ``op`` and the barrier after it: ("raised", seconds, message) or ("no error", ...)."""
    from collectives.core.errors import DistBackendError
    be = ctx.state["be"]
    be.barrier()  # every rank is up before the fault
    a = np.ones(1 << 20, np.float32)
    src = np.ones(ctx.world_size << 20, np.float32)
    out = np.empty(ctx.world_size << 20, np.float32)
    if ctx.rank == victim:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, DIE_AFTER)
    elif ctx.rank == (victim + 1) % ctx.world_size:
        time.sleep(LATE_BY)
    t0 = time.monotonic()
    try:
        if op == "broadcast":  # the victim is the root
            be.broadcast(to_buffer(a), victim)
        elif op == "all_reduce":
            be.all_reduce(to_buffer(a), D.SUM)
        elif op == "scatter":  # rank 0 the root: it waits for the victim to read its block
            be.scatter(to_buffer(a), to_buffer(src) if ctx.rank == 0 else None, 0)
        else:
            be.all_gather(to_buffer(out), to_buffer(a))
        be.barrier()
    except DistBackendError as e:
        return ("raised", time.monotonic() - t0, str(e))
    if ctx.rank == victim:
        time.sleep(60)  # the call returned before the timer: die here
    return ("no error", time.monotonic() - t0, "")


def check_survivors_raised(world, victim, op, env):
    """A fresh pool whose ``victim`` dies inside ``op``: every other rank raised
    DistBackendError within the timeout, and no segment is left in /dev/shm."""
    before = shm_segments()
    pool = RankPool(world, setup_backend, ("shm",), env)
    answers, died = pool.run_dead_peer(die_in_collective, victim, op, victims={victim},
                                       timeout=TIMEOUT + 60)
    assert died == {victim}, (answers, died)
    assert sorted(answers) == [r for r in range(world) if r != victim], answers
    for r, (what, took, msg) in answers.items():
        assert what == "raised", f"rank {r} in {op}: {what} after {took:.1f} s"
        assert took < TIMEOUT + 5, f"rank {r} took {took:.1f} s: {msg}"
    assert shm_segments() <= before


def hier_info(ctx):
    be = ctx.state["be"]
    return (type(be).__name__, getattr(be, "host_index", None), getattr(be, "is_leader", None),
            getattr(be, "blocked", None))


def destroy(ctx):
    ctx.state["be"].shutdown()
    ctx.state["atexit"].remove(ctx.state["be"].shutdown)
    return True


# ---- tests ---------------------------------------------------------------------------

def pool_for(world, kind="shm", env=None):
    return get_pool(world, setup=setup_backend, setup_args=(kind,), env=env or ENV_SMALL)


# the gathers' forms: contiguous output, input inside it, one array per rank, both forms
# in one call (each rank picks its own)
GATHERS = ["all_gather", "all_gather_in_place", "all_gather_list", "all_gather_mixed", "gather"]
OPS = ["all_reduce", "reduce", "broadcast", *GATHERS, "scatter", "reduce_scatter",
       "reduce_scatter_in_place", "all_to_all"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", quick_only([1, 2, 3, 4, 6], 2, 3, 6))
@SETTINGS
@given(data=st.data())
def test_every_collective_matches_numpy(world, data):
    """Property: each op on any dtype/size equals the NumPy reference on every rank."""
    draw_and_run(data, pool_for(world), world, OPS)


def draw_and_run(data, pool, world, ops):
    """One drawn collective (op, dtype/op, count, root, seed) on every rank of ``pool``."""
    name = data.draw(st.sampled_from(ops), "op")
    dtype, op = data.draw(st.sampled_from(VALID), "dtype/op")
    count = data.draw(st.one_of(st.sampled_from(SIZES), st.integers(0, 20000)), "count")
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    assert pool.run(run_op, name, seed, dtype, count, op, root, timeout=60) == [True] * world


# segment writes with streaming stores, as a rank makes them while its peers are far;
# chunks of a whole slot so that the slices are large enough to stream, broadcasts in two
# copies (through the segment)
# one-shot up to 8 KiB: its copy-in streams from 4 KiB (copy_stream's smallest size)
ENV_STREAM = dict(ENV_SMALL, COLLECTIVES_SHM_STREAM="1", COLLECTIVES_SHM_CHUNK_BYTES=str(SMALL_HALF),
                  COLLECTIVES_SHM_ONESHOT_MAX="8192",
                  COLLECTIVES_SHM_CMA_BCAST_MIN="0", COLLECTIVES_SHM_CMA_AR_MIN="0")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", quick_only([2, 3, 4], 3))
@pytest.mark.parametrize("count", [1, 5, 300, 5000, 100003])
def test_all_reduce_bitwise_identical(world, count):
    """Random floats (order-sensitive sums): every rank holds exactly the same bytes."""
    # small slots (two-shot), the defaults (one-shot), two-shot with streamed writes
    for env in (ENV_SMALL, {}, ENV_STREAM):
        pool = pool_for(world, env=env)
        for dtype in (D.FLOAT32, D.FLOAT16, D.FLOAT64):
            res = pool.run(run_float_all_reduce, count, count, dtype, timeout=60)
            assert all(x == res[0] for x in res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_default_sizes_large(world):
    """Default thresholds: sizes around one-shot max and across several chunks."""
    pool = pool_for(world, env={})
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        for count in (8191, 8192, 8193, 65536 + 3, 600001):
            assert pool.run(run_op, name, 3, D.FLOAT32, count, D.SUM, world - 1,
                            timeout=60) == [True] * world


@pytest.mark.timeout(120)
def test_barrier_many_rounds_oversubscribed():
    """6 ranks on 2 cores: 300 barriers finish quickly (waits yield, then sleep)."""
    pool = pool_for(6)
    t0 = time.monotonic()
    assert pool.run(run_barrier_rounds, 300, timeout=60) == [True] * 6
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", quick_only([2, 3, 4], 2, 3))
@pytest.mark.parametrize("pattern", ["exchange_large", "tags_order", "any_source", "ring"])
@pytest.mark.parametrize("nbytes", [0, 1, 1000, 3 << 20])
def test_p2p(world, pattern, nbytes):
    """isend/irecv: tags, any-source, non-overtaking, no deadlock when all send large first."""
    pool = pool_for(world, env={})
    assert pool.run(run_p2p, pattern, nbytes, timeout=90) == [True] * world


@pytest.mark.timeout(120)
def test_segment_unlinked_after_init():
    """The segment is unlinked once every rank mapped it: nothing in /dev/shm while in use."""
    pool = pool_for(3, env={})
    names = pool.run(segment_name, timeout=30)
    assert len(set(names)) == 1
    assert not os.path.exists("/dev/shm" + names[0])


@pytest.mark.timeout(120)
def test_default_backend_is_shm_on_one_host_and_tcp_when_forced():
    pool = get_pool(2, setup=setup_backend, setup_args=("default",))
    assert pool.run(hier_info, timeout=30)[0][0] == "ShmBackend"
    tcp = pytest.importorskip("collectives.backends.tcp", reason="TCP backend not present")
    pool = get_pool(2, setup=setup_backend, setup_args=("default",),
                    env={"COLLECTIVES_TRANSPORT": "tcp"})
    assert pool.run(hier_info, timeout=30)[0][0] == tcp.TcpBackend.__name__


def _has_tcp():
    try:
        import collectives.backends.tcp  # noqa: F401
    except ImportError:
        return False
    return True


# faked hosts: blocks of consecutive ranks (host blocks are slices of the user's buffers),
# interleaved and uneven hosts (staged through padded scratch), one rank per host
HIER_LAYOUTS = [("a", "a", "b", "b"), ("a", "a", "a", "b", "b", "b"), ("a", "b", "a", "b", "b"),
                ("x", "y", "z"), ("a", "b", "b")]
HIER_OPS = [o for o in OPS if o not in ("all_gather_list", "all_gather_mixed")]  # front end stages


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _has_tcp(), reason="the hierarchical mode needs the TCP backend")
@pytest.mark.parametrize("hosts", quick_only(HIER_LAYOUTS, ("a", "b", "a", "b", "b"), ("a", "b", "b")))
def test_hierarchical_mode_is_chosen_for_faked_hosts(hosts):
    """Faked host ids: shared memory within a host, TCP across; p2p still works."""
    world = len(hosts)
    pool = get_pool(world, setup=setup_hier, setup_args=(hosts,), env=ENV_SMALL)
    info = pool.run(hier_info, timeout=30)
    assert [i[0] for i in info] == ["HierarchicalBackend"] * world
    first = {h: hosts.index(h) for h in hosts}
    assert [i[2] for i in info] == [first[h] == r for r, h in enumerate(hosts)]  # leaders
    blocked = hosts in (("a", "a", "b", "b"), ("a", "a", "a", "b", "b", "b"), ("x", "y", "z"))
    assert [i[3] for i in info] == [blocked] * world
    assert pool.run(run_p2p, "ring", 1000, timeout=60) == [True] * world


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _has_tcp(), reason="the hierarchical mode needs the TCP backend")
# quick: blocked hosts (host blocks are slices) and interleaved ones (the whole group's TCP)
@pytest.mark.parametrize("hosts", quick_only(HIER_LAYOUTS, ("a", "a", "b", "b"), ("a", "b", "a", "b", "b")))
@SETTINGS
@given(data=st.data())
def test_hierarchical_collectives_match_numpy(hosts, data):
    """Property: with ranks on several (faked) hosts, every collective, dtype, size and root
    equals the NumPy reference on every rank (and reduce leaves the others' inputs alone)."""
    world = len(hosts)
    pool = get_pool(world, setup=setup_hier, setup_args=(hosts,), env=ENV_SMALL)
    draw_and_run(data, pool, world, HIER_OPS)


def hier_all_reduce_pieces(ctx, counts, dtype, op, seed, tag=None):
    """all_reduce of counts[rank] elements (a hierarchical all_reduce of at least PIPE_MIN
    bytes runs in pieces), in the pool's group or (``tag``) a new one; returns (result or
    error text, the leaders' collective number, the group's)."""
    from collectives.backends.select import create_default_backend
    from collectives.core.errors import DistError
    from collectives.store import PrefixStore
    be = ctx.state["be"]
    if tag is not None:
        be = create_default_backend(PrefixStore(tag, ctx.state["store"]), ctx.rank,
                                    ctx.world_size, TIMEOUT)
    x = make_input(seed, ctx.rank, counts[ctx.rank], dtype)
    try:
        try:
            be.all_reduce(to_buffer(x), op)
        except DistError as e:
            return str(e), None, be._seq
        leaders = getattr(be, "leaders", None)
        return x, None if leaders is None else leaders.seq, be._seq
    finally:
        if tag is not None:
            be.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _has_tcp(), reason="the hierarchical mode needs the TCP backend")
@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a", "b", "b")])
def test_a_large_hierarchical_all_reduce_in_pieces_matches_numpy(hosts):
    """At PIPE_MIN bytes and more the hierarchical all_reduce runs in pieces (the leaders'
    part of one beside the hosts' parts of the next): odd counts, a last short piece, every
    rank equal to the NumPy reference; the leaders number the pieces as parts of one
    collective; a count that differs between hosts raises on every rank, naming the call."""
    from collectives.backends.hierarchical import PIPE_MIN, PIPE_PIECE, PIPE_SHIFT
    world = len(hosts)
    pool = get_pool(world, setup=setup_hier, setup_args=(hosts,), env=ENV_SMALL)
    for dtype, op, count in ((D.FLOAT32, D.SUM, PIPE_MIN // 4 + 12345),
                             (D.INT64, D.MAX, (PIPE_MIN + 3 * PIPE_PIECE) // 8 + 7),
                             (D.INT32, D.SUM, PIPE_MIN // 4 - 1)):
        got = pool.run(hier_all_reduce_pieces, [count] * world, dtype, op, 7, timeout=120)
        want = make_input(7, 0, count, dtype)
        for r in range(1, world):
            other = make_input(7, r, count, dtype)
            want = want + other if op == D.SUM else np.maximum(want, other)
        for r, (x, _, _) in enumerate(got):
            assert isinstance(x, np.ndarray), x
            np.testing.assert_array_equal(x, want.astype(x.dtype), err_msg=f"rank {r}")
        # the leaders' last piece of the group's collective k: (k << PIPE_SHIFT) + pieces - 1
        nbytes = count * x.itemsize
        pieces = -(-nbytes // PIPE_PIECE) if nbytes >= PIPE_MIN else 1
        k = got[0][2]
        assert {seq for _, seq, _ in got if seq is not None} == {(k << PIPE_SHIFT) + pieces - 1}
    # in a group of its own (the pool's stays usable)
    counts = [PIPE_MIN // 4 + (1 if hosts[r] == "b" else 0) for r in range(world)]
    got = pool.run(hier_all_reduce_pieces, counts, D.FLOAT32, D.SUM, 8, "pieces-mismatch",
                   timeout=120)
    for r, (text, _, k) in enumerate(got):
        assert isinstance(text, str), f"rank {r} returned without error"
        assert f"#{k}" in text and str(PIPE_MIN // 4) in text and str(PIPE_MIN // 4 + 1) in text, text


def setup_hier(ctx, hosts):
    os.environ["COLLECTIVES_HOST_ID"] = hosts[ctx.rank]
    return setup_backend(ctx, "default")


def timed_out_message(ctx, callers, tag):
    """A fresh hierarchical group with a short timeout; the ranks in ``callers`` call
    all_reduce, the others do not. Returns a caller's error message."""
    from collectives.backends.select import create_default_backend
    from collectives.core.errors import DistError
    from collectives.store import PrefixStore
    be = create_default_backend(PrefixStore(tag, ctx.state["store"]), ctx.rank,
                                ctx.world_size, 1.5)
    try:
        if ctx.rank not in callers:
            time.sleep(2.5)
            return None
        try:
            be.all_reduce(to_buffer(np.ones(8, np.float32)), D.SUM)
        except DistError as e:
            return str(e)
        return "no error"
    finally:
        be.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _has_tcp(), reason="the hierarchical mode needs the TCP backend")
def test_a_hierarchical_groups_errors_name_the_groups_ranks():
    """A host's shared-memory group and the leaders' TCP group number their ranks from 0;
    their timeouts name the whole group's ranks (hosts a,a,b,b: host b's ranks are 2 and
    3, its leader is the leaders' rank 1)."""
    hosts = ("a", "a", "b", "b")
    pool = get_pool(4, setup=setup_hier, setup_args=(hosts,), env=ENV_SMALL)
    got = pool.run(timed_out_message, (0, 1), "names-a", timeout=60)
    # rank 0, host a's leader, waits for host b's leader
    assert "receiving from rank 2" in got[0], got[0]
    got = pool.run(timed_out_message, (2, 3), "names-b", timeout=60)
    # rank 3 waits in host b's shared memory for its leader, rank 2
    assert "on rank 3" in got[3] and "peer rank 2" in got[3], got[3]
    assert "receiving from rank 0" in got[2], got[2]


@pytest.mark.faults
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,victim", [(2, 1), (4, 0), (4, 2)])
def test_peer_killed_mid_collective_raises(world, victim):
    """A rank killed inside an all_reduce (two-copy): the others raise DistBackendError
    within the timeout, and the segment is not left in /dev/shm."""
    check_survivors_raised(world, victim, "all_reduce", ENV_SMALL)


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_survivors_raise_within_timeout(tmp_path):
    """Direct check of survivors: they raise (not hang) well within the group timeout."""
    import subprocess
    import sys
    script = tmp_path / "survivors.py"
    script.write_text(_SURVIVOR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT,
               SURVIVOR_PORT=str(free_port()))
    before = shm_segments()
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("rank")]
    assert len(lines) == 3, p.stdout + p.stderr
    for ln in lines:
        assert "raised" in ln, ln
        assert float(ln.split()[3]) < TIMEOUT, ln
    assert shm_segments() <= before


_SURVIVOR_SCRIPT = r"""
import multiprocessing as mp, os, signal, time
import numpy as np

def worker(rank, port, q):
    from datetime import timedelta
    from collectives.store import TCPStore
    from collectives.backends.shm import ShmBackend
    from collectives.core.tensors import to_buffer
    from collectives.core.errors import DistBackendError
    from collectives import dtypes as D
    store = TCPStore("127.0.0.1", port, 4, rank == 0, timeout=timedelta(seconds=30))
    be = ShmBackend(store, rank, 4, 20.0)
    be.barrier()
    if rank == 2:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(10):
            a = np.ones(1 << 18, np.float32)
            be.all_reduce(to_buffer(a), D.SUM)
        q.put(f"rank {rank} nothing {time.monotonic() - t0:.3f}")
    except DistBackendError as e:
        q.put(f"rank {rank} raised {time.monotonic() - t0:.3f} {e}")

if __name__ == "__main__":
    port = int(os.environ["SURVIVOR_PORT"])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, port, q)) for r in range(4)]
    for p in ps: p.start()
    for _ in range(3):
        print(q.get(timeout=60), flush=True)
    for p in ps: p.join(10)
"""


@pytest.mark.timeout(120)
def test_no_segment_left_after_exit_and_shutdown():
    """Normal exit and shutdown (destroy) leave nothing in /dev/shm."""
    before = shm_segments()
    pool = get_pool(3, setup=setup_backend, setup_args=("shm",), env={"EXITTEST": "1"})
    assert pool.run(run_op, "all_reduce", 1, D.FLOAT32, 1000, D.SUM, 0, timeout=30) == [True] * 3
    assert pool.run(destroy, timeout=30) == [True] * 3
    assert shm_segments() <= before
    pool.close()
    assert shm_segments() <= before


_CREATOR_SCRIPT = r"""
import sys, time
from collectives.engines._shm import ShmComm
c = ShmComm(sys.argv[1], True, 0, 2, 1 << 16, 1 << 12, 5.0)
print("created", flush=True)
time.sleep(120)
"""


def _start_creator(name):
    """A process that creates a 2-rank segment and never gets to unlink its name, as a
    rank 0 that waits for a peer that never maps it."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", _CREATOR_SCRIPT, name], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "created"
    return p


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_segment_of_a_killed_creator_is_swept_by_the_next_group():
    """A rank 0 SIGKILLed between creating its segment and unlinking the name leaves it in
    /dev/shm; the sweep at the next group's creation removes it, but never the segment of
    a creator that still lives, nor one created in the last few seconds."""
    from collectives.backends.shm import ShmBackend, sweep_stale_segments
    from collectives.store import HashStore
    tag = os.urandom(4).hex()
    live = f"/collectives-{os.getuid()}-1-live{tag}"
    dead = f"/collectives-{os.getuid()}-2-dead{tag}"
    p_live, p_dead = _start_creator(live), _start_creator(dead)
    try:
        old = time.time() - 3600
        for name in (live, dead):
            os.utime("/dev/shm" + name, (old, old))
        assert sweep_stale_segments(min_age=0) == []  # both creators hold their locks
        p_dead.kill()
        p_dead.wait()
        assert "/dev/shm" + dead in shm_segments()
        os.utime("/dev/shm" + dead)  # just touched: too young to sweep
        assert dead[1:] not in sweep_stale_segments()
        os.utime("/dev/shm" + dead, (old, old))
        be = ShmBackend(HashStore(), 0, 1, 10.0)  # rank 0 of a new group sweeps first
        assert "/dev/shm" + dead not in shm_segments()
        assert "/dev/shm" + live in shm_segments()
        be.shutdown()
    finally:
        p_live.kill()
        p_live.wait()
        p_dead.kill()
        from collectives.engines._shm import unlink
        unlink(live)
        unlink(dead)
    assert "/dev/shm" + live not in shm_segments()


def frontend_p2p_and_all_reduce(ctx):
    """Through the front end (torch tensors): the default group is shared memory."""
    import torch

    import collectives as dist
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(r + 1))
    dist.all_reduce(t)
    ok = bool(torch.all(t == n * (n + 1) / 2))
    # ring exchange, both sides sending a large message first
    big = torch.arange(1 << 20, dtype=torch.float32) + r
    got = torch.empty_like(big)
    s = dist.isend(big, (r + 1) % n, tag=3)
    q = dist.irecv(got, (r - 1) % n, tag=3)
    s.wait()
    q.wait()
    ok = ok and bool(torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) + (r - 1) % n))
    from collectives.api.group import default_group
    return ok, type(default_group().backend).__name__


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", ["gloo", "gloo-tcp"])
def test_frontend_default_backend(config):
    """`import collectives as dist` with torch tensors, on shared memory and forced TCP."""
    pytest.importorskip("torch")
    from tests.support.ranks import backend_pool, config_available
    ok, why = config_available(config)
    if not ok:
        pytest.skip(why)
    pool = backend_pool(config, 3)
    res = pool.run(frontend_p2p_and_all_reduce, timeout=90)
    assert all(r[0] for r in res), res
    want = "TcpBackend" if config == "gloo-tcp" else "ShmBackend"
    assert all(r[1] == want for r in res), res


def small_ops_rounds(ctx, k):
    be = ctx.state["be"]
    a = np.ones(16, np.float32)
    t0 = time.monotonic()
    for _ in range(k):
        be.all_reduce(to_buffer(a), D.SUM)
        be.broadcast(to_buffer(a), 0)
        be.barrier()
    return time.monotonic() - t0


@pytest.mark.timeout(180)
def test_eight_ranks_on_two_cores_finish_quickly():
    """8 ranks on a 2-core machine: 200 rounds of small all_reduce/broadcast/barrier in
    seconds, not minutes (waits spin briefly, yield, then sleep on a futex)."""
    pool = pool_for(8, env={})
    times = pool.run(small_ops_rounds, 200, timeout=120)
    assert max(times) < 60, times


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_p2p_send_timeout_runs_from_the_last_progress_not_from_any_bell():
    """A send stuck on a full ring gives up one timeout after its last progress, even while
    other ranks' messages keep ringing the sender's bell (they used to restart the wait)."""
    import secrets
    import threading

    from collectives.engines._shm import ShmComm, unlink
    from collectives.core.errors import DistError
    name = f"/collectives-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
    tmo = 1.0
    comms = [ShmComm(name, r == 0, r, 3, 4096, 64 * 1024, tmo, "test") for r in range(3)]
    unlink(name)
    big = np.zeros(1 << 20, np.uint8)  # 16 rings' worth: rank 1 never reads
    small = np.zeros(8, np.uint8)
    hdr = b"\0" * 16
    result = {}

    def stuck_send():
        t0 = time.monotonic()
        try:
            comms[0].p2p_send(1, hdr, big.ctypes.data, big.nbytes)
            result["outcome"] = "sent"
        except DistError as e:
            result["outcome"] = str(e)
        result["took"] = time.monotonic() - t0

    t = threading.Thread(target=stuck_send)
    t.start()
    ring_until = time.monotonic() + 3 * tmo
    while time.monotonic() < ring_until and t.is_alive():  # rank 2 keeps ringing rank 0's bell
        try:
            comms[2].p2p_try_send(0, hdr, small.ctypes.data, small.nbytes)
        except DistError:
            break
        time.sleep(0.02)
    t.join(30)
    for c in comms:
        c.abort()
        c.close()
    assert result["outcome"] != "sent"
    assert tmo * 0.9 < result["took"] < tmo + 1.5, result


# ---- single-copy (process_vm_readv) gathers --------------------------------------------

ENV_CMA = dict(ENV_SMALL, COLLECTIVES_SHM_CMA_MIN="64",  # from 64 bytes: exercised
               COLLECTIVES_SHM_CMA_BCAST_MIN="64", COLLECTIVES_SHM_CMA_AR_MIN="64",
               COLLECTIVES_SHM_AR_ALGO="single_copy")


def _cma_permitted():
    """Whether a process may read a sibling's memory here (what the backend probes for)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    src = ctypes.create_string_buffer(b"probe", 8)
    pid = os.fork()
    if pid == 0:  # the child reads its parent, as one rank reads another
        dst = ctypes.create_string_buffer(8)
        lo = IoVec(ctypes.cast(dst, ctypes.c_void_p), 8)
        rem = IoVec(ctypes.cast(src, ctypes.c_void_p), 8)
        ok = libc.process_vm_readv(os.getppid(), ctypes.byref(lo), 1, ctypes.byref(rem), 1, 0) == 8
        os._exit(0 if ok and dst.value == b"probe" else 1)
    return os.waitpid(pid, 0)[1] == 0


def single_copy(ctx):
    return ctx.state["be"].single_copy


def single_copy_readable(ctx):
    return ctx.state["be"]._comm.cma_readable


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@SETTINGS
@given(data=st.data())
def test_single_copy_ops_match_numpy(world, data):
    """all_gather, gather, scatter, broadcast, reduce_scatter (out of place and in place)
    and all_reduce in one copy: same results as the reference; every rank agrees on the
    path (single copy where permitted, for all_reduce only where the ranks do not outnumber
    the cores, for broadcast where they are at most two a core)."""
    pool = pool_for(world, env=ENV_CMA)
    flags = pool.run(single_copy)
    assert flags == [_cma_permitted() and world <= os.cpu_count()] * world
    assert pool.run(single_copy_readable) == [_cma_permitted()] * world
    name = data.draw(st.sampled_from(GATHERS + ["scatter", "broadcast", "all_reduce",
                                                "reduce_scatter", "reduce_scatter_in_place"]),
                     "op")
    dtype = data.draw(st.sampled_from([D.FLOAT32, D.INT8, D.COMPLEX64]), "dtype")
    count = data.draw(st.one_of(st.sampled_from([0, 1, 15, 16, 17, 12345]), st.integers(0, 70000)))
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    assert pool.run(run_op, name, seed, dtype, count, D.SUM, root, timeout=60) == [True] * world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [700, 100003, 1 << 20])
def test_single_copy_all_reduce_bitwise_identical(count):
    """Random floats through the single-copy all_reduce: every rank holds the same bytes."""
    pool = pool_for(2, env=ENV_CMA)
    for dtype in (D.FLOAT32, D.FLOAT16, D.FLOAT64):
        res = pool.run(run_float_all_reduce, count, count, dtype, timeout=60)
        assert res[0] == res[1]


def _huge_kib(addr):
    """AnonHugePages (KiB) of the mapping of this process that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_always():
    """Whether anonymous memory gets huge pages when it is first touched, asked or not."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def _can_collapse():
    """Whether this kernel collapses anonymous memory into huge pages on request."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    a[:] = 1
    start = a.ctypes.data + (-a.ctypes.data) % (2 << 20)
    ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(2 << 20), 25) == 0  # MADV_COLLAPSE
    del a
    m.close()
    return ok


def run_single_copy_on_small_pages(ctx, calls):
    """all_gathers and broadcasts of buffers in anonymous mappings of 4 KiB pages (as
    torch's allocator hands out): the results, and the KiB of the input's and the
    output's mappings that ended up in huge pages (the broadcast's buffer and the
    all_gather's output are what the peers copy into or out of)."""
    import mmap
    be, n, r = ctx.state["be"], ctx.world_size, ctx.rank
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def mapping(nbytes):
        """nbytes of their own mapping: read-only pages on both sides keep the kernel from
        merging it with its neighbours, so its smaps entry describes it alone."""
        m = mmap.mmap(-1, nbytes + 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        a = np.frombuffer(m, np.uint8)
        for at in (0, nbytes + mmap.PAGESIZE):
            assert libc.mprotect(ctypes.c_void_p(a.ctypes.data + at), mmap.PAGESIZE, 1) == 0
        return m, a[mmap.PAGESIZE:mmap.PAGESIZE + nbytes].view(np.float32)

    m, buf = mapping(6 << 20)
    mo, out = mapping(n * (6 << 20))
    ok = True
    for k in range(calls):
        buf[:] = np.arange(buf.size, dtype=np.float32) * (r + 1) + k
        be.all_gather(to_buffer(out), to_buffer(buf))
        want = np.concatenate([np.arange(buf.size, dtype=np.float32) * (q + 1) + k for q in range(n)])
        ok = ok and np.array_equal(out, want)
        be.broadcast(to_buffer(buf), 0)
        ok = ok and np.array_equal(buf, np.arange(buf.size, dtype=np.float32) + k)
    huge = [_huge_kib(buf.ctypes.data), _huge_kib(out.ctypes.data)]
    del buf, out
    m.close()
    mo.close()
    return ok, huge, be.single_copy


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thp", ["1", "0"])
def test_single_copy_buffers_are_collapsed_into_huge_pages(thp):
    """A buffer that peers copy by process_vm_readv/writev is collapsed into huge pages
    the second time it is seen (they copy it twice as fast), contents unchanged;
    COLLECTIVES_SHM_THP=0 leaves it alone."""
    if not (_cma_permitted() and os.cpu_count() >= 2):
        pytest.skip("no single-copy path here (process_vm_readv not permitted, or one core)")
    if not _can_collapse():
        pytest.skip("this kernel does not collapse memory into huge pages (MADV_COLLAPSE)")
    if _thp_always():
        pytest.skip("transparent huge pages are 'always' here: fresh mappings get them anyway")
    pool = pool_for(2, env={"COLLECTIVES_SHM_THP": thp})
    res = pool.run(run_single_copy_on_small_pages, 3, timeout=60)
    assert [ok for ok, _, _ in res] == [True, True]
    assert [sc for _, _, sc in res] == [True, True]
    huge = [kib for _, kib, _ in res]
    if thp == "1":
        assert all(kib >= 2048 for pair in huge for kib in pair), huge
    else:
        assert huge == [[0, 0], [0, 0]], huge


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [3, 4])
@SETTINGS
@given(data=st.data())
def test_single_copy_ops_match_numpy_on_more_ranks_than_cores(world, data):
    """The single-copy paths with 3 and 4 ranks (reader splits, slice owners), forced on
    where the ranks outnumber the cores (COLLECTIVES_SHM_CMA_ANY_CORES), as a machine with
    more cores would run them. A 16 KiB "last-level cache" makes the larger all_gathers
    stream the local block past the cache, as outputs over half the real one do."""
    if not _cma_permitted():
        pytest.skip("process_vm_readv is not permitted between processes here")
    pool = pool_for(world, env=dict(ENV_CMA, COLLECTIVES_SHM_CMA_ANY_CORES="1",
                                    COLLECTIVES_SHM_LLC_BYTES=str(16 << 10)))
    assert pool.run(single_copy) == [True] * world
    name = data.draw(st.sampled_from(GATHERS + ["scatter", "broadcast", "all_reduce"]), "op")
    dtype = data.draw(st.sampled_from([D.FLOAT32, D.INT32, D.FLOAT64, D.UINT8]), "dtype")
    count = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4099]), st.integers(0, 90000)))
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    assert pool.run(run_op, name, seed, dtype, count, D.SUM, root, timeout=60) == [True] * world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", quick_only([2, 4], 4))
@settings(SETTINGS, max_examples=examples(15))
@given(data=st.data())
def test_two_copy_gather_streamed_into_output_matches_numpy(world, data):
    """The two-copy all_gather and gather with a 4 KiB "last-level cache", so that the
    copies into and out of the segment stream past the cache (odd lengths: unaligned
    blocks)."""
    pool = pool_for(world, env=dict(ENV_SMALL, COLLECTIVES_SHM_CMA_MIN="0",
                                    COLLECTIVES_SHM_LLC_BYTES="4096"))
    name = data.draw(st.sampled_from(GATHERS), "op")
    dtype = data.draw(st.sampled_from([D.UINT8, D.FLOAT32, D.FLOAT64]), "dtype")
    count = data.draw(st.one_of(st.sampled_from([1, 4097, 12345]), st.integers(0, 70000)))
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    assert pool.run(run_op, name, seed, dtype, count, D.SUM, root, timeout=60) == [True] * world


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", quick_only([2, 3, 4], 3))
@settings(SETTINGS, max_examples=examples(15))
@given(data=st.data())
def test_streamed_segment_writes_match_numpy(world, data):
    """One- and two-shot all_reduce and reduce (two-shot: each rank reduces its slice in
    place, then streams it into the segment; a reduce's non-roots keep their buffers), the
    two-copy broadcast, all_gather and gather, reduce_scatter (also with the output inside
    the input), scatter and all_to_all with streaming stores, odd lengths (unaligned
    slices)."""
    pool = pool_for(world, env=ENV_STREAM)
    assert pool.run(stream_state) == [(True, [0] * world)] * world
    name = data.draw(st.sampled_from(["all_reduce", "reduce", "broadcast", "reduce_scatter",
                                      "reduce_scatter_in_place", "scatter", "all_to_all",
                                      *GATHERS]), "op")
    dtype, op = data.draw(st.sampled_from(VALID), "dtype/op")
    count = data.draw(st.one_of(st.sampled_from([1, 1025, 4097, 12345]), st.integers(0, 70000)))
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    assert pool.run(run_op, name, seed, dtype, count, op, root, timeout=60) == [True] * world


def stream_state(ctx):
    comm = ctx.state["be"]._comm
    return comm.far, [comm.peer_distance(q) for q in range(ctx.world_size)]


def run_probed_all_reduces(ctx, max_calls, nbytes):
    """Large all_reduces in batches of 16 (one probe each) until every rank has measured
    every peer, or max_calls: a probe gives no verdict when a rank is descheduled in it."""
    be, comm = ctx.state["be"], ctx.state["be"]._comm
    a = np.ones(nbytes // 4, np.float32)
    for _ in range(max_calls // 16):
        for _ in range(16):
            be.all_reduce(to_buffer(a), D.SUM)
        done = np.array([all(comm.peer_distance(q) for q in range(ctx.world_size)
                             if q != ctx.rank)], np.int32)
        be.all_reduce(to_buffer(done), D.MIN)  # every rank stops after the same batch
        if done[0]:
            break
    return stream_state(ctx)


@pytest.mark.slow  # load-sensitive (see test_probe_verdict_is_shared_when_ranks_outnumber_cores)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("far_ns, verdict", [("1", 2), ("1000000000", 1)])
def test_latency_probes_decide_streaming(far_ns, verdict):
    """COLLECTIVES_SHM_STREAM=2: large all_reduces now and then bounce a cache line
    between two ranks; a round trip of COLLECTIVES_SHM_FAR_NS or more makes the peer far,
    and a rank whose peers are far streams its segment writes. With a 1 ns bound every
    measured peer is far, with 1 s every one is near."""
    pool = get_pool(2, setup=setup_backend, setup_args=("shm",),
                    env={"COLLECTIVES_SHM_STREAM": "2", "COLLECTIVES_SHM_FAR_NS": far_ns})
    assert pool.run(stream_state) == [(False, [0, 0])] * 2  # nothing measured yet
    # 256 KiB: the smallest step that probes; every 16th does, up to 1000 probes (on a
    # loaded machine, the quick suite's other process beside it, 200 probes once measured
    # nothing: a probe gives no verdict when its partner is descheduled)
    res = pool.run(run_probed_all_reduces, 16000, 256 << 10, timeout=100)
    for r, (far, dist) in enumerate(res):
        assert dist[r] == 0 and dist[1 - r] == verdict, res
        assert far == (verdict == 2), res


def run_until_a_probe_decides(ctx, max_calls, nbytes):
    """Large all_reduces in batches of 16 (one probe each) until some rank has measured
    a peer, or max_calls; returns every rank's (far, distances) after that batch."""
    be = ctx.state["be"]
    a = np.ones(nbytes // 4, np.float32)
    for _ in range(max_calls // 16):
        for _ in range(16):
            be.all_reduce(to_buffer(a), D.SUM)
        far, dist = stream_state(ctx)
        measured = np.array([any(dist)], np.int32)
        be.all_reduce(to_buffer(measured), D.MAX)  # every rank stops after the same batch
        if measured[0]:
            break
    return stream_state(ctx)


@pytest.mark.slow  # load-sensitive: a probe gives no verdict while its partner is descheduled
@pytest.mark.timeout(120)
def test_probe_verdict_is_shared_when_ranks_outnumber_cores():
    """With more ranks than cores two ranks can bounce a cache line only while both hold
    a core, so most probes give no verdict; there the latest verdict of any pair decides
    for the whole group (the cores are the same whichever ranks measured them). With a
    1 ns bound every verdict is far: once one pair has measured, a rank that measured
    nothing streams as well. Where every rank has a core the verdict stays per rank."""
    world = 3
    pool = get_pool(world, setup=setup_backend, setup_args=("shm",),
                    env={"COLLECTIVES_SHM_STREAM": "2", "COLLECTIVES_SHM_FAR_NS": "1"})
    res = pool.run(run_until_a_probe_decides, 16000, 256 << 10, timeout=100)
    assert any(any(dist) for _, dist in res), f"no probe gave a verdict in 1000: {res}"
    for far, dist in res:
        if world > (os.cpu_count() or 1):
            assert far, res
        else:
            assert far == any(d == 2 for d in dist), res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["3", "-1"])
def test_bad_stream_mode_is_a_value_error_naming_the_variable(monkeypatch, value):
    from collectives.backends.shm import ShmBackend
    from collectives.store import HashStore
    before = shm_segments()
    monkeypatch.setenv("COLLECTIVES_SHM_STREAM", value)
    with pytest.raises(ValueError, match=f"COLLECTIVES_SHM_STREAM.*got '?{value}"):
        ShmBackend(HashStore(), 0, 1, 10.0)
    assert shm_segments() == before  # the segment was unlinked before the check


@pytest.mark.faults
@pytest.mark.timeout(180)
@pytest.mark.parametrize("op", quick_only(["all_gather", "broadcast", "all_reduce", "scatter"],
                                          "all_reduce"))
def test_peer_killed_in_single_copy_op_raises(op):
    """A rank killed inside a single-copy call (its peer reads its memory, or it reads the
    peer's): the survivor raises DistBackendError within the timeout."""
    check_survivors_raised(2, 1, op, ENV_CMA)


def setup_mixed_env(ctx):
    """Rank 1's environment says "never single copy, one-shot up to 64 bytes"; rank 0's
    the defaults. The thresholds must come from rank 0, or the ranks would pick different
    algorithms for the same call and hang or corrupt."""
    if ctx.rank == 1:
        os.environ.update(COLLECTIVES_SHM_CMA_BCAST_MIN="0", COLLECTIVES_SHM_CMA_MIN="0",
                          COLLECTIVES_SHM_ONESHOT_MAX="64")
    return setup_backend(ctx, "shm")


def group_tuning(ctx):
    """The settings the rank's group applied, as the backend reports them."""
    return ctx.state["be"].tuning


@pytest.mark.timeout(120)
def test_thresholds_come_from_rank_0_whatever_the_other_ranks_environment():
    pool = get_pool(2, setup=setup_mixed_env, env={"MIXED_ENV_TEST": "1"})
    tunings = pool.run(group_tuning)
    assert tunings[0] == tunings[1], tunings
    assert tunings[1]["COLLECTIVES_SHM_ONESHOT_MAX"] != "64", tunings  # rank 1's own says 64
    assert tunings[1]["COLLECTIVES_SHM_CMA_MIN"] != "0", tunings
    for name in ("broadcast", "all_gather", "all_reduce"):
        for count in (5, 3000, 70000, 300000):
            assert pool.run(run_op, name, 11, D.FLOAT32, count, D.SUM, 0, timeout=60) == [True] * 2


# ---- the all_reduce algorithms, forced and measured --------------------------------------

# every algorithm above the one-shot size (2 KiB here), each forced through the settings;
# "auto" times them on its own calls (the first rounds of trials start at the third call)
AR_ALGOS = {
    "two_shot_plain": dict(COLLECTIVES_SHM_AR_ALGO="two_shot", COLLECTIVES_SHM_STREAM="0"),
    "two_shot_stream": dict(COLLECTIVES_SHM_AR_ALGO="two_shot", COLLECTIVES_SHM_STREAM="1"),
    "single_copy": dict(COLLECTIVES_SHM_AR_ALGO="single_copy", COLLECTIVES_SHM_CMA_AR_MIN="64",
                        COLLECTIVES_SHM_CMA_ANY_CORES="1"),
    "auto": dict(COLLECTIVES_SHM_AR_ALGO="auto", COLLECTIVES_SHM_CMA_AR_MIN="64",
                 COLLECTIVES_SHM_CMA_ANY_CORES="1"),
}


def ar_algo_state(ctx, nbytes):
    """What the group runs an all_reduce of nbytes with: the single-copy flag, the
    measured choice so far."""
    comm = ctx.state["be"]._comm
    return comm.cma, comm.ar_choice(nbytes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", sorted(AR_ALGOS))
@pytest.mark.parametrize("world", [2, 3])
@settings(SETTINGS, max_examples=examples(20))
@given(data=st.data())
def test_each_all_reduce_algorithm_matches_numpy(algo, world, data):
    """all_reduce (and reduce, which stays two-shot) under each algorithm the settings
    can force, and under the measured choice, every dtype and op, odd lengths: the
    reference's result on every rank."""
    if algo in ("single_copy", "auto") and not _cma_permitted():
        pytest.skip("process_vm_readv is not permitted between processes here")
    pool = pool_for(world, env=dict(ENV_SMALL, **AR_ALGOS[algo]))
    dtype, op = data.draw(st.sampled_from(VALID), "dtype/op")
    count = data.draw(st.one_of(st.sampled_from([1, 513, 4097, 12345]), st.integers(0, 70000)))
    name = data.draw(st.sampled_from(["all_reduce", "all_reduce", "reduce"]), "op")
    root = data.draw(st.integers(0, world - 1), "root")
    seed = data.draw(st.integers(0, 1000), "seed")
    for k in range(data.draw(st.integers(1, 4), "calls")):  # several: auto's trials rotate
        assert pool.run(run_op, name, seed + k, dtype, count, op, root,
                        timeout=60) == [True] * world


def run_measured_all_reduces(ctx, calls, count):
    """calls all_reduces of random float32s; the bytes of every result (the same on
    every rank only if every rank ran the same algorithm on each call, bit for bit the
    owner's sums) and the choice each rank agreed on at the end."""
    be = ctx.state["be"]
    rng = np.random.default_rng([count, ctx.rank])
    digests = []
    for _ in range(calls):
        a = rng.standard_normal(count).astype(np.float32)
        be.all_reduce(to_buffer(a), D.SUM)
        digests.append(hash(a.tobytes()))
    return digests, be._comm.ar_choice(count * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_measured_all_reduce_choice_is_agreed_and_exact(world):
    """The measured choice: over 80 calls of one size (several rounds of trials and
    decisions) every rank gets the same bytes on every call and settles on the same
    algorithm; a two-shot group (no single copy) chooses between its two stores."""
    if not _cma_permitted():
        pytest.skip("process_vm_readv is not permitted between processes here")
    # a pool of its own (the marker variable), so that no earlier test has decided yet
    pool = pool_for(world, env=dict(ENV_SMALL, **AR_ALGOS["auto"], MEASURED_CHOICE_TEST="1"))
    assert pool.run(ar_algo_state, 40000) == [(True, None)] * world
    res = pool.run(run_measured_all_reduces, 80, 10000, timeout=90)
    assert all(digests == res[0][0] for digests, _ in res)
    choices = {choice for _, choice in res}
    assert len(choices) == 1 and choices <= {"two_shot", "two_shot_stream", "single_copy"}, res
    pool = pool_for(world, env=dict(ENV_SMALL, COLLECTIVES_SHM_CMA_AR_MIN="0",
                                    MEASURED_CHOICE_TEST="1"))
    res = pool.run(run_measured_all_reduces, 60, 10000, timeout=90)
    assert all(digests == res[0][0] for digests, _ in res)
    assert {choice for _, choice in res} <= {"two_shot", "two_shot_stream"}
    assert len({choice for _, choice in res}) == 1 and res[0][1] is not None


def run_measured_all_gathers(ctx, calls, count, mixed=False):
    """calls all_gathers of count float32s per rank into one array, each checked against
    the reference; whether all were right, and the path this rank's group agreed on. With
    ``mixed`` even ranks gather into one array per rank on even calls (the single copy's
    two forms, writing and reading, in one call)."""
    be = ctx.state["be"]
    n, r = ctx.world_size, ctx.rank
    ok = True
    for k in range(calls):
        mine = np.arange(count, dtype=np.float32) * (r + 1) + k
        want = np.concatenate([np.arange(count, dtype=np.float32) * (q + 1) + k for q in range(n)])
        if mixed and k % 2 == 0 and r % 2 == 0:
            outs = [np.empty(count, np.float32) for _ in range(n)]
            be.all_gather_list([to_buffer(o) for o in outs], to_buffer(mine))
            got = np.concatenate(outs)
        else:
            got = np.empty(n * count, np.float32)
            be.all_gather(to_buffer(got), to_buffer(mine))
        ok = ok and np.array_equal(got, want)
    return ok, be._comm.ag_choice(count * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_measured_all_gather_stores_are_agreed(world):
    """With the stream mode "measured" the all_gather below the single copy's threshold
    times plain and streaming stores (and the single copy, from 16 KiB blocks where it is
    on) on its own calls: over 80 calls (several rounds) every result is right and every
    rank settles on the same choice."""
    pool = pool_for(world, env=dict(ENV_SMALL, COLLECTIVES_SHM_CMA_MIN="0",
                                    COLLECTIVES_SHM_STREAM="2", MEASURED_CHOICE_TEST="1"))
    res = pool.run(run_measured_all_gathers, 80, 3000, timeout=90)
    assert all(ok for ok, _ in res), res
    assert len({choice for _, choice in res}) == 1 and res[0][1] in ("plain", "stream"), res
    # the single copy as a third candidate from 16 KiB blocks (and the two forms of output)
    pool = pool_for(world, env=dict(ENV_SMALL, COLLECTIVES_SHM_CMA_MIN=str(1 << 20),
                                    COLLECTIVES_SHM_CMA_ANY_CORES="1",
                                    COLLECTIVES_SHM_STREAM="2", MEASURED_CHOICE_TEST="1"))
    res = pool.run(run_measured_all_gathers, 80, 6000, timeout=90)
    assert all(ok for ok, _ in res), res
    assert len({choice for _, choice in res}) == 1, res
    assert res[0][1] in ("plain", "stream", "single_copy"), res


@pytest.mark.timeout(150)
@pytest.mark.skipif(not _cma_permitted(), reason="process_vm_readv between siblings not permitted")
@pytest.mark.skipif((os.cpu_count() or 1) > 3,
                    reason="needs more ranks than cores with at most 4 ranks (at most 3 cores)")
def test_with_more_ranks_than_cores_the_all_gather_times_its_single_copy():
    """Where the ranks outnumber the cores, an all_gather from COLLECTIVES_SHM_CMA_MIN on is
    timed against the two-copy path instead of always taking the single copy (which was
    slower there on some hosts): every result is right and the ranks agree on a choice.
    With COLLECTIVES_SHM_CMA_ANY_CORES the single copy runs from there as it does where
    every rank has a core: no choice is ever made at that size."""
    world = (os.cpu_count() or 1) + 1
    env = dict(ENV_SMALL, COLLECTIVES_SHM_CMA_MIN="16384", COLLECTIVES_SHM_STREAM="2",
               MEASURED_CHOICE_TEST="1")
    res = pool_for(world, env=env).run(run_measured_all_gathers, 80, 6000, timeout=120)
    assert all(ok for ok, _ in res), res
    assert len({choice for _, choice in res}) == 1, res
    assert res[0][1] in ("plain", "stream", "single_copy"), res
    res = pool_for(world, env=dict(env, COLLECTIVES_SHM_CMA_ANY_CORES="1")).run(
        run_measured_all_gathers, 40, 6000, timeout=120)
    assert res == [(True, None)] * world, res


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _cma_permitted(), reason="process_vm_readv between siblings not permitted")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a core per rank (2 ranks)")
def test_the_all_gathers_single_copy_times_its_block_whole_against_in_pieces():
    """Where every rank has a core, an all_gather from COLLECTIVES_SHM_CMA_MIN on takes the
    single copy and times its two forms, each block written in 256 KiB pieces or in one
    write (which is faster varies by host): with 1 MiB blocks, both output forms, every
    result is right and the ranks agree on one of the two. Blocks of one piece or less are
    not timed."""
    env = dict(ENV_SMALL, MEASURED_CHOICE_TEST="whole")
    pool = pool_for(2, env=env)
    res = pool.run(run_measured_all_gathers, 60, (1 << 20) // 4, True, timeout=90)
    assert all(ok for ok, _ in res), res
    assert len({choice for _, choice in res}) == 1, res
    assert res[0][1] in ("single_copy", "single_copy_whole"), res
    res = pool.run(run_measured_all_gathers, 40, (256 << 10) // 4, True, timeout=90)
    assert res == [(True, None)] * 2, res


@pytest.mark.timeout(60)
def test_a_bad_all_reduce_algorithm_is_a_value_error_naming_the_variable(monkeypatch):
    from collectives import config
    monkeypatch.setenv("COLLECTIVES_SHM_AR_ALGO", "fastest")
    with pytest.raises(ValueError, match="COLLECTIVES_SHM_AR_ALGO"):
        config.get("COLLECTIVES_SHM_AR_ALGO")
