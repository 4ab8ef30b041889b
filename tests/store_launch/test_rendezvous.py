"""Ranks meet through every init method, take rank and size from any launcher's
environment, and a missing piece is a ValueError that names it."""
import os
import sys
import time
from datetime import timedelta

import pytest

from collectives.core.errors import DistNetworkError, DistStoreError
from collectives.store.rendezvous import env_local_rank, env_rank_world, meet
from collectives.store import FileStore, HashStore, TCPStore
from tests.support.ranks import free_port, get_pool, mpiexec_path
from tests.support.requires import needs_gloo
from tests.support.marks import quick_only

TORCH_POOL = {"COLLECTIVES_TEST_POOL": "imports torch"}  # keeps the plain pools torch-free
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def _environ(ctx, style, port):
    """This rank's environment as a launcher of ``style`` would have set it."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    r, n = str(ctx.rank), str(ctx.world_size)
    if style == "torchrun":
        env.update(RANK=r, WORLD_SIZE=n)
    elif style == "mpich":
        env.update(PMI_RANK=r, PMI_SIZE=n)
    elif style == "openmpi":
        env.update(OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=n)
    elif style == "slurm":
        env.update(SLURM_PROCID=r, SLURM_NTASKS=n)
    return env


def meet_and_exchange(ctx, method, port, path, style):
    """Rendezvous, set one key per rank, read every rank's key; returns what was read."""
    environ = _environ(ctx, style, port)
    t0 = time.perf_counter()
    if method == "env":
        store, rank, world = meet("env://", timeout=20, environ=environ)
    elif method == "default":
        store, rank, world = meet(timeout=timedelta(seconds=20), environ=environ)
    elif method == "tcp":
        store, rank, world = meet(f"tcp://127.0.0.1:{port}?rank={ctx.rank}", -1,
                                        ctx.world_size, timeout=20, environ=environ)
    elif method == "tcp-env":  # rank and size from the launcher's environment
        store, rank, world = meet(f"tcp://localhost:{port}", timeout=20, environ=environ)
    elif method == "file":
        store, rank, world = meet(f"file://{path}?world_size={ctx.world_size}",
                                        rank=ctx.rank, timeout=20, environ=environ)
    elif method == "store":
        given = TCPStore("127.0.0.1", port, ctx.world_size, ctx.rank == 0, timeout=20)
        store, rank, world = meet(store=given, rank=ctx.rank, world_size=ctx.world_size,
                                        environ=environ)
        assert store is given
    else:
        raise ValueError(method)
    elapsed = time.perf_counter() - t0
    assert (rank, world) == (ctx.rank, ctx.world_size)
    store.set(f"key{rank}", f"value{rank}")
    got = store.multi_get([f"key{r}" for r in range(world)])
    _leave(store, rank, world)
    return [g.decode() for g in got], elapsed


def _leave(store, rank, world):
    """Rank 0 serves the TCPStore: it closes only after every other rank's last request."""
    if rank != 0:
        store.add("left", 1)
    else:
        deadline = time.monotonic() + 20
        while store.add("left", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.002)
    store.close()


