"""Every collective, on every backend configuration, against a NumPy reference.

Property: for any world size 1-6, group membership, dtype, shape (0-d, empty, one
element, odd lengths), op, root and sync/async interleaving, each rank ends with
what the NumPy reference computes from all ranks' deterministic inputs (exactly
for integers and bools, within rounding for floats), and all_reduce results are
bitwise identical on every rank.
"""
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from tests.support.collective_cases import DTYPES, FACTORS, HAVE_TORCH, LIBS, OPS_FOR, check, family, run_case
from tests.support.ranks import available_configs, backend_pool
from tests.support.marks import quick_only

CONFIGS = available_configs()


REDUCING = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_in_place",
            "all_reduce_coalesced"]
MOVING = ["broadcast", "all_gather", "all_gather_list_own", "all_gather_single", "all_gather_in_place",
          "all_gather_coalesced", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier"]
SHAPES = [(), (0,), (1,), (5,), (3, 2), (7,), (2, 0, 3)]
SETTINGS = settings(max_examples=examples(8), deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def steps(draw, kinds, n, dtypes=DTYPES, ops=OPS_FOR, libs=LIBS, shapes=SHAPES):
    """One step; ``dtypes``, ``ops`` (per dtype family), ``libs`` and ``shapes`` narrow it
    to what a backend takes (tests/backends/test_nccl.py: CUDA tensors and NCCL's types and ops)."""
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    step = {
        "kind": kind, "dtype": dtype,
        "lib": "torch" if dtype == "bfloat16" and "torch" in libs else draw(st.sampled_from(libs)),
        "shape": draw(st.sampled_from(shapes)),
        "root": draw(st.integers(0, n - 1)),
        "async": draw(st.booleans()),
    }
    if kind in REDUCING:
        op = draw(st.sampled_from(ops[family(dtype)]))
        if op == "PREMUL_SUM" and kind == "all_reduce_coalesced":
            op = "SUM"
        step["op"] = op
        if op == "PREMUL_SUM":
            step["factor"] = draw(st.sampled_from(FACTORS))
    return step


@st.composite
def cases(draw, kinds, max_world=6, **narrow):
    """(world size, case); ``narrow`` goes to :func:`steps`."""
    world = draw(st.integers(1, max_world))
    if world > 1 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)))
    else:
        members = list(range(world))
    n = len(members)
    return world, {
        "members": members,
        "world": draw(st.booleans()) if n == world else False,
        "seed": draw(st.integers(0, 2**31)),
        "steps": draw(st.lists(steps(kinds, n, **narrow), min_size=1, max_size=3)),
        "wait_reversed": draw(st.booleans()),
    }


def _run(config, world, case):
    pool = backend_pool(config, world)
    results = pool.run(run_case, case, timeout=90)
    check(case, results, world)


def _blocking_sum(world, members, kinds, dtype="float32", shape=(5,)):
    """A fixed case of blocking SUM steps: the front end's short paths, which random draws
    reach only now and then (one kind, op and sync flag out of many)."""
    return world, {
        "members": members, "world": members == list(range(world)), "seed": 11,
        "steps": [dict({"kind": k, "dtype": dtype, "lib": lib, "shape": shape, "root": 0,
                        "async": False}, **({"op": "SUM"} if k in REDUCING else {}))
                  for k in kinds for lib in LIBS],
        "wait_reversed": False,
    }


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(REDUCING))
@example(wc=_blocking_sum(3, [0, 1, 2], ["reduce_scatter_single", "all_reduce"]))
@example(wc=_blocking_sum(4, [1, 3], ["reduce_scatter_single"], dtype="int64", shape=(3, 2)))
def test_reductions_match_numpy_and_agree_bitwise(config, wc):
    _run(config, *wc)


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(MOVING))
@example(wc=_blocking_sum(3, [0, 1, 2], ["all_gather_single"], dtype="float64", shape=(7,)))
def test_data_movement_matches_numpy(config, wc):
    _run(config, *wc)


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=cases(REDUCING + MOVING))
def test_interleaved_sync_and_async_collectives(config, wc):
    _run(config, *wc)


