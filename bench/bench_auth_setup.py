"""What authentication costs: init_process_group time and small all_reduce latency, with
and without a job key, on the TCP transport (the one whose connections authenticate).

    python bench/bench_auth_setup.py --worlds 2,4 [--tree main=DIR]

Starts WORLD ranks on this host (env://, COLLECTIVES_TRANSPORT=tcp) that each set up
and destroy the default group ITERS times, each time on a fresh port: the setup time of
one iteration is the slowest rank's init_process_group. After each setup, 200 blocking
all_reduces of 1 float give a per-call latency (median over ranks' medians). ``--tree``
runs another checkout's package too (e.g. main's, for a before/after in the same run);
the configurations run in interleaved batches. Also prints what the handshake adds to
one store connection, measured in one process.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RANK_CODE = r"""
import json, os, sys, time
import numpy as np
import collectives as dist
ports = [int(p) for p in sys.argv[1].split(",")]
out = {"init": [], "allreduce_us": []}
x = np.ones(1, np.float32)
for port in ports:
    os.environ["MASTER_PORT"] = str(port)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=60)
    out["init"].append(time.perf_counter() - t0)
    dist.barrier()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    out["allreduce_us"].append(sorted(times)[len(times) // 2] * 1e6)
    dist.barrier()
    dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


def free_ports(n):
    sys.path.insert(0, ROOT)
    from collectives.run import free_port
    return [free_port() for _ in range(n)]


def run(world, iters, key, tree):
    ports = ",".join(map(str, free_ports(iters)))
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k != "COLLECTIVES_AUTH_KEY"}
        env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", COLLECTIVES_TRANSPORT="tcp", OMP_NUM_THREADS="1",
                   PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
        if key:
            env["COLLECTIVES_AUTH_KEY"] = key
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CODE, ports], env=env, cwd=tree,
                                      stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed (world {world})")
    inits = [max(o["init"][i] for o in outs) for i in range(iters)][1:]  # the first warms up imports
    lat = statistics.median(statistics.median(o["allreduce_us"]) for o in outs)
    return inits, lat


def handshake_cost(n=300):
    """Microseconds per store connection (connect, and the handshake with a key), median
    of ``n``, against a server in this process over loopback."""
    sys.path.insert(0, ROOT)
    import time

    from collectives.store import TCPStore
    out = {}
    for key in (None, b"k" * 64):
        master = TCPStore("127.0.0.1", 0, None, True, timeout=10, auth_key=key)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            c = TCPStore("127.0.0.1", master.port, timeout=10, auth_key=key)
            times.append(time.perf_counter() - t)
            c.close()
        master.close()
        out[key is not None] = statistics.median(times) * 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--iters", type=int, default=10, help="setups per batch")
    ap.add_argument("--rounds", type=int, default=3, help="batches per configuration, interleaved")
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=DIR: a checkout whose package to run too (e.g. main=/tmp/main)")
    args = ap.parse_args()
    trees = [("this", ROOT)] + [tuple(t.split("=", 1)) for t in args.tree]
    hs = handshake_cost()
    print(f"store connection, loopback: {hs[False]:.0f} us without a key, {hs[True]:.0f} us with "
          f"(handshake adds {hs[True] - hs[False]:.0f} us per connection)")
    print(f"{'tree':>8} {'world':>5} {'key':>4} {'init median ms':>15} {'init p25 ms':>12} "
          f"{'all_reduce 4 B us':>18}")
    for world in [int(w) for w in args.worlds.split(",")]:
        got = {}
        for _ in range(args.rounds):  # interleaved, so that the machine's load drifts evenly
            for label, tree in trees:
                for key in (None, "k" * 64):
                    inits, lat = run(world, args.iters, key, tree)
                    got.setdefault((label, key), ([], []))
                    got[(label, key)][0].extend(inits)
                    got[(label, key)][1].append(lat)
        for (label, key), (inits, lats) in got.items():
            inits = sorted(inits)
            print(f"{label:>8} {world:>5} {'yes' if key else 'no':>4} "
                  f"{statistics.median(inits) * 1e3:>15.2f} {inits[len(inits) // 4] * 1e3:>12.2f} "
                  f"{statistics.median(lats):>18.2f}", flush=True)


if __name__ == "__main__":
    main()
