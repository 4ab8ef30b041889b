"""CUDA tensors: collectives' nccl backend against torch.distributed's ProcessGroupNCCL.

Both run in the same rank processes, on the same GPU(s), through the same libnccl, and
are timed alternately, sample by sample: what differs is the work around each NCCL call
(torch's C++ ProcessGroupNCCL against our Python front end and ctypes calls). Each
sample times ``iters`` calls then synchronises the device; the median per call is shown.

Where ranks outnumber GPUs (one GPU, world 2), each rank names a host of its own to NCCL
(NCCL_HOSTID), so both go through NCCL's socket transport on loopback: a check of the
per-call overhead at world > 1, not of GPU bandwidth.

    python bench/bench_nccl.py --world 1 --sizes 4 65536 16777216
    python bench/bench_nccl.py --profile --sizes 4      # where our time per call goes
"""
import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SIZES = [4, 64 * 1024, 1 << 20, 16 << 20, 256 << 20]
OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]


def _calls(dist, t, out, part):
    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, 0),
        "all_gather": lambda: dist.all_gather_into_tensor(out, t),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, out),
    }


def worker(rank, world, ports, ops, sizes, samples, budget):
    import torch
    import torch.distributed as tdist

    import collectives as cdist
    count = torch.cuda.device_count()
    torch.cuda.set_device(rank % count)
    if world > count:
        os.environ["NCCL_HOSTID"] = f"bench-nccl-{rank}"
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                             world_size=world, timeout=timedelta(seconds=120))
    cdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                             world_size=world, timeout=timedelta(seconds=120))
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        t = torch.ones(n, device="cuda")
        out = torch.ones(n * world, device="cuda")
        part = torch.empty(n, device="cuda")  # reduce_scatter: out's world blocks into one
        for op in ops:
            fns = [_calls(tdist, t, out, part)[op], _calls(cdist, t, out, part)[op]]
            for fn in fns:
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fns[0]()
            torch.cuda.synchronize()
            one = max(time.perf_counter() - start, 1e-6)
            # every rank must run the same number of calls: take rank 0's count
            box = torch.tensor([max(2, min(2000, int(budget / samples / 2 / one)))], device="cuda")
            tdist.broadcast(box, 0)
            iters = int(box.item())
            times = [[], []]
            for _ in range(samples):
                for i, fn in enumerate(fns):
                    torch.cuda.synchronize()
                    tdist.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    torch.cuda.synchronize()
                    times[i].append((time.perf_counter() - start) / iters)
            med = [sorted(ts)[len(ts) // 2] for ts in times]
            rows.append({"op": op, "bytes": n * 4, "torch_s": med[0], "ours_s": med[1]})
    cdist.destroy_process_group()
    tdist.destroy_process_group()
    return rows


def profile(ops, nbytes, calls=3000, top=14):
    """World 1, this process: each op ``calls`` times through collectives under cProfile; the
    functions with the most own time, per call (where the front end's time goes on CUDA)."""
    import cProfile
    import pstats

    import torch

    import collectives as cdist
    from collectives.run import free_port
    cdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                             world_size=1)
    n = max(1, nbytes // 4)
    t, out, part = (torch.ones(n, device="cuda"), torch.ones(n, device="cuda"),
                    torch.empty(n, device="cuda"))
    for op in ops:
        fn = _calls(cdist, t, out, part)[op]
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        plain = (time.perf_counter() - start) / calls
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        print(f"\n{op} {nbytes} B: {plain * 1e6:.1f} us per call unprofiled; own time per call:")
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (file, line, name), (_, nc, tt, _, _) in rows:
            print(f"  {tt / calls * 1e6:7.2f} us {nc / calls:5.1f}x  {name}  "
                  f"{os.path.basename(file)}:{line}")
    cdist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", action="store_true",
                   help="world 1 in this process: cProfile each op through collectives")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    p.add_argument("--sizes", nargs="+", type=int, default=SIZES, help="bytes per rank")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--budget", type=float, default=1.0, help="seconds per op and size")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_ports", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.profile:
        return profile(a.ops, a.sizes[0])
    if a._rank is not None:
        rows = worker(a._rank, a.world, a._ports.split(","), a.ops, a.sizes, a.samples, a.budget)
        if a._rank == 0:
            print("ROWS " + json.dumps(rows), flush=True)
        return
    from collectives.run import free_port
    ports = f"{free_port()},{free_port()}"
    env = dict(os.environ, COLLECTIVES_TORCH_BRIDGE="0")  # torch keeps its own default group
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    args = [sys.executable, os.path.abspath(__file__), "--world", str(a.world), "--ops", *a.ops,
            "--sizes", *map(str, a.sizes), "--samples", str(a.samples), "--budget", str(a.budget),
            "--_ports", ports]
    procs = [subprocess.Popen(args + ["--_rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(a.world)]
    out = procs[0].communicate()[0]
    for q in procs[1:]:
        q.wait()
    if any(q.returncode for q in procs):
        sys.exit(f"a rank failed: exit codes {[q.returncode for q in procs]}")
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])
    import torch
    print(f"world {a.world} on {torch.cuda.get_device_name(0)}, {a.samples} samples, median per call")
    print(f"{'op':<15}{'bytes':>11}{'torch nccl':>13}{'collectives':>13}{'ratio':>8}")
    for r in rows:
        print(f"{r['op']:<15}{r['bytes']:>11}{r['torch_s'] * 1e6:>11.1f}us{r['ours_s'] * 1e6:>11.1f}us"
              f"{r['ours_s'] / r['torch_s']:>8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
