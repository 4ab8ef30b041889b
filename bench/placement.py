"""Which cores are near and which far: a cache-line round trip between every pair of cores,
and core sets for pinning ranks near (one cache domain) and far (spread across domains).

usage: python bench/placement.py [--cpus 0-15] [--worlds 2,4,8,16] [--json F]

Two threads, pinned to cores a and b, pass a counter back and forth through one cache line
(a small C program built with cc at run time); the median round trip in ns per pair is the
distance. Where the round trips are uniform (90th percentile within 1.5x of the 10th) the
cores are one group; else they are grouped greedily: a core joins the group of the first
core within 1.5x the smallest round trip seen from it. "near" for world w is w cores taken group by
group (the closest first); "far" takes the cores round-robin across the groups, so
neighbouring ranks sit in different groups. With one group the two sets are the same and
"far" is reported as unavailable. sysfs's L3 groups (cache/index3/shared_cpu_list) are
printed beside the measured ones. Prints one JSON object.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

PINGPONG_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <time.h>
static _Alignas(64) _Atomic long line;
static int cpu_b;
static long rounds;
static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s);
                           pthread_setaffinity_np(pthread_self(), sizeof s, &s); }
static void *pong(void *arg) {
    (void)arg; pin(cpu_b);
    for (long i = 1; i <= rounds; i++) {
        while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i - 1) ;
        atomic_store_explicit(&line, 2 * i, memory_order_release);
    }
    return NULL;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    int a = atoi(argv[1]); cpu_b = atoi(argv[2]); rounds = atol(argv[3]);
    int samples = atoi(argv[4]);
    pin(a);
    for (int s = 0; s < samples; s++) {
        atomic_store(&line, 0);
        pthread_t t; pthread_create(&t, NULL, pong, NULL);
        double t0 = now();
        for (long i = 1; i <= rounds; i++) {
            atomic_store_explicit(&line, 2 * i - 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i) ;
        }
        double dt = now() - t0;
        pthread_join(t, NULL);
        printf("%.1f\n", dt / rounds);
    }
    return 0;
}
"""


def build(folder):
    src, exe = os.path.join(folder, "pingpong.c"), os.path.join(folder, "pingpong")
    with open(src, "w") as f:
        f.write(PINGPONG_C)
    subprocess.run(["cc", "-O2", "-pthread", src, "-o", exe], check=True)
    return exe


def round_trip(exe, a, b, rounds=20000, samples=5):
    out = subprocess.run([exe, str(a), str(b), str(rounds), str(samples)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    vals = sorted(float(v) for v in out)
    return vals[len(vals) // 2]


def parse_cpus(text):
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += list(range(int(lo), int(hi or lo) + 1))
    return cpus


def sysfs_l3():
    groups = set()
    for cpu in sorted(os.sched_getaffinity(0)):
        p = f"/sys/devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list"
        if os.path.exists(p):
            groups.add(open(p).read().strip())
    return sorted(groups)


def group(cpus, rtt):
    """One group where the round trips are uniform (the 90th percentile within 1.5x of the
    10th: outliers are noise, not topology); else greedy: each core joins the first group
    whose first core is within 1.5x of the smallest round trip seen from that core."""
    vals = sorted(rtt[c][d] for c in cpus for d in cpus if c < d)
    if vals[int(0.9 * (len(vals) - 1))] < 1.5 * vals[int(0.1 * (len(vals) - 1))]:
        return [list(cpus)]
    groups = []
    for c in cpus:
        nearest = min(rtt[c][d] for d in cpus if d != c)
        for g in groups:
            if rtt[c][g[0]] <= 1.5 * nearest:
                g.append(c)
                break
        else:
            groups.append([c])
    return groups


def sets(groups, worlds):
    flat = [c for g in groups for c in g]
    near, far = {}, {}
    for w in worlds:
        if w > len(flat):
            continue
        near[w] = flat[:w]
        rr, i = [], 0
        while len(rr) < w:  # round-robin over the groups
            for g in groups:
                if i < len(g) and len(rr) < w:
                    rr.append(g[i])
            i += 1
        far[w] = rr if len(groups) > 1 else None
    return near, far


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", default=None, help="cores to measure (default: those allowed)")
    ap.add_argument("--worlds", default="2,4,8,16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cpus = parse_cpus(a.cpus) if a.cpus else sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        exe = build(d)
        rtt = {c: {} for c in cpus}
        for i, c in enumerate(cpus):
            for d2 in cpus[i + 1:]:
                rtt[c][d2] = rtt[d2][c] = round_trip(exe, c, d2)
    groups = group(cpus, rtt) if len(cpus) > 1 else [cpus]
    near, far = sets(groups, [int(w) for w in a.worlds.split(",")])
    res = {"cpus": cpus, "rtt_ns": {str(c): rtt[c] for c in cpus}, "groups": groups,
           "sysfs_l3": sysfs_l3(), "near": near, "far": far}
    text = json.dumps(res)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