def split_case(ctx, case):
    """Run on every rank: split the parent (the world, or a subgroup) with split_group, then
    all_reduce each rank's global rank inside its new group."""
    import numpy as np

    import collectives as dist
    parent_members = case["parent"]
    parent = None
    if parent_members is not None:
        key = ("group", tuple(parent_members))
        if key not in ctx.state:
            ctx.state[key] = dist.new_group(parent_members)
        parent = ctx.state[key]
        if ctx.rank not in parent_members:
            return "outside"
    g = dist.split_group(parent, case["splits"])
    if g is None:
        return None
    t = np.array([ctx.rank], np.int64)
    dist.all_reduce(t, group=g)
    got = (int(t[0]), dist.get_rank(g), dist.get_world_size(g), dist.get_process_group_ranks(g))
    dist.destroy_process_group(g)
    return got


@st.composite
def split_cases(draw):
    world = draw(st.integers(1, 6))
    parent = None
    if world > 1 and draw(st.booleans()):
        parent = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)))
    n = world if parent is None else len(parent)
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n - 1))) if n > 1 else []
    parts = [list(order[a:b]) for a, b in zip([0] + cuts, cuts + [n])]
    kept = [p for p in parts if draw(st.booleans())] or parts[:1]  # some ranks left out
    return world, {"parent": parent, "splits": kept}


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=split_cases())
def test_split_group_gives_each_rank_its_own_part(config, wc):
    world, case = wc
    results = backend_pool(config, world).run(split_case, case, timeout=90)
    members = list(range(world)) if case["parent"] is None else case["parent"]
    for r in range(world):
        if r not in members:
            assert results[r] == "outside"
            continue
        mine = [s for s in case["splits"] if members.index(r) in s]
        if not mine:
            assert results[r] is None, f"rank {r} is in no split but got {results[r]!r}"
            continue
        glob = sorted(members[i] for i in mine[0])
        assert results[r] == (sum(glob), glob.index(r), len(glob), glob), (r, case)


def shrink_case(ctx, case):
    """Run on every rank: a group of ``case["parent"]`` (global ranks), shrunk by the
    members that stay (the excluded ones never call), then used: the stayers all_reduce
    and all_gather their global ranks in the new group. Returns what each rank saw."""
    import numpy as np

    import collectives as dist
    members = case["parent"]
    parent = dist.new_group(members)
    if ctx.rank not in members:
        return "outside"
    if members.index(ctx.rank) in case["exclude"]:
        dist.destroy_process_group(parent)  # left behind: only its own handle to drop
        return "excluded"
    flags = dist.distributed_c10d.SHRINK_ABORT if case["abort"] else 0
    g = dist.shrink_group(list(case["exclude_order"]), group=parent, shrink_flags=flags)
    try:
        dist.get_rank(parent)
        parent_left = "still usable"
    except ValueError as e:
        parent_left = str(e)
    t = np.array([ctx.rank], np.int64)
    dist.all_reduce(t, group=g)
    out = np.empty(dist.get_world_size(g), np.int64)
    dist.all_gather_into_tensor(out, np.array([ctx.rank], np.int64), group=g)
    got = {"sum": int(t[0]), "gathered": out.tolist(), "rank": dist.get_rank(g),
           "size": dist.get_world_size(g), "ranks": dist.get_process_group_ranks(g),
           "parent": parent_left, "default": g is dist.group.WORLD}
    dist.destroy_process_group(g)
    return got


@st.composite
def shrink_cases(draw):
    world = draw(st.integers(2, 5))
    members = sorted(draw(st.sets(st.integers(0, world - 1), min_size=2, max_size=world)))
    n = len(members)
    exclude = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))
    order = draw(st.permutations(sorted(exclude)))  # the list need not be sorted
    return world, {"parent": members, "exclude": sorted(exclude), "exclude_order": list(order),
                   "abort": draw(st.booleans())}


@pytest.mark.timeout(600)
@SETTINGS
@given(wc=shrink_cases())
def test_shrink_group_makes_a_group_of_the_stayers_without_the_others(config, wc):
    world, case = wc
    results = backend_pool(config, world).run(shrink_case, case, timeout=90)
    members = case["parent"]
    stay = [g for i, g in enumerate(members) if i not in case["exclude"]]
    for r in range(world):
        if r not in members:
            assert results[r] == "outside"
        elif r not in stay:
            assert results[r] == "excluded"
        else:
            got = dict(results[r])
            assert "destroyed" in got.pop("parent"), results[r]
            assert got == {"sum": sum(stay), "gathered": stay, "rank": stay.index(r),
                           "size": len(stay), "ranks": stay, "default": False}, (r, case)


