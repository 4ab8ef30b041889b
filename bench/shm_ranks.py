"""A group of shared-memory ranks for the benchmarks that drive the shm backend directly
(bench_stream.py, bench_allreduce_algos.py): the launcher that starts the script's
workers, and the backend each worker opens."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def open_backend():
    """In a worker: (backend, rank, world) of a fresh ShmBackend over this launch's store."""
    from datetime import timedelta

    from collectives.backends.shm import ShmBackend
    from collectives.store import TCPStore
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                     timeout=timedelta(seconds=60))
    return ShmBackend(store, rank, world, 60.0), rank, world


def launch(script, args, world, timeout, env=None, cpus=None):
    """Start ``world`` workers (``script --worker args``), rank r pinned to the r-th core
    of ``cpus`` (taskset) where given; returns the JSON lines they printed."""
    from collectives.run import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    cmd = [sys.executable, os.path.abspath(script), "--worker", *args]
    procs = [subprocess.Popen((["taskset", "-c", cpus[r % len(cpus)]] if cpus else []) + cmd,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    rows = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        rows += [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode:
            print(f"rank {r}: {err[-2000:]}", file=sys.stderr)
    return rows
