#!/usr/bin/env python3
"""A cost model of the TCP transport's collectives between hosts (alpha-beta-gamma).

Every algorithm the TCP engine runs (``collectives/engines/tcp/tcp_engine.c``) is a sequence of
rounds; in a round each host sends and receives at most one message per peer, and a round
costs ``alpha + (messages - 1) * msg + max(bytes / (eta * rate), cpu_time)`` (the sum
where the algorithm does not stream by segments), and each call ``call`` more: ``alpha``
the per-round cost (wake-up, kernel, wire latency), ``msg`` the cost of each further
message of a round, ``rate`` the link's line rate and ``eta`` the fraction of it left for
payload (Ethernet, IP and TCP headers: 1448 of each 1514 bytes, ~0.956, less whatever the
stack loses). A host sends its messages of one round back to back on its own link, so the
bytes of a round are the sum over that host's messages. ``cpu_time`` = (2 * bytes * cpu +
bytes reduced * gamma) / share: the core time the host's stack (sending and receiving) and
its reductions take, on ``share`` cores (on the emulated cluster every host shares this
machine's cores, so 8 hosts on 2 cores get a quarter each). The α-β-γ model of Thakur,
Rabenseifner and Gropp (2005), with the γ term split into the stack's and the reductions'.
The planned tables leave the CPU terms out unless ``--plan-cores`` gives the cores a host
has: fitted here, they are a 2-core VM's (veth, bridge and token buckets included), not a
cluster host's. The parameters are fitted to measured emulated-link runs
(``bench/netlab.py --json``), and the model is then used past this machine. It predicts
the time per call of a loop of calls, as the benchmarks measure it; every rank of a call
waits for all the others' fingerprints of it, so one call ends before the next begins.

    python bench/model.py --fit bench/results/netlab-1gbit.json     # fit, check, predict
    python bench/model.py --params 50e-6,20e-6,10e-6,0.94 --rates 10gbit,100gbit --hosts 64,256,1024

``choose()`` mirrors the engine's choice of algorithm (same thresholds as its defaults);
``ALTERNATIVES`` lists algorithms the engine does not have, so the tables show what
each would gain at scale.
"""
import argparse
import json
import math
import os
import statistics
import sys

# the TCP engine's defaults (tcp_engine.c: tcp_engine_new)
RD_MAX = 64 * 1024          # all_reduce: recursive doubling up to this many bytes
TREE_MAX = 64 * 1024        # broadcast: hypercube exchange up to this many bytes
SEGMENT = 1024 * 1024       # pipelining segment
DIRECT_MAX = 64 * 1024      # all_gather/reduce_scatter: direct exchange up to n*bytes
DIRECT_WORLD = 8            # large all_reduce: two-round direct exchange up to this world
DIRECT_WORLD_HOSTS = 1      # ... in a group across hosts: the ring at every size (tcp.py)
RD_MAX_HOSTS = 32 * 1024    # ... and recursive doubling up to this, above 2 ranks (tcp.py)
HD_MAX_HOSTS = 64 * 1024    # ... then halving-doubling up to this, above 2 ranks (tcp.py)
CHAIN_SEG_MIN = 64 * 1024   # the chain broadcast's smallest segment (bcast_chain)


