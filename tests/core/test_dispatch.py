"""Each group's dispatcher (collectives/api/group_dispatcher.py,
collectives/engines/_group_dispatcher.pxi): every collective, reduce included, takes one
cheap path when nothing records a timeout, profiles or waits in the queue, and every other
call takes the one general path; the C dispatcher and its pure-Python twin record the same
thing."""
import threading

import numpy as np
import pytest

from collectives.api import group_dispatcher
from collectives.diagnostics import flight_recorder as fr
from collectives.backends.base import Backend
from collectives.core.errors import DistBackendError
from collectives.store import HashStore
from collectives.core.work import per_call_timeout

from tests.support.dispatchers import choose
from tests.support.requires import needs_gloo


@pytest.fixture(params=["c", "python"])
def world1(request, monkeypatch):
    """A one-rank world whose dispatcher reports each call it sends to the general path;
    ``request.param``: the C dispatcher (where built) or the Python one."""
    import collectives as dist
    general = []
    real = group_dispatcher.general

    def spy(pg, kind, *rest):
        general.append(kind)
        return real(pg, kind, *rest)

    monkeypatch.setattr(group_dispatcher, "general", spy)  # the dispatchers made from now on call it
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    yield dist, choose(dist, request.param), general
    dist.destroy_process_group()


def _every_collective(dist):
    """One blocking call of each collective on one rank (reduce included); their kinds."""
    t = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.reduce(t, 0)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(out, t)
    dist.barrier()
    dist.all_gather([out], t)
    dist.gather(t, [out], 0)
    dist.scatter(out, [t], 0)
    dist.reduce_scatter(out, [t])
    dist.all_to_all_single(out, t)
    dist.all_to_all([out], [t])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # several steps (reduce, then scale): one call
    dist.reduce(t, 0, op=dist.ReduceOp.PREMUL_SUM(0.5))
    return ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier",
            "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all", "all_to_all",
            "all_reduce", "reduce"]


@needs_gloo
def test_every_collective_takes_the_cheap_path_when_nothing_needs_the_general_one(world1):
    dist, pg, general = world1
    assert pg.dispatch.inline  # the shared-memory backend runs blocking calls in the caller
    kinds = _every_collective(dist)
    assert general == []
    assert [e[1] for e in pg.fr.entries()] == kinds
    assert pg.fr.seq == pg.fr.started == pg.fr.done == len(kinds)
    assert {pg.fr.state(s) for s in range(1, len(kinds) + 1)} == {fr.COMPLETED}


@pytest.mark.faults
@needs_gloo
def test_async_calls_and_timeouts_take_the_general_path(world1):
    dist, pg, general = world1
    t = np.ones(4, np.float32)
    dist.all_reduce(t, async_op=True).wait()
    dist.reduce(t, 0, async_op=True).wait()
    dist.barrier(timeout=5)
    with per_call_timeout(5.0):
        dist.broadcast(t, 0)
    assert general == ["all_reduce", "reduce", "barrier", "broadcast"]
    assert pg.fr.seq == pg.fr.done == 4
    general.clear()
    dist.all_reduce(t)  # and back on the cheap path once nothing needs the general one
    assert general == []


@needs_gloo
def test_a_call_behind_queued_work_waits_for_it_in_issue_order(world1):
    dist, pg, general = world1
    gate = threading.Event()
    order = []
    pg.backend.submit(lambda: (gate.wait(10), order.append("queued")))
    assert pg.backend.pending.n == 1
    threading.Timer(0.2, gate.set).start()
    t = np.ones(4, np.float32)
    dist.all_reduce(t)
    order.append("all_reduce")
    assert order == ["queued", "all_reduce"]
    assert general == ["all_reduce"]
    assert pg.backend.pending.n == 0


@needs_gloo
def test_a_failure_on_the_cheap_path_is_recorded_and_raised(world1):
    dist, pg, general = world1

    def boom():
        raise DistBackendError("boom: Timed out waiting 1ms")

    with pytest.raises(DistBackendError, match="boom"):
        pg.dispatch.call("barrier", None, -1, -1, boom, ())
    s = pg.fr.seq
    assert general == [] and pg.fr.state(s) == fr.FAILED and pg.fr.started == s
    assert pg.fr.done == s - 1
    with pytest.raises(ZeroDivisionError):  # not a DistError: raised as it is, not recorded
        pg.dispatch.call("barrier", None, -1, -1, lambda: 1 / 0, ())
    assert pg.fr.state(pg.fr.seq) == fr.STARTED


def test_a_backend_that_runs_calls_its_own_way_never_takes_the_cheap_path():
    class Own(Backend):
        def run(self, fn, *args):
            return fn(*args)

    class Group:
        backend = Own(None, 0, 1, 5)
        fr = fr.Recorder("g", [0], 0, "own")  # (the module fr, read before the name is bound)

    assert not group_dispatcher.for_group(Group).inline
    Group.backend = Backend(None, 0, 1, 5)
    assert group_dispatcher.for_group(Group).inline
