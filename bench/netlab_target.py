"""One rank of bench/netlab.py's jobs: times collectives with ``collectives`` or torch gloo.

    netlab_target.py --impl collectives|torch --ops all_reduce,broadcast --sizes 4,1m \
        --budget 1.0 --out FILE

Started by collectives-run or torchrun (their environment). Per (op, size): two warm-up
calls, a calibration that sets the iteration count (rank 0's, broadcast) for --budget
seconds, then three timed loops after a barrier; a loop's time is the slowest rank's
(all_reduce MAX). Rank 0 writes {"rows": [{op, nbytes, us, samples}]} to --out.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np


def parse_size(s):
    s = s.strip().lower()
    mult = {"k": 1024, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def verify(dist, impl, rank, n, ops):
    """Each op once on rank-dependent data of odd sizes, against NumPy; the failures."""
    def conv(a):
        if impl == "torch":
            import torch
            return torch.from_numpy(a)
        return a

    bad = []
    for count in (1, 1001, 300007):
        data = [np.arange(count, dtype=np.float32) % 97 + q for q in range(n)]
        mine = data[rank]
        for op in ops:
            if op == "all_reduce":
                x = conv(mine.copy())
                dist.all_reduce(x)
                ok = np.array_equal(np.asarray(x), sum(data))
            elif op == "broadcast":
                x = conv(mine.copy())
                dist.broadcast(x, src=n - 1)
                ok = np.array_equal(np.asarray(x), data[n - 1])
            elif op == "all_gather":
                out = conv(np.empty(count * n, np.float32))
                dist.all_gather_into_tensor(out, conv(mine.copy()))
                ok = np.array_equal(np.asarray(out), np.concatenate(data))
            elif op == "reduce_scatter":
                full = [np.tile(d, n) for d in data]
                out = conv(np.empty(count, np.float32))
                dist.reduce_scatter_tensor(out, conv(full[rank]))
                ok = np.array_equal(np.asarray(out), sum(data))
            elif op == "all_to_all":
                src = np.concatenate([mine + 1000 * q for q in range(n)])
                out = conv(np.empty(count * n, np.float32))
                dist.all_to_all_single(out, conv(src))
                ok = np.array_equal(np.asarray(out),
                                    np.concatenate([data[q] + 1000 * rank for q in range(n)]))
            else:
                continue
            if not ok:
                bad.append(f"{op} count={count} rank={rank}")
    if impl == "collectives":  # the settings that follow a group spanning hosts
        from collectives import config
        from collectives.core.world import world
        from collectives.backends.tcp import _TUNING, placement_defaults
        be = world.default.backend
        tcp = getattr(be, "leaders", None) or be  # hierarchical: the leaders' group
        tuning = getattr(tcp, "tuning", None)
        if tuning is not None:
            # the engine's defaults (seg_split, 8, is the engine's alone), then the ones
            # placement_defaults sets across hosts; a setting in the environment wins
            want = {name: config.declared(_TUNING[name][0]).default for name in
                    ("allreduce_rd_max", "allreduce_hd_max", "allreduce_direct_world")}
            want["seg_split"] = 8
            want.update(placement_defaults(True, tcp.size))
            got = tuning()
            for name, value in want.items():
                env = _TUNING[name][0]
                if (env is None or os.environ.get(env) is None) and got[name] != value:
                    bad.append(f"rank {rank}: a group of {tcp.size} across hosts has {name} "
                               f"{got[name]}, not {value}")
    others = conv(np.array([float(len(bad))]))
    dist.all_reduce(others)
    others = int(np.asarray(others)[0]) - len(bad)
    if others:
        bad.append(f"{others} failed checks on other ranks")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("collectives", "torch"), required=True)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--verify", action="store_true",
                    help="first check each op's result against NumPy (odd sizes, rank data)")
    args = ap.parse_args()
    if args.impl == "torch":
        import torch
        import torch.distributed as dist

        def arr(n):
            return torch.ones(n, dtype=torch.float32)

        def scalar(x):
            return torch.tensor([x], dtype=torch.float64)

        def value(t):
            return float(t[0])
    else:
        import collectives as dist

        def arr(n):
            return np.ones(n, dtype=np.float32)

        def scalar(x):
            return np.array([x], dtype=np.float64)

        def value(t):
            return float(t[0])

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    MAX = dist.ReduceOp.MAX

    rows = []
    bad = verify(dist, args.impl, rank, n, args.ops.split(",")) if args.verify else []
    for op in args.ops.split(","):
        for size in args.sizes.split(","):
            nbytes = parse_size(size)
            count = max(1, nbytes // 4)
            if op == "all_reduce":
                x = arr(count)
                call = lambda x=x: dist.all_reduce(x)
            elif op == "broadcast":
                x = arr(count)
                call = lambda x=x: dist.broadcast(x, src=0)
            elif op == "all_gather":
                x, out = arr(count), arr(count * n)
                call = lambda x=x, out=out: dist.all_gather_into_tensor(out, x)
            elif op == "reduce_scatter":
                x, out = arr(count * n), arr(count)
                call = lambda x=x, out=out: dist.reduce_scatter_tensor(out, x)
            elif op == "all_to_all":
                per = max(1, count // n)
                x, out = arr(per * n), arr(per * n)
                call = lambda x=x, out=out: dist.all_to_all_single(out, x)
            else:
                raise SystemExit(f"unknown op {op!r}")
            call()
            call()
            dist.barrier()
            t0 = time.perf_counter()
            call()
            t = scalar(time.perf_counter() - t0)
            dist.all_reduce(t, op=MAX)
            iters = scalar(max(1, min(10000, int(args.budget / 3 / max(value(t), 1e-6)))))
            dist.broadcast(iters, src=0)
            iters = int(value(iters))
            samples = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                t = scalar((time.perf_counter() - t0) / iters)
                dist.all_reduce(t, op=MAX)
                samples.append(value(t) * 1e6)
            rows.append({"op": op, "nbytes": count * 4, "us": statistics.median(samples),
                         "samples": samples, "iters": iters, "world": n})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "bad": bad}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