def _log2c(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


def rounds(algo, n, s):
    """[(rounds, messages per round, bytes per round on the busiest link, bytes a host
    reduces per round)] of ``algo`` on ``n`` hosts with ``s`` bytes per rank (all_gather:
    each rank's input; reduce_scatter: each rank's output). Every rank of a call waits for
    every other rank's fingerprint of it (issue 28), so calls do not overlap: a call lasts
    until its last rank is done."""
    if n <= 1:
        return []
    p2 = 1 << int(math.floor(math.log2(n)))
    extra = 2 if p2 != n else 0  # recursive doubling folds the ranks past a power of two
    # the fold: one round reduces the buffer, the other only moves it back
    fold = [(extra, 1, s, s / 2)] if extra else []
    if algo == "rd":                     # recursive doubling: log2 rounds of the whole buffer
        return [(_log2c(p2), 1, s, s)] + fold
    if algo == "direct_ar":              # reduce-scatter and all-gather, each one direct round
        return [(2, n - 1, (n - 1) / n * s, (n - 1) / n * s / 2)]
    if algo == "ring_ar":                # n - 1 steps reduce a block, n - 1 only pass one on
        return [(2 * (n - 1), 1, s / n, s / n / 2)]
    if algo == "rabenseifner":           # halving-doubling: 2 log2 n rounds, halving bytes
        k = _log2c(p2)
        return [(2, 1, s / 2 ** (i + 1), s / 2 ** (i + 2)) for i in range(k)] + fold
    if algo == "cube":                   # broadcast: recursive doubling from the root
        return [(_log2c(p2) + extra, 1, s, 0)]
    if algo == "chain":                  # pipelined chain: the last rank waits n - 2 segments more
        seg = chain_segment(n, s)
        nseg = math.ceil(s / seg)
        return [(1, 1, (nseg + n - 2) * seg, 0)]  # segments stream to one peer: no msg cost
    if algo == "scatter_ag":             # broadcast as scatter (tree) + ring all_gather
        return [(_log2c(n), 1, s / 2, 0), (n - 1, 1, s / n, 0)]
    if algo == "direct_gather":          # n-1 messages of s out of each host, one round
        return [(1, n - 1, (n - 1) * s, 0)]
    if algo == "ring_gather":
        return [(n - 1, 1, s, 0)]
    if algo == "direct_rs":              # n-1 blocks out of each host, then all reduced
        return [(1, n - 1, (n - 1) * s, (n - 1) * s)]
    if algo == "ring_rs":                # each step reduces the block that came in
        return [(n - 1, 1, s, s)]
    if algo == "bruck":                  # all_gather in log2 n rounds, doubling
        return [(1, 1, s * 2 ** i, 0) for i in range(_log2c(n))]
    if algo == "direct_a2a":
        return [(1, n - 1, (n - 1) / n * s, 0)]
    raise ValueError(f"unknown algorithm {algo!r}")


def chain_segment(n, s):
    """The pipelined chain broadcast's segment (tcp_algorithms.c: bcast_chain)."""
    return max(CHAIN_SEG_MIN, min(SEGMENT, s // (32 * (n - 1)))) if n > 1 else SEGMENT


def choose(op, n, s):
    """The algorithm the TCP engine runs for ``op`` on ``n`` ranks, ``s`` bytes per rank."""
    if op == "all_reduce":
        if s <= (RD_MAX_HOSTS if n > 2 else RD_MAX):  # (the model's ranks are hosts)
            return "rd"
        if n > 2 and s <= HD_MAX_HOSTS:
            return "rabenseifner"
        return "direct_ar" if n <= DIRECT_WORLD_HOSTS else "ring_ar"  # hosts, not one host
    if op == "broadcast":
        return "cube" if (s <= TREE_MAX or n == 2) else "chain"
    if op == "all_gather":
        return "direct_gather" if s * n <= DIRECT_MAX else "ring_gather"
    if op == "reduce_scatter":
        return "direct_rs" if s * n <= DIRECT_MAX else "ring_rs"
    if op == "all_to_all":
        return "direct_a2a"
    raise ValueError(f"unknown op {op!r}")


# the engine's algorithms that stream by segments, so that a round's CPU work overlaps its
# wire time; the others send, then reduce (tcp_algorithms.c)
PIPELINED = frozenset({"ring_ar", "direct_ar", "ring_gather", "ring_rs", "chain"})

ALTERNATIVES = {"all_reduce": ["rd", "direct_ar", "ring_ar", "rabenseifner"],
                "broadcast": ["cube", "chain", "scatter_ag"],
                "all_gather": ["direct_gather", "ring_gather", "bruck"],
                "reduce_scatter": ["direct_rs", "ring_rs"],
                "all_to_all": ["direct_a2a"]}


class Params:
    """The model's parameters: ``alpha`` seconds per round (wake-up, kernel, wire latency),
    ``msg`` seconds per message beyond the first of a round, ``call`` seconds per call
    (front end), ``eta`` the fraction of the line rate left for payload; ``cpu`` the core
    seconds per byte a host's network stack moves (sent or received) and ``gamma`` per byte
    reduced: a round of a pipelined algorithm (:data:`PIPELINED`) lasts its wire time or
    its CPU time, whichever is longer; in the others the CPU work follows the transfer."""

    def __init__(self, alpha=50e-6, msg=20e-6, call=10e-6, eta=0.94, cpu=0.0, gamma=0.0):
        self.alpha, self.msg, self.call, self.eta = alpha, msg, call, eta
        self.cpu, self.gamma = cpu, gamma

    def __repr__(self):
        return (f"alpha = {self.alpha * 1e6:.1f} us, msg = {self.msg * 1e6:.1f} us, "
                f"call = {self.call * 1e6:.1f} us, eta = {self.eta:.3f}, "
                f"cpu = {self.cpu * 1e9:.3f} ns/B, gamma = {self.gamma * 1e9:.3f} ns/B")


def predict(op, n, s, p, bps, algo=None, share=math.inf):
    """Seconds per call of ``op`` on ``n`` hosts, ``s`` bytes per rank, links of ``bps``
    bit/s, parameters ``p`` (:class:`Params`); ``share``: the cores each host has for its
    stack and reductions (on the emulated cluster, where every host shares the machine's
    cores, :func:`lab_share`; unbounded by default: the CPU terms do not count)."""
    algo = algo or choose(op, n, s)
    beta = 8 / (p.eta * bps)
    t = p.call if n > 1 else 0.0
    overlap = algo in PIPELINED
    for count, msgs, nbytes, reduced in rounds(algo, n, s):
        wire, cpu = nbytes * beta, (2 * nbytes * p.cpu + reduced * p.gamma) / share
        t += count * (p.alpha + (msgs - 1) * p.msg + (max(wire, cpu) if overlap else wire + cpu))
    return t


def lab_share(cores, hosts, ranks_per_host=1):
    """The cores each emulated host has: the machine's, shared by all the lab's ranks."""
    return min(1.0, cores / (hosts * ranks_per_host))


def bound(op, n, s, bps):
    """The link bound in seconds (bench/netlab.py's)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "all_gather": n - 1,
              "reduce_scatter": n - 1, "all_to_all": (n - 1) / n}[op]
    return factor * s * 8 / bps if n > 1 else 0.0


def fit(rows, bps):
    """:class:`Params` minimising the squared log error over the measured rows; cells of
    1 MiB and more weigh ten times the others (they fix the bandwidth term, which is what
    plans at scale). The CPU terms only count where they outlast the wire, so the error is
    flat in them below that: every parameter is descended from each point of a grid of them
    (0 and 0.25-16 ns/B), and the best three refined."""
    def err(p):
        return sum((10 if r["nbytes"] >= 1 << 20 else 1)
                   * math.log(_predict_row(r, p, bps) * 1e6 / r["us"]) ** 2 for r in rows)

    names = ("alpha", "msg", "call", "eta", "cpu", "gamma")
    grid = [0.0] + [0.25e-9 * 2 ** i for i in range(7)]
    starts = sorted((_descend(Params(cpu=c, gamma=g), err, names, until=0.1)
                     for c in grid for g in grid), key=err)
    return min((_descend(p, err, names) for p in starts[:3]), key=err)


def _descend(p, err, names, until=0.002):
    """Coordinate descent in multiplicative steps over the parameters ``names`` (a zero
    stays zero: the fit's grid tries the CPU terms at 0)."""
    best = err(p)
    step = 0.5
    while step > until:
        improved = False
        for name in names:
            for f in (1 + step, 1 / (1 + step)):
                old = getattr(p, name)
                new = min(old * f, 0.999) if name == "eta" else old * f
                setattr(p, name, new)
                v = err(p)
                if v < best:
                    best, improved = v, True
                else:
                    setattr(p, name, old)
        if not improved:
            step /= 2
    return p


def _predict_row(r, p, bps):
    return predict(r["op"], r["hosts"], r["nbytes"], p, bps, share=r.get("share", math.inf))


def medians(rows, impl="collectives"):
    """One row per (op, hosts, bytes) of ``impl``: the median over its launches."""
    cells, share = {}, {}
    for r in rows:
        if r.get("impl", impl) == impl:
            key = (r["op"], r["hosts"], r["nbytes"])
            cells.setdefault(key, []).append(r["us"])
            share[key] = r.get("share", math.inf)
    return [{"op": op, "hosts": h, "nbytes": b, "us": statistics.median(v),
             "share": share[(op, h, b)]}
            for (op, h, b), v in sorted(cells.items())]


def check(rows, p, bps, min_bytes=1 << 20):
    """Per measured cell: measured, predicted, error; the worst error at >= min_bytes."""
    lines, worst = [], 0.0
    for r in rows:
        t = _predict_row(r, p, bps) * 1e6
        e = (t - r["us"]) / r["us"]
        if r["nbytes"] >= min_bytes:
            worst = max(worst, abs(e))
        lines.append(f"{r['hosts']:>5} {r['op']:<15} {r['nbytes']:>10} {r['us']:>12.1f} "
                     f"{t:>12.1f} {e:>+7.1%} {choose(r['op'], r['hosts'], r['nbytes']):>14}")
    return lines, worst


def table(ops, hosts_list, sizes, rates, p, share=math.inf):
    out = []
    for rate in rates:
        bps = parse_rate(rate)
        for n in hosts_list:
            for op in ops:
                for s in sizes:
                    algo = choose(op, n, s)
                    t = predict(op, n, s, p, bps, share=share)
                    alts = {a: predict(op, n, s, p, bps, a, share) for a in ALTERNATIVES[op]}
                    best = min(alts, key=alts.get)
                    out.append({"rate": rate, "hosts": n, "op": op, "nbytes": s, "algo": algo,
                                "us": t * 1e6, "bound_us": bound(op, n, s, bps) * 1e6,
                                "best_algo": best, "best_us": alts[best] * 1e6})
    return out


def parse_rate(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, m in units.items():
        if rate.endswith(suffix):
            return float(rate[:-len(suffix)]) * m
    return float(rate)


def fmt_size(b):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:g} {unit}"
    return f"{b} B"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", help="bench/netlab.py --json files to calibrate from (commas)")
    ap.add_argument("--params", help="alpha,msg,call,eta[,cpu,gamma] (seconds, seconds per "
                    "byte; skips fitting)")
    ap.add_argument("--rates", default="10gbit,100gbit")
    ap.add_argument("--hosts", default="64,256,1024")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather")
    ap.add_argument("--sizes", default="4,65536,1048576,16777216,268435456")
    ap.add_argument("--plan-cores", type=float, default=math.inf,
                    help="cores per host for the planned tables' CPU terms (default: "
                    "unbounded; the fitted cpu and gamma are this machine's, where the "
                    "lab's hosts share its cores)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", help="write the fit and the prediction table here")
    args = ap.parse_args(argv)
    p = None
    if args.params:
        p = Params(*[float(x) for x in args.params.split(",")])
    check_rows = []
    if args.fit:
        rows, bps, rate = [], None, None
        for path in args.fit.split(","):
            with open(path) as f:
                run = json.load(f)
            if bps not in (None, run["bps"]):
                ap.error(f"--fit: {path} ran at {run['rate']}, the others at {rate}")
            bps, rate = run["bps"], run["rate"]
            cores = run.get("cores") or os.cpu_count()  # older runs: this machine's
            for r in run["rows"]:
                rows.append(dict(r, share=lab_share(cores, r["hosts"],
                                                    run.get("ranks_per_host", 1))))
        rows = medians(rows)
        if p is None:
            p = fit(rows, bps)
        print(f"fitted to {args.fit} ({rate}): {p}")
        lines, worst = check(rows, p, bps)
        check_rows = lines
        print(f"{'hosts':>5} {'op':<15} {'bytes':>10} {'measured us':>12} {'model us':>12} "
              f"{'error':>7} {'algorithm':>14}")
        print("\n".join(lines))
        print(f"worst error at >= 1 MiB: {worst:.1%}")
    if p is None:
        ap.error("give --fit FILE or --params ALPHA,MSG,CALL,ETA")
    rows = table(args.ops.split(","), [int(h) for h in args.hosts.split(",")],
                 [int(s) for s in args.sizes.split(",")], args.rates.split(","), p,
                 args.plan_cores)
    sep = " | " if args.markdown else "  "
    head = ["rate", "hosts", "op", "size", "algorithm", "model", "link bound", "best algorithm",
            "best"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print(sep.join(head))
    for r in rows:
        cells = [r["rate"], str(r["hosts"]), r["op"], fmt_size(r["nbytes"]), r["algo"],
                 _ms(r["us"]), _ms(r["bound_us"]), r["best_algo"], _ms(r["best_us"])]
        print(("| " + " | ".join(cells) + " |") if args.markdown else sep.join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": vars(p), "check": check_rows, "rows": rows}, f, indent=1)
    return 0


def _ms(us):
    return f"{us / 1000:.3f} ms" if us >= 1000 else f"{us:.1f} us"


if __name__ == "__main__":
    sys.exit(main())
