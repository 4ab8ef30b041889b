"""One table of ProcessGroup methods, called torch's way and ours.

Properties, for every collective method, on a subgroup whose group ranks differ from the
global ones, on three kinds of group (a BridgedGroup: ours and torch's at once; torch's
wrapper ``to_torch`` over a plain group; a plain group):

- torch's ``*Options`` struct and ours, with the same fields (reduce op, root, timeout)
  and asyncOp True or False, give the NumPy reference's values; so do the legacy
  positional forms, and PREMUL_SUM spelled either way.
- The Work type follows the way the call came: torch's Work (whose future is a
  ``torch.futures.Future`` holding the method's outputs) for torch's options on a
  bridged group, for torch tensors with no options there (a DDP comm hook's
  ``group.allreduce([bucket.buffer()])``) and for every call on torch's wrapper; ours
  for our options, NumPy arrays, and every call on a plain group.
- ``asyncOp=False`` blocks: the outputs hold the result when the method returns, and the
  Work is already completed.
- Misuse raises the same ValueError/TypeError, naming the argument, whichever way it came.
"""
import numpy as np
import pytest

from tests.ranks import available_configs, backend_pool

torch = pytest.importorskip("torch")

CONFIGS = [c for c in available_configs() if c in ("gloo", "mpi")]
WORLD = 3
MEMBERS = [1, 2]  # group rank = global rank - 1
KINDS = ("bridged", "wrapped", "plain")


def _group(ctx, kind):
    import collectives as dist
    from collectives._world import world
    key = f"table-{kind}"
    if key not in ctx.state:
        was = world.bridge
        world.bridge = kind == "bridged"
        try:
            g = dist.new_group(MEMBERS)
        finally:
            world.bridge = was
        if kind == "wrapped" and ctx.rank in MEMBERS:
            from collectives.torch_pg import to_torch
            g = to_torch(g)
        ctx.state[key] = g
    return ctx.state[key]


def _calls(me, n, mk, op):
    """{label: (issue, outputs)}: ``issue(opts_maker)`` issues the call and returns its
    Work; ``outputs()`` the tensors it fills, read after."""
    v = lambda k=4, s=0: torch.arange(k, dtype=torch.float64) + 10 * (me + 1) + s  # noqa: E731
    z = lambda k=4: torch.zeros(k, dtype=torch.float64)  # noqa: E731
    calls = {}

    def add(label, make):
        calls[label] = make

    def allreduce(o):
        t = v()
        return [t], lambda: mk("AllreduceOptions", reduceOp=op("MAX"), **o), \
            lambda pg, opts: pg.allreduce([t], opts)
    add("allreduce", allreduce)

    def premul(o):
        t = v()
        return [t], lambda: mk("AllreduceOptions", reduceOp=op("PREMUL_SUM"), **o), \
            lambda pg, opts: pg.allreduce([t], opts)
    add("allreduce premul", premul)

    def coalesced(o):
        ts = [v(), v(3)]
        return ts, lambda: mk("AllreduceCoalescedOptions", reduceOp=op("SUM"), **o), \
            lambda pg, opts: pg.allreduce_coalesced(ts, opts)
    add("allreduce_coalesced", coalesced)

    def broadcast(o):
        t = v()
        return [t], lambda: mk("BroadcastOptions", rootRank=1, **o), \
            lambda pg, opts: pg.broadcast([t], opts)
    add("broadcast", broadcast)

    def reduce(o):
        t = v()
        return [t], lambda: mk("ReduceOptions", rootRank=1, reduceOp=op("MIN"), **o), \
            lambda pg, opts: pg.reduce([t], opts)
    add("reduce", reduce)

    def allgather(o):
        outs = [z() for _ in range(n)]
        return outs, lambda: mk("AllgatherOptions", **o), \
            lambda pg, opts: pg.allgather([outs], [v()], opts)
    add("allgather", allgather)

    def allgather_base(o):
        big = z(4 * n)
        return [big], lambda: mk("AllgatherOptions", **o), \
            lambda pg, opts: pg._allgather_base(big, v(), opts)
    add("_allgather_base", allgather_base)

    def ag_coalesced(o):
        outs = [z(4 * n), z(2 * n)]
        return outs, lambda: mk("AllgatherOptions", **o), \
            lambda pg, opts: pg.allgather_into_tensor_coalesced(outs, [v(), v(2)], opts)
    add("allgather_into_tensor_coalesced", ag_coalesced)

    def gather(o):
        outs = [z() for _ in range(n)]
        return (outs if me == 1 else []), lambda: mk("GatherOptions", rootRank=1, **o), \
            lambda pg, opts: pg.gather([outs] if me == 1 else [], [v()], opts)
    add("gather", gather)

    def scatter(o):
        t = z()
        src = [torch.full((4,), 100.0 + q, dtype=torch.float64) for q in range(n)]
        return [t], lambda: mk("ScatterOptions", rootRank=0, **o), \
            lambda pg, opts: pg.scatter([t], [src] if me == 0 else [], opts)
    add("scatter", scatter)

    def reduce_scatter(o):
        t = z()
        return [t], lambda: mk("ReduceScatterOptions", reduceOp=op("MAX"), **o), \
            lambda pg, opts: pg.reduce_scatter([t], [[v(s=q) for q in range(n)]], opts)
    add("reduce_scatter", reduce_scatter)

    def rs_base(o):
        t = z()
        return [t], lambda: mk("ReduceScatterOptions", **o), \
            lambda pg, opts: pg._reduce_scatter_base(t, torch.cat([v(s=q) for q in range(n)]), opts)
    add("_reduce_scatter_base", rs_base)

    def rs_coalesced(o):
        outs = [z(), z(2)]
        return outs, lambda: mk("ReduceScatterOptions", **o), \
            lambda pg, opts: pg.reduce_scatter_tensor_coalesced(
                outs, [torch.cat([v(k, s=q) for q in range(n)]) for k in (4, 2)], opts)
    add("reduce_scatter_tensor_coalesced", rs_coalesced)

    def alltoall_base(o):
        t = z(2 * n)
        inp = torch.cat([torch.full((2,), 10.0 * me + q, dtype=torch.float64) for q in range(n)])
        return [t], lambda: mk("AllToAllOptions", **o), \
            lambda pg, opts: pg.alltoall_base(t, inp, [], [], opts)
    add("alltoall_base", alltoall_base)

    def alltoall(o):
        outs = [z(1) for _ in range(n)]
        ins = [torch.full((1,), 10.0 * me + q, dtype=torch.float64) for q in range(n)]
        return outs, lambda: mk("AllToAllOptions", **o), \
            lambda pg, opts: pg.alltoall(outs, ins, opts)
    add("alltoall", alltoall)

    def barrier(o):
        return [], lambda: mk("BarrierOptions", **o), lambda pg, opts: pg.barrier(opts)
    add("barrier", barrier)
    return calls


