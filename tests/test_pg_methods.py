"""ProcessGroup's own collective methods (``pg.allreduce([t], opts)`` and the legacy
positional forms) and the ``*Options`` structs, on every backend configuration.

Each method is called on a subgroup whose group ranks differ from the global ones, in
both of torch's forms, and every rank's result is checked against NumPy.
"""
import numpy as np
import pytest

import collectives as dist
from tests.ranks import available_configs, backend_pool
from tests.marks import quick_only

CONFIGS = [c for c in available_configs() if c in ("gloo", "gloo-tcp", "mpi")]
WORLD = 4
MEMBERS = [1, 2, 3]  # global ranks of the subgroup: group rank = global rank - 1



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
    from collectives._world import world
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
