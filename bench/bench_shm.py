"""Shared-memory backend vs raw mpi4py (MPICH), in the same run, on NumPy buffers.

usage: python bench/bench_shm.py [--worlds 2,4] [--ops all_reduce,broadcast,all_gather,barrier]
                                 [--sizes 4,64,...] [--budget 0.5] [--impls shm,mpi4py]
                                 [--stat median|min] [--cpus 0,1]

Each implementation runs as its own set of ranks (ours spawned with a TCPStore
rendezvous, mpi4py under mpiexec), in turn, so drift hits both alike. Rank 0
prints the median microseconds per call of 5 samples; the table gives both,
the ratio ours/mpi4py and the bus bandwidth (nccl-tests' definition).
Environment knobs of the shm backend (COLLECTIVES_SHM_*) pass through.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SIZES = "4,64,1024,16384,65536,262144,1048576,4194304,16777216"
BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0,
         "all_gather": lambda n: (n - 1) / n, "barrier": lambda n: 0.0}


def worker():
    cpus = os.environ.get("BENCH_CPUS")
    if cpus:  # rank r on cpus[r % len]: e.g. "0" puts every rank on one core
        cpus = [int(c) for c in cpus.split(",")]
        rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    impl = os.environ["IMPL"]
    ops = os.environ["OPS"].split(",")
    sizes = [int(s) for s in os.environ["SIZES"].split(",")]
    budget = float(os.environ["BUDGET_S"])
    if impl == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, world = comm.rank, comm.size

        def run(op, buf, out):
            if op == "all_reduce":
                comm.Allreduce(MPI.IN_PLACE, buf)
            elif op == "broadcast":
                comm.Bcast(buf, root=0)
            elif op == "all_gather":
                comm.Allgather(buf, out)
            else:
                comm.Barrier()
        sync = comm.Barrier

        def bcast_int(x):
            return comm.bcast(x, root=0)
        close = None
    else:
        from datetime import timedelta

        from collectives.core import dtypes as D
        from collectives.backends.select import create_default_backend
        from collectives.store import TCPStore
        from collectives.core.tensors import to_buffer
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                         timeout=timedelta(seconds=60))
        be = create_default_backend(store, rank, world, 60.0)
        bufs = {}

        def run(op, buf, out):
            b = bufs.get(id(buf))
            if b is None:
                b = bufs[id(buf)] = (to_buffer(buf), to_buffer(out) if out is not None else None)
            if op == "all_reduce":
                be.all_reduce(b[0], D.SUM)
            elif op == "broadcast":
                be.broadcast(b[0], 0)
            elif op == "all_gather":
                be.all_gather(b[1], b[0])
            else:
                be.barrier()
        sync = be.barrier

        def bcast_int(x):
            a = np.array([x], np.int64)
            be.broadcast(to_buffer(a), 0)
            return int(a[0])
        close = be.shutdown

    for op in ops:
        for nbytes in sizes if op != "barrier" else [0]:
            buf = np.ones(max(1, nbytes // 4), np.float32)
            out = np.ones(buf.size * world, np.float32) if op == "all_gather" else None
            for _ in range(3):
                run(op, buf, out)
            sync()
            k = 5
            t0 = time.perf_counter()
            for _ in range(k):
                run(op, buf, out)
            per = (time.perf_counter() - t0) / k
            iters = bcast_int(max(3, min(20000, int(budget / 5 / per))))
            samples = []
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    run(op, buf, out)
                samples.append((time.perf_counter() - t0) / iters * 1e6)
            if rank == 0:
                print(json.dumps({"impl": impl, "op": op, "bytes": nbytes, "world": world,
                                  "us": statistics.median(samples), "us_min": min(samples)}),
                      flush=True)
    if close:
        close()


def launch(impl, world, args):
    env = dict(os.environ, IMPL=impl, OPS=args.ops, SIZES=args.sizes, BUDGET_S=str(args.budget),
               BENCH_CPUS=args.cpus or "",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = [sys.executable, os.path.abspath(__file__), "--worker"]
    if impl == "mpi4py":
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.path.exists(mpiexec):
            mpiexec = shutil.which("mpiexec") or "mpiexec"
        p = subprocess.run([mpiexec, "-n", str(world)] + me, env=env, capture_output=True,
                           text=True, timeout=args.timeout)
        outs = p.stdout
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)
    else:
        from collectives.run import free_port
        port = free_port()
        procs = [subprocess.Popen(me, env=dict(env, RANK=str(r), WORLD_SIZE=str(world),
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = ""
        for r, p in enumerate(procs):
            o, e = p.communicate(timeout=args.timeout)
            outs += o
            if p.returncode:
                print(f"rank {r}: {e[-2000:]}", file=sys.stderr)
    return [json.loads(ln) for ln in outs.splitlines() if ln.startswith("{")]


def fmt_bytes(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,barrier")
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--impls", default="shm,mpi4py")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--cpus", default=None,
                    help="pin rank r to CPU cpus[r %% len], e.g. 0 (every rank on one core) or 0,1")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="median of the 5 samples (default) or the best one (for busy machines)")
    args = ap.parse_args()
    if args.worker:
        return worker()
    impls = args.impls.split(",")
    for world in [int(w) for w in args.worlds.split(",")]:
        res = {}
        for impl in impls:
            for row in launch(impl, world, args):
                res[(impl, row["op"], row["bytes"])] = row["us" if args.stat == "median" else "us_min"]
        print(f"\nworld {world} ({args.stat} of 5 samples)")
        print(f"{'op':<11}{'size':>9}" + "".join(f"{i + ' us':>13}" for i in impls)
              + f"{'ratio':>8}{'busbw GB/s':>12}")
        for op in args.ops.split(","):
            for nbytes in [int(s) for s in args.sizes.split(",")] if op != "barrier" else [0]:
                row = [res.get((i, op, nbytes)) for i in impls]
                cells = "".join(f"{v:13.1f}" if v else f"{'-':>13}" for v in row)
                ratio = row[0] / row[1] if len(row) > 1 and row[0] and row[1] else float("nan")
                bw = BUSBW[op](world) * nbytes / (row[0] * 1e-6) / 1e9 if row[0] else 0.0
                print(f"{op:<11}{fmt_bytes(nbytes):>9}{cells}{ratio:8.2f}{bw:12.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
