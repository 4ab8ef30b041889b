"""torch's profiler sees collectives' calls, as it sees torch's own.

Properties:

- Under ``torch.profiler.profile()``, every collective (all_reduce sync and async, with
  SUM and another op, broadcast, all_gather_into_tensor, all_gather into a list,
  reduce_scatter_tensor, barrier sync and async, send, recv from a rank and from any
  rank, isend/irecv, all_gather_object, and torch's own ``torch.distributed.all_reduce``
  on our group) is one span named as torch's gloo names its work, ``<backend>:<op>``,
  on every configuration and world, and gives the same results as unprofiled.
- ``record_comm(name)`` names the spans of the collectives issued inside it, and
  nested blocks restore the outer name.
- Each span closes when its op has ended, on whatever thread ended it: before the next
  op's span opens, and an async collective's span lasts until the collective has
  finished (here: until a peer that joins 0.3 s late has joined), though the call
  returned at once.
- Misuse: ``record_comm`` with a name that is not a str raises TypeError.
"""
import pytest

from tests.support.ranks import available_configs, backend_pool
from tests.support.marks import quick_only

torch = pytest.importorskip("torch")

CONFIGS = available_configs()
LATE = 0.3  # seconds the last rank waits before joining the async all_reduce


def profiled_case(ctx):
    """Run on every rank: the ops under the profiler; (our span names in start order,
    the async all_reduce's span in s and the time its call took, results, label of the
    group's backend)."""
    import time

    import torch.distributed as td
    from torch.profiler import profile

    import collectives as dist
    import collectives.torch_bridge.torch_pg as tp
    if not td.is_initialized():
        tp.install_default(dist.group.WORLD)
    rank, n = dist.get_rank(), dist.get_world_size()
    b = dist.get_backend()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    res = {}
    with profile() as prof:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["sum"] = t.tolist()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res["max"] = t.tolist()
        t = torch.full((2,), float(rank))
        if rank == n - 1:
            time.sleep(LATE)
        start = time.perf_counter()
        w = dist.all_reduce(t, async_op=True)
        issued = time.perf_counter() - start
        w.wait()
        res["async"] = t.tolist()
        t = torch.full((2,), float(rank))
        dist.broadcast(t, src=0)
        res["bcast"] = t.tolist()
        out = torch.zeros(2 * n)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        res["agit"] = out.tolist()
        lst = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(lst, torch.full((1,), float(rank)))
        res["ag"] = [x.item() for x in lst]
        o = torch.zeros(1)
        dist.reduce_scatter_tensor(o, torch.arange(n, dtype=torch.float32))
        res["rs"] = o.tolist()
        dist.barrier()
        dist.barrier(async_op=True).wait()
        got = torch.zeros(1)
        if rank % 2 == 0:
            dist.send(torch.full((1,), float(rank)), nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(torch.full((1,), float(rank)), nxt)
        res["ring"] = got.item()
        got = torch.zeros(1)
        ws = [dist.isend(torch.full((1,), float(rank)), nxt), dist.irecv(got, prv)]
        for w2 in ws:
            w2.wait()
        res["iring"] = got.item()
        got = torch.zeros(1)
        if rank == 0:
            res["any"] = sorted(dist.recv(got) for _ in range(n - 1))
        else:
            dist.send(torch.full((1,), float(rank)), 0)
        objs = [None] * n
        dist.all_gather_object(objs, {"r": rank})
        res["objs"] = objs
        with dist.record_comm("outer"):
            with dist.record_comm("inner"):
                dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
        t = torch.ones(2)
        td.all_reduce(t)
        res["torch"] = t.tolist()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    ours = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
            if e.name.startswith(f"{b}:") or e.name in ("outer", "inner")]
    return ours, issued, res, b


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("world", quick_only([2, 3], 2))
def test_the_profiler_sees_each_collective_as_one_span(config, world):
    results = backend_pool(config, world).run(profiled_case, timeout=120)
    for rank, (spans, issued, res, b) in enumerate(results):
        names = [name for name, _, _ in spans]
        recv_any = [f"{b}:recvAnySource"] * (world - 1) if rank == 0 else [f"{b}:send"]
        ring = [f"{b}:send", f"{b}:recv"] if rank % 2 == 0 else [f"{b}:recv", f"{b}:send"]
        assert names == ([f"{b}:all_reduce"] * 3 + [f"{b}:broadcast"] + [f"{b}:all_gather"] * 2
                         + [f"{b}:reduce_scatter"] + [f"{b}:barrier"] * 2 + ring
                         + [f"{b}:send", f"{b}:recv"] + recv_any + [f"{b}:all_gather"] * 2
                         + ["inner", "outer", f"{b}:all_reduce"]), (rank, names)
        total = world * (world + 1) / 2
        assert res["sum"] == [total] * 3 and res["max"] == [float(world)] * 3
        assert res["async"] == [world * (world - 1) / 2] * 2
        assert res["bcast"] == [0.0, 0.0]
        assert res["agit"] == [float(r) for r in range(world) for _ in range(2)]
        assert res["ag"] == [float(r) for r in range(world)]
        assert res["rs"] == [float(rank * world)]
        assert res["ring"] == float((rank - 1) % world) and res["iring"] == res["ring"]
        if rank == 0:
            assert res["any"] == list(range(1, world))
        assert res["objs"] == [{"r": r} for r in range(world)]
        assert res["torch"] == [float(world)] * 2
        # each span closed when its op ended: before the next op's began, but for the
        # isend/irecv pair (both issued, then both waited on)
        pair = 11
        assert names[pair:pair + 2] == [f"{b}:send", f"{b}:recv"]
        for i in range(len(spans) - 1):
            if i != pair:
                assert spans[i][2] <= spans[i + 1][1], (rank, spans[i], spans[i + 1])
        if rank != world - 1:  # waited LATE for the last rank, though its call returned at once
            _, start, end = spans[2]
            assert issued < LATE / 2, (rank, issued)
            assert end - start >= LATE * 0.6, (rank, spans[2])


def test_record_comm_wants_a_str_and_restores_the_outer_name():
    import collectives as dist
    from collectives.core import profiling

    class G:
        backend_name = "gloo"

    with pytest.raises(TypeError, match="name must be a str"):
        with dist.record_comm(3):
            pass
    assert profiling.label(G, "all_reduce") == "gloo:all_reduce"
    with dist.record_comm("a"):
        with dist.record_comm("b"):
            assert profiling.label(G, "all_reduce") == "b"
        assert profiling.label(G, "all_reduce") == "a"
    assert profiling.label(G, "all_reduce") == "gloo:all_reduce"
