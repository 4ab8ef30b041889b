"""Raw mpi4py against collectives in the same mpiexec job, loops alternating, for the ops
../shared/tools/bench_pair.py leaves out: gather, scatter, reduce (root 0), reduce_scatter,
all_to_all, and the in-place forms all_gather_in_place (FSDP2's: the input is this rank's
block of the output) and reduce_scatter_in_place (the output is this rank's block of the
input), MPI_IN_PLACE on the MPI side. Run under mpiexec (collectives' default backend on
one host is shm):

  mpiexec -n W PY bench/pair_ops.py [--ops gather,scatter,...] [--sizes 4,65536,...]
                                    [--samples 9] [--budget 0.3] [--json F]

Sizes are bytes per rank's block (gather: each rank's input; scatter: each rank's output;
reduce: the buffer; reduce_scatter: each rank's output; all_to_all: each block;
the in-place forms: each rank's block). Rank 0 prints one JSON line per (op, bytes): both
medians (us) and the median of the per-sample ratios collectives/mpi4py.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

ap = argparse.ArgumentParser()
ap.add_argument("--ops", default="gather,scatter,reduce,reduce_scatter,all_to_all")
ap.add_argument("--sizes", default="4,65536,262144,1048576,4194304")
ap.add_argument("--samples", type=int, default=9)
ap.add_argument("--budget", type=float, default=0.3, help="seconds per (op, size, impl)")
ap.add_argument("--json", default=None)
a = ap.parse_args()

comm = MPI.COMM_WORLD
rank, world = comm.rank, comm.size
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                  LOCAL_WORLD_SIZE=str(world))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    os.environ["MASTER_PORT"] = str(comm.bcast(
        21000 + (os.getpid() % 10000) if rank == 0 else None, root=0))
import collectives as dist  # noqa: E402

dist.init_process_group("gloo")


def buffers(op, n):
    """(small, big): the per-rank block and the world-block buffer of ``op``."""
    big = np.ones(n * world, np.float32)
    if op.endswith("_in_place"):  # this rank's block of the world-block buffer
        return big[rank * n:(rank + 1) * n], big
    return np.ones(n, np.float32), big


def raw(op, small, big):
    if op == "gather":
        comm.Gather(small, big if rank == 0 else None, root=0)
    elif op == "scatter":
        comm.Scatter(big if rank == 0 else None, small, root=0)
    elif op == "reduce":
        comm.Reduce(MPI.IN_PLACE if rank == 0 else small, small if rank == 0 else None, root=0)
    elif op == "reduce_scatter":
        comm.Reduce_scatter_block(big, small)
    elif op == "all_gather_in_place":
        comm.Allgather(MPI.IN_PLACE, big)
    elif op == "reduce_scatter_in_place":  # (MPI leaves the result in the first block)
        comm.Reduce_scatter_block(MPI.IN_PLACE, big)
    else:
        comm.Alltoall(big, _a2a_out)


def ours(op, small, big):
    if op == "gather":
        dist.gather(small, list(big.reshape(world, -1)) if rank == 0 else None, dst=0)
    elif op == "scatter":
        dist.scatter(small, list(big.reshape(world, -1)) if rank == 0 else None, src=0)
    elif op == "reduce":
        dist.reduce(small, dst=0)
    elif op in ("reduce_scatter", "reduce_scatter_in_place"):  # (buffers() makes the alias)
        dist.reduce_scatter_tensor(small, big)
    elif op == "all_gather_in_place":
        dist.all_gather_into_tensor(big, small)
    else:
        dist.all_to_all_single(_a2a_out, big)


def loop(fn, op, small, big, iters):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(op, small, big)
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX) / iters * 1e6


rows = []
for op in a.ops.split(","):
    for nbytes in (int(s) for s in a.sizes.split(",")):
        small, big = buffers(op, max(1, nbytes // 4))
        _a2a_out = np.empty_like(big)
        for fn in (raw, ours):
            for _ in range(3):
                fn(op, small, big)
        per = max(loop(raw, op, small, big, 3), loop(ours, op, small, big, 3)) / 1e6
        iters = comm.bcast(max(3, min(20000, int(a.budget / a.samples / per))), root=0)
        t_raw, t_ours, ratios = [], [], []
        for s in range(a.samples):
            pair = (raw, ours) if s % 2 == 0 else (ours, raw)
            got = {fn: loop(fn, op, small, big, iters) for fn in pair}
            t_raw.append(got[raw])
            t_ours.append(got[ours])
            ratios.append(got[ours] / got[raw])
        if rank == 0:
            row = {"world": world, "op": op, "bytes": nbytes, "backend": "gloo",
                   "mpi": MPI.Get_library_version().split()[0],
                   "mpi4py_us": statistics.median(t_raw),
                   "collectives_us": statistics.median(t_ours), "ratio": statistics.median(ratios)}
            rows.append(row)
            print(json.dumps(row), flush=True)
if rank == 0 and a.json:
    with open(a.json, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
dist.destroy_process_group()
