"""FSDP2's collectives timed where they run: inside the steps of bench_train's transformer.

The probe behind 2026-11-29-train-steps-noon.md. Run from the checkout's root:

    collectives-run -n 2 bench/results/2026-11-29-fsdp-in-situ-probe.py

It wraps the default group's shm backend methods (all_gather, reduce_scatter...) so that
each call, on the thread that runs it, records its wall time, its thread CPU time and its
minor page faults. It then trains bench_train's ``tfm`` model under FSDP2 over that group
("real") and over torch's fake group ("floor", no communication), in alternating blocks.
Each rank prints the median step and its phases, the per-call figures summed per step, the
whole process's faults per step, and one step's calls ("a" all_gather, "r" reduce_scatter,
then wall ms / faults).
"""
import argparse
import os
import resource
import statistics as st
import sys
import time

import torch
import torch.distributed as td

import collectives as dist
from collectives.api import group as _groups

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_train as bt  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
import torch.testing._internal.distributed.fake_pg  # noqa: E402,F401  (registers "fake")

fake = td.new_group(backend="fake")
be = _groups.world.default.backend
log = []  # (method, start ns, end ns, thread CPU ns, minor faults)
faults = {}  # which -> the process's minor faults per step


def _wrap(name):
    f = getattr(be, name)

    def timed(*args, **kw):
        t0, c0 = time.monotonic_ns(), time.thread_time_ns()
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        try:
            return f(*args, **kw)
        finally:
            log.append((name, t0, time.monotonic_ns(), time.thread_time_ns() - c0,
                        resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0))
    setattr(be, name, timed)


for _name in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"):
    _wrap(_name)

a = argparse.Namespace(tfm_batch=2, tfm_seq=32)
mods = {}
for which in ("real", "floor"):
    m, x = bt._build("tfm", a)
    m = bt._wrap("fsdp", m, which == "floor", fake)
    mods[which] = (m, torch.optim.SGD(m.parameters(), lr=1e-4))


class _PhasesOnly:
    """A timeline without events: bench_train's step then records its phases only."""

    def take(self):
        return []


def step(which):
    """One step of bench_train's own (its phases' times), and the process's faults in it."""
    m, opt = mods[which]
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps = []
    bt._step(m, opt, x, which, steps, _PhasesOnly(), (which,))
    faults.setdefault(which, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    mk = steps[0][2]
    return mk["t0"], mk["fwd"], mk["bwd"], mk["end"]


for which in mods:
    for _ in range(15):
        step(which)
rows = {"real": [], "floor": []}
for _block in range(8):
    for which in ("real", "floor"):
        td.barrier()
        for _ in range(5):
            del log[:]
            t = step(which)
            rows[which].append((t, [c for c in log if c[1] >= t[0]]))

r = dist.get_rank()
out = []
for which in ("real", "floor"):
    ts = [t for t, _ in rows[which]]
    med = [st.median([(t[j + 1] - t[j]) / 1e6 for t in ts]) for j in range(3)]
    out.append(f"r{r} {which}: step {st.median([(t[3] - t[0]) / 1e6 for t in ts]):.1f} ms "
               f"(forward {med[0]:.1f}, backward {med[1]:.1f}, optimizer {med[2]:.1f})")
per = {}
for _t, calls in rows["real"]:
    for name, a0, a1, cpu, flt in calls:
        per.setdefault(name, []).append(((a1 - a0) / 1e6, cpu / 1e6, flt))
nsteps = len(rows["real"])
for name, v in per.items():
    wall, cpu, flt = zip(*v)
    out.append(f"r{r}   {name}: {len(v) / nsteps:.1f} a step; wall median {st.median(wall):.2f} ms, "
               f"{sum(wall) / nsteps:.1f} ms a step; CPU median {st.median(cpu):.2f} ms, "
               f"{sum(cpu) / nsteps:.1f} ms a step; minor faults {sum(flt) / nsteps:.0f} a step")
out.append(f"r{r} the process's minor faults a step: real {st.median(faults['real'][-40:])}, "
           f"floor {st.median(faults['floor'][-40:])}")
_t, calls = rows["real"][-1]
out.append(f"r{r} one step: " + " ".join(f"{n[0]}{(a1 - a0) / 1e6:.1f}/{flt}"
                                          for n, a0, a1, _c, flt in calls))
print("\n".join(out), flush=True)
dist.destroy_process_group()