def _ways():
    """{way: (opts maker, op maker)} for torch's options and ours."""
    import torch.distributed as td

    import collectives as dist

    def maker(ns):
        def mk(cls, **fields):
            o = getattr(ns, cls)()
            for k, val in fields.items():
                setattr(o, k, val)
            return o
        return mk

    def torch_op(name):
        return td._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else getattr(td.ReduceOp, name)

    def our_op(name):
        return dist.ReduceOp.PREMUL_SUM(0.5) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)

    return {"torch": (maker(td.distributed_c10d), torch_op), "ours": (maker(dist), our_op)}


def _describe(work):
    """(Work class name, future is torch's, length of result())."""
    fut = work.get_future()
    return (type(work).__name__, type(fut).__module__.startswith("torch"),
            len(work.result()))


def table_case(ctx, kind):
    """Run on every rank: every method, torch's way and ours, async and not, on a group of
    ``kind``; {(label, way, async): (outputs, work description, completed on return)}."""
    import datetime

    pg = _group(ctx, kind)  # every rank makes it
    if ctx.rank not in MEMBERS:
        return None
    me, n = pg.rank(), pg.size()
    got = {}
    for way, (mk, op) in _ways().items():
        for async_op in (True, False):
            o = {"asyncOp": async_op}
            if not async_op:
                o["timeout"] = datetime.timedelta(seconds=60)
            for label, make in _calls(me, n, mk, op).items():
                outs, opts, issue = make(o)
                work = issue(pg, opts())
                done = work.is_completed()
                if not async_op:  # blocking: the outputs are final now, before any wait
                    early = [t.clone() for t in outs]
                work.wait()
                vals = [t.tolist() for t in outs]
                if not async_op:
                    assert [t.tolist() for t in early] == vals, (label, way)
                got[(label, way, async_op)] = (vals, _describe(work), done)
    return got


def _reference(label, g, n):
    v = lambda q, k=4, s=0: np.arange(k, dtype=np.float64) + 10 * (q + 1) + s  # noqa: E731
    every = [v(q) for q in range(n)]
    if label == "allreduce":
        return [np.max(every, axis=0).tolist()]
    if label == "allreduce premul":
        return [(0.5 * sum(every)).tolist()]
    if label == "allreduce_coalesced":
        return [sum(every).tolist(), sum(v(q, 3) for q in range(n)).tolist()]
    if label == "broadcast":
        return [v(1).tolist()]
    if label == "reduce":
        return [np.min(every, axis=0).tolist() if g == 1 else v(g).tolist()]
    if label == "allgather":
        return [x.tolist() for x in every]
    if label == "_allgather_base":
        return [np.concatenate(every).tolist()]
    if label == "allgather_into_tensor_coalesced":
        return [np.concatenate(every).tolist(), np.concatenate([v(q, 2) for q in range(n)]).tolist()]
    if label == "gather":
        return [x.tolist() for x in every] if g == 1 else []
    if label == "scatter":
        return [[100.0 + g] * 4]
    if label == "reduce_scatter":
        return [np.max([v(q, s=g) for q in range(n)], axis=0).tolist()]
    if label == "_reduce_scatter_base":
        return [sum(v(q, s=g) for q in range(n)).tolist()]
    if label == "reduce_scatter_tensor_coalesced":
        return [sum(v(q, s=g) for q in range(n)).tolist(),
                sum(v(q, 2, s=g) for q in range(n)).tolist()]
    if label == "alltoall_base":
        return [[10.0 * q + g for q in range(n) for _ in range(2)]]
    if label == "alltoall":
        return [[10.0 * q + g] for q in range(n)]
    assert label == "barrier"
    return []


