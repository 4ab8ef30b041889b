"""ProcessGroup's own collective methods (``pg.allreduce([t], opts)`` and the legacy
positional forms) and the ``*Options`` structs, on every backend configuration.

Each method is called on a subgroup whose group ranks differ from the global ones, in
both of torch's forms, and every rank's result is checked against NumPy.

The second half (it needs torch): one table of the methods, called torch's way and ours.

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

import collectives as dist
from tests.support.marks import quick_only
from tests.support.ranks import available_configs, backend_pool
from tests.support.requires import needs_torch

CONFIGS = [c for c in available_configs() if c in ("gloo", "gloo-tcp", "mpi")]
WORLD = 4
MEMBERS = [1, 2, 3]  # global ranks of the subgroup: group rank = global rank - 1
# the table's tests: torch's options and ours on three kinds of group
TABLE_CONFIGS = [c for c in available_configs() if c in ("gloo", "mpi")]
TABLE_WORLD = 3
TABLE_MEMBERS = [1, 2]  # group rank = global rank - 1
KINDS = ("bridged", "wrapped", "plain")


def methods_case(ctx, timed):
    """Run on every rank: every method on the subgroup; returns {label: result}. ``timed``:
    every options struct carries a timeout of its own (the call runs with it)."""
    import datetime

    import numpy as np

    import collectives as dist
    if "pg" not in ctx.state:
        ctx.state["pg"] = dist.new_group(MEMBERS)
    pg = ctx.state["pg"]
    if ctx.rank not in MEMBERS:
        return None
    me, n = pg.rank(), pg.size()
    v = lambda k=4: np.arange(k, dtype=np.float64) + 10 * (me + 1)  # noqa: E731
    out = {"name": pg.name(), "group_name": pg.group_name}

    def opts(cls):
        o = cls()
        if timed:
            o.timeout = datetime.timedelta(seconds=45)
        return o

    t = v()
    pg.allreduce([t], opts(dist.AllreduceOptions)).wait()
    out["allreduce opts"] = t.tolist()
    t = v()
    o = opts(dist.AllreduceOptions)
    o.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([t], o).wait()
    out["allreduce max"] = t.tolist()
    t = v()
    pg.allreduce(t, dist.ReduceOp.MIN).wait()
    out["allreduce tensor op"] = t.tolist()
    ts = [v(), v(3)]
    pg.allreduce_coalesced(ts).wait()
    out["allreduce_coalesced"] = [x.tolist() for x in ts]

    t = v()
    o = opts(dist.BroadcastOptions)
    o.rootRank = 2
    pg.broadcast([t], o).wait()
    out["broadcast opts"] = t.tolist()
    t = v()
    pg.broadcast(t, 1).wait()
    out["broadcast root"] = t.tolist()

    t = v()
    o = opts(dist.ReduceOptions)
    o.rootRank, o.reduceOp = 1, dist.ReduceOp.SUM
    pg.reduce([t], o).wait()
    out["reduce opts"] = t.tolist() if me == 1 else None
    t = v()
    pg.reduce(t, 2, dist.ReduceOp.PRODUCT).wait()
    out["reduce root op"] = t.tolist() if me == 2 else None

    outs = [np.zeros(4) for _ in range(n)]
    pg.allgather([outs], [v()]).wait()
    out["allgather"] = [x.tolist() for x in outs]
    outs = [np.zeros(4) for _ in range(n)]
    pg.allgather(outs, v()).wait()
    out["allgather legacy"] = [x.tolist() for x in outs]
    big = np.zeros(4 * n)
    pg._allgather_base(big, v()).wait()
    out["_allgather_base"] = big.tolist()

    outs = [np.zeros(4 * n), np.zeros(2 * n)]
    pg.allgather_into_tensor_coalesced(outs, [v(), v(2)], opts(dist.AllgatherOptions)).wait()
    out["allgather_into_tensor_coalesced"] = [x.tolist() for x in outs]

    o = opts(dist.GatherOptions)
    o.rootRank = 0
    outs = [np.zeros(4) for _ in range(n)]
    pg.gather([outs] if me == 0 else [], [v()], o).wait()
    out["gather opts"] = [x.tolist() for x in outs] if me == 0 else None
    outs = [np.zeros(4) for _ in range(n)]
    pg.gather(outs if me == 2 else [], v(), 2).wait()
    out["gather root"] = [x.tolist() for x in outs] if me == 2 else None

    o = opts(dist.ScatterOptions)
    o.rootRank = 1
    t = np.zeros(4)
    src = [np.full(4, 100.0 + q) for q in range(n)]
    pg.scatter([t], [src] if me == 1 else [], o).wait()
    out["scatter opts"] = t.tolist()
    t = np.zeros(4)
    pg.scatter(t, src if me == 0 else [], 0).wait()
    out["scatter root"] = t.tolist()

    t = np.zeros(4)
    pg.reduce_scatter([t], [[v() + q for q in range(n)]], opts(dist.ReduceScatterOptions)).wait()
    out["reduce_scatter opts"] = t.tolist()
    t = np.zeros(4)
    pg.reduce_scatter(t, [v() + q for q in range(n)], dist.ReduceOp.MAX).wait()
    out["reduce_scatter op"] = t.tolist()
    t = np.zeros(4)
    pg._reduce_scatter_base(t, np.concatenate([v() + q for q in range(n)])).wait()
    out["_reduce_scatter_base"] = t.tolist()
    outs = [np.zeros(4), np.zeros(2)]
    pg.reduce_scatter_tensor_coalesced(
        outs, [np.concatenate([v(k) + q for q in range(n)]) for k in (4, 2)],
        opts(dist.ReduceScatterOptions)).wait()
    out["reduce_scatter_tensor_coalesced"] = [x.tolist() for x in outs]

    t = np.zeros(2 * n)
    pg.alltoall_base(t, np.concatenate([np.full(2, 10.0 * me + q) for q in range(n)]), [], [],
                     opts(dist.AllToAllOptions)).wait()
    out["alltoall_base"] = t.tolist()
    outs = [np.zeros(1) for _ in range(n)]
    pg.alltoall(outs, [np.full(1, 10.0 * me + q) for q in range(n)]).wait()
    out["alltoall"] = [x.tolist() for x in outs]

    pg.barrier(opts(dist.BarrierOptions)).wait()
    if me == 0:
        pg.send([np.full(3, 7.0)], 2, 5).wait()
        pg.send([np.full(3, 8.0)], 1, 0).wait()
    elif me == 2:
        t = np.zeros(3)
        pg.recv([t], 0, 5).wait()
        out["recv"] = t.tolist()
    else:
        t = np.zeros(3)
        w = pg.recv_anysource([t])
        w.wait()
        out["recv_anysource"] = (t.tolist(), w.source_rank())

    errors = []
    for call in (lambda: pg.broadcast(v(), 3), lambda: pg.send([v()], -1),
                 lambda: pg.barrier("nope"), lambda: pg.allreduce([], None)):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("timed", [False, True], ids=["group-timeout", "own-timeout"])
def test_process_group_methods_match_numpy(config, timed):
    results = backend_pool(config, WORLD).run(methods_case, timed, timeout=120)
    assert results[0] is None
    n = len(MEMBERS)
    v = lambda me, k=4: np.arange(k, dtype=np.float64) + 10 * (me + 1)  # noqa: E731
    every = [v(q) for q in range(n)]
    for g in range(n):
        got = results[MEMBERS[g]]
        assert got["name"] == ("mpi" if config == "mpi" else "gloo")
        assert got["group_name"].startswith(("group/", "split/"))
        assert got["allreduce opts"] == sum(every).tolist()
        assert got["allreduce max"] == np.max(every, axis=0).tolist()
        assert got["allreduce tensor op"] == np.min(every, axis=0).tolist()
        assert got["allreduce_coalesced"] == [sum(every).tolist(), sum(v(q, 3) for q in range(n)).tolist()]
        assert got["broadcast opts"] == v(2).tolist()
        assert got["broadcast root"] == v(1).tolist()
        assert got["reduce opts"] == (sum(every).tolist() if g == 1 else None)
        assert got["reduce root op"] == (np.prod(every, axis=0).tolist() if g == 2 else None)
        assert got["allgather"] == [x.tolist() for x in every]
        assert got["allgather legacy"] == [x.tolist() for x in every]
        assert got["_allgather_base"] == np.concatenate(every).tolist()
        assert got["gather opts"] == ([x.tolist() for x in every] if g == 0 else None)
        assert got["gather root"] == ([x.tolist() for x in every] if g == 2 else None)
        assert got["scatter opts"] == [100.0 + g] * 4
        assert got["scatter root"] == [100.0 + g] * 4
        assert got["reduce_scatter opts"] == sum(x + g for x in every).tolist()
        assert got["reduce_scatter op"] == np.max([x + g for x in every], axis=0).tolist()
        assert got["_reduce_scatter_base"] == sum(x + g for x in every).tolist()
        assert got["allgather_into_tensor_coalesced"] == [
            np.concatenate(every).tolist(), np.concatenate([v(q, 2) for q in range(n)]).tolist()]
        assert got["reduce_scatter_tensor_coalesced"] == [
            sum(x + g for x in every).tolist(), sum(v(q, 2) + g for q in range(n)).tolist()]
        assert got["alltoall_base"] == [10.0 * q + g for q in range(n) for _ in range(2)]
        assert got["alltoall"] == [[10.0 * q + g] for q in range(n)]
        if g == 2:
            assert got["recv"] == [7.0] * 3
        if g == 1:
            assert got["recv_anysource"] == ([8.0] * 3, MEMBERS[0])  # source_rank(): global
        e = got["errors"]
        assert "rootRank must be a rank of this group, in [0, 3), got 3" in e[0]
        assert "dstRank must be a rank of this group, in [0, 3), got -1" in e[1]
        assert e[2].startswith("TypeError: opts must be a BarrierOptions, got str")
        assert "tensors must hold at least one tensor" in e[3]


def _all_ranks_group(bridged):
    """A new group of all ranks: torch's too (a BridgedGroup) when ``bridged``.

    Whether a world's groups bridge is decided once (at init, or by torch_pg.install_default);
    this test sets that decision around the one new_group call, to try both classes."""
    import collectives as dist
    from collectives.core.world import world
    if bridged:
        import torch  # noqa: F401  (a BridgedGroup is torch's ProcessGroup too)
    was = world.bridge
    world.bridge = bridged
    try:
        pg = dist.new_group(list(range(dist.get_world_size())))
    finally:
        world.bridge = was
    assert (type(pg).__name__ == "BridgedGroup") == bridged, type(pg)
    return pg


def monitored_case(ctx, absent, bridged):
    """Run on every rank: ``pg.monitored_barrier`` on a new group of all ranks (torch's
    too when ``bridged``), passed by all, then skipped by ``absent``; what each saw."""
    import datetime

    import collectives as dist
    pg = _all_ranks_group(bridged)
    try:
        pg.monitored_barrier(datetime.timedelta(seconds=60))
        pg.monitored_barrier(60, wait_all_ranks=True)
        if ctx.rank == absent:
            return "absent"
        try:
            pg.monitored_barrier(datetime.timedelta(seconds=1), wait_all_ranks=True)
        except dist.DistError as e:
            return str(e)
        return "passed"
    finally:
        dist.destroy_process_group(pg)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bridged", quick_only([False, True], False, ids=["plain", "torch"]))
def test_monitored_barrier_method_names_the_rank_that_did_not_come(config, bridged):
    if bridged:
        pytest.importorskip("torch")
    absent = WORLD - 2
    got = backend_pool(config, WORLD).run(monitored_case, absent, bridged, timeout=120)
    assert got[absent] == "absent"
    assert f"Rank {absent} failed to pass monitoredBarrier in 1000 ms" in got[0]
    for r in range(1, WORLD):
        if r != absent:
            assert "got no answer from rank 0" in got[r], got[r]


def _every_timeout_config(test):
    """``test(config, bridged)`` on every gloo configuration and mpi, on plain and on
    torch-bridged groups, with a timeout."""
    configs = [c for c in available_configs() if c in ("gloo", "gloo-tcp", "gloo-hier", "mpi")]
    # torch-bridged groups' timeouts are slow: test_torch_pg's own timeout test stays quick
    test = pytest.mark.parametrize("bridged", quick_only([False, True], False, ids=["plain", "torch"]))(test)
    test = pytest.mark.parametrize("config", configs)(test)
    return pytest.mark.timeout(300)(test)


def set_timeout_case(ctx, secs, bridged, lone):
    """Run on every rank: misuse of ``pg.set_timeout`` on a new group of all ranks, then
    ``set_timeout(secs)``, an all_reduce, and (``lone``) a barrier rank 0 calls alone:
    (errors, timeout seen, all_reduce result, (what rank 0's barrier raised, after how
    long))."""
    import datetime
    import time

    import numpy as np

    import collectives as dist
    pg = _all_ranks_group(bridged)
    try:
        errors = []
        for bad in (-1, 0, "soon", float("nan")):
            try:
                pg.set_timeout(bad)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        pg.set_timeout(datetime.timedelta(seconds=secs))
        t = np.full(3, ctx.rank + 1.0)
        dist.all_reduce(t, group=pg)
        lone_got = None
        if lone and ctx.rank == 0:
            t0 = time.monotonic()
            try:
                dist.barrier(group=pg)
                lone_got = ("passed", time.monotonic() - t0)
            except dist.DistError as e:
                lone_got = (type(e).__name__, time.monotonic() - t0)
        if lone:
            dist.barrier()  # the others stay until rank 0 is done
        return errors, pg.timeout, t.tolist(), lone_got
    finally:
        dist.destroy_process_group(pg)


@pytest.mark.faults
@_every_timeout_config
def test_set_timeout_bounds_the_groups_later_calls(config, bridged):
    if bridged:
        pytest.importorskip("torch")
    lone = config != "mpi"  # on mpi a blocking collective past its timeout ends the job
    secs = 1.5
    got = backend_pool(config, WORLD).run(set_timeout_case, secs, bridged, lone, timeout=120)
    total = sum(range(1, WORLD + 1))
    for errors, timeout, summed, _ in got:
        assert errors[0].startswith("ValueError") and "timeout" in errors[0], errors
        assert errors[1].startswith("ValueError"), errors
        assert errors[2].startswith("TypeError") and "timeout must be" in errors[2], errors
        assert errors[3].startswith("ValueError"), errors
        assert timeout == secs
        assert summed == [float(total)] * 3
    if lone:
        name, took = got[0][3]
        assert name != "passed", f"a barrier rank 0 called alone passed after {took:.2f} s"
        assert secs - 0.1 <= took < secs + 5, f"rank 0's lone barrier raised after {took:.2f} s"


def test_options_have_torchs_fields_and_defaults():
    o = dist.ReduceOptions()
    assert (o.reduceOp, o.rootRank, o.rootTensor, o.asyncOp) == (dist.ReduceOp.SUM, 0, 0, True)
    assert o.timeout.total_seconds() == -0.001
    b1, b2 = dist.BarrierOptions(), dist.BarrierOptions()
    b1.device_ids.append(3)
    assert b2.device_ids == []  # not shared between instances
    assert dist.BroadcastOptions().rootRank == 0 and dist.ScatterOptions().rootRank == 0
    assert dist.AllreduceCoalescedOptions().reduceOp == dist.ReduceOp.SUM
    assert "reduceOp" in repr(dist.AllreduceOptions())


def call_timeout_case(ctx, bridged, lone):
    """Run on every rank: a call's own timeout (``barrier(timeout=...)``, an options struct's
    ``timeout``) on new groups of all ranks whose own timeout is 300 s. Returns (misuse
    errors, all_reduce result, {case: (what rank 0's lone call raised, after how long)})."""
    import datetime
    import time

    import numpy as np

    import collectives as dist
    sec = datetime.timedelta(seconds=1)
    errors = []
    for call in (lambda: dist.barrier(timeout=-1), lambda: dist.barrier(timeout="soon"),
                 lambda: dist.barrier(timeout=0)):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    pg = _all_ranks_group(bridged)
    # passed by all: the call's timeout replaces the group's for that call only
    pg.set_timeout(3)
    dist.barrier(group=pg, timeout=30)
    o = dist.AllreduceOptions()
    o.timeout = datetime.timedelta(seconds=30)
    t = np.full(3, ctx.rank + 1.0)
    pg.allreduce([t], o).wait()
    lone_got = {}

    def lone_call(name, group, fn):
        if ctx.rank == 0:
            t0 = time.monotonic()
            try:
                fn()
                lone_got[name] = ("passed", time.monotonic() - t0)
            except dist.DistError as e:
                lone_got[name] = (str(e), time.monotonic() - t0)
        dist.barrier()  # the others stay in the group until rank 0 is done
        dist.destroy_process_group(group)

    if lone:  # rank 0 alone; each group is left broken by its timeout: a new one each time
        lone_call("group timeout restored (3 s)", pg, lambda: dist.barrier(group=pg))
        g = _all_ranks_group(bridged)
        g.set_timeout(300)
        lone_call("barrier(timeout=1)", g, lambda: dist.barrier(group=g, timeout=sec))
        g = _all_ranks_group(bridged)
        g.set_timeout(300)
        b = dist.BarrierOptions()
        b.timeout = sec
        lone_call("pg.barrier(opts)", g, lambda: g.barrier(b).wait())
        g = _all_ranks_group(bridged)
        g.set_timeout(300)
        o1 = dist.AllreduceOptions()
        o1.timeout = sec
        lone_call("pg.allreduce(opts)", g, lambda: g.allreduce([np.ones(5)], o1).wait())
        if bridged:
            import torch
            import torch.distributed as td
            g = _all_ranks_group(bridged)
            g.set_timeout(300)
            lone_call("torch barrier(timeout=1)", g, lambda: td.barrier(group=g, timeout=sec))
            g = _all_ranks_group(bridged)
            g.set_timeout(300)
            lone_call("torch all_reduce opts", g,
                      lambda: g.allreduce([torch.ones(5)], _torch_opts(sec)).wait())
    else:
        dist.destroy_process_group(pg)
    o.timeout = datetime.timedelta(seconds=-5)
    try:
        dist.group.WORLD.allreduce([t], o)
        errors.append(None)
    except (TypeError, ValueError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    return errors, t.tolist(), lone_got


def _torch_opts(timeout):
    import torch.distributed as td
    o = td.AllreduceOptions()
    o.timeout = timeout
    return o


@pytest.mark.faults
@pytest.mark.slow  # waits out timeouts; quick: test_set_timeout_bounds_the_groups_later_calls
@_every_timeout_config
def test_a_calls_own_timeout_bounds_that_call_only(config, bridged):
    if bridged:
        pytest.importorskip("torch")
    lone = config != "mpi"  # on mpi a blocking collective past its timeout ends the job
    got = backend_pool(config, WORLD).run(call_timeout_case, bridged, lone, timeout=120)
    for errors, summed, _ in got:
        assert errors[0].startswith("ValueError: timeout must be"), errors
        assert errors[1].startswith("TypeError: timeout must be"), errors
        assert errors[2].startswith("ValueError: timeout must be"), errors
        assert errors[3].startswith("ValueError: opts.timeout must be"), errors
        assert summed == [float(sum(range(1, WORLD + 1)))] * 3
    if not lone:
        return
    cases = got[0][2]
    assert len(cases) == (6 if bridged else 4), cases
    for name, (msg, took) in cases.items():
        want = 3.0 if name.startswith("group timeout") else 1.0
        assert msg != "passed", f"{name}: rank 0's lone call passed after {took:.2f} s"
        assert want - 0.1 <= took < want + 2, f"{name}: raised after {took:.2f} s: {msg}"
        # torch gloo's words, which torch's own tests match
        assert " Timed out " in msg and f"Timed out waiting {want * 1000:.0f}ms" in msg, msg


# ---- one table of methods, torch's options and ours, on three kinds of group ------------

def _group(ctx, kind):
    import torch  # noqa: F401  (imported before the group is made, as torch programs do)

    import collectives as dist
    from collectives.core.world import world
    key = f"table-{kind}"
    if key not in ctx.state:
        was = world.bridge
        world.bridge = kind == "bridged"
        try:
            g = dist.new_group(TABLE_MEMBERS)
        finally:
            world.bridge = was
        if kind == "wrapped" and ctx.rank in TABLE_MEMBERS:
            from collectives.torch_bridge.torch_pg import to_torch
            g = to_torch(g)
        ctx.state[key] = g
    return ctx.state[key]


def _calls(me, n, mk, op):
    """{label: (issue, outputs)}: ``issue(opts_maker)`` issues the call and returns its
    Work; ``outputs()`` the tensors it fills, read after."""
    import torch
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
    if ctx.rank not in TABLE_MEMBERS:
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


@needs_torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", TABLE_CONFIGS, indirect=True, scope="module")
def test_torchs_options_and_ours_give_the_same_values_and_the_ways_work(config, kind):
    results = backend_pool(config, TABLE_WORLD).run(table_case, kind, timeout=240)
    assert results[0] is None
    n = len(TABLE_MEMBERS)
    for g in range(n):
        got = results[TABLE_MEMBERS[g]]
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
    import torch

    import collectives as dist
    pg = _group(ctx, kind)  # every rank makes it
    if ctx.rank not in TABLE_MEMBERS:
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


@needs_torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", TABLE_CONFIGS, indirect=True, scope="module")
def test_legacy_forms_and_calls_without_options(config, kind):
    results = backend_pool(config, TABLE_WORLD).run(legacy_case, kind, timeout=120)
    assert results[0] is None
    n = len(TABLE_MEMBERS)
    torch_way = ("TorchWork", True) if kind != "plain" else ("Work", False)
    ours = ("TorchWork", True) if kind == "wrapped" else ("Work", False)
    for g in range(n):
        got = results[TABLE_MEMBERS[g]]
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
