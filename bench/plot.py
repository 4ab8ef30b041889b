"""Plot benchmark result tables: latency and bus bandwidth against message size.

Reads the CSV companions of the dated result files in bench/results/ and writes one PNG
per figure beside each CSV (matplotlib, Agg backend: no display needed)::

    python bench/plot.py                          # every CSV in bench/results/
    python bench/plot.py bench/results/2026-11-25-forced-tcp.csv --out /tmp

Two CSV layouts are understood (the header names them):

* collectives: ``world, op, size_bytes, impl, us, busbw_gbs`` -> ``<name>-latency.png``
  (microseconds per call) and, where bandwidth is given, ``<name>-busbw.png`` (GB/s);
  one panel per (world, op), one line per implementation, log-log axes;
* kernels: ``dtype, op, size_bytes, impl, gbs`` -> ``<name>-gbs.png``, one panel per dtype.

Rows without a size (barrier) are not plotted. Other CSVs are skipped with a note.
"""
import argparse
import csv
import glob
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _size_label(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _panels(rows, keys, value):
    """{panel key: {impl: [(size, value)...]}} for rows that have a size and the value."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if not r.get("size_bytes") or not r.get(value):
            continue
        out[tuple(r[k] for k in keys)][r["impl"]].append((int(r["size_bytes"]), float(r[value])))
    return out


def _figure(panels, title, ylabel, titles, path, logy=True):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(panels, key=lambda k: tuple(int(x) if x.isdigit() else x for x in k))
    ncol = min(3, len(keys))
    nrow = (len(keys) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
    impls = sorted({i for k in keys for i in panels[k]})
    colours = {impl: f"C{n}" for n, impl in enumerate(impls)}
    for ax, key in zip(axes.flat, keys):
        sizes = set()
        for impl, pts in sorted(panels[key].items()):
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            sizes.update(xs)
            ax.plot(xs, ys, marker="o", markersize=3, label=impl, color=colours[impl])
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ticks = sorted(sizes)
        if len(ticks) > 8:  # every 16x (4 B, 64 B, 1 KiB ... 4 MiB) and the largest
            ticks = [t for t in ticks if t.bit_length() % 4 == 3] + [ticks[-1]]
            ticks = sorted(set(ticks))
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size_label(t) for t in ticks], rotation=45, fontsize=7)
        ax.minorticks_off()
        ax.set_title(titles(key), fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colours[i], marker="o", markersize=3) for i in impls]
    fig.legend(handles, impls, loc="upper center", ncol=min(len(impls), 4), fontsize=8,
               bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.suptitle(title, fontsize=10, y=1.0 + 0.04 / nrow + 0.02)
    fig.tight_layout(rect=(0, 0, 1, 0.97 - 0.02 * (nrow == 1)))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_csv(path, out_dir=None):
    """Draw the figures of one CSV; returns the PNG paths written."""
    rows = _read(path)
    name = os.path.splitext(os.path.basename(path))[0]
    out_dir = out_dir or os.path.dirname(path)
    cols = set(rows[0]) if rows else set()
    written = []
    if {"world", "op", "size_bytes", "impl", "us"} <= cols:
        def titles(k):
            return f"{k[1]}, world {k[0]}"
        written.append(_figure(_panels(rows, ("world", "op"), "us"), f"{name}: time per call",
                               "us per call (lower is better)", titles,
                               os.path.join(out_dir, f"{name}-latency.png")))
        bw = _panels(rows, ("world", "op"), "busbw_gbs")
        bw = {k: {i: [p for p in v if p[1] > 0] for i, v in d.items()} for k, d in bw.items()}
        bw = {k: {i: v for i, v in d.items() if v} for k, d in bw.items()}
        bw = {k: d for k, d in bw.items() if d}
        if bw:
            written.append(_figure(bw, f"{name}: bus bandwidth", "bus GB/s (higher is better)",
                                   titles, os.path.join(out_dir, f"{name}-busbw.png")))
    elif {"dtype", "size_bytes", "impl", "gbs"} <= cols:
        written.append(_figure(_panels(rows, ("dtype", "op"), "gbs"), f"{name}: reduction kernels",
                               "GB/s (higher is better)", lambda k: f"{k[0]} {k[1]}",
                               os.path.join(out_dir, f"{name}-gbs.png"), logy=False))
    else:
        print(f"{path}: no size/impl columns, not plotted", file=sys.stderr)
    return written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="*", help="CSV files (default: bench/results/*.csv)")
    p.add_argument("--out", help="directory for the PNGs (default: beside each CSV)")
    args = p.parse_args(argv)
    paths = args.csv or sorted(glob.glob(os.path.join(RESULTS, "*.csv")))
    for path in paths:
        for png in plot_csv(path, args.out):
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
