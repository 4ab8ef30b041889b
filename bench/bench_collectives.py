#!/usr/bin/env python3
"""Collective benchmark: collectives against torch.distributed (gloo) and raw mpi4py, in one run.

    python bench/bench_collectives.py                       # everything, worlds 2 and 4
    python bench/bench_collectives.py --impls mpi4py,collectives:mpi --worlds 2 --markdown

Implementations (``--impls``, any subset, comma-separated):

    torch:gloo        torch.distributed with its gloo backend (torch tensors)
    mpi4py            raw mpi4py on NumPy arrays (comm.Allreduce(MPI.IN_PLACE, a), ...)
    collectives:gloo  ``import collectives as dist``; init_process_group('gloo')
    collectives:mpi   ``import collectives as dist``; init_process_group('mpi') under mpiexec
    backend:mpi       our mpi Backend called directly on Buffers (no front end): where the
                      per-call time of collectives:mpi goes

For every world size, ``--rounds`` rounds each launch every implementation once, in
turn (round-robin), so drift on a shared machine hits all alike. Every launch times
each (op, size): warm-up, an iteration count chosen on rank 0 for ``--budget``
seconds, then ``--samples`` timed loops (barrier before each). Implementations
launched together (the MPI-launched ones, and the gloo ones) interleave their timed
loops, sample by sample. The table shows rank 0's median microseconds per call over
all samples of all rounds.

Sizes are bytes per rank of float32 data (all_gather: each rank's input; its output
is world times larger; reduce_scatter, only with --ops: each rank's output, its input
world times larger). Bus bandwidth follows nccl-tests: all_reduce 2(n-1)/n * S/t,
broadcast S/t, all_gather and reduce_scatter (n-1) * S/t (S = per-rank bytes); barrier
has none.
Ratios are collectives / baseline, below 1 is faster: the median of per-sample
ratios where the two ran side by side in the same launch (collectives:mpi vs
mpi4py, collectives:gloo vs torch:gloo), else the ratio of medians. The mpi
backend's targets (<= 1.1x mpi4py at >= 64 KiB, <= +2 us at 4 B) are checked the
same way, with the median per-sample difference for the 4-byte cases.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import timedelta

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ALL_IMPLS = ["torch:gloo", "mpi4py", "collectives:gloo", "collectives:mpi"]
EXTRA_IMPLS = ["backend:mpi"]
OPS = ["all_reduce", "broadcast", "all_gather", "barrier"]
EXTRA_OPS = ["reduce_scatter"]  # on request (--ops): the default table keeps its four
SIZES = [4, 1024, 65536, 1 << 20, 16 << 20]
BASELINES = ["torch:gloo", "mpi4py"]


def busbw_gbs(op, world, nbytes, us):
    """Bus bandwidth in GB/s (nccl-tests conventions); None for barrier."""
    if op == "barrier" or us <= 0:
        return None
    factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0,
              "all_gather": float(world - 1), "reduce_scatter": float(world - 1)}[op]
    return factor * nbytes / us / 1e3


# ---- the worker: one rank of one implementation ---------------------------------------

class Impl:
    """``run(op, buf, out)`` one call, ``barrier()``, ``agree(int)`` rank 0's int everywhere."""

    def __init__(self, spec, tensor_kind):
        self.spec = spec
        if spec == "mpi4py":
            self._init_mpi4py()
        elif spec == "backend:mpi":
            self._init_backend()
        else:
            impl, _, backend = spec.partition(":")
            self._init_dist(impl, backend or "gloo", tensor_kind)

    def _init_mpi4py(self):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        in_place = MPI.IN_PLACE
        self.wrap = lambda arr: arr
        self.ops = {
            "all_reduce": lambda b, o: comm.Allreduce(in_place, b),
            "broadcast": lambda b, o: comm.Bcast(b, 0),
            "all_gather": lambda b, o: comm.Allgather(b, o),
            "reduce_scatter": lambda b, o: comm.Reduce_scatter_block(o, b, MPI.SUM),
            "barrier": lambda b, o: comm.Barrier(),
        }
        self.barrier = comm.Barrier
        self.agree = lambda x: comm.bcast(x, 0)
        self.close = lambda: None

    def _init_backend(self):

        from collectives.core import dtypes as D
        from collectives.backends.mpi import create_mpi_backend, world_rank_size
        from collectives.core.tensors import Buffer
        self.rank, self.world = world_rank_size()
        be = create_mpi_backend(None, self.rank, self.world, 300.0)

        self.wrap = lambda arr: Buffer(arr.__array_interface__["data"][0], arr.size, D.FLOAT32, -1, arr)
        self.ops = {
            "all_reduce": lambda b, o: be.all_reduce(b, D.SUM),
            "broadcast": lambda b, o: be.broadcast(b, 0),
            "all_gather": lambda b, o: be.all_gather(o, b),
            "reduce_scatter": lambda b, o: be.reduce_scatter(b, o, D.SUM),
            "barrier": lambda b, o: be.barrier(),
        }
        self.barrier = be.barrier

        def agree(x):
            b = Buffer(0, 1, D.INT64)
            arr = np.array([x], np.int64)
            b.ptr, b.obj = arr.__array_interface__["data"][0], arr
            be.broadcast(b, 0)
            return int(arr[0])

        self.agree = agree
        self.close = be.shutdown

    def _init_dist(self, impl, backend, tensor_kind):
        if impl == "torch":
            import torch
            import torch.distributed as dist
            torch.set_num_threads(1)
            self.wrap = torch.from_numpy
            agree_buf = lambda x: torch.tensor([x], dtype=torch.int64)
        elif impl == "collectives":
            import collectives as dist
            if tensor_kind == "torch":
                import torch
                torch.set_num_threads(1)
                self.wrap = torch.from_numpy
                agree_buf = lambda x: torch.tensor([x], dtype=torch.int64)
            else:
                self.wrap = lambda arr: arr
                agree_buf = lambda x: np.array([x], np.int64)
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        if backend == "mpi":
            dist.init_process_group("mpi")
        else:  # each gloo gets its own rendezvous port: torch's and ours share the processes
            port = os.environ["BENCH_PORT_TORCH" if impl == "torch" else "BENCH_PORT_COLLECTIVES"]
            rank, world = rank_world()
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=300))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        gather = getattr(dist, "all_gather_into_tensor", None)
        self.ops = {
            "all_reduce": lambda b, o: dist.all_reduce(b),
            "broadcast": lambda b, o: dist.broadcast(b, 0),
            "all_gather": (lambda b, o: gather(o, b)) if gather is not None
            else (lambda b, o: dist.all_gather(list(o.reshape(self.world, -1)), b)),
            "reduce_scatter": lambda b, o: dist.reduce_scatter_tensor(b, o),
            "barrier": lambda b, o: dist.barrier(),
        }
        self.barrier = dist.barrier

        def agree(x):
            t = agree_buf(x)
            dist.broadcast(t, 0)
            return int(t[0])

        self.agree = agree
        self.close = dist.destroy_process_group


