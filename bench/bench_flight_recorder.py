"""What the flight recorder costs a small blocking call: world 2 on shared memory, 1 float32,
NumPy arrays, timed per call (send_recv: per round trip), this tree against another (e.g.
the commit before the recorder) in alternating launches.

    git archive BASE | tar -x -C /tmp/base && cp collectives/*.so /tmp/base/collectives/
    python bench/bench_flight_recorder.py --base /tmp/base --rounds 5

Prints, per op, the median over rounds of each tree's median per-call time and their
difference. Absolute times on a shared machine are noise; the difference within one run
is the figure.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("all_reduce", "broadcast", "barrier", "send_recv")


def worker():
    import numpy as np

    import collectives as dist
    dist.init_process_group("gloo")
    n, samples = int(os.environ["FRB_N"]), int(os.environ["FRB_SAMPLES"])
    t = np.ones(1, np.float32)
    peer = 1 - dist.get_rank()
    if dist.get_rank() == 0:
        def send_recv():  # a round trip: one send and one recv on each rank
            dist.send(t, peer)
            dist.recv(t, peer)
    else:
        def send_recv():
            dist.recv(t, peer)
            dist.send(t, peer)
    calls = {"all_reduce": lambda: dist.all_reduce(t), "broadcast": lambda: dist.broadcast(t, 0),
             "barrier": dist.barrier, "send_recv": send_recv}
    out = {}
    for op in OPS:
        fn = calls[op]
        for _ in range(n):  # warm up
            fn()
        times = []
        for _ in range(samples):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
        out[op] = statistics.median(times)
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def launch(tree, n, samples, port):
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE="2", LOCAL_RANK=str(r), PYTHONPATH=tree, FRB_N=str(n),
                   FRB_SAMPLES=str(samples), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                      cwd=tree, stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads([ln for ln in out[0].splitlines() if ln.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other tree (its collectives/ built in place)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=5000, help="calls per sample")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        return worker()
    sys.path.insert(0, HERE)
    from collectives.run import free_port
    trees = {"base": os.path.abspath(a.base), "this": HERE}
    got = {k: {op: [] for op in OPS} for k in trees}
    for i in range(a.rounds):
        for k in (("base", "this") if i % 2 == 0 else ("this", "base")):
            res = launch(trees[k], a.n, a.samples, free_port())
            for op in OPS:
                got[k][op].append(res[op])
    print(f"world 2, shared memory, 1 float32, median of {a.rounds} launches x {a.samples} "
          f"samples x {a.n} calls (us per call)")
    print(f"{'op':<12}{'base':>8}{'this':>8}{'diff':>8}")
    for op in OPS:
        b, t = statistics.median(got["base"][op]), statistics.median(got["this"][op])
        print(f"{op:<12}{b:8.2f}{t:8.2f}{t - b:+8.2f}")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
