"""Time the tcp backend directly (TcpBackend on NumPy Buffers) against torch.distributed gloo.

Both run in the same worker processes, interleaved size by size, so the shared
machine's noise hits both alike; the table shows microseconds per call (rank 0,
median of ``--reps`` timed batches) and the ratio ours / gloo.

    python bench/bench_tcp.py --world 2 4 --ops all_reduce broadcast all_gather barrier
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [4, 1024, 64 * 1024, 1 << 20, 16 << 20]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, sync, agree, budget, reps):
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-6)
    iters = agree(max(3, min(2000, int(budget / reps / one))))  # every rank runs rank 0's count
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t) / iters)
    out.sort()
    return out[len(out) // 2]


def agreement(backend):
    """``agree(k)``: rank 0's ``k`` on every rank (a broadcast on ``backend``), so all ranks
    run the same number of timed calls."""
    import numpy as np

    from collectives.core.tensors import to_buffer
    cnt = np.zeros(1, np.int64)
    bcnt = to_buffer(cnt)

    def agree(k):
        cnt[0] = k
        backend.broadcast(bcnt, 0)
        return int(cnt[0])
    return agree


def worker(rank, world, port, tport, ops, sizes, budget, reps, with_torch):
    sys.path.insert(0, ROOT)
    import numpy as np

    from collectives.core import dtypes as D
    from collectives.backends.tcp import TcpBackend
    from collectives.store import TCPStore
    from collectives.core.tensors import to_buffer
    store = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    ours = TcpBackend(store, rank, world, 60.0)
    dist = None
    if with_torch:
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tport}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
    agree = agreement(ours)
    rows = []
    for op in ops:
        for nbytes in ([0] if op == "barrier" else sizes):
            n = max(1, nbytes // 4)
            a = np.ones(n, np.float32)
            out = np.empty(n * world, np.float32)
            ba, bo = to_buffer(a), to_buffer(out)
            fns = {
                "all_reduce": lambda ba=ba: ours.all_reduce(ba, D.SUM),
                "broadcast": lambda ba=ba: ours.broadcast(ba, 0),
                "all_gather": lambda ba=ba, bo=bo: ours.all_gather(bo, ba),
                "barrier": ours.barrier,
            }
            t_ours = _time(fns[op], ours.barrier, agree, budget, reps)
            t_torch = None
            if dist is not None:
                ta = torch.ones(n, dtype=torch.float32)
                touts = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
                tf = {
                    "all_reduce": lambda ta=ta: dist.all_reduce(ta),
                    "broadcast": lambda ta=ta: dist.broadcast(ta, 0),
                    "all_gather": lambda ta=ta, touts=touts: dist.all_gather(touts, ta),
                    "barrier": dist.barrier,
                }
                t_torch = _time(tf[op], dist.barrier, agree, budget, reps)
            rows.append((op, nbytes, t_ours, t_torch))
    ours.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    ours.shutdown()
    if dist is not None:
        dist.destroy_process_group()


def run_workers(cmd, world, port, env, timeout):
    """Run ``cmd --worker RANK WORLD PORT`` for every rank at once: (stdouts, exit codes);
    any rank still running at the timeout or on an error is killed."""
    procs = [subprocess.Popen(cmd + ["--worker", str(r), str(world), str(port)], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs, [p.returncode for p in procs]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ops", nargs="+", default=["all_reduce", "broadcast", "all_gather", "barrier"])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--worker", type=int, nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        rank, world, port = a.worker
        worker(rank, world, port, int(os.environ["BENCH_TPORT"]), a.ops, a.sizes,
               a.budget, a.reps, not a.no_torch)
        return
    print(f"{'world':>5} {'op':>11} {'bytes':>9} {'ours us':>10} {'gloo us':>10} {'ratio':>7}")
    for world in a.world:
        port, tport = free_port(), free_port()
        env = dict(os.environ, BENCH_TPORT=str(tport), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--ops", *a.ops, "--sizes", *map(str, a.sizes),
               "--budget", str(a.budget), "--reps", str(a.reps)] + (["--no-torch"] if a.no_torch else [])
        outs, codes = run_workers(cmd, world, port, env, timeout=900)
        line = next((ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"world {world}: no result (exit codes {codes})")
            continue
        for op, nbytes, t_ours, t_torch in json.loads(line[7:]):
            ratio = f"{t_ours / t_torch:7.3f}" if t_torch else "      -"
            tt = f"{t_torch * 1e6:10.1f}" if t_torch else "         -"
            print(f"{world:>5} {op:>11} {nbytes:>9} {t_ours * 1e6:10.1f} {tt} {ratio}", flush=True)


if __name__ == "__main__":
    main()
