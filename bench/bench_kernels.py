"""Kernel throughput: collectives.engines._core.reduce_into(SUM) beside numpy.add and torch.add.

Usage: python bench/bench_kernels.py [--dtypes float32,bfloat16,float16] [--quick]
       [--isa avx512|avx2|baseline]

GB/s counts 2 reads + 1 write per element (3 x nbytes per call), for all three.
Every call is in place (dst = dst + src). torch runs with torch.set_num_threads(1).
Timings are the minimum per-call time over 40 short (~2 ms) batches taken in turn
(ours, torch, numpy, ours, ...), measured in this run; read the ratios, not the
absolute numbers, on a shared machine.
Targets: float32 >= 0.95x the faster of numpy/torch at every size; bfloat16 and
float16 >= 1.5x torch from 64 KiB to 4 MiB.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from collectives.engines import _core as core  # noqa: E402
from collectives.core import dtypes as D  # noqa: E402

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def best_times(fns, batch_s=0.002, repeats=40):
    """Minimum seconds per call of each fn, over ``repeats`` interleaved short batches.

    Short batches, taken in turn, make the minimum robust on a loaded machine: a
    batch shorter than a scheduler slice often runs undisturbed, and slow periods
    hit every contender alike.
    """
    per = []
    for fn in fns:
        fn()
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-7)
        per.append(max(1, int(batch_s / once)))
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            k = per[i]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / k)
    return best


def gbps(nbytes, seconds):
    return 3 * nbytes / seconds / 1e9


def fmt_size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def run(dtype_name, sizes, torch, repeats):
    rows = []
    for nbytes in sizes:
        if dtype_name == "bfloat16":
            n = nbytes // 2
            ours_a = torch.randn(n).to(torch.bfloat16)
            ours_b = torch.randn(n).to(torch.bfloat16)
            na = nb = None  # NumPy has no bfloat16
        else:
            npdt = np.dtype(dtype_name)
            n = nbytes // npdt.itemsize
            rng = np.random.default_rng(0)
            na = rng.standard_normal(n).astype(npdt)
            nb = rng.standard_normal(n).astype(npdt)
            ours_a, ours_b = na.copy(), nb
        ta = ours_a.clone() if na is None else torch.from_numpy(na.copy())
        tb = ours_b if na is None else torch.from_numpy(nb)
        fns = [lambda a=ours_a, b=ours_b: core.reduce_into(a, b, D.SUM),
               lambda a=ta, b=tb: torch.add(a, b, out=a)]
        if na is not None:
            fns.append(lambda a=na, b=nb: np.add(a, b, out=a))
        times = best_times(fns, repeats=repeats)
        t_ours, t_torch = times[0], times[1]
        t_np = times[2] if na is not None else None
        rows.append((nbytes, t_ours, t_np, t_torch))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--quick", action="store_true", help="shorter timing budget")
    ap.add_argument("--isa", default=None, help="force a kernel instruction set")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    if args.isa and not core._force_isa(args.isa):
        sys.exit(f"this CPU lacks {args.isa}")
    repeats = 10 if args.quick else 40
    print(f"kernels: {core.kernel_isa()}; torch {torch.__version__} (1 thread), numpy {np.__version__}")
    print("GB/s = 3 x bytes per call (2 reads + 1 write) / best time per call; in place dst += src")
    failures = []
    for dt in args.dtypes.split(","):
        rows = run(dt, SIZES, torch, repeats)
        print(f"\n{dt} SUM")
        print(f"{'size':>8} {'ours GB/s':>10} {'numpy GB/s':>11} {'torch GB/s':>11} "
              f"{'ours/numpy':>11} {'ours/torch':>11} {'ours/best':>10}")
        for nbytes, t_ours, t_np, t_torch in rows:
            best_other = min(t for t in (t_np, t_torch) if t is not None)
            np_gbps = f"{gbps(nbytes, t_np):11.1f}" if t_np else f"{'-':>11}"
            np_ratio = f"{t_np / t_ours:10.2f}x" if t_np else f"{'-':>11}"
            print(f"{fmt_size(nbytes):>8} {gbps(nbytes, t_ours):10.1f} {np_gbps} "
                  f"{gbps(nbytes, t_torch):11.1f} {np_ratio} {t_torch / t_ours:10.2f}x "
                  f"{best_other / t_ours:9.2f}x")
            if dt == "float32" and best_other / t_ours < 0.95:
                failures.append(f"float32 {fmt_size(nbytes)}: {best_other / t_ours:.2f}x the faster")
            if dt in ("bfloat16", "float16") and (64 << 10) <= nbytes <= (4 << 20) \
                    and t_torch / t_ours < 1.5:
                failures.append(f"{dt} {fmt_size(nbytes)}: {t_torch / t_ours:.2f}x torch")
    print("\ntargets:", "all met" if not failures else "MISSED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
