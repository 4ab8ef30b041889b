"""What the reduce_scatter's own sum costs in a step of bench_train's FSDP2 transformer.

FSDP2 calls one reduce_scatter per ``fully_shard`` unit in the backward pass (the six
encoder layers and the root). On a group of collectives the call runs through shared
memory (collectives.torch_bridge.fsdp.SharedReduceScatter): each rank sums its block of
every rank's input into its output, in rank order, with the Cython kernel
``reduce_many_ptr``. Any reduce_scatter has to read every input byte once and write every
output byte once; this times that work alone, with no communication and no waiting, on
inputs of the model's sizes (one input tensor per rank, as in the shared segment):

    python bench/fsdp_sum_cost.py --worlds 2,4 [--copies 2] [--reps 30] [--json out.jsonl]

``--copies N`` runs N processes at once, each timing every rank's share in turn, so that
N cores' memory traffic competes as it does when ranks run side by side (2 on the 2-core
VM). Printed per world: one rank's median milliseconds a step and the sum over the
world's ranks (core-ms a step), the figure to set beside bench_train's CPU time a step.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def unit_sizes():
    """Parameters of each FSDP2 unit of bench_train's ``tfm`` (the layers, then the root)."""
    sys.path.insert(0, HERE)
    from bench_train import _build
    model, _ = _build("tfm", types.SimpleNamespace(tfm_batch=1, tfm_seq=1))
    units = [sum(p.numel() for p in layer.parameters()) for layer in model[:-1]]
    return units + [sum(p.numel() for p in model[-1].parameters())]


def one_rank_ms(world, units, reps):
    """Median ms of one rank's sums over a step: per unit, its block of every rank's input."""
    import numpy as np

    from collectives.core.dtypes import FLOAT32, SUM
    from collectives.engines._core import reduce_many_ptr
    rng = np.random.default_rng(0)
    cases = []
    for n in units:
        block = -(-n // world)  # FSDP2 pads each unit to a multiple of the world
        inputs = [rng.random(block * world, dtype=np.float32) for _ in range(world)]
        cases.append((block, inputs, np.empty(block, np.float32)))
    times = []
    for rep in range(reps + 3):
        rank = rep % world
        t0 = time.perf_counter()
        for block, inputs, out in cases:
            srcs = [x.ctypes.data + rank * block * 4 for x in inputs]
            reduce_many_ptr(out.ctypes.data, srcs, block, FLOAT32, SUM)
        if rep >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _copy(args):
    return one_rank_ms(*args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    units = unit_sizes()
    for world in (int(w) for w in a.worlds.split(",")):
        with mp.get_context("spawn").Pool(a.copies) as pool:
            per = pool.map(_copy, [(world, units, a.reps)] * a.copies)
        ms = statistics.median(per)
        row = {"world": world, "copies": a.copies, "units": units, "reps": a.reps,
               "rank_ms": ms, "core_ms_per_step": ms * world}
        print(f"world {world}, {a.copies} copies at once: one rank's reduce_scatter sums "
              f"{ms:.2f} ms a step, all ranks {ms * world:.1f} core-ms a step")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
