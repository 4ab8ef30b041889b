"""Ranks on several hosts: the hierarchical mode against TCP across the whole group.

Each rank takes a faked host identity (COLLECTIVES_HOST_ID) from --hosts, so one
machine plays several hosts; the default backend then runs each collective in shared
memory within a host and over TCP among the host leaders (HierarchicalBackend). The
same ranks also hold a TcpBackend over the whole group (what every collective but
all_reduce used before), and both are timed in the same processes, alternating batch
by batch. On one machine the "network" is loopback, so this measures what the
hierarchical mode saves in steps and copies, not a real network's bandwidth.

    python bench/bench_hier.py --hosts a,a,b,b --ops all_reduce broadcast all_gather
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SIZES = [4, 1024, 64 * 1024, 1 << 20, 16 << 20]
OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
       "reduce_scatter", "barrier"]


def _time_pair(fns, sync, agree, budget, samples):
    """Median seconds per call of each of ``fns``, sampled alternately."""
    for fn in fns:
        for _ in range(2):
            fn()
    sync()
    t = time.perf_counter()
    fns[0]()
    one = max(time.perf_counter() - t, 1e-6)
    iters = agree(max(2, min(1000, int(budget / samples / len(fns) / one))))
    times = [[] for _ in fns]
    for _ in range(samples):
        for i, fn in enumerate(fns):
            sync()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            times[i].append((time.perf_counter() - t) / iters)
    return [sorted(ts)[len(ts) // 2] for ts in times]


def worker(rank, world, port, hosts, ops, sizes, budget, samples):
    import numpy as np

    from bench.bench_tcp import agreement
    from collectives.core import dtypes as D
    from collectives.backends.select import create_default_backend
    from collectives.backends.tcp import TcpBackend
    from collectives.store import PrefixStore, TCPStore
    from collectives.core.tensors import to_buffer
    os.environ["COLLECTIVES_HOST_ID"] = hosts[rank]
    store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    hier = create_default_backend(PrefixStore("hier", store), rank, world, 60.0)
    assert type(hier).__name__ == "HierarchicalBackend", type(hier).__name__
    flat = TcpBackend(PrefixStore("flat", store), rank, world, 60.0)
    agree = agreement(flat)
    root = world - 1  # on the last host, not rank 0's
    rows = []
    for op in ops:
        for nbytes in ([0] if op == "barrier" else sizes):
            n = max(1, nbytes // 4)
            a = to_buffer(np.ones(n, np.float32))
            big = to_buffer(np.ones(n * world, np.float32))
            out = to_buffer(np.empty(n, np.float32))

            def call(be, op=op, a=a, big=big, out=out):
                if op == "all_reduce":
                    be.all_reduce(a, D.SUM)
                elif op == "broadcast":
                    be.broadcast(a, root)
                elif op == "reduce":
                    be.reduce(a, D.SUM, root)
                elif op == "all_gather":
                    be.all_gather(big, a)
                elif op == "gather":
                    be.gather(big if rank == root else None, a, root)
                elif op == "scatter":
                    be.scatter(out, big if rank == root else None, root)
                elif op == "reduce_scatter":
                    be.reduce_scatter(out, big, D.SUM)
                else:
                    be.barrier()

            # every call ends in the same barrier (the hierarchical one, the quicker): a
            # rank's time is then the collective's, not how fast it can post its part and
            # move on (a root-less rank of a reduce over TCP returns once it has sent)
            t_hier, t_flat = _time_pair([lambda: (call(hier), hier.barrier()),
                                         lambda: (call(flat), hier.barrier())],
                                        flat.barrier, agree, budget, samples)
            rows.append((op, nbytes, t_hier, t_flat))
    flat.barrier()
    print("RESULT " + json.dumps(rows), flush=True)
    hier.shutdown()
    flat.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="a,a,b,b", help="host id of each rank, comma-separated")
    ap.add_argument("--ops", nargs="+", default=OPS)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per rank")
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per (op, size)")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", type=int, nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    hosts = a.hosts.split(",")
    if a.worker:
        worker(*a.worker, hosts, a.ops, a.sizes, a.budget, a.samples)
        return
    from bench.bench_tcp import run_workers
    from collectives.run import free_port
    world, port = len(hosts), free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--hosts", a.hosts, "--ops", *a.ops,
           "--sizes", *map(str, a.sizes), "--budget", str(a.budget), "--samples", str(a.samples)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("COLLECTIVES_TRANSPORT", None)
    outs, codes = run_workers(cmd, world, port, env, timeout=1200)
    lines = [next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None) for out in outs]
    if None in lines:
        sys.exit(f"no result (exit codes {codes})")
    per_rank = [json.loads(ln[7:]) for ln in lines]
    # a call ends on its slowest rank: each row takes the largest of the ranks' medians
    rows = [(r0[0], r0[1], max(pr[i][2] for pr in per_rank), max(pr[i][3] for pr in per_rank))
            for i, r0 in enumerate(per_rank[0])]
    print(f"hosts {a.hosts} (root: rank {world - 1}); microseconds per call and barrier (the "
          f"same barrier for both), the slowest rank's median")
    if a.markdown:
        print("| op | bytes/rank | hierarchical | TCP, whole group | ratio |")
        print("|---|---:|---:|---:|---:|")
    else:
        print(f"{'op':>15} {'bytes':>9} {'hier us':>10} {'tcp us':>10} {'ratio':>7}")
    for op, nbytes, t_h, t_f in rows:
        if a.markdown:
            print(f"| {op} | {nbytes} | {t_h * 1e6:.1f} | {t_f * 1e6:.1f} | {t_h / t_f:.2f} |")
        else:
            print(f"{op:>15} {nbytes:>9} {t_h * 1e6:10.1f} {t_f * 1e6:10.1f} {t_h / t_f:7.2f}")


if __name__ == "__main__":
    main()