CASES = [("env", "torchrun"), ("default", "torchrun"), ("tcp", "none"), ("tcp-env", "torchrun"),
         ("file", "none"), ("store", "none"), ("env", "mpich"), ("env", "openmpi"), ("env", "slurm")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("method,style", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_ranks_meet_and_see_each_others_keys(method, style, world, tmp_path):
    pool = get_pool(world)
    port = free_port()
    results = pool.run(meet_and_exchange, method, port, str(tmp_path / "rdzv"), style, timeout=60)
    expect = [f"value{r}" for r in range(world)]
    for got, _ in results:
        assert got == expect


def meet_through_agent_store(ctx, port, rounds):
    """torchrun's workers: MASTER_PORT is the agent's (torch) TCPStore and
    TORCHELASTIC_USE_AGENT_STORE=True. Meet ``rounds`` times as a group made, destroyed
    and made again would; what every round read."""
    environ = dict(_environ(ctx, "torchrun", port), TORCHELASTIC_USE_AGENT_STORE="True")
    reads = []
    for i in range(rounds):
        store, rank, world = meet("env://", timeout=20, environ=environ)
        store.set(f"key{rank}", f"round{i}-{rank}")
        reads.append([g.decode() for g in store.multi_get([f"key{r}" for r in range(world)])])
        _leave(store, rank, world)
    return reads


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_meet_through_torchruns_agent_store(world):
    """Under torchrun the agent already serves MASTER_PORT (torch's store, not ours): rank
    0 serves ours on a free port and posts it there, and a second meeting in the same
    processes gets a new server rather than the first one's port."""
    td = pytest.importorskip("torch.distributed")
    agent = td.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    reads = get_pool(world, env=TORCH_POOL).run(meet_through_agent_store, agent.port, 3, timeout=90)
    assert reads == [[[f"round{i}-{r}" for r in range(world)] for i in range(3)]] * world


def test_agent_store_without_torch_says_what_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               TORCHELASTIC_USE_AGENT_STORE="True")
    with pytest.raises(DistNetworkError, match="torchrun's agent store.*install torch"):
        meet(timeout=2, environ=env)


def init_again_on_the_same_port(ctx, port, rounds, with_torch):
    """init_process_group / all_reduce / destroy_process_group ``rounds`` times on one
    port, rank 0 lingering before it destroys: the others initialise again while its
    previous server still answers. Whether every all_reduce was right."""
    import numpy as np
    if with_torch:  # every group is then torch's too: a BridgedGroup refers to itself
        import torch  # noqa: F401

    import collectives as dist
    ok = True
    for _ in range(rounds):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timedelta(seconds=20))
        x = np.full(4, ctx.rank + 1, np.float32)
        dist.all_reduce(x)
        ok = ok and x[0] == ctx.world_size * (ctx.world_size + 1) // 2
        if ctx.rank == 0:
            time.sleep(0.1)
        dist.destroy_process_group()
    return ok


@pytest.mark.timeout(120)
@needs_gloo
@pytest.mark.parametrize("world", quick_only([2, 3], 3))
@pytest.mark.parametrize("with_torch", quick_only([False, True], False, ids=["numpy", "torch"]))
def test_destroy_and_init_again_on_the_same_port(world, with_torch):
    """The ranks that re-initialise first do not join the previous group's server, and
    rank 0's destroy stops that server (with torch imported too, where only the cycle
    collector would free the group that holds it)."""
    if with_torch:
        pytest.importorskip("torch")
    pool = get_pool(world, env=TORCH_POOL if with_torch else None)
    assert pool.run(init_again_on_the_same_port, free_port(), 4, with_torch,
                    timeout=90) == [True] * world


@pytest.mark.timeout(120)
def test_four_rank_rendezvous_is_quick():
    pool = get_pool(4)
    times = []
    for _ in range(3):
        results = pool.run(meet_and_exchange, "env", free_port(), "", "torchrun", timeout=60)
        times.append(max(t for _, t in results))
    # well under a second on an idle machine; a loaded 2-core box gets some slack
    assert min(times) < 1.0, times


# ---- the environment ----------------------------------------------------------------------

