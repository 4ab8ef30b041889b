"""Segment stores of the shared-memory backend: plain, streaming and measured, side by side.

usage: python bench/bench_stream.py [--world 2] [--ops all_reduce,broadcast,reduce_scatter,...]
                                    [--sizes 1048576,16777216] [--samples 40] [--budget 0.05]

The shm backend writes what other ranks read from its part of the segment with plain
stores, with streaming (non-temporal) stores, or with whichever its latency probes call
for (COLLECTIVES_SHM_STREAM 0, 1, 2; see collectives/engines/shm/shm_copy.c, "near and far
peers"). This runs one group of --world ranks and, for every sample, times each of the
three modes in turn (rotating order; every rank switches modes between barriers); sizes
are each rank's buffer (reduce_scatter, all_to_all: its input; scatter: the root's).
Ops: all_reduce, broadcast, reduce_scatter, scatter, all_to_all, all_gather.
Broadcasts and all_gathers go through the segment (single copy off), and all_reduce is
always two-shot (COLLECTIVES_SHM_AR_ALGO=two_shot; bench_allreduce_algos.py times the
algorithms). Each sample is labelled with what
the measured mode's probes said on rank 0 at its end (far: the peers' cache-line round
trip is COLLECTIVES_SHM_FAR_NS or more), and the table gives medians per label: on this
project's VM the two vCPUs switch between close and far every few seconds to minutes, so
a run of a minute or two usually sees both.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shm_ranks  # noqa: E402

MODES = (0, 1, 2)
NAMES = {0: "plain", 1: "streaming", 2: "measured"}


def worker(a):
    from collectives.core import dtypes as D
    from collectives.core.tensors import to_buffer
    be, rank, world = shm_ranks.open_backend()
    comm = be._comm

    def agree(x):
        v = np.array([x], np.int64)
        be.broadcast(to_buffer(v), 0)
        return int(v[0])

    for op in a.ops.split(","):
        for nbytes in (int(s) for s in a.sizes.split(",")):
            arr = np.ones(max(world, nbytes // 4 // world * world), np.float32)
            buf, out = to_buffer(arr), to_buffer(np.empty(arr.size // world, np.float32))
            full, counts = to_buffer(np.empty_like(arr)), [arr.size // world] * world
            gathered = to_buffer(np.empty(arr.size * world, np.float32))
            call = {"all_reduce": lambda b=buf: be.all_reduce(b, D.SUM),
                    "broadcast": lambda b=buf: be.broadcast(b, 0),
                    "reduce_scatter": lambda b=buf, o=out: be.reduce_scatter(o, b, D.SUM),
                    "scatter": lambda b=buf, o=out: be.scatter(o, b if rank == 0 else None, 0),
                    "all_to_all": lambda b=buf, f=full, k=counts: be.all_to_all(f, b, k, k),
                    "all_gather": lambda b=buf, g=gathered: be.all_gather(g, b)}[op]
            for _ in range(20):  # the measured mode's first probes
                call()
            comm.set_stream(2)
            t0 = time.perf_counter()
            for _ in range(5):
                call()
            iters = agree(max(16, int(a.budget / ((time.perf_counter() - t0) / 5))))
            for s in range(a.samples):
                us = {}
                for k in range(len(MODES)):
                    mode = MODES[(s + k) % len(MODES)]
                    be.barrier()
                    comm.set_stream(mode)
                    be.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    us[mode] = (time.perf_counter() - t0) / iters * 1e6
                    if mode == 2:
                        far = comm.far
                if rank == 0:
                    print(json.dumps({"op": op, "bytes": nbytes, "far": far, "us": us}), flush=True)
    be.shutdown()


def launch(a):
    return shm_ranks.launch(__file__, ["--ops", a.ops, "--sizes", a.sizes, "--samples",
                                       str(a.samples), "--budget", str(a.budget)], a.world,
                            a.timeout, env={"COLLECTIVES_SHM_CMA_BCAST_MIN": "0",
                                            "COLLECTIVES_SHM_CMA_MIN": "0",
                                            "COLLECTIVES_SHM_AR_ALGO": "two_shot"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ops", default="all_reduce,broadcast")
    ap.add_argument("--sizes", default="1048576,16777216")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per mode per sample")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    groups = {}
    for row in launch(a):
        key = (row["op"], row["bytes"], "far" if row["far"] else "close")
        groups.setdefault(key, []).append(row["us"])
    print(f"world {a.world}: median us per call; samples labelled by the measured mode's verdict")
    print(f"{'op':<11}{'size':>9}{'label':>7}{'n':>4}" + "".join(f"{NAMES[m]:>11}" for m in MODES)
          + f"{'meas/plain':>12}{'meas/strm':>11}")
    for (op, nbytes, label), samples in sorted(groups.items()):
        med = {m: statistics.median(s[str(m)] for s in samples) for m in MODES}
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"{op:<11}{size:>9}{label:>7}{len(samples):>4}"
              + "".join(f"{med[m]:11.1f}" for m in MODES)
              + f"{med[2] / med[0]:12.2f}{med[2] / med[1]:11.2f}")


if __name__ == "__main__":
    main()
