#!/usr/bin/env python3
"""The host's memory bandwidth, one process alone and several at once: the bound that a
training step's communication meets on a host with no free core.

    python bench/bench_membw.py                      # 1 and 2 processes (and the cores)
    python bench/bench_membw.py --procs 1,2,4 --mib 64 --samples 20 --json out.json

Each process holds its own buffers of ``--mib`` MiB (larger than the last-level cache, so
that every pass reaches memory) and, between barriers, all processes run the same pass at
once: ``copy`` (``dst[:] = src``: reads N bytes, writes N) and ``add`` (``dst = a + b``:
reads 2N, writes N). A sample's bandwidth is the bytes the pass names (reads + writes,
the write-allocate reads not counted) over the slowest process's time; the table gives
medians, in total GB/s and per process.

What it is for: a collective's least traffic over this figure is the least time it can
take while the other cores are busy (bench/results/2026-11-29-train-steps-bound.md). At
world 2, DDP's all_reduce of G bytes must read each rank's gradient once and write the
sum into each once: 4G bytes in all, whatever the algorithm.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _worker(mib, samples, barrier, out):
    import numpy as np
    n = (mib << 20) // 4
    a, b, dst = (np.full(n, i + 1.0, np.float32) for i in range(3))
    passes = {"copy": (lambda: np.copyto(dst, a), 2),
              "add": (lambda: np.add(a, b, out=dst), 3)}
    times = {k: [] for k in passes}
    for _ in range(samples):
        for name, (fn, _) in passes.items():
            barrier.wait()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out.put(times)


def measure(procs, mib, samples):
    """{pass: (total GB/s, per-process GB/s)}, medians over samples of the slowest process."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(mib, samples, barrier, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    res = {}
    for name, mult in (("copy", 2), ("add", 3)):
        slowest = [max(g[name][i] for g in got) for i in range(samples)][1:]  # the first faults
        gbs = [mult * (mib << 20) * procs / t / 1e9 for t in slowest]
        med = statistics.median(gbs)
        res[name] = (med, med / procs)
    return res


def main(argv=None):
    ncpu = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default=",".join(str(p) for p in sorted({1, 2, ncpu})))
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    print(f"# {ncpu} cores, {a.mib} MiB a buffer, {a.samples} samples")
    print("procs  pass  total GB/s  per process GB/s")
    for procs in (int(p) for p in a.procs.split(",")):
        for name, (total, per) in measure(procs, a.mib, a.samples).items():
            print(f"{procs}  {name}  {total:.1f}  {per:.1f}", flush=True)
            rows.append({"procs": procs, "pass": name, "total_gbs": total, "per_proc_gbs": per})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ncpu": ncpu, "mib": a.mib, "samples": a.samples, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