@pytest.mark.parametrize("env,expect", [
    ({}, (None, None)),
    ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, (1, 3)),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, (0, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),
    ({"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "3", "PMI_SIZE": "4"}, (1, 2)),  # torchrun wins
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"}, (1, 2)),
])
def test_env_rank_world_reads_each_launcher(env, expect):
    assert env_rank_world(env) == expect


def test_env_local_rank_reads_each_launcher():
    assert env_local_rank({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)
    assert env_local_rank({"MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}) == (3, 4)
    assert env_local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}) == (0, None)
    assert env_local_rank({"SLURM_LOCALID": "2"}) == (2, None)


def test_a_malformed_variable_is_named():
    with pytest.raises(ValueError, match="PMI_RANK"):
        env_rank_world({"PMI_RANK": "one"})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        env_rank_world({"WORLD_SIZE": "0"})


FULL = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"])
def test_env_rendezvous_names_the_missing_variable(missing):
    env = {k: v for k, v in FULL.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        meet("env://", environ=env, timeout=1)


@pytest.mark.timeout(30)
def test_mpiexec_env_without_master_addr_says_what_is_needed():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        meet(environ={"PMI_RANK": "0", "PMI_SIZE": "2"}, timeout=1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,match", [
    ({"init_method": "tcp://127.0.0.1:29500", "world_size": 2}, "rank parameter missing"),
    ({"init_method": "tcp://127.0.0.1:29500", "rank": 0}, "world_size parameter missing"),
    ({"init_method": "tcp://127.0.0.1", "rank": 0, "world_size": 2}, "host:port"),
    ({"init_method": "file:///tmp/x", "rank": 0}, "world_size parameter missing"),
    ({"init_method": "tcp://127.0.0.1:1?rank=1", "rank": 0, "world_size": 2}, "rank=0.*rank=1"),
    ({"init_method": "tcp://127.0.0.1:1?rank=x", "world_size": 2}, "rank in the URL"),
    ({"init_method": "udp://a:1", "rank": 0, "world_size": 1}, "env://, tcp:// or file://"),
    ({"init_method": "tcp://127.0.0.1:0", "rank": 0, "world_size": 2}, "port is 0"),
    ({"init_method": "env://", "rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\)"),
    ({"rank": -3}, "rank must be"),
    ({"world_size": 0}, "world_size must be"),
    ({"store": HashStore(), "world_size": 2}, "rank must be given"),
    ({"store": HashStore(), "rank": 0}, "world_size must be given"),
    ({"store": HashStore(), "init_method": "env://", "rank": 0, "world_size": 1}, "mutually exclusive"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meet(environ={}, timeout=1, **kwargs)


@pytest.mark.timeout(30)
def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="store"):
        meet(store={}, rank=0, world_size=1)
    with pytest.raises(TypeError, match="rank"):
        meet("tcp://127.0.0.1:1", rank="0", world_size=1)
    with pytest.raises(TypeError, match="timeout"):
        meet("tcp://127.0.0.1:1", rank=0, world_size=1, timeout="10")


@pytest.mark.timeout(30)
def test_world_of_one_may_use_port_zero_and_returns_a_working_store():
    store, rank, world = meet("tcp://127.0.0.1:0", rank=0, world_size=1, timeout=5)
    assert (rank, world) == (0, 1) and store.port > 0
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()


@pytest.mark.timeout(30)
def test_file_rendezvous_of_one(tmp_path):
    store, rank, world = meet(f"file://{tmp_path}/f", rank=0, world_size=1, timeout=5)
    assert isinstance(store, FileStore) and store.timeout == timedelta(seconds=5)
    store.close()


@pytest.mark.timeout(30)
def test_a_missing_rank_times_out_on_every_side():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="1 of 2"):  # the master waits for the worker
        meet(f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=0.5)
    with pytest.raises(DistNetworkError, match=str(port)):  # a worker with no master
        meet(f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=0.5)
    assert time.monotonic() - t0 < 5


def meet_as_launched(ctx, port):
    """Rendezvous with the environment the real launcher gave this process."""
    assert "RANK" not in os.environ and "PMI_RANK" in os.environ
    environ = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store, rank, world = meet(timeout=20, environ=environ)
    store.set(f"key{rank}", f"value{rank}")
    got = store.multi_get([f"key{r}" for r in range(world)])
    _leave(store, rank, world)
    return rank, world, [g.decode() for g in got]


@pytest.mark.timeout(120)
def test_ranks_started_by_mpiexec_take_rank_and_size_from_it():
    if mpiexec_path() is None:
        pytest.skip("no mpiexec")
    pool = get_pool(3, launcher="mpiexec")
    results = pool.run(meet_as_launched, free_port(), timeout=60)
    assert sorted(r[:2] for r in results) == [(0, 3), (1, 3), (2, 3)]
    assert all(r[2] == ["value0", "value1", "value2"] for r in results)


# ---- torch.distributed's rendezvous() iterator and handler registry ------------------------------

@pytest.mark.timeout(30)
def test_rendezvous_yields_one_store_then_refuses_to_re_rendezvous(tmp_path):
    import collectives as dist
    for url in (f"file://{tmp_path}/f", f"tcp://127.0.0.1:{free_port()}"):
        it = dist.rendezvous(url, rank=0, world_size=1, timeout=timedelta(seconds=5))
        store, rank, world = next(it)
        assert (rank, world) == (0, 1)
        store.set("k", "v")
        assert store.get("k") == b"v"
        with pytest.raises(RuntimeError, match="re-rendezvous"):
            next(it)


@pytest.fixture
def scheme():
    """A fresh scheme name; its handler is unregistered afterwards."""
    import sys

    import collectives  # noqa: F401  (collectives.rendezvous is the function; the module:)
    handlers = sys.modules["collectives.store.rendezvous"]._handlers
    name = f"testscheme{len(handlers)}"
    yield name
    handlers.pop(name, None)


@pytest.mark.timeout(30)
def test_rendezvous_passes_rank_and_world_size_to_the_handler_in_the_query(scheme):
    import collectives as dist
    seen = []

    def handler(url, **kwargs):
        seen.append((url, kwargs))
        yield HashStore(), 1, 4

    dist.register_rendezvous_handler(scheme, handler)
    store, rank, world = next(dist.rendezvous(f"{scheme}://host/job?x=y", 1, 4, timeout=7))
    assert isinstance(store, HashStore) and (rank, world) == (1, 4)
    assert seen == [(f"{scheme}://host/job?x=y&rank=1&world_size=4", {"timeout": 7})]
    next(dist.rendezvous(f"{scheme}://host/job"))  # nothing to add: the url as given
    assert seen[-1] == (f"{scheme}://host/job", {})
    with pytest.raises(ValueError, match="node-specific arguments"):
        dist.rendezvous(f"{scheme}://h?rank=0", rank=0)
    with pytest.raises(ValueError, match=f"{scheme}:// already registered"):
        dist.register_rendezvous_handler(scheme, handler)
    with pytest.raises(ValueError, match="No rendezvous handler for nosuch://"):
        dist.rendezvous("nosuch://h")
    with pytest.raises(ValueError, match="scheme must be a URL scheme"):
        dist.register_rendezvous_handler("no scheme", handler)
    dashed = scheme + "-v2.x"  # any RFC 3986 scheme, as urlparse splits it off
    dist.register_rendezvous_handler(dashed, handler)
    try:
        assert next(dist.rendezvous(f"{dashed}://h", 1, 4))[1:] == (1, 4)
        assert seen[-1][0] == f"{dashed}://h?rank=1&world_size=4"
    finally:
        sys.modules["collectives.store.rendezvous"]._handlers.pop(dashed)
    with pytest.raises(TypeError, match="handler must be callable"):
        dist.register_rendezvous_handler(scheme + "x", None)
    with pytest.raises(TypeError, match="url must be a str"):
        dist.rendezvous(5)
    with pytest.raises(TypeError, match="rank must be an int"):
        dist.rendezvous(f"{scheme}://h", rank="0")


@pytest.mark.timeout(60)
@needs_gloo
def test_init_process_group_meets_through_a_registered_scheme(scheme):
    import numpy as np

    import collectives as dist
    calls = []

    def handler(url, timeout=None, **kwargs):
        calls.append((url, timeout))
        yield HashStore(), 0, 1

    dist.register_rendezvous_handler(scheme, handler)
    dist.init_process_group("gloo", init_method=f"{scheme}://job", rank=0, world_size=1,
                            timeout=timedelta(seconds=9))
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        x = np.arange(3.0)
        dist.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()
    assert calls == [(f"{scheme}://job?rank=0&world_size=1", timedelta(seconds=9))]


def test_the_module_keeps_torchs_path_and_dist_rendezvous_stays_the_function():
    """torch.distributed.rendezvous is a module and, on the package, the function: so here
    (the module lives in store/rendezvous.py; collectives.rendezvous names it too)."""
    import importlib

    import collectives as dist
    from collectives.store import rendezvous as module
    assert importlib.import_module("collectives.rendezvous") is module
    from collectives.rendezvous import register_rendezvous_handler
    assert register_rendezvous_handler is module.register_rendezvous_handler
    assert dist.rendezvous is module.rendezvous and callable(dist.rendezvous)
