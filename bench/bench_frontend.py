"""Front-end overhead: microseconds per blocking all_reduce of one element on a backend
that does nothing, i.e. what the torch.distributed-style front end costs per call
(argument checks, buffer wrapping, flight recorder entry, group lookup).

Usage: python bench/bench_frontend.py [--calls 20000]

Target: well under 2 us per call on a quiet machine (torch tensor and NumPy array).
Timings are the best of 5 batches of ``--calls`` calls; read them on a quiet machine.
"""
import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives as dist  # noqa: E402
from collectives import backends  # noqa: E402
from collectives.backends.base import Backend  # noqa: E402
from collectives.store import HashStore  # noqa: E402


class Noop(Backend):
    name = "noop"

    def all_reduce(self, buf, op):
        pass


def overhead_us(tensor, n):
    """Best microseconds per blocking all_reduce(tensor) over 5 batches of n calls."""
    for _ in range(1000):
        dist.all_reduce(tensor)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(tensor)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if "noop" not in backends.registered_backends():
        backends.register_backend("noop", Noop)
    dist.init_process_group("noop", store=HashStore(), rank=0, world_size=2)
    try:
        rows = [("numpy float32[1]", np.ones(1, np.float32))]
        try:
            import torch
            rows.insert(0, ("torch float32[1]", torch.ones(1)))
        except ImportError:
            pass
        for name, t in rows:
            print(f"{name:18s} {overhead_us(t, args.calls):6.2f} us per all_reduce")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
