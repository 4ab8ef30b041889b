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

from tests.ranks import CONFIGS, ROOT, available_configs, free_port

GROUP_TIMEOUT = 3.0
GRACE = 6.0  # "a few seconds" on a loaded 2-core machine
WORLD = 3
VICTIM = WORLD - 1  # not rank 0, which serves the store

# mpiexec aborts the whole job when one rank dies: that case belongs to MPI, not to us
FAULT_CONFIGS = [c for c in available_configs() if CONFIGS[c][1] == "spawn"]


def worker():
    """One rank: a collective that works, then the fault, then the collective that must fail."""
    from datetime import timedelta

    import numpy as np

    import collectives as dist
    mode, backend = os.environ["FAULT_MODE"], os.environ["FAULT_BACKEND"]
    if backend == "store":
        import tests.store_backend  # noqa: F401
    hosts = os.environ.get("COLLECTIVES_TEST_HOSTS")
    if hosts:  # gloo-hier: faked hosts, dealt out as tests/ranks.py does
        os.environ["COLLECTIVES_HOST_ID"] = f"host{int(os.environ['RANK']) % int(hosts)}"
    dist.init_process_group(backend, timeout=timedelta(seconds=GROUP_TIMEOUT))
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


def run_world(config, mode, op):
    backend, _, extra_env = CONFIGS[config]
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD),
                   FAULT_MODE=mode, FAULT_BACKEND=backend, FAULT_OP=op, OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_faults"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    try:
        for r, p in enumerate(procs):
            if r == VICTIM:
                continue
            out, err = p.communicate(timeout=120)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert lines, f"rank {r} printed no result (exit {p.returncode}):\n{out}\n{err}"
            results[r] = json.loads(lines[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return results


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


if __name__ == "__main__":
    worker()
