"""Master-worker: the master's cost of issuing one queued call, the transport stubbed.

usage: python bench/bench_master_worker_issue.py [--library numpy|torch] [--n 100000]

One process, no workers: a Master over a stub transport (frames are built, not sent, and
flow control is off), so the figure is the master's own work per call -- argument
conversion, dispatch, encoding -- without the scheduling noise of a shared machine.
Prints the best of 7 repetitions, in us per call, of ``x.add_(1)`` (the queued in-place
path bench_master_worker.py drives), ``x += 1.5``, ``x + y`` and ``x * 2``. Runs against
any tree on PYTHONPATH (to compare a change with its base, run both, alternating).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives.master_worker as mw  # noqa: E402
from collectives.master_worker import master as M  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()

    class StubGroup:
        backend = None
    m = M.Master(StubGroup(), [M.Node(0, 1, 0, True, 0)], args.library, 30.0)
    M.Master._send_frame = lambda self, node, msg: None
    M.Master._credit = lambda self, node: None
    M._master = m
    x, y = mw.ones(4, node=0), mw.ones(4, node=0)
    try:  # a call's result kind is learned from one reply; there is none here: seed it
        from collectives.master_worker import remote_call as dispatch
        table = dispatch.table(m)
        for name, kinds in (("numpy.add", ("T", "T")), ("numpy.multiply", ("T", int)),
                            ("torch.Tensor.__add__", ("T", "T")),
                            ("torch.Tensor.__mul__", ("T", int))):
            if name in table:
                table[name].results[kinds] = dispatch._TENSOR
    except ImportError:  # the op-table tree before issue 42
        pass

    def best(fn, reps=7):
        r = []
        for _ in range(reps):
            t = time.process_time()
            fn(args.n)
            r.append((time.process_time() - t) / args.n * 1e6)
        return min(r)

    def add_(n):
        for _ in range(n):
            x.add_(1)

    def iadd(n):
        for _ in range(n):
            x.__iadd__(1.5)

    def binop(n):
        for _ in range(n):
            x + y

    def scalar(n):
        for _ in range(n):
            x * 2
    out = {"add_": best(add_), "iadd_float": best(iadd), "binop_remote": best(binop),
           "binop_scalar": best(scalar)}
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
