"""collectives against MPICH and Open MPI on one host, in one mpiexec job each, with
labelled placement: ../shared/tools/bench_pair.py (raw mpi4py and collectives' default
backend timed alternately in the same job) run under each MPI's mpiexec, for each world
and each build of collectives (e.g. before and after a change), launches alternating.

usage: python bench/mpi_matrix.py --mpi mpich=.venv/bin,ompi=/path/ompi/bin
           [--tree after=.,before=/path/old-checkout] [--worlds 2,4] [--launches 2]
           [--ops all_reduce,broadcast,all_gather,barrier] [--sizes 4,1024,65536,...]
           [--out F.jsonl] [--budget 0.4] [--cpus 0,8 --pin far] [--pair PATH]

--cpus pins every launch (and its near/far probe, on the first two cores) with taskset; Open
MPI then gets --bind-to none so that its ranks keep the mask, as MPICH's do by default.
bench/placement.py measures which cores are near and which far.

Each --mpi names a bin folder with mpiexec and a python that has mpi4py and NumPy
(collectives comes from the tree, through PYTHONPATH; its extensions built in place).
Before every launch two shared-memory ranks of this checkout measure a cache-line round trip
(the shm backend's probes, 1 MiB two-shot all_reduces): the launch is labelled near or far
by what they said, as bench/bench_stream.py labels its samples. The table: per cell, each
tree's ratio collectives/MPI against each MPI (median over launches) and the larger of the
two (at most 1.0 means faster than both).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PAIR = os.path.join(HERE, "..", "..", "shared", "tools", "bench_pair.py")
OMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def label_worker():
    """Two ranks: 1 MiB two-shot all_reduces until both probed each other; prints far."""
    import numpy as np

    sys.path.insert(0, HERE)
    import shm_ranks
    from collectives.core import dtypes as D
    from collectives.core.tensors import to_buffer
    be, rank, world = shm_ranks.open_backend()
    comm = be._comm
    comm.set_ar_algo("two_shot")
    a = to_buffer(np.ones(1 << 18, np.float32))
    for _ in range(64):
        be.all_reduce(a, D.SUM)
    if rank == 0:
        print(json.dumps({"far": comm.far, "dist": comm.peer_distance(1)}), flush=True)
    be.shutdown()


def label(cpus=None):
    """near or far: what this checkout's probes say of two ranks now (on the first two
    of ``cpus`` where given)."""
    sys.path.insert(0, HERE)
    import shm_ranks
    rows = shm_ranks.launch(__file__, [], 2, 120, cpus=cpus[:2] if cpus else None)
    return "far" if rows and rows[0]["far"] else "near" if rows else "?"


def launch(mpi_bin, tree, world, a):
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as f:
        env = dict(os.environ, PYTHONPATH=tree, **OMPI_ENV)
        cmd = [os.path.join(mpi_bin, "mpiexec"), "-n", str(world)]
        if a.cpus:  # every rank inherits the mask; MPICH's hydra binds nothing by default
            cmd = ["taskset", "-c", a.cpus] + cmd
        if "ompi" in subprocess.run([os.path.join(mpi_bin, "mpiexec"), "--version"],
                                    capture_output=True, text=True).stdout.lower() + mpi_bin:
            cmd.append("--oversubscribe")
            if a.cpus:  # Open MPI would bind by its own map, ignoring the mask: keep the mask
                cmd += ["--bind-to", "none"]
        cmd += [os.path.join(mpi_bin, "python"), a.pair, "--backend", "gloo", "--ops", a.ops,
                "--sizes", a.sizes, "--samples", str(a.samples), "--budget", str(a.budget),
                "--json", f.name]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)
        return [json.loads(ln) for ln in f.read().splitlines() if ln.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label-worker", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mpi", required=False, default="")
    ap.add_argument("--tree", default="after=" + os.path.dirname(HERE))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather,barrier")
    ap.add_argument("--sizes", default="4,1024,65536,1048576,16777216")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--pair", default=PAIR, help="bench_pair.py (default: ../shared/tools)")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per (op, size, impl)")
    ap.add_argument("--cpus", default=None, help="pin every launch to these cores (taskset)")
    ap.add_argument("--pin", default=None, help="name of the --cpus placement, e.g. near or far:"
                    " launches are labelled NAME/probe")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", default=None, help="only report this JSONL file")
    ap.add_argument("--plot", default=None, help="also draw the ratios into this PNG")
    a = ap.parse_args()
    if a.worker or a.label_worker:
        return label_worker()
    rows = []
    if a.report:
        rows = [json.loads(ln) for ln in open(a.report)]
    else:
        mpis = dict(kv.split("=", 1) for kv in a.mpi.split(","))
        trees = dict(kv.split("=", 1) for kv in a.tree.split(","))
        for n in range(a.launches):
            for world in (int(w) for w in a.worlds.split(",")):
                for mpi, mpi_bin in mpis.items():
                    names = list(trees) if n % 2 == 0 else list(trees)[::-1]
                    for tree in names:
                        where = label(a.cpus.split(",") if a.cpus else None)
                        if a.pin:
                            where = f"{a.pin}/{where}"
                        got = launch(mpi_bin, os.path.abspath(trees[tree]), world, a)
                        for r in got:
                            r.update(tree=tree, mpi=mpi, launch=n, label=where, cpus=a.cpus)
                            print(json.dumps(r), flush=True)
                        rows += got
                        if a.out:
                            with open(a.out, "a") as f:
                                for r in got:
                                    f.write(json.dumps(r) + "\n")
    report(rows)
    if a.plot:
        plot(rows, a.plot)


def plot(rows, path):
    """One panel per world and op: each tree's ratio against the faster MPI per size,
    near and far launches apart (log x), and 1.0 drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    worlds = sorted({r["world"] for r in rows})
    ops = sorted({r["op"] for r in rows if r["op"] != "barrier"})
    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(4 * len(ops), 3.2 * len(worlds)),
                             squeeze=False)
    cells = collections.defaultdict(list)
    for r in rows:
        cells[(r["world"], r["op"], r["bytes"], r["tree"], r["mpi"], r["label"])].append(r["ratio"])
    for i, w in enumerate(worlds):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for tree in sorted({r["tree"] for r in rows}):
                for label, style in zip(sorted({r["label"] for r in rows}),
                                        ("-o", "--s", ":^", "-.v", "-D", "--x")):
                    xs, ys = [], []
                    for nb in sorted({r["bytes"] for r in rows if r["op"] == op}):
                        meds = [statistics.median(v) for k, v in cells.items()
                                if k[:4] == (w, op, nb, tree) and k[5] == label]
                        if meds:
                            xs.append(max(nb, 1))
                            ys.append(max(meds))
                    if xs:
                        ax.plot(xs, ys, style, label=f"{tree} ({label})")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"world {w}: {op}")
            ax.set_xlabel("bytes")
            ax.set_ylabel("time / faster MPI's")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def report(rows):
    cells = collections.defaultdict(list)
    for r in rows:
        cells[(r["world"], r["op"], r["bytes"], r["tree"], r["mpi"], r["label"])].append(r["ratio"])
    trees = sorted({r["tree"] for r in rows})
    mpis = sorted({r["mpi"] for r in rows})
    labels = sorted({r["label"] for r in rows})
    print("median ratio collectives/MPI over launches (n launches); max: against the faster")
    for label in labels:
        print(f"\n{label}:")
        print(f"{'world':>5} {'op':<11}{'bytes':>9}" + "".join(
            f"{t + '/' + m:>16}" for t in trees for m in mpis) + "".join(f"{t + ' max':>12}" for t in trees))
        keys = sorted({k[:3] for k in cells if k[5] == label})
        for w, op, nb in keys:
            line = f"{w:>5} {op:<11}{nb:>9}"
            worst = {}
            for t in trees:
                for m in mpis:
                    v = cells.get((w, op, nb, t, m, label))
                    if v:
                        med = statistics.median(v)
                        worst[t] = max(worst.get(t, 0), med)
                        line += f"{med:>12.2f} ({len(v)})"
                    else:
                        line += f"{'-':>16}"
            line += "".join(f"{worst.get(t, float('nan')):>12.2f}" for t in trees)
            print(line)


if __name__ == "__main__":
    main()
