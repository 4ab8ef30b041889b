"""What the flight recorder costs a small blocking call: world 2 on shared memory, 1 float32,
NumPy arrays, timed per call (send_recv: per round trip), this tree against another (e.g.
the commit before the recorder) in alternating launches. ``--world 1`` times the same
calls on a one-rank group, where the backend's call does next to nothing: the front end's
own cost, timed as the calling thread's CPU time, which a loaded machine disturbs far less
than a two-rank exchange's wall time.

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
OPS = tuple(os.environ.get("FRB_OPS", "all_reduce,broadcast,barrier,send_recv").split(","))


def worker():
    import numpy as np

    import collectives as dist
    dist.init_process_group("gloo")
    n, samples = int(os.environ["FRB_N"]), int(os.environ["FRB_SAMPLES"])
    t = np.ones(1, np.float32)
    peer = 1 - dist.get_rank()
    if dist.get_world_size() == 1:
        def send_recv():
            pass
    elif dist.get_rank() == 0:
        def send_recv():  # a round trip: one send and one recv on each rank
            dist.send(t, peer)
            dist.recv(t, peer)
    else:
        def send_recv():
            dist.recv(t, peer)
            dist.send(t, peer)
    calls = {"all_reduce": lambda: dist.all_reduce(t), "broadcast": lambda: dist.broadcast(t, 0),
             "barrier": dist.barrier, "send_recv": send_recv}
    # one rank waits for nobody: the calling thread's CPU time is the call's cost, and other
    # processes on a loaded machine do not count in it
    clock = time.thread_time if dist.get_world_size() == 1 else time.perf_counter
    out = {}
    for op in OPS:
        fn = calls[op]
        for _ in range(n):  # warm up
            fn()
        times = []
        for _ in range(samples):
            dist.barrier()
            t0 = clock()
            for _ in range(n):
                fn()
            times.append((clock() - t0) / n * 1e6)
        out[op] = [statistics.median(times), min(times)]
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def launch(tree, n, samples, port, world):
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r), PYTHONPATH=tree, FRB_N=str(n),
                   FRB_SAMPLES=str(samples), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                      cwd=tree, stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads([ln for ln in out[0].splitlines() if ln.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the other tree (its collectives/ built in place)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=5000, help="calls per sample")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--world", type=int, default=2, choices=(1, 2),
                   help="1: one rank, the front end's cost alone (the backend's call does nothing)")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        return worker()
    if not a.base:
        p.error("--base is required")
    sys.path.insert(0, HERE)
    from collectives.run import free_port
    trees = {"base": os.path.abspath(a.base), "this": HERE}
    got = {k: {op: [] for op in OPS} for k in trees}
    for i in range(a.rounds):
        for k in (("base", "this") if i % 2 == 0 else ("this", "base")):
            res = launch(trees[k], a.n, a.samples, free_port(), a.world)
            for op in OPS:
                got[k][op].append(res[op])
    print(f"world {a.world}, shared memory, 1 float32, {a.rounds} launches x {a.samples} samples x {a.n} "
          f"calls (us per call): the median over launches of each launch's median sample, and "
          f"the fastest sample of all")
    print(f"{'op':<12}{'base':>9}{'this':>9}{'diff':>9}   {'min base':>9}{'min this':>9}{'diff':>9}")
    for op in OPS:
        b = statistics.median(x[0] for x in got["base"][op])
        t = statistics.median(x[0] for x in got["this"][op])
        bm = min(x[1] for x in got["base"][op])
        tm = min(x[1] for x in got["this"][op])
        print(f"{op:<12}{b:9.2f}{t:9.2f}{t - b:+9.2f}   {bm:9.2f}{tm:9.2f}{tm - bm:+9.2f}")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
