"""A lost peer gives an error, not a hang.

Property: when a rank is killed mid-run, or never calls the collective, every
other rank's collective raises a DistError within the group timeout plus a few
seconds. Ranks are plain processes (so one can die without taking a harness
down), started with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.collective_cases import HAVE_TORCH
from tests.support.procs import json_results
from tests.support.ranks import CONFIGS, ROOT, available_configs, free_port

pytestmark = pytest.mark.faults

GROUP_TIMEOUT = 3.0
GRACE = 6.0  # "a few seconds" on a loaded 2-core machine
WORLD = 3
VICTIM = WORLD - 1  # not rank 0, which serves the store

# mpiexec aborts the whole job when one rank dies: that case belongs to MPI, not to us
FAULT_CONFIGS = [c for c in available_configs() if CONFIGS[c][1] == "spawn"]


def init_rank():
    """This rank's default group, from the FAULT_* environment (FAULT_INIT: the
    init_method, env:// when unset)."""
    from datetime import timedelta

    import collectives as dist
    backend = os.environ["FAULT_BACKEND"]
    if backend == "store":
        import tests.support.store_backend  # noqa: F401
    hosts = os.environ.get("COLLECTIVES_TEST_HOSTS")
    if hosts:  # gloo-hier: faked hosts, dealt out as tests/support/ranks.py does
        os.environ["COLLECTIVES_HOST_ID"] = f"host{int(os.environ['RANK']) % int(hosts)}"
    dist.init_process_group(backend, os.environ.get("FAULT_INIT"),
                            timeout=timedelta(seconds=GROUP_TIMEOUT))


def worker():
    """One rank: a collective that works, then the fault, then the collective that must fail."""
    import numpy as np

    import collectives as dist
    mode = os.environ["FAULT_MODE"]
    init_rank()
    rank = dist.get_rank()
    t = np.ones(1000, np.float32)
    dist.all_reduce(t)
    dist.barrier()
    assert t[0] == WORLD
    if rank == VICTIM:
        if mode == "kill":
            os._exit(17)
        time.sleep(GROUP_TIMEOUT + 30)  # never calls the collective
        os._exit(0)
    op = os.environ["FAULT_OP"]
    t0 = time.monotonic()
    try:
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "broadcast":
            dist.broadcast(t, VICTIM)
        elif op == "recv":
            dist.recv(t, VICTIM)
        elif op == "barrier":
            dist.barrier()
        elif op == "monitored_barrier":
            dist.monitored_barrier(timeout=GROUP_TIMEOUT)
        result = {"raised": None}
    except dist.DistError as e:
        result = {"raised": "DistError", "type": type(e).__name__, "msg": str(e)}
    except Exception as e:  # not the error we promise: report it
        result = {"raised": type(e).__name__, "msg": str(e)}
    result["elapsed"] = time.monotonic() - t0
    print(json.dumps(result), flush=True)
    os._exit(0)  # don't wait on a dead peer at exit


SHRINK_WORLD = 4


def shrink_worker():
    """One rank of a world that loses rank FAULT_VICTIM and goes on without it: the
    others' all_reduce raises, they shrink the default group, and the new world works
    (numbered 0..2, a subgroup of it too; with FAULT_TORCH, torch.distributed's default
    group is the new one)."""
    import numpy as np

    import collectives as dist
    if os.environ.get("FAULT_TORCH"):
        import torch
        import torch.distributed as td
    victim = int(os.environ["FAULT_VICTIM"])
    init_rank()
    rank = dist.get_rank()
    old_sub = dist.new_group(list(range(dist.get_world_size())))
    t = np.ones(1000, np.float32)
    dist.all_reduce(t)
    if rank == victim:
        os._exit(17)
    result = {}
    try:
        dist.all_reduce(t)
        result["first"] = "no error"
    except dist.DistError as e:
        result["first"] = type(e).__name__
    t0 = time.monotonic()
    try:
        g = dist.shrink_group([victim])
    except dist.DistError as e:  # the store died with its server, rank 0
        result.update(shrink=type(e).__name__, msg=str(e), shrink_s=time.monotonic() - t0)
        print(json.dumps(result), flush=True)
        os._exit(0)
    result["shrink_s"] = time.monotonic() - t0
    x = np.array([rank], np.int64)  # old ranks, summed over the new world
    dist.all_reduce(x)
    sub = dist.new_group([0, 2])
    y = np.array([rank], np.int64)
    if sub is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.all_reduce(y, group=sub)
    result.update(default=g is dist.group.WORLD, rank=dist.get_rank(), size=dist.get_world_size(),
                  sum=int(x[0]), sub=int(y[0]), old_sub_destroyed=old_sub.destroyed)
    if os.environ.get("FAULT_TORCH"):
        z = torch.full((2,), float(rank))
        td.all_reduce(z)
        result.update(torch_size=td.get_world_size(), torch_sum=z[0].item())
    store = dist.distributed_c10d._get_default_store()  # new rank 0 may serve it: it leaves last
    if dist.get_rank() != 0:
        store.add("done", 1)
    else:
        deadline = time.monotonic() + 20
        while store.add("done", 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    os._exit(0)


def run_world(config, mode, op, world=WORLD, victim=VICTIM, **extra):
    backend, _, extra_env = CONFIGS[config]
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   FAULT_MODE=mode, FAULT_BACKEND=backend, FAULT_OP=op, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env,
                   **extra)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.backends.test_faults"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return json_results(procs, 120, skip=(victim,))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", FAULT_CONFIGS)