def rank_world():
    """This rank and the world size, from mpiexec's or our launcher's environment."""
    for rk, wk in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                   ("RANK", "WORLD_SIZE")):
        if os.environ.get(rk) and os.environ.get(wk):
            return int(os.environ[rk]), int(os.environ[wk])
    return 0, 1


def time_family(impls, op, nbytes, budget, samples):
    """{spec: (us per call of each sample, iterations)} for ``op`` on ``nbytes`` per rank (rank 0).

    Every implementation is warmed up and calibrated, then the timed loops interleave:
    sample k runs each implementation once, starting from a rotating position.
    """
    n = max(1, nbytes // 4)
    # one allocation that every implementation wraps: MPI's large-message path caches
    # per-buffer state, so separate arrays favoured whichever was allocated first
    base = np.ones(n, np.float32)  # written pages, as a real input (zeros stay unfaulted)
    # all_gather's output, reduce_scatter's input (world blocks of ones)
    base_out = (np.zeros if op == "all_gather" else np.ones)(n * impls[0].world, np.float32) \
        if op in ("all_gather", "reduce_scatter") else None
    runs = []
    for impl in impls:
        buf = impl.wrap(base)
        out = impl.wrap(base_out) if base_out is not None else None
        call = impl.ops[op]
        for _ in range(3):
            call(buf, out)
        impl.barrier()
        # calibrate: every rank runs the same number of calls; rank 0 decides when to stop
        k = 1
        while True:
            t0 = time.perf_counter()
            for _ in range(k):
                call(buf, out)
            per_call = (time.perf_counter() - t0) / k
            if impl.agree(int(per_call * k >= budget / 20 or k >= 4096)):
                break
            k *= 4
        iters = impl.agree(max(3, min(50000, int(budget / samples / per_call))))
        runs.append((impl, call, buf, out, iters, []))
    for s in range(samples):
        for j in range(len(runs)):
            impl, call, buf, out, iters, times = runs[(s + j) % len(runs)]
            impl.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call(buf, out)
            times.append((time.perf_counter() - t0) / iters * 1e6)
    return {impl.spec: (times, iters) for impl, _, _, _, iters, times in runs}


def worker(a):
    impls = [Impl(spec, a.tensor) for spec in a.worker.split(",")]
    rank, world = impls[0].rank, impls[0].world
    for op in a.ops.split(","):
        for nbytes in ([0] if op == "barrier" else [int(s) for s in a.sizes.split(",")]):
            res = time_family(impls, op, nbytes, a.budget, a.samples)
            if rank == 0:
                for spec, (times, iters) in res.items():
                    print(json.dumps({"impl": spec, "op": op, "bytes": nbytes, "world": world,
                                      "us": statistics.median(times), "samples": times,
                                      "iters": iters}), flush=True)
    for impl in impls:
        impl.barrier()
    for impl in reversed(impls):
        impl.close()


# ---- the driver -----------------------------------------------------------------------

def free_port():
    from collectives.run import free_port as pick  # below the ephemeral range: no race
    return pick()


def mpiexec_path():
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


MPI_FAMILY = ("mpi4py", "backend:mpi", "collectives:mpi")


def families(impls, separate, gloo_with_mpi=False):
    """Implementations that share processes: MPI-launched ones, and the gloo ones
    (with ``gloo_with_mpi``, collectives:gloo runs in the mpiexec job instead)."""
    if separate:
        return [[s] for s in impls]
    mpi = [s for s in impls if s in MPI_FAMILY]
    rest = [s for s in impls if s not in MPI_FAMILY]
    if gloo_with_mpi and "collectives:gloo" in rest:
        rest.remove("collectives:gloo")
        # one default group per process: collectives:gloo gets a job of its own with
        # mpi4py (which then runs in both jobs) when collectives:mpi is measured too
        if any(s.startswith("collectives") for s in mpi):
            return [g for g in (mpi, ["mpi4py", "collectives:gloo"], rest) if g]
        mpi.append("collectives:gloo")
    return [g for g in (mpi, rest) if g]


def launch(family, world, a):
    """Run implementations ``family`` together at one world size; their JSON rows."""
    args = [sys.executable, os.path.abspath(__file__), "--worker", ",".join(family), "--ops", a.ops,
            "--sizes", a.sizes, "--budget", str(a.budget), "--samples", str(a.samples),
            "--tensor", a.tensor]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               BENCH_PORT_TORCH=str(free_port()), BENCH_PORT_COLLECTIVES=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    name = "+".join(family)
    if any(s in MPI_FAMILY for s in family):
        mpiexec = mpiexec_path()
        if mpiexec is None:
            print(f"# {name}: no mpiexec found, skipped", file=sys.stderr)
            return []
        procs = [subprocess.Popen([mpiexec, "-n", str(world)] + args, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)]
    else:
        procs = []
        for r in range(world):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                     LOCAL_WORLD_SIZE=str(world))
            procs.append(subprocess.Popen(args, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
    outs, errs = [], []
    deadline = time.monotonic() + a.timeout
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            o, e = p.communicate()
            e += f"\n[killed after {a.timeout} s]"
        outs.append(o)
        errs.append(e if p.returncode else "")
    rows = [json.loads(line) for o in outs for line in o.splitlines() if line.startswith("{")]
    err = "".join(errs).strip()
    if err or not rows:
        print(f"# {name} world={world}: {'no results; ' if not rows else ''}{err[-800:]}",
              file=sys.stderr)
    return rows


def median(values):
    return statistics.median(values) if values else None


def fmt_us(us):
    return "-" if us is None else (f"{us:.1f}" if us < 1000 else f"{us:.0f}")


def report(res, impls, worlds, a):
    """Print the table (and the targets of the mpi backend); returns the summary dict."""
    keys = sorted({(w, op, b) for (w, op, b, _) in res}, key=lambda k: (k[0], OPS.index(k[1])
                                                                        if k[1] in OPS else 9, k[2]))
    ours = [s for s in impls if s not in BASELINES]
    ratio_pairs = [(s, base) for s in ours for base in BASELINES if base in impls]
    def all_samples(key):
        return [t for times in res.get(key, {}).values() for t in times]

    def paired(key_a, key_b, fn):
        """fn(a, b) over samples taken side by side (same launch, same sample index)."""
        la, lb = res.get(key_a, {}), res.get(key_b, {})
        return [fn(x, y) for launch in la.keys() & lb.keys() for x, y in zip(la[launch], lb[launch])]

    rows = []
    for (w, op, b) in keys:
        med = {s: median(all_samples((w, op, b, s))) for s in impls}
        ratios = {}
        for s, base in ratio_pairs:
            pr = paired((w, op, b, s), (w, op, b, base), lambda x, y: x / y)
            ratios[(s, base)] = median(pr) if pr else (med[s] / med[base] if med[s] and med[base]
                                                       else None)
        rows.append((w, op, b, med, ratios))

    def size_name(b):
        return "-" if b == 0 else (f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
                                   if b >= 1024 else f"{b} B")

    def ratio_name(s, base):
        return f"{s.replace('collectives:', 'c:')}/{base.split(':')[0]}"

    if a.markdown:
        head = ["world", "op", "size"] + [f"{s} us (GB/s)" for s in impls] + \
               [ratio_name(s, base) for s, base in ratio_pairs]
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---:"] * len(head)) + "|")
        for w, op, b, med, ratios in rows:
            cells = [str(w), op, size_name(b)]
            for s in impls:
                bw = busbw_gbs(op, w, b, med[s]) if med[s] else None
                cells.append(fmt_us(med[s]) + (f" ({bw:.2f})" if bw is not None else ""))
            cells += ["-" if ratios[p] is None else f"{ratios[p]:.2f}" for p in ratio_pairs]
            print("| " + " | ".join(cells) + " |")
    else:
        width = 22
        print(f"{'w':>2} {'op':<10} {'size':>7} " + "".join(f"{s:>{width}}" for s in impls)
              + "   ratios (<1: collectives faster)")
        for w, op, b, med, ratios in rows:
            cells = []
            for s in impls:
                bw = busbw_gbs(op, w, b, med[s]) if med[s] else None
                cell = fmt_us(med[s]) + " us" + (f" {bw:6.2f}GB/s" if bw is not None else " " * 10)
                cells.append(f"{cell:>{width}}")
            rs = " ".join(f"{ratio_name(*p)}={ratios[p]:.2f}" for p in ratio_pairs
                          if ratios[p] is not None)
            print(f"{w:>2} {op:<10} {size_name(b):>7} " + "".join(cells) + "   " + rs)
    checks = []
    for mine in ("collectives:mpi", "backend:mpi"):
        if mine not in impls or "mpi4py" not in impls:
            continue
        for w, op, b, med, ratios in rows:
            key, base = (w, op, b, mine), (w, op, b, "mpi4py")
            if med[mine] is None or med["mpi4py"] is None:
                continue
            if op != "barrier" and b >= 65536:
                r = ratios[(mine, "mpi4py")]
                checks.append((mine, w, op, b, f"{r:.2f}x mpi4py (target <= 1.10x)", r <= 1.1))
            elif b == 4 or op == "barrier":
                diffs = paired(key, base, lambda x, y: x - y)
                d = median(diffs) if diffs else med[mine] - med["mpi4py"]
                checks.append((mine, w, op, b, f"{d:+.2f} us vs mpi4py (target <= +2 us)", d <= 2.0))
    if checks:
        print("\n# mpi backend targets" + (" (markdown)" if a.markdown else ""))
        for mine, w, op, b, text, ok in checks:
            print(f"{'ok  ' if ok else 'MISS'} {mine:<16} w={w} {op:<10} {size_name(b):>7}: {text}")
    return {"rows": [{"world": w, "op": op, "bytes": b, "us": med,
                      "ratios": {ratio_name(*p): r for p, r in ratios.items()}}
                     for w, op, b, med, ratios in rows],
            "checks": [{"impl": c[0], "world": c[1], "op": c[2], "bytes": c[3], "text": c[4],
                        "ok": c[5]} for c in checks]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default=",".join(ALL_IMPLS),
                    help=f"comma-separated subset of {', '.join(ALL_IMPLS + EXTRA_IMPLS)}")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per rank")
    ap.add_argument("--rounds", type=int, default=3, help="launches of every impl per world size")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed calls per (op, size)")
    ap.add_argument("--samples", type=int, default=7, help="timed loops per (op, size) per launch")
    ap.add_argument("--tensor", choices=["numpy", "torch"], default="numpy",
                    help="what collectives:* pass (torch:gloo always uses torch tensors)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--gloo-with-mpi", action="store_true",
                    help="run collectives:gloo inside the mpiexec job, its timed loops interleaved "
                         "with mpi4py's sample by sample: a steadier collectives:gloo/mpi4py ratio "
                         "on a noisy machine (torch:gloo then runs in a job of its own)")
    ap.add_argument("--separate", action="store_true",
                    help="launch every implementation alone (default: MPI-launched ones share "
                         "processes, as do the gloo ones, and their timed loops interleave)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--json", default=None, help="also write raw medians and ratios to this file")
    ap.add_argument("--from-json", default=None, metavar="FILE",
                    help="print the table of a run saved with --json, without running anything")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        res = {}
        for key, launches in saved["samples"].items():
            w, op, b, spec = key.split("|")
            res[(int(w), op, int(b), spec)] = launches
        impls = [s.strip() for s in saved["args"]["impls"].split(",")]
        report(res, impls, None, a)
        return 0
    impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    for s in impls:
        if s not in ALL_IMPLS + EXTRA_IMPLS:
            ap.error(f"--impls: unknown implementation {s!r}; expected some of "
                     f"{', '.join(ALL_IMPLS + EXTRA_IMPLS)}")
    for op in a.ops.split(","):
        if op not in OPS + EXTRA_OPS:
            ap.error(f"--ops: unknown op {op!r}; expected some of {', '.join(OPS + EXTRA_OPS)}")
    worlds = [int(w) for w in a.worlds.split(",")]
    res = defaultdict(dict)  # (world, op, bytes, impl) -> {launch: [us per sample]}
    t0 = time.monotonic()
    groups = families(impls, a.separate, a.gloo_with_mpi)
    launch_id = 0
    for w in worlds:
        for r in range(a.rounds):
            for family in groups:
                launch_id += 1
                rows = launch(family, w, a)
                if not rows and len(family) > 1:  # one failed to start: run the others alone
                    rows = []
                    for spec in family:
                        launch_id += 1
                        rows += [dict(row, launch=launch_id) for row in launch([spec], w, a)]
                for row in rows:
                    res[(w, row["op"], row["bytes"], row["impl"])][row.get("launch", launch_id)] = \
                        row["samples"]
                print(f"# world={w} round={r + 1}/{a.rounds} {'+'.join(family)} done "
                      f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    summary = report(res, impls, worlds, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "samples": {"|".join(map(str, k)): v for k, v in res.items()},
                       **summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
