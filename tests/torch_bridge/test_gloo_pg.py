"""``dist.ProcessGroupGloo``: torch's direct constructor of a gloo group, without
init_process_group, in both of its forms (a timeout, or ``_Options`` with a device).

The ranks build groups on one shared store, use them through their own methods and
through the front-end functions, and their results are checked against NumPy; a device
sets the address the group's TCP connections publish. Misuse raises before any rank
talks to another.
"""
import datetime
import socket

import numpy as np
import pytest

import collectives as dist
from collectives.store import HashStore
from tests.support.ranks import get_pool, ipv4_interfaces
from tests.support.requires import needs_gloo

pytestmark = needs_gloo


def _store(ctx):
    if "store" not in ctx.state:
        ctx.state["store"] = dist.TCPStore("127.0.0.1", ctx.port, ctx.world_size, ctx.rank == 0,
                                           datetime.timedelta(seconds=60))
    return ctx.state["store"]


def group_case(ctx, transport, device):
    """On every rank: a group made with a timeout (``device`` None) or with options naming
    ``device`` ((hostname, interface) for create_device); returns what it computed, the
    address each rank published (TCP only) and the group's identity."""
    import os

    import numpy as np

    import collectives as dist
    store = _store(ctx)
    os.environ["COLLECTIVES_TRANSPORT"] = transport
    try:
        if device is None:
            pg = dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size,
                                       datetime.timedelta(seconds=30))
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(*device)]
            opts._timeout = datetime.timedelta(seconds=30)
            opts.group_name = f"mine-{device}"
            pg = dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size, opts)
    finally:
        del os.environ["COLLECTIVES_TRANSPORT"]
    me, n = pg.rank(), pg.size()
    out = {"rank": me, "size": n, "name": pg.name(), "group_name": pg.group_name,
           "timeout": pg.options._timeout.total_seconds()}
    t = np.arange(5, dtype=np.float64) * (me + 1)
    pg.allreduce([t]).wait()
    out["allreduce"] = t.tolist()
    b = np.full(3, float(me), dtype=np.float32)
    pg.broadcast([b], n - 1).wait()
    out["broadcast"] = b.tolist()
    outs = [[np.zeros(2, dtype=np.int32) for _ in range(n)]]
    pg.allgather(outs, [np.array([me, -me], dtype=np.int32)]).wait()
    out["allgather"] = [x.tolist() for x in outs[0]]
    m = np.array([me + 1], dtype=np.int64)
    dist.all_reduce(m, op=dist.ReduceOp.PRODUCT, group=pg)  # the front end takes it too
    out["front end product"] = int(m[0])
    key = f"tcp/0/addr/{me}"  # the TCP mesh's published host:port; shared memory has none
    out["published"] = (pg.store.get(key).decode().rpartition(":")[0]
                        if pg.store.check([key]) else None)
    pg.shutdown()
    return out


def _check(results, n):
    for r, out in enumerate(results):
        assert (out["rank"], out["size"], out["name"]) == (r, n, "gloo"), out
        assert out["allreduce"] == (np.arange(5) * sum(range(1, n + 1))).tolist(), out
        assert out["broadcast"] == [float(n - 1)] * 3, out
        assert out["allgather"] == [[i, -i] for i in range(n)], out
        assert out["front end product"] == int(np.prod(np.arange(1, n + 1))), out
        assert out["timeout"] == 30.0, out


@pytest.mark.faults
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_groups_made_with_a_timeout_or_a_device_compute_and_listen_where_told(n):
    pool = get_pool(n)
    # shared memory (one host) and forced TCP, with a timeout
    for transport in ("auto", "tcp"):
        results = pool.run(group_case, transport, None, timeout=90)
        _check(results, n)
        published = {out["published"] for out in results}
        assert published == ({None} if transport == "auto" else {"127.0.0.1"}), results
    # a device per interface, and by host name; the last group made wins no key of the others
    devices = [("", name) for name in ipv4_interfaces()] + [("localhost", "lo"), ("127.0.0.1", "")]
    for device in devices:
        results = pool.run(group_case, "tcp", device, timeout=90)
        _check(results, n)
        want = socket.gethostbyname(device[0]) if device[0] else ipv4_interfaces()[device[1]]
        assert {out["published"] for out in results} == {want}, (device, results)
        assert {out["group_name"] for out in results} == {f"mine-{device}"}


def test_a_group_of_one_and_the_options_struct():
    pg = dist.ProcessGroupGloo(HashStore(), 0, 1)
    assert (pg.rank(), pg.size(), pg.name(), pg._get_backend_name()) == (0, 1, "gloo", "gloo")
    assert pg.options._timeout == datetime.timedelta(minutes=30)
    t = np.arange(4.0)
    pg.allreduce([t]).wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    pg.shutdown()
    o = dist.ProcessGroupGloo._Options()
    assert (o._devices, o._threads, o._timeout, o.global_ranks_in_group, o.group_name,
            o.backend) == ([], 2, datetime.timedelta(minutes=30), [], "", "gloo")
    assert dist.ProcessGroupGloo.Options is dist.ProcessGroupGloo._Options
    assert dist.ProcessGroupGloo.create_device(hostname="127.0.0.1").host == "127.0.0.1"
    assert dist.ProcessGroupGloo.create_device(hostname="localhost", interface="lo").host \
        == socket.gethostbyname("localhost")  # the host name wins, as in torch
    assert isinstance(dist.ProcessGroupGloo.create_default_device(), dist.ProcessGroupGloo.Device)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: dist.ProcessGroupGloo.create_device(), ValueError, "either `hostname` or `interface`"),
    (lambda: dist.ProcessGroupGloo.create_device(interface="no-such-if0"), ValueError,
     "interface names interface 'no-such-if0', which has no IPv4"),
    (lambda: dist.ProcessGroupGloo.create_device(hostname="192.0.2.254"), ValueError,
     r"hostname='192.0.2.254' \(192.0.2.254\) is not an address of this machine"),
    (lambda: dist.ProcessGroupGloo.create_device(hostname="no-such-host.invalid"), ValueError,
     "hostname='no-such-host.invalid' cannot be resolved"),
    (lambda: dist.ProcessGroupGloo.create_device(hostname=5), TypeError, "hostname must be a str"),
    (lambda: dist.ProcessGroupGloo("store", 0, 1), TypeError, "store must be a collectives Store"),
    (lambda: dist.ProcessGroupGloo(HashStore(), 2, 2), ValueError, r"rank must be in \[0, size=2\)"),
    (lambda: dist.ProcessGroupGloo(HashStore(), 0, 0), ValueError, "size must be >= 1"),
    (lambda: dist.ProcessGroupGloo(HashStore(), 0.0, 1), TypeError, "rank must be an int"),
    (lambda: dist.ProcessGroupGloo(HashStore(), 0, 1, 0), ValueError, "timeout must be a finite"),
    (lambda: dist.ProcessGroupGloo(HashStore(), 0, 1, "1s"), TypeError, "timeout must be a datetime"),
])
def test_misuse_raises_before_any_communication(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.faults
def test_options_with_a_bad_device_or_timeout_raise():
    o = dist.ProcessGroupGloo._Options()
    o._devices = ["lo"]
    with pytest.raises(TypeError, match="options._devices must be a list of ProcessGroupGloo.Device"):
        dist.ProcessGroupGloo(HashStore(), 0, 1, o)
    o._devices = []
    o._timeout = datetime.timedelta(0)
    with pytest.raises(ValueError, match="options._timeout must be a finite number of seconds > 0"):
        dist.ProcessGroupGloo(HashStore(), 0, 1, o)
