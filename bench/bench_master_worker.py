"""Master-worker mode against torch.distributed.rpc, in the same run, one host, 2 ranks.

usage: python bench/bench_master_worker.py [--rounds 3] [--reps 5] [--n 200] [--mib 16]
                                           [--impls mw,rpc,bcast,futures] [--transport auto|tcp]

Each implementation runs as its own pair of processes (rank 0 drives rank 1), in turn:

* mw: ``collectives.init_master_worker`` -- round trip of a no-op (``synchronize(0)``),
  round trip of a small tensor op copied back (``(x + 1).numpy()`` on 4 floats), queued
  in-place ops per second (``x += 1`` then one ``synchronize``), and copy-back bandwidth
  of a ``--mib`` MiB float32 tensor (``.numpy()``);
* rpc: ``torch.distributed.rpc`` (TensorPipe): ``rpc_sync`` of a no-op, ``remote`` of a
  small op + ``to_here()``, ``rpc_async`` throughput, and ``rpc_sync`` returning the
  ``--mib`` MiB tensor;
* futures: ``mpi4py.futures.MPIPoolExecutor`` under ``mpiexec -n 2 python -m
  mpi4py.futures`` (pickled calls over MPI): ``submit(noop).result()``, a small NumPy op,
  queued submits, and a call returning the ``--mib`` MiB array;
* bcast: the package's process-group ``broadcast`` of ``--mib`` MiB between the two ranks
  (the shared-memory path's bandwidth, the copy-back target's yardstick).

Each launch reports the median of ``--reps`` samples; the launches are repeated
``--rounds`` times, interleaved, and the table gives the median and the best of the
rounds, with the ratios the issue asks for.
Absolute times on shared machines are noise; the ratios are the result.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _timeit(fn, n, reps):
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def noop():
    return None


def add_one(t):
    return t + 1


def big_tensor(nbytes):
    import torch
    return torch.ones(nbytes // 4, dtype=torch.float32)


def run_mw(args):
    import collectives as dist
    import collectives.master_worker as mw
    dist.init_master_worker(backend="tcp", timeout=300, library="numpy")
    out = {}
    out["noop_rtt_us"] = _timeit(lambda: mw.synchronize(0), args.n, args.reps) * 1e6
    x = mw.ones(4, node=0)
    out["small_op_rtt_us"] = _timeit(lambda: (x + 1).numpy(), args.n, args.reps) * 1e6
    q = args.n * 20

    def queued():
        for _ in range(q):
            x.add_(1)
        mw.synchronize(0)
    out["queued_ops_per_s"] = q / (_timeit(queued, 1, args.reps))
    nbytes = args.mib << 20
    big = mw.ones(nbytes // 4, node=0)
    mw.synchronize(0)
    out["copy_back_gb_s"] = nbytes / _timeit(big.numpy, max(3, args.n // 20), args.reps) / 1e9
    print(json.dumps({"impl": "mw", **out}), flush=True)


def run_rpc(args):
    import torch
    import torch.distributed.rpc as rpc
    rank = int(os.environ["RANK"])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=300)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        out = {}
        out["noop_rtt_us"] = _timeit(lambda: rpc.rpc_sync("w1", noop), args.n, args.reps) * 1e6
        x = torch.ones(4)
        out["small_op_rtt_us"] = _timeit(lambda: rpc.remote("w1", add_one, (x,)).to_here(),
                                         args.n, args.reps) * 1e6
        q = args.n * 20

        def queued():
            futs = [rpc.rpc_async("w1", noop) for _ in range(q)]
            torch.futures.wait_all(futs)
        out["queued_ops_per_s"] = q / _timeit(queued, 1, args.reps)
        nbytes = args.mib << 20
        out["copy_back_gb_s"] = nbytes / _timeit(lambda: rpc.rpc_sync("w1", big_tensor, (nbytes,)),
                                                 max(3, args.n // 20), args.reps) / 1e9
        print(json.dumps({"impl": "rpc", **out}), flush=True)
    rpc.shutdown()


def big_array(nbytes):
    return np.ones(nbytes // 4, np.float32)


def run_futures(args):
    """mpi4py.futures: this rank (0) is the master of an MPIPoolExecutor whose worker is
    the job's other rank (``python -m mpi4py.futures``): pickled calls over MPI."""
    from mpi4py.futures import MPIPoolExecutor
    with MPIPoolExecutor() as ex:
        out = {}
        out["noop_rtt_us"] = _timeit(lambda: ex.submit(noop).result(), args.n, args.reps) * 1e6
        x = np.ones(4, np.float32)
        out["small_op_rtt_us"] = _timeit(lambda: ex.submit(add_one, x).result(), args.n,
                                         args.reps) * 1e6
        q = args.n * 20

        def queued():
            for f in [ex.submit(noop) for _ in range(q)]:
                f.result()
        out["queued_ops_per_s"] = q / _timeit(queued, 1, args.reps)
        nbytes = args.mib << 20
        out["copy_back_gb_s"] = nbytes / _timeit(lambda: ex.submit(big_array, nbytes).result(),
                                                 max(3, args.n // 20), args.reps) / 1e9
    print(json.dumps({"impl": "futures", **out}), flush=True)


def run_bcast(args):
    import collectives as dist
    dist.init_process_group("gloo")
    nbytes = args.mib << 20
    buf = np.ones(nbytes // 4, np.float32)
    dist.barrier()
    per = _timeit(lambda: dist.broadcast(buf, src=1), max(3, args.n // 20), args.reps)
    if dist.get_rank() == 0:
        print(json.dumps({"impl": "bcast", "bcast_gb_s": nbytes / per / 1e9}), flush=True)
    dist.destroy_process_group()


def launch(impl, args):
    from collectives.run import free_port
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE="2", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.transport != "auto":
        env["COLLECTIVES_TRANSPORT"] = args.transport
    me = [sys.executable, os.path.abspath(__file__), "--role", impl, "--n", str(args.n),
          "--reps", str(args.reps), "--mib", str(args.mib)]
    if impl == "futures":  # one mpiexec job of 2: rank 0 runs the script, rank 1 serves it
        mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable),
                                                          "mpiexec")
        procs = [subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py.futures"]
                                  + me[1:], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)]
    else:
        procs = [subprocess.Popen(me, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
    outs = ""
    for r, p in enumerate(procs):
        o, e = p.communicate(timeout=args.timeout)
        outs += o
        if p.returncode:
            print(f"{impl} rank {r}: {e[-2000:]}", file=sys.stderr)
    res = [json.loads(ln) for ln in outs.splitlines() if ln.startswith("{")]
    return res[0] if res else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["mw", "rpc", "bcast", "futures"])
    ap.add_argument("--impls", default="mw,rpc,bcast")
    ap.add_argument("--n", type=int, default=200, help="calls per sample (round trips)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved launches of each impl")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp"])
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.role:
        {"mw": run_mw, "rpc": run_rpc, "bcast": run_bcast, "futures": run_futures}[args.role](args)
        return
    rounds = {impl: [] for impl in args.impls.split(",")}
    for r in range(args.rounds):  # interleaved, so a change of load hits every impl alike
        for impl in rounds:
            got = launch(impl, args)
            print(f"round {r} {impl}: {got}", flush=True)
            if got:
                rounds[impl].append(got)
    for label, pick in (("median of rounds", statistics.median), ("best of rounds", None)):
        res = {}
        for impl, rs in rounds.items():
            if not rs:
                continue
            res[impl] = {}
            for k in rs[0]:
                if k == "impl":
                    continue
                vals = [x[k] for x in rs]
                better_low = k.endswith("_us")
                res[impl][k] = pick(vals) if pick else (min(vals) if better_low else max(vals))
        print(f"--- {label} ({args.rounds} rounds) ---")
        report(res, args)


def report(res, args):
    mwr, rpcr, bc = res.get("mw"), res.get("rpc"), res.get("bcast")
    if mwr and rpcr:
        print(f"no-op round trip      mw {mwr['noop_rtt_us']:9.1f} us   rpc_sync "
              f"{rpcr['noop_rtt_us']:9.1f} us   ratio {mwr['noop_rtt_us'] / rpcr['noop_rtt_us']:.3f}"
              " (target <= 0.2)")
        print(f"small op + copy back  mw {mwr['small_op_rtt_us']:9.1f} us   remote+to_here "
              f"{rpcr['small_op_rtt_us']:9.1f} us   ratio "
              f"{mwr['small_op_rtt_us'] / rpcr['small_op_rtt_us']:.3f}")
        print(f"queued ops            mw {mwr['queued_ops_per_s']:9.0f} /s   rpc_async "
              f"{rpcr['queued_ops_per_s']:9.0f} /s")
        print(f"copy back {args.mib} MiB      mw {mwr['copy_back_gb_s']:9.2f} GB/s rpc_sync "
              f"{rpcr['copy_back_gb_s']:9.2f} GB/s")
    fut = res.get("futures")
    if mwr and fut:
        print(f"no-op round trip      mw {mwr['noop_rtt_us']:9.1f} us   mpi4py.futures "
              f"{fut['noop_rtt_us']:9.1f} us   ratio {mwr['noop_rtt_us'] / fut['noop_rtt_us']:.3f}")
        print(f"small op + copy back  mw {mwr['small_op_rtt_us']:9.1f} us   mpi4py.futures "
              f"{fut['small_op_rtt_us']:9.1f} us   ratio "
              f"{mwr['small_op_rtt_us'] / fut['small_op_rtt_us']:.3f}")
        print(f"queued ops            mw {mwr['queued_ops_per_s']:9.0f} /s   mpi4py.futures "
              f"{fut['queued_ops_per_s']:9.0f} /s")
        print(f"copy back {args.mib} MiB      mw {mwr['copy_back_gb_s']:9.2f} GB/s mpi4py.futures "
              f"{fut['copy_back_gb_s']:9.2f} GB/s")
    if mwr and bc:
        print(f"copy back vs broadcast of {args.mib} MiB: {mwr['copy_back_gb_s']:.2f} / "
              f"{bc['bcast_gb_s']:.2f} GB/s = {mwr['copy_back_gb_s'] / bc['bcast_gb_s']:.2f} "
              "(target >= 0.5)")


if __name__ == "__main__":
    main()
