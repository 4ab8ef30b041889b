"""The shared-memory all_reduce's algorithms side by side, and the copy+add floor.

usage: python bench/bench_allreduce_algos.py [--world 2] [--sizes 1048576,16777216]
                                             [--samples 20] [--budget 0.05] [--json F]

Above the one-shot size the shm backend's all_reduce runs two-shot with plain stores,
two-shot with streaming stores, or the single copy (process_vm_readv), and by default
("auto", COLLECTIVES_SHM_AR_ALGO) the ranks time the candidates on their own calls and
all take the fastest (collectives/engines/shm/shm_tune.c). This runs one group of --world ranks
and, for every sample, times each forced algorithm and auto in turn (rotating order;
every rank switches between barriers), plus the copy+add floor: every rank at once copying
2 (W - 1) / W of its buffer and adding 1 / W of it (numpy, in its own memory: what reduce-scatter plus
all-gather must do on each rank at least, without the transfers between cores), the
slowest rank's time. Each sample
is labelled near or far by the group's latency probes (rank 0's verdict at its end: far
when the peers' cache-line round trip is COLLECTIVES_SHM_FAR_NS or more), since the
project's VM moves its two vCPUs between the two states every few seconds to minutes;
the table gives medians per label, and auto's choice at the end of each sample.
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shm_ranks  # noqa: E402
# name -> (COLLECTIVES_SHM_AR_ALGO, COLLECTIVES_SHM_STREAM)
ALGOS = {"plain": ("two_shot", 0), "stream": ("two_shot", 1), "single": ("single_copy", 2),
         "auto": ("auto", 2)}


def worker(a):
    from collectives.core import dtypes as D
    from collectives.core.tensors import to_buffer
    be, rank, world = shm_ranks.open_backend()
    comm = be._comm

    def agree(x):
        v = np.array([x], np.float64)
        be.all_reduce(to_buffer(v), D.MAX)
        return float(v[0])

    def use(name):
        algo, stream = ALGOS[name]
        be.barrier()
        comm.set_ar_algo(algo)
        comm.set_stream(stream)
        be.barrier()

    for nbytes in (int(s) for s in a.sizes.split(",")):
        arr = np.ones(nbytes // 4, np.float32)
        other, scratch = np.ones_like(arr), np.empty_like(arr)
        buf = to_buffer(arr)
        # the floor: what reduce-scatter plus all-gather must do on each rank at least,
        # without a byte crossing between cores: copy 2 (W - 1) / W of the buffer and add
        # its own 1 / W once
        moved, own = arr.size * 2 * (world - 1) // world, arr.size // world
        use("auto")
        for _ in range(40):  # auto's first rounds, the probes' first verdicts
            be.all_reduce(buf, D.SUM)
        t0 = time.perf_counter()
        for _ in range(5):
            be.all_reduce(buf, D.SUM)
        iters = int(agree(max(8, int(a.budget / ((time.perf_counter() - t0) / 5)))))
        names = list(ALGOS) + ["floor"]
        for s in range(a.samples):
            us = {}
            for k in range(len(names)):
                name = names[(s + k) % len(names)]
                if name == "floor":
                    be.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        np.copyto(scratch[:moved], arr[:moved])
                        np.add(arr[:own], other[:own], out=arr[:own])
                    us[name] = agree((time.perf_counter() - t0) / iters * 1e6)
                    continue
                use(name)
                t0 = time.perf_counter()
                for _ in range(iters):
                    be.all_reduce(buf, D.SUM)
                us[name] = agree((time.perf_counter() - t0) / iters * 1e6)
                if name == "auto":
                    far, choice = comm.far, comm.ar_choice(nbytes)
            arr[:] = 1
            if rank == 0:
                print(json.dumps({"world": world, "bytes": nbytes, "far": far, "choice": choice,
                                  "us": us}), flush=True)
    be.shutdown()


def launch(a):
    return shm_ranks.launch(__file__, ["--sizes", a.sizes, "--samples", str(a.samples),
                                       "--budget", str(a.budget)], a.world, a.timeout,
                            cpus=a.cpus.split(",") if a.cpus else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="262144,1048576,16777216")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per algorithm per sample")
    ap.add_argument("--cpus", default="", help="pin rank r to the r-th of these cores (taskset)")
    ap.add_argument("--json", default=None, help="append the samples to this file")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    rows = launch(a)
    if a.json:
        with open(a.json, "a") as f:
            for row in rows:
                f.write(json.dumps(dict(row, cpus=a.cpus)) + "\n")
    groups = collections.defaultdict(list)
    for row in rows:
        groups[(row["bytes"], "far" if row["far"] else "near")].append(row)
    names = list(ALGOS) + ["floor"]
    print(f"world {a.world}: median us per call; samples labelled by the probes' verdict")
    print(f"{'size':>9}{'label':>6}{'n':>4}" + "".join(f"{n:>10}" for n in names)
          + f"{'auto/best':>10}{'auto/floor':>11}  auto chose")
    for (nbytes, label), samples in sorted(groups.items()):
        med = {n: statistics.median(s["us"][n] for s in samples) for n in names}
        best = min(med[n] for n in ("plain", "stream", "single"))
        chose = collections.Counter(s["choice"] for s in samples).most_common()
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"{size:>9}{label:>6}{len(samples):>4}" + "".join(f"{med[n]:10.1f}" for n in names)
              + f"{med['auto'] / best:10.2f}{med['auto'] / med['floor']:11.2f}  "
              + ", ".join(f"{c} {k}" for c, k in chose))


if __name__ == "__main__":
    main()