def _expected_work(kind, way):
    """Which Work a call gets: torch's for torch's options on a bridged group and for every
    call on torch's wrapper; ours otherwise."""
    if kind == "wrapped" or (kind == "bridged" and way == "torch"):
        return "TorchWork", True
    return "Work", False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_torchs_options_and_ours_give_the_same_values_and_the_ways_work(config, kind):
    results = backend_pool(config, WORLD).run(table_case, kind, timeout=240)
    assert results[0] is None
    n = len(MEMBERS)
    for g in range(n):
        got = results[MEMBERS[g]]
        for (label, way, async_op), (vals, (work_type, torch_future, nres), done) in got.items():
            where = f"{label}, {way}'s options, asyncOp={async_op}, group rank {g}, {kind}"
            assert vals == _reference(label, g, n), where
            assert (work_type, torch_future) == _expected_work(kind, way), where
            if not async_op:
                assert done, f"{where}: not completed on return"
            if work_type == "TorchWork":  # torch's Work: its result() is what the method filled
                assert nres == (1 if label == "allgather" else len(vals)), where


def legacy_case(ctx, kind):
    """Run on every rank: the legacy forms and calls without options, with torch tensors and
    with NumPy arrays; {label: (values, work description)}; and the misuse errors."""
    import collectives as dist
    pg = _group(ctx, kind)  # every rank makes it
    if ctx.rank not in MEMBERS:
        return None
    me, n = pg.rank(), pg.size()
    got = {}

    def rec(label, work, outs):
        work.wait()
        got[label] = ([np.asarray(t).tolist() for t in outs], _describe(work))

    t = torch.full((3,), me + 1.0, dtype=torch.float64)
    rec("torch allreduce no opts", pg.allreduce([t]), [t])  # a comm hook's call
    t = torch.full((3,), me + 1.0, dtype=torch.float64)
    rec("torch allreduce tensor op", pg.allreduce(t, dist.ReduceOp.MAX), [t])
    t = torch.full((3,), me + 1.0, dtype=torch.float64)
    import torch.distributed as td
    rec("torch allreduce tensor torch op", pg.allreduce(t, td.ReduceOp.PRODUCT), [t])
    a = np.full(3, me + 1.0)
    rec("numpy allreduce no opts", pg.allreduce([a]), [a])
    t = torch.full((3,), me + 1.0, dtype=torch.float64)
    rec("torch broadcast root", pg.broadcast(t, 1), [t])
    t = torch.full((3,), me + 1.0, dtype=torch.float64)
    rec("torch reduce root op", pg.reduce(t, 0, td.ReduceOp.SUM), [t])
    outs = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
    rec("torch allgather legacy", pg.allgather(outs, torch.full((3,), me + 1.0,
                                                                dtype=torch.float64)), outs)
    errors = []
    for call in (lambda: pg.broadcast([torch.ones(2)], _opt(td.BroadcastOptions, rootRank=n)),
                 lambda: pg.broadcast([np.ones(2)], _opt(dist.BroadcastOptions, rootRank=n)),
                 lambda: pg.barrier("nope"), lambda: pg.allreduce([], None),
                 lambda: pg.send([torch.ones(2)], -1)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    got["errors"] = errors
    return got


def _opt(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_legacy_forms_and_calls_without_options(config, kind):
    results = backend_pool(config, WORLD).run(legacy_case, kind, timeout=120)
    assert results[0] is None
    n = len(MEMBERS)
    torch_way = ("TorchWork", True) if kind != "plain" else ("Work", False)
    ours = ("TorchWork", True) if kind == "wrapped" else ("Work", False)
    for g in range(n):
        got = results[MEMBERS[g]]
        want = {
            "torch allreduce no opts": ([[3.0] * 3], torch_way),
            "torch allreduce tensor op": ([[2.0] * 3], ours),
            "torch allreduce tensor torch op": ([[2.0] * 3], torch_way),
            "numpy allreduce no opts": ([[3.0] * 3], ours),
            "torch broadcast root": ([[2.0] * 3], torch_way),
            "torch reduce root op": ([[3.0 if g == 0 else g + 1.0] * 3], torch_way),
            "torch allgather legacy": ([[1.0] * 3, [2.0] * 3], torch_way),
        }
        for label, (vals, way) in want.items():
            assert got[label][0] == vals, (label, g, kind)
            assert got[label][1][:2] == way, (label, g, kind)
        e = got["errors"]
        assert e[0] == e[1] and "rootRank must be a rank of this group, in [0, 2), got 2" in e[0], e
        assert e[2].startswith("TypeError: opts must be a BarrierOptions, got str"), e
        assert "tensors must hold at least one tensor" in e[3], e
        assert "dstRank must be a rank of this group, in [0, 2), got -1" in e[4], e