@pytest.mark.parametrize("mode,op", [("kill", "all_reduce"), ("kill", "recv"), ("absent", "all_reduce"),
                                     ("absent", "broadcast"), ("absent", "barrier"),
                                     ("absent", "monitored_barrier")])
def test_other_ranks_raise_dist_error_within_the_timeout(config, mode, op):
    results = run_world(config, mode, op)
    for r, res in results.items():
        assert res["raised"] == "DistError", f"rank {r} ({mode}, {op}): {res}"
        # a killed peer may be noticed at once (closed socket); an absent one at the timeout
        assert res["elapsed"] < GROUP_TIMEOUT + GRACE, f"rank {r} took {res['elapsed']:.1f} s: {res}"
    if op == "monitored_barrier":  # rank 0 names the rank that did not arrive
        assert f"Rank {VICTIM} failed to pass monitoredBarrier" in results[0]["msg"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("config,victim,init", [(c, 1, "env") for c in FAULT_CONFIGS]
                         + [(c, 0, "file") for c in FAULT_CONFIGS if c == "gloo"])
def test_the_ranks_left_shrink_the_world_and_go_on(config, victim, init, tmp_path):
    """A middle rank dies (the ranks after it are renumbered), or rank 0 with a file://
    store, which outlives it."""
    extra = {"FAULT_TORCH": "1"} if config == "gloo" and HAVE_TORCH else {}
    if init == "file":
        extra["FAULT_INIT"] = f"file://{tmp_path / 'store'}"
    results = run_world(config, "shrink", "all_reduce", SHRINK_WORLD, victim,
                        FAULT_VICTIM=str(victim), **extra)
    stay = [r for r in range(SHRINK_WORLD) if r != victim]
    for r in stay:
        res = results[r]
        assert res["first"] in ("DistBackendError", "DistNetworkError", "DistError"), res
        assert res["shrink_s"] < GROUP_TIMEOUT + GRACE, res
        new = stay.index(r)
        assert (res["default"], res["rank"], res["size"], res["sum"]) == (True, new, 3, sum(stay)), res
        # the new world's ranks 0 and 2 are the old 0 and 3
        assert res["sub"] == (stay[0] + stay[2] if new in (0, 2) else r), res
        assert res["old_sub_destroyed"], res
        if extra.get("FAULT_TORCH"):
            assert (res["torch_size"], res["torch_sum"]) == (3, sum(stay)), res


@pytest.mark.timeout(120)
@pytest.mark.skipif("gloo" not in FAULT_CONFIGS, reason="needs the gloo configuration")
def test_shrinking_out_rank_0_raises_when_its_store_died_with_it():
    """With env:// rank 0 serves the store the stayers would meet through."""
    results = run_world("gloo", "shrink", "all_reduce", 3, 0, FAULT_VICTIM="0")
    for r in (1, 2):
        assert results[r]["shrink"] == "DistNetworkError", results[r]
        assert "rendezvous store, which rank 0 serves" in results[r]["msg"], results[r]
        assert results[r]["shrink_s"] < GROUP_TIMEOUT + GRACE, results[r]


if __name__ == "__main__":
    if os.environ.get("FAULT_MODE") == "shrink":
        shrink_worker()
    worker()
