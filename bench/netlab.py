#!/usr/bin/env python3
"""An emulated cluster on one machine: N "hosts" joined by rate-limited links.

Each host is a network namespace with one interface (``eth0``, 10.77.0.<i+1>/24) on a
veth pair whose other end sits on a bridge in a switch namespace. Both directions of
every host's link are limited by a token bucket (``tc ... tbf``): the host's egress on
its own end, its ingress on the switch's end. No delay is added (this kernel has no
netem). Needs root, iproute2's ``ip`` and ``tc``; :func:`missing` says why not.

    sudo python bench/netlab.py --hosts 4 --rate 1gbit --ranks-per-host 1 \
        --impls collectives,torch --ops all_reduce,broadcast,all_gather --sizes 1k,64k,16m

runs bench/netlab_target.py on every host with ``collectives-run`` (static or c10d
rendezvous) and torch's gloo with ``torchrun``, launches alternating, and prints each
(op, size): the median time per call, the fraction of the link bound reached, and
collectives / torch gloo. ``--probe`` first times raw TCP streams over the same links
(bench/netlab_probe.py), the ceiling of the moment. ``--json FILE`` keeps the run for
bench/model.py's calibration; ``--report`` reports such files together, ``--csv`` writes
the medians for bench/plot.py. Every namespace is deleted on exit, on an error and on
SIGINT/SIGTERM.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET = os.path.join(HERE, "netlab_target.py")
PROBE = os.path.join(HERE, "netlab_probe.py")
SUBNET = "10.77.0"


def missing():
    """Why the lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def parse_rate(rate):
    """Bits per second of a tc rate string ('1gbit', '100mbit', '10gbit')."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for suffix in ("kbit", "mbit", "gbit", "bit"):
        if rate.endswith(suffix):
            return float(rate[:-len(suffix)]) * units[suffix]
    return float(rate)


def _sh(*cmd, check=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p


class Lab:
    """``hosts`` namespaces on a bridge, each link limited to ``rate`` both ways.

    Use as a context manager; :meth:`popen` starts a command inside host ``i``.
    """

    def __init__(self, hosts, rate="1gbit", burst=None, tag=None):
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in 1..200, got {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.bps = parse_rate(rate)
        # a bucket of ~1 ms of traffic (at least 64 KiB, so GSO packets pass whole)
        self.burst = burst or max(64 * 1024, int(self.bps / 8 / 1000))
        self.tag = tag or f"nl{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        self._made = []
        self._procs = []

    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def __enter__(self):
        why = missing()
        if why:
            raise RuntimeError(why)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)
        return self

    def __exit__(self, *exc):
        self.close()

    def _tbf(self, ns, dev):
        _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
            "burst", str(self.burst), "latency", "100ms")

    def _build(self):
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            a, b = f"{self.tag}a{i}", f"{self.tag}b{i}"
            _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _sh("ip", "link", "set", a, "netns", ns)
            _sh("ip", "link", "set", b, "netns", self.switch)
            _sh("ip", "-n", ns, "link", "set", a, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", self.switch, "link", "set", b, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", b, "up")
            self._tbf(ns, "eth0")          # host -> switch
            self._tbf(self.switch, b)      # switch -> host

    def popen(self, i, cmd, env=None, **kw):
        """Start ``cmd`` inside host ``i`` (its own host name too, via unshare --uts)."""
        script = f'hostname {self.names[i]} && exec "$@"'
        full = ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", script,
                "sh", *cmd]
        p = subprocess.Popen(full, env=env, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def close(self):
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        self._procs = []
        for ns in reversed(self._made):
            _sh("ip", "netns", "del", ns, check=False)
        self._made = []


# ---- the link bound -----------------------------------------------------------------

def link_bytes(op, hosts, nbytes, ranks_per_host=1):
    """Bytes the busiest host link must carry one way for ``op`` on ``nbytes`` per rank
    with ``ranks_per_host`` ranks on each host (all_gather: each rank's input;
    reduce_scatter: each rank's output). A reduced or broadcast buffer crosses a host's
    link as one, whatever the host's rank count; gathered and exchanged data is every
    rank's own, so a host's share grows with its ranks."""
    n, r = hosts, ranks_per_host
    if n == 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "broadcast":
        return nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * r * nbytes
    if op == "all_to_all":
        return r * (n - 1) / n * nbytes
    return 0


def bound_s(op, hosts, nbytes, bps, ranks_per_host=1):
    return link_bytes(op, hosts, nbytes, ranks_per_host) * 8 / bps


# ---- runs ---------------------------------------------------------------------------

def _env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "COLLECTIVES_HOST_ID", "COLLECTIVES_TRANSPORT", "COLLECTIVES_IFNAME",
                        "GLOO_SOCKET_IFNAME")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def launch(lab, impl, args, port, out_path, verify=False):
    """One job over every host of ``lab``; returns the target's JSON (rank 0's)."""
    procs = []
    target = [TARGET, "--impl", impl, "--ops", args.ops, "--sizes", args.sizes,
              "--budget", str(args.budget), "--out", out_path] + (["--verify"] if verify else [])
    for i in range(lab.hosts):
        if impl == "torch":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(lab.hosts),
                   "--node-rank", str(i), "--nproc-per-node", str(args.ranks_per_host),
                   "--master-addr", lab.addr(0), "--master-port", str(port)]
        elif args.rdzv == "c10d":
            cmd = [sys.executable, "-m", "collectives.run", "--nnodes", str(lab.hosts),
                   "-n", str(args.ranks_per_host), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{lab.addr(0)}:{port}"]
        else:
            cmd = [sys.executable, "-m", "collectives.run", "--nnodes", str(lab.hosts),
                   "--node-rank", str(i), "-n", str(args.ranks_per_host),
                   "--master-addr", lab.addr(0), "--master-port", str(port)]
        procs.append(lab.popen(i, cmd + target, env=_env(), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.job_timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            lab.close()
            raise RuntimeError(f"{impl} job did not finish within {args.job_timeout} s") from None
        outs.append(out)
        if p.returncode:
            raise RuntimeError(f"{impl} job failed (exit {p.returncode}):\n{out[-4000:]}")
    with open(out_path) as f:
        return json.load(f)


def probe(lab, pattern, nbytes=16 << 20, reps=8, timeout=120):
    """Raw TCP streams over the lab's links (bench/netlab_probe.py): each sending host's
    goodput as a fraction of the link rate, in host order."""
    start = time.time() + 2.0
    procs = [lab.popen(i, [sys.executable, PROBE, "--host", str(i), "--hosts", str(lab.hosts),
                           "--subnet", SUBNET, "--pattern", pattern, "--bytes", str(nbytes),
                           "--reps", str(reps), "--start", str(start)],
                       env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(lab.hosts if pattern == "ring" else 2)]
    fractions = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"netlab_probe failed (exit {p.returncode}):\n{out[-2000:]}")
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                fractions.append(r["bytes"] * 8 / r["seconds"] / lab.bps)
    return fractions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="2", help="comma-separated host counts (default 2)")
    ap.add_argument("--rate", default="1gbit", help="tc rate of each link, both ways")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--impls", default="collectives,torch")
    ap.add_argument("--ops", default="all_reduce,broadcast,all_gather")
    ap.add_argument("--sizes", default="4,1k,64k,1m,16m", help="bytes per rank (k, m suffixes)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per cell")
    ap.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--json", help="write every sample here")
    ap.add_argument("--probe", action="store_true",
                    help="each round, first time raw TCP streams over the links (one way, "
                    "and a ring: every link both ways) for the ceiling a library can reach")
    ap.add_argument("--csv", help="write the medians for bench/plot.py here")
    ap.add_argument("--report", help="comma-separated --json files of earlier runs: report "
                    "them together (and --csv) instead of running")
    args = ap.parse_args(argv)
    if args.report:
        rows, probes, bps, rph = from_json(args.report.split(","))
        summarize(rows, probes, bps, rph, args.csv)
        return 0
    why = missing()
    if why:
        print(f"netlab: skipped: {why}")
        return 0
    runs, probes = [], []
    port = 29600
    for hosts in [int(h) for h in args.hosts.split(",")]:
        with Lab(hosts, args.rate) as lab:
            for rnd in range(args.rounds):
                if args.probe:
                    for pattern in ("oneway", "ring"):
                        probes.append({"hosts": hosts, "round": rnd, "pattern": pattern,
                                       "fractions": probe(lab, pattern)})
                for impl in args.impls.split(","):
                    port += 1
                    out = f"/tmp/netlab-{os.getpid()}-{impl}.json"
                    res = launch(lab, impl, args, port, out)
                    for row in res["rows"]:
                        row.update(hosts=hosts, rate=args.rate, impl=impl, round=rnd,
                                   ranks_per_host=args.ranks_per_host)
                        runs.append(row)
                    os.unlink(out)
    summarize(runs, probes, parse_rate(args.rate), args.ranks_per_host, args.csv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rate": args.rate, "bps": parse_rate(args.rate),
                       "ranks_per_host": args.ranks_per_host, "cores": os.cpu_count(),
                       "rows": runs, "probes": probes}, f, indent=1)
    return 0


def cells(rows):
    """{(hosts, op, nbytes): {impl: [each launch's median us]}}."""
    out = {}
    for r in rows:
        out.setdefault((r["hosts"], r["op"], r["nbytes"]), {}).setdefault(r["impl"], []).append(
            r["us"])
    return out


def report(rows, bps, ranks_per_host=1):
    """One line per (hosts, op, size) and impl: the median over launches of the time per
    call, its fraction of the link bound (and the launches' range of it), collectives /
    torch."""
    print(f"{'hosts':>5} {'op':<15} {'bytes':>10} {'impl':<12} {'us':>11} {'of bound':>9} "
          f"{'launches':>12} {'vs torch':>9}")
    for (hosts, op, nbytes), impls in sorted(cells(rows).items()):
        b = bound_s(op, hosts, nbytes, bps, ranks_per_host) * 1e6
        torch_us = statistics.median(impls["torch"]) if "torch" in impls else None
        for impl, us in sorted(impls.items()):
            m = statistics.median(us)
            frac = f"{b / m:.3f}" if b else "-"
            spread = f"{b / max(us):.3f}-{b / min(us):.3f}" if b else "-"
            ratio = f"{m / torch_us:.2f}" if torch_us and impl != "torch" else ""
            print(f"{hosts:>5} {op:<15} {nbytes:>10} {impl:<12} {m:>11.1f} {frac:>9} "
                  f"{spread:>12} {ratio:>9}")


def summarize(rows, probes, bps, ranks_per_host, csv_path=None):
    """A run's or earlier runs' report, the raw TCP probes after it, and the CSV."""
    report(rows, bps, ranks_per_host)
    for p in probes:
        print(f"raw TCP, {p['hosts']} hosts, round {p['round']}, {p['pattern']:<6}: "
              f"{min(p['fractions']):.3f}-{max(p['fractions']):.3f} of the link rate")
    if csv_path:
        write_csv(rows, csv_path, ranks_per_host)


def write_csv(rows, path, ranks_per_host=1):
    """bench/plot.py's layout: the median time per call and the busiest link's GB/s."""
    with open(path, "w") as f:
        f.write("world,op,size_bytes,impl,us,busbw_gbs\n")
        for (hosts, op, nbytes), impls in sorted(cells(rows).items()):
            for impl, us in sorted(impls.items()):
                m = statistics.median(us)
                gbs = link_bytes(op, hosts, nbytes, ranks_per_host) / m / 1e3
                f.write(f"{hosts},{op},{nbytes},{impl}:gloo,{m:.1f},{gbs:.4f}\n")


def from_json(paths):
    """The rows, probes, rate and ranks per host of earlier runs' --json files."""
    rows, probes, bps, rph = [], [], None, None
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if bps not in (None, d["bps"]) or rph not in (None, d["ranks_per_host"]):
            raise SystemExit(f"{path}: another rate or ranks per host than the files before it")
        bps, rph = d["bps"], d["ranks_per_host"]
        rows += d["rows"]
        probes += d.get("probes", [])
    return rows, probes, bps, rph


if __name__ == "__main__":
    sys.exit(main())