def shrink_abort_case(ctx, flags):
    """Run on every rank of 3: ranks 0 and 1 start an all_reduce on a group of all three
    that rank 2 never joins, then shrink it without rank 2. Returns how long the shrink
    took, how long until the pending all_reduce finished, and how it ended."""
    import numpy as np

    import collectives as dist
    parent = dist.new_group([0, 1, 2], timeout=3)
    if ctx.rank == 2:
        time.sleep(6)  # its destroy would end the others' all_reduce (a closed connection)
        dist.destroy_process_group(parent)
        return None
    pending = dist.all_reduce(np.ones(10), group=parent, async_op=True)
    time.sleep(0.2)  # under way: waiting for rank 2
    t0 = time.monotonic()
    g = dist.shrink_group([2], group=parent, shrink_flags=flags)
    took = time.monotonic() - t0
    try:
        pending.wait()
        ended = "completed"
    except dist.DistError as e:
        ended = type(e).__name__
    done = time.monotonic() - t0
    x = np.ones(1)
    dist.all_reduce(x, group=g)
    dist.destroy_process_group(g)
    return took, done, ended, float(x[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("abort", quick_only([True, False], True, ids=["SHRINK_ABORT", "SHRINK_DEFAULT"]))
def test_shrink_abort_fails_the_old_groups_pending_work_at_once(config, abort):
    """SHRINK_ABORT: the all_reduce that waits for the excluded rank fails at once;
    SHRINK_DEFAULT lets it run out the old group's timeout (3 s)."""
    if config == "mpi":
        pytest.skip("an MPI collective can be neither interrupted nor timed out: the "
                    "pending all_reduce would never end")
    if abort and config not in ("gloo", "gloo-tcp", "gloo-hier"):
        pytest.skip(f"the {config} backend cannot interrupt running work (its abort is "
                    f"its shutdown)")
    flags = 1 if abort else 0
    for took, done, ended, total in backend_pool(config, 3).run(shrink_abort_case, flags,
                                                                timeout=90)[:2]:
        assert total == 2.0 and ended != "completed"
        if abort:
            assert done < 1.5, (took, done, ended)
        else:
            assert done > 2.5, (took, done, ended)


def detail_case(ctx, seed):
    """Run on every rank: a group made at DebugLevel.DETAIL, fed matching and mismatched
    collectives; returns what each step did here ('ok' with values, or the error text)."""
    import numpy as np

    import collectives as dist
    from collectives.core.errors import DistBackendError
    n, r = ctx.world_size, ctx.rank
    odd = seed % n  # the rank that calls something else
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        g = dist.new_group(list(range(n)))
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    steps = {
        "match": lambda: dist.all_reduce(np.full(3, r + 1.0, np.float32), group=g),
        "kind": lambda: (dist.broadcast if r == odd else dist.all_reduce)(
            np.ones(3, np.float32), group=g),
        "count": lambda: dist.all_reduce(np.ones(4 if r == odd else 3, np.float32), group=g),
        "async": lambda: (dist.barrier(group=g, async_op=True) if r == odd else
                          dist.all_gather_into_tensor(np.empty(n, np.int32), np.ones(1, np.int32),
                                                      group=g, async_op=True)).wait(),
        "list": lambda: dist.all_gather([np.empty(2, np.int64) for _ in range(n)],
                                        np.full(2, r, np.int64), group=g),
    }
    got = {}
    try:
        for name, call in steps.items():
            try:
                call()
                got[name] = "ok"
            except DistBackendError as e:
                got[name] = str(e)
        x = np.full(2, r + 1.0, np.float64)
        dist.all_reduce(x, group=g)  # the group still works after the refused calls
        got["after"] = x.tolist()
    finally:
        dist.destroy_process_group(g)
    return got


@pytest.mark.timeout(300)
@settings(max_examples=examples(4), deadline=None)
@given(world=st.integers(2, 4), seed=st.integers(0, 100))
def test_detail_debug_level_refuses_mismatched_collectives_on_every_rank(config, world, seed):
    results = backend_pool(config, world).run(detail_case, seed, timeout=90)
    n = world * (world + 1) // 2
    for r, got in enumerate(results):
        assert got["match"] == got["list"] == "ok", (r, got)
        assert "Detected mismatch" in got["kind"] and "OpType=BROADCAST" in got["kind"] \
            and "OpType=ALL_REDUCE" in got["kind"], got["kind"]
        assert "NumElements=4" in got["count"] and "NumElements=3" in got["count"], got["count"]
        assert "OpType=BARRIER" in got["async"] and "OpType=ALL_GATHER" in got["async"], got["async"]
        assert got["after"] == [float(n)] * 2


# ---- examples (the properties above, pinned) ------------------------------------------------

@pytest.mark.timeout(300)
def test_every_dtype_all_reduce_sum_on_four_ranks(config):
    for dtype in DTYPES:
        case = {"members": [0, 1, 2, 3], "seed": 5, "wait_reversed": False,
                "steps": [{"kind": "all_reduce", "dtype": dtype, "lib": LIBS[0], "shape": (7,),
                           "root": 0, "async": False, "op": "SUM"}]}
        _run(config, 4, case)


@pytest.mark.timeout(300)
def test_uneven_all_to_all_single_in_a_subgroup(config):
    case = {"members": [0, 2, 3], "seed": 11, "wait_reversed": True,
            "steps": [{"kind": "all_to_all_single", "dtype": "int32", "lib": "numpy", "shape": (1,),
                       "root": 0, "async": True},
                      {"kind": "all_to_all", "dtype": "float64", "lib": LIBS[0], "shape": (1,),
                       "root": 0, "async": False}]}
    _run(config, 4, case)


# ---- the old *_multigpu calls: k tensors per rank ----------------------------------------------

def multigpu_case(ctx, k):
    """Rank r's entry j holds r * 10 + j (+ position); returns every output as lists."""
    import torch

    import collectives as dist
    n, r = ctx.world_size, ctx.rank

    def entries(m=3):
        return [torch.arange(m, dtype=torch.float64) + r * 10 + j for j in range(k)]
    out = {}
    t = entries()
    dist.all_reduce_multigpu(t)
    out["all_reduce"] = [x.tolist() for x in t]
    t = entries()
    dist.all_reduce_multigpu(t, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = [x.tolist() for x in t]
    t = entries()
    dist.broadcast_multigpu(t, n - 1, src_tensor=k - 1)
    out["broadcast"] = [x.tolist() for x in t]
    t = entries()
    dist.reduce_multigpu(t, 0, op=dist.ReduceOp.MAX)
    out["reduce"] = [x.tolist() for x in t]
    outs = [[torch.zeros(3, dtype=torch.float64) for _ in range(n * k)] for _ in range(k)]
    dist.all_gather_multigpu(outs, entries())
    out["all_gather"] = [[x.tolist() for x in lst] for lst in outs]
    ins = [[torch.full((2,), float(r * 100 + i * 10 + q), dtype=torch.float64) for q in range(n * k)]
           for i in range(k)]
    res = [torch.zeros(2, dtype=torch.float64) for _ in range(k)]
    dist.reduce_scatter_multigpu(res, ins)
    out["reduce_scatter"] = [x.tolist() for x in res]
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_TORCH, reason="the *_multigpu calls take lists of torch tensors")
@pytest.mark.parametrize("k", [1, 2])
def test_multigpu_variants_reduce_across_the_list_and_the_ranks(config, k):
    n = 3
    results = backend_pool(config, n).run(multigpu_case, k, timeout=90)

    def entry(r, j, m=3):
        return [r * 10 + j + p for p in range(m)]
    total = [sum(entry(r, j)[p] for r in range(n) for j in range(k)) for p in range(3)]
    for r, out in enumerate(results):
        assert out["all_reduce"] == [total] * k
        assert out["all_reduce_avg"] == [[v / (n * k) for v in total]] * k
        assert out["broadcast"] == [entry(n - 1, k - 1)] * k
        if r == 0:
            assert out["reduce"][0] == entry(n - 1, k - 1)
        else:
            assert out["reduce"] == [entry(r, j) for j in range(k)]  # inputs unchanged
        assert out["all_gather"] == [[entry(q, j) for q in range(n) for j in range(k)]] * k
        want = [[sum(q * 100 + i * 10 + (r * k + j) for q in range(n) for i in range(k))] * 2
                for j in range(k)]
        assert out["reduce_scatter"] == want
