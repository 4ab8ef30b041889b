"""The figures README.md and docs/benchmarks.md state, computed from bench/results/.

Each claim names its data file, how many launches (or rounds) each cell holds, and how the
figure is computed; :func:`render` gives the figure's text as the documents state it (two
decimals, "lo-hi" or "at most hi"), and tests/install/test_claims.py checks that each
document holds exactly that text next to the file's name. Run it to print every claim:

    python bench/claims.py            # figure, data file, launches, where stated
    python bench/claims.py --check    # exit 1 if a document does not state a claim's figure

A ratio is the default backend's time over the other implementation's in one cell (world,
op, message size). Against "the faster of MPICH and Open MPI", a cell's ratio is the larger
of its two ratios; with several launches per cell, a cell's figure is the median over them.
"""
import argparse
import collections
import csv
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
DOCS = {"README.md": os.path.join(ROOT, "README.md"),
        "docs/benchmarks.md": os.path.join(ROOT, "docs", "benchmarks.md")}


def _json(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _jsonl(name):
    with open(os.path.join(RESULTS, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def vs_faster_mpi(name, tree="after", keep=lambda row: True):
    """{(world, op, bytes): [ratio per launch]} against the faster of MPICH and Open MPI:
    per launch, the larger of the cell's two ratios (collectives over each MPI's time)."""
    by = collections.defaultdict(dict)
    for r in _jsonl(name):
        if r.get("tree") == tree and keep(r):
            by[(r["launch"], r["world"], r["op"], r["bytes"])][r["mpi"]] = r["ratio"]
    cells = collections.defaultdict(list)
    for (_launch, *cell), mpis in sorted(by.items()):
        if len(mpis) == 2:
            cells[tuple(cell)].append(max(mpis.values()))
    return dict(cells)


def launches(name, tree="after"):
    return len({r["launch"] for r in _jsonl(name) if r.get("tree") == tree})


def before_after(name):
    """A two-tree mpi_matrix run: its launches, and :func:`vs_faster_mpi` of the "after"
    and of the "before" tree."""
    return launches(name), vs_faster_mpi(name), vs_faster_mpi(name, tree="before")


def medians(cells):
    return [statistics.median(v) for v in cells.values()]


def vs_torch_gloo(name, keep):
    """Ratios against torch gloo of bench_vs's JSON (its "ratios" list), cells kept by keep."""
    rows = _json(name)["ratios"]
    return [r["ratio"] for r in rows
            if r["vs"] == "torch:gloo" and r["impl"] == "collectives:gloo" and keep(r)]


def rounds_of(name):
    return len(next(iter(_json(name)["medians"].values())))


def csv_vs(name, impl, other, keep):
    """Ratios impl / other of a results CSV (columns world, op, size_bytes, impl, us)."""
    with open(os.path.join(RESULTS, name)) as f:
        rows = list(csv.DictReader(f))
    cells = collections.defaultdict(dict)
    for r in rows:  # a barrier's size is empty: 0 bytes
        cells[(int(r["world"]), r["op"], int(r["size_bytes"] or 0))][r["impl"]] = float(r["us"])
    return [v[impl] / v[other] for k, v in cells.items() if impl in v and other in v and keep(k)]


def nccl_vs_torch(name, key, max_bytes):
    rows = _json(name)[key]
    return [r["ours_s"] / r["torch_s"] for r in rows if r["bytes"] <= max_bytes]


def train_ratios(name, model, num, den):
    """Per launch and case of ``model`` in a bench_train JSON: the ``num`` step over the
    ``den`` step (keys of a mixed launch's result, e.g. "coll_ms", "floor_mem_sync_ms")."""
    return [r[num] / r[den] for run in _json(name) for r in run["results"] if r["model"] == model]


def _train_results(name, world, match):
    """The results, per launch at ``world``, of a bench_train JSON whose runs carry the keys
    ``match`` (e.g. map_min=0)."""
    return [r for run in _json(name)
            if run["world"] == world and all(run.get(k) == v for k, v in match.items())
            for r in run["results"]]


def cases(name, world, kind, model=None):
    """The results of ``kind`` ("ddp" or "fsdp"), per launch at ``world``, of a bench_train
    JSON (of ``model`` alone where given: "mlp8", "tfm")."""
    return [r for r in _train_results(name, world, {})
            if r["kind"] == kind and model in (None, r["model"])]


def ratios(results, num, den):
    """Per result of bench_train: the ``num`` step over the ``den`` step (e.g. "coll_ms",
    "gloo_ms")."""
    return [r[num] / r[den] for r in results]


def above_floor(name, world, **match):
    """Per launch (see :func:`_train_results`): ours' time above the floor over gloo's."""
    return above_floor_of(_train_results(name, world, match))


def above_floor_of(results):
    """Per result of bench_train: ours' time above the floor over gloo's."""
    return [(r["coll_ms"] - r["floor_ms"]) / (r["gloo_ms"] - r["floor_ms"]) for r in results]


def sums_core_ms(name, world, copies=2):
    """bench/fsdp_sum_cost.py's core-ms a step of the reduce_scatter's sums at ``world``,
    timed with ``copies`` processes at once (the 2-core VM's two cores both busy)."""
    return next(r["core_ms_per_step"] for r in _jsonl(name)
                if r["world"] == world and r["copies"] == copies)


def fsdp_bound(results, sum_core_ms, cores=2):
    """Per FSDP2 result of bench_train, over gloo's step: the fake floor with one wait a
    call plus the reduce_scatter's sums spread over the cores (ranks >= cores), the least a
    step takes when every call sums after its wait, as ours does."""
    return [(r["floor_sync_ms"] + sum_core_ms / cores) / r["gloo_ms"] for r in results]


def over_floor(name, world, **match):
    """Per launch (see :func:`_train_results`): ours' step over the floor's."""
    return ratios(_train_results(name, world, match), "coll_ms", "floor_ms")


def shared_ratios(name, model, copy):
    """Per launch and case of ``model`` in a bench_train JSON run with ``--shared``: the
    step of the shared-memory copy ``copy`` over torch gloo's."""
    return [r["shared_ms"][copy] / r["gloo_ms"] for run in _json(name) for r in run["results"]
            if r["model"] == model]


def train_launches(name):
    """Launches per world in a bench_train JSON (the fewest of any world)."""
    return min(collections.Counter(run["world"] for run in _json(name)).values())


def span(values):
    """"lo-hi" to two decimals, or the one figure when both read the same."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


def at_most(values):
    return f"{max(values):.2f}"


Claim = collections.namedtuple("Claim", "name file launches figure text where")

S5_VM = "2026-11-27-s5-vm-shm-vs-mpich-openmpi.jsonl"
S5_16 = "2026-11-27-s5-16core-after-shm-vs-mpich-openmpi.jsonl"
S5_VS = "2026-11-27-s5-bench-vs-torch-gloo.json"
S5_NCCL = "2026-11-27-s5-nccl-vs-torch-h100.json"
NOV21 = "2026-11-21-collectives-vs-torch-gloo-and-mpich.csv"
FSDP_MEM = "2026-11-29-fsdp-memory-floor.json"
FSDP_SHARED = "2026-11-29-fsdp-shared.json"
FSDP_DEFAULT = "2026-11-29-fsdp-default.json"
DDP_MAPPED = "2026-11-30-ddp-mapped-buckets.json"
DDP_HEAP = "2026-11-30-ddp-heap.json"
CPU = "2026-11-30-cpu-accounting.json"
BOUND = "2026-11-30-fsdp-bound.json"
SUMS = "2026-11-30-fsdp-sum-cost.jsonl"
GATHERS = "2026-11-30-evening-gathers-vs-mpich-openmpi.jsonl"
CHOICE = "2026-11-30-evening-all-gather-choice.jsonl"
WHOLE = "2026-11-30-night-all-gather-whole-block.jsonl"
H200_TRAIN = "2026-11-30-h200-16core-train.json"
H200_GATHERS = "2026-11-30-h200-16core-gathers.jsonl"
LATE_TRAIN = "2026-11-30-late-vm-train.json"
LATE_GATHER = "2026-11-30-late-vm-all-gather.jsonl"
LATE_PAIR = "2026-11-30-late-vm-pair-ops.jsonl"
LATE_FRONT = "2026-11-30-late-vm-in-place-front-end.jsonl"
DEC01_TRAIN = "2026-12-01-vm-train.json"
DEC01_GATHER = "2026-12-01-vm-all-gather.jsonl"
SMALL = 65536
BIG = 16 << 20


def ddp_claims(name, world, label, over, above, where):
    """Issue 51's two DDP lines for the comm-bound MLP at ``world`` in a bench_train JSON:
    ours over the floor (``over``), and ours' time above the floor over gloo's (``above``)."""
    mlp = cases(name, world, "ddp", "mlp8")
    return [Claim(f"{label}, DDP MLP over the floor, world {world}", name, len(mlp),
                  span(ratios(mlp, "coll_ms", "floor_ms")), over, where),
            Claim(f"{label}, DDP MLP above the floor, world {world}", name, len(mlp),
                  span(above_floor_of(mlp)), above, where)]


def day_claims(name, world, label, over, above, suffix, where):
    """A VM day's training claims at ``world`` in a bench_train JSON: :func:`ddp_claims`, and
    FSDP2's and the transformer's DDP step over gloo's (their texts ending in ``suffix``)."""
    fsdp, tfm = cases(name, world, "fsdp"), cases(name, world, "ddp", "tfm")
    return ddp_claims(name, world, label, over, above, where) + [
        Claim(f"{label}, FSDP2 transformer, world {world}", name, len(fsdp),
              span(ratios(fsdp, "coll_ms", "gloo_ms")),
              f"FSDP2 at world {world} {{fig}}x gloo's step{suffix}", where),
        Claim(f"{label}, DDP transformer, world {world}", name, len(tfm),
              span(ratios(tfm, "coll_ms", "gloo_ms")),
              f"the transformer's DDP at world {world} {{fig}}x{suffix}", where)]


def claims():
    """Every stated figure: (name, data file, launches per cell, figure, the text that states
    it, the documents that state it). ``text`` holds ``{fig}`` where the figure goes."""
    out = []
    both = ("README.md", "docs/benchmarks.md")
    r = rounds_of(S5_VS)
    out.append(Claim("torch gloo up to 64 KiB", S5_VS, r,
                     at_most(vs_torch_gloo(S5_VS, lambda c: c["bytes"] <= SMALL)),
                     "at most {fig}x torch gloo's time for messages up to 64 KiB", both))
    out.append(Claim("torch gloo at 16 MiB", S5_VS, r,
                     span(vs_torch_gloo(S5_VS, lambda c: c["bytes"] == BIG)),
                     "{fig}x at 16 MiB", both))
    out.append(Claim("16-core host, faster MPI", S5_16, launches(S5_16),
                     span(medians(vs_faster_mpi(S5_16))),
                     "{fig}x the time of all_reduce, all_gather, broadcast and barrier", both))
    vm = vs_faster_mpi(S5_VM)
    out.append(Claim("2-core VM, faster MPI", S5_VM, launches(S5_VM), span(medians(vm)),
                     "{fig}x on 2 and 4 ranks of a 2-core VM", both))
    closest = vm[(4, "broadcast", SMALL)]
    out.append(Claim("2-core VM, 4-rank 64 KiB broadcast", S5_VM, len(closest), span(closest),
                     "the 4-rank 64 KiB broadcast, {fig}x", both))
    out.append(Claim("2-core VM, 4-rank 64 KiB broadcast median", S5_VM, len(closest),
                     f"{statistics.median(closest):.2f}", "median {fig}x", both))
    out.append(Claim("nccl at world 1 up to 1 MiB", S5_NCCL, 1,
                     span(nccl_vs_torch(S5_NCCL, "after", 1 << 20)),
                     "{fig}x torch's ProcessGroupNCCL time up to 1 MiB at world 1 on one H100 GPU",
                     both))
    bench = ("docs/benchmarks.md",)
    over = train_ratios(FSDP_MEM, "tfm", "coll_ms", "floor_mem_sync_ms")
    per = train_launches(FSDP_MEM)
    out.append(Claim("FSDP2 transformer over its memory floor with the waits", FSDP_MEM,
                     per, span(over),
                     "ours {fig}x the memory floor plus one wait a call", bench))
    out.append(Claim("FSDP2 transformer's memory floor against torch gloo", FSDP_MEM,
                     per, span(train_ratios(FSDP_MEM, "tfm", "floor_mem_ms", "gloo_ms")),
                     "the memory floor alone {fig}x gloo's step", bench))
    out.append(Claim("FSDP2 transformer with share_collectives against torch gloo", FSDP_SHARED,
                     train_launches(FSDP_SHARED),
                     span(shared_ratios(FSDP_SHARED, "tfm", "coll")),
                     "with `share_collectives` ours {fig}x gloo's step", bench))
    per = train_launches(FSDP_DEFAULT)
    out.append(Claim("FSDP2 transformer as written (shared by default) against torch gloo",
                     FSDP_DEFAULT, per, span(train_ratios(FSDP_DEFAULT, "tfm", "coll_ms", "gloo_ms")),
                     "as the program wrote it ours {fig}x gloo's step", bench))
    out.append(Claim("FSDP2 transformer with FSDP2's own calls against torch gloo",
                     FSDP_DEFAULT, per, span(shared_ratios(FSDP_DEFAULT, "tfm", "coll_own")),
                     "with FSDP2's own calls {fig}x", bench))
    per = train_launches(DDP_MAPPED) // 2  # launches in pairs: mapped and not
    for world in (2, 4):
        out.append(Claim(f"DDP MLP above the floor, buckets mapped, world {world}", DDP_MAPPED,
                         per, span(above_floor(DDP_MAPPED, world, map_min=1 << 20)),
                         f"world {world}: {{fig}} of gloo's time above the floor mapped", bench))
        out.append(Claim(f"DDP MLP above the floor, not mapped, world {world}", DDP_MAPPED, per,
                         span(above_floor(DDP_MAPPED, world, map_min=0)),
                         "against {fig} without", bench))
    per = train_launches(DDP_HEAP) // 2  # launches in pairs: glibc's thresholds fixed and not
    for world in (2, 4):
        for heap, said in (("on", "fixed"), ("off", "glibc's own")):
            out.append(Claim(f"DDP MLP over the floor, world {world}, heap {heap}", DDP_HEAP, per,
                             span(over_floor(DDP_HEAP, world, heap=heap)),
                             f"world {world}, malloc thresholds {said}: ours {{fig}}x the floor",
                             bench))
            out.append(Claim(f"DDP MLP above the floor, world {world}, heap {heap}", DDP_HEAP,
                             per, span(above_floor(DDP_HEAP, world, heap=heap)),
                             "{fig} of gloo's time above it", bench))
    fsdp4 = cases(CPU, 4, "fsdp")
    out.append(Claim("FSDP2 transformer, world 4, against torch gloo", CPU, len(fsdp4),
                     span(ratios(fsdp4, "coll_ms", "gloo_ms")),
                     "world 4: ours {fig}x gloo's step", bench))
    out.append(Claim("FSDP2 transformer's fake floor with one wait a call, world 4", CPU,
                     len(fsdp4), span(ratios(fsdp4, "floor_sync_ms", "gloo_ms")),
                     "the fake floor with one wait a call {fig}x", bench))
    ddp4 = cases(CPU, 4, "ddp")
    out.append(Claim("DDP MLP over the floor, world 4, CPU launches", CPU, len(ddp4),
                     span(ratios(ddp4, "coll_ms", "floor_ms")),
                     "DDP at world 4: ours {fig}x the floor", bench))
    fsdp4 = cases(BOUND, 4, "fsdp")
    out.append(Claim("FSDP2 transformer, world 4, evening launches", BOUND, len(fsdp4),
                     span(ratios(fsdp4, "coll_ms", "gloo_ms")),
                     "FSDP2 at world 4: ours {fig}x gloo's step", bench))
    out.append(Claim("FSDP2 transformer, world 4, the fake floor with one wait a call plus the sums",
                     BOUND, len(fsdp4), span(fsdp_bound(fsdp4, sums_core_ms(SUMS, 4))),
                     "the fake floor with one wait a call plus the reduce_scatter's sums "
                     "{fig}x", bench))
    out.append(Claim("FSDP2 transformer, world 4, the fake floor with one wait a call, evening",
                     BOUND, len(fsdp4), span(ratios(fsdp4, "floor_sync_ms", "gloo_ms")),
                     "the fake floor with one wait a call alone {fig}x", bench))
    fsdp2 = cases(BOUND, 2, "fsdp")
    out.append(Claim("FSDP2 transformer, world 2, evening launch", BOUND, len(fsdp2),
                     span(ratios(fsdp2, "coll_ms", "gloo_ms")),
                     "at world 2 (a core a rank) {fig}x", bench))
    ddp = {w: cases(BOUND, w, "ddp") for w in (2, 4)}
    for world in (2, 4):
        out.append(Claim(f"DDP MLP over the floor, world {world}, evening launch", BOUND,
                         len(ddp[world]), span(ratios(ddp[world], "coll_ms", "floor_ms")),
                         f"DDP at world {world}: ours {{fig}}x the floor", bench))
        out.append(Claim(f"DDP MLP above the floor, world {world}, evening launch", BOUND,
                         len(ddp[world]), span(above_floor_of(ddp[world])),
                         "{fig} of gloo's time above it", bench))
    for op, said in (("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter")):
        cells = vs_faster_mpi(GATHERS, keep=lambda r, op=op: r["op"] == op)
        out.append(Claim(f"2-core VM, {op} against the faster MPI, evening", GATHERS,
                         launches(GATHERS), span(medians(cells)),
                         f"{said} {{fig}}x the faster MPI's time", bench))
    ag = vs_faster_mpi(GATHERS, keep=lambda r: r["op"] == "all_gather")
    for world in (2, 4):
        out.append(Claim(f"2-core VM, 1 MiB all_gather against the faster MPI, world {world}",
                         GATHERS, len(ag[(world, "all_gather", 1 << 20)]),
                         span([statistics.median(ag[(world, "all_gather", 1 << 20)])]),
                         f"the 1 MiB all_gather at world {world} {{fig}}x", bench))
    n, after, before = before_after(CHOICE)
    out.append(Claim("2-core VM, all_gather at world 4 with the measured choice", CHOICE, n,
                     span(medians({k: v for k, v in after.items() if k[0] == 4})),
                     "world 4, the measured choice: all_gather {fig}x the faster MPI's time",
                     bench))
    mib = (4, "all_gather", 1 << 20)
    out.append(Claim("2-core VM, 1 MiB all_gather at world 4 per launch, measured choice", CHOICE,
                     n, span(after[mib]), "the 1 MiB cell {fig}x per launch", bench))
    out.append(Claim("2-core VM, 1 MiB all_gather at world 4 per launch, single copy", CHOICE,
                     n, span(before[mib]), "against {fig}x with the single copy always", bench))
    out.append(Claim("2-core VM, 1 MiB all_gather at world 2 per launch (path unchanged)",
                     CHOICE, n, span(after[(2, "all_gather", 1 << 20)]),
                     "world 2's 1 MiB cell (its path unchanged) {fig}x", bench))
    n, after, before = before_after(WHOLE)
    out.append(Claim("2-core VM, all_gather with the block whole or in pieces measured", WHOLE, n,
                     span(medians(after)), "every cell's median {fig}x the faster MPI's time",
                     bench))
    for mib in (1, 4):
        cell = (2, "all_gather", mib << 20)
        out.append(Claim(f"2-core VM, {mib} MiB all_gather at world 2 per launch, measured form",
                         WHOLE, n, span(after[cell]),
                         f"world 2, {mib} MiB: {{fig}}x per launch", bench))
        out.append(Claim(f"2-core VM, {mib} MiB all_gather at world 2 per launch, in pieces",
                         WHOLE, n, span(before[cell]),
                         "against {fig}x in pieces always", bench))
    for world in (4, 8):  # the lent 16-core machine
        out += ddp_claims(H200_TRAIN, world, "16-core host",
                          f"16 cores, DDP at world {world}: ours {{fig}}x the floor",
                          "{fig} of gloo's time above it", bench)
        tfm = cases(H200_TRAIN, world, "ddp", "tfm")
        out.append(Claim(f"16-core host, DDP transformer, world {world}", H200_TRAIN, len(tfm),
                         span(ratios(tfm, "coll_ms", "gloo_ms")),
                         f"the transformer at world {world} {{fig}}x gloo's step", bench))
    for op in ("all_gather", "reduce_scatter"):
        cells = vs_faster_mpi(H200_GATHERS, keep=lambda r, op=op: r["op"] == op)
        out.append(Claim(f"16-core host, {op} against the faster MPI", H200_GATHERS,
                         launches(H200_GATHERS), span(medians(cells)),
                         f"16 cores, {op} {{fig}}x the faster MPI's time", bench))
    for world in (2, 4):  # the VM again, on another day's host
        out += day_claims(LATE_TRAIN, world, "2-core VM, late",
                          f"late host, DDP at world {world}: ours {{fig}}x the floor",
                          f"and {{fig}} of gloo's time above it (world {world})", "", bench)
    cells = vs_faster_mpi(LATE_GATHER, keep=lambda r: r["op"] == "all_gather")
    out.append(Claim("2-core VM, late, all_gather against the faster MPI", LATE_GATHER,
                     launches(LATE_GATHER), span(medians(cells)),
                     "all_gather's medians {fig}x the faster MPI's time", bench))
    cells = vs_faster_mpi(LATE_PAIR, keep=lambda r: r["op"] == "reduce_scatter")
    out.append(Claim("2-core VM, late, reduce_scatter against the faster MPI", LATE_PAIR,
                     launches(LATE_PAIR), span(medians(cells)),
                     "reduce_scatter's {fig}x", bench))
    cells = vs_faster_mpi(LATE_PAIR, keep=lambda r: r["op"] == "all_gather_in_place"
                          and r["world"] == 2 and r["bytes"] >= SMALL)
    out.append(Claim("2-core VM, late, in-place all_gather at world 2 from 64 KiB", LATE_PAIR,
                     launches(LATE_PAIR), span(medians(cells)),
                     "the in-place all_gather (FSDP2's form) at world 2 from 64 KiB {fig}x",
                     bench))
    n, after, before = before_after(LATE_FRONT)
    tiny = (2, "all_gather_in_place", 4)
    out.append(Claim("2-core VM, in-place all_gather of 4 B, the direct call", LATE_FRONT, n,
                     span(after[tiny]), "the in-place all_gather of 4 B {fig}x", bench))
    out.append(Claim("2-core VM, in-place all_gather of 4 B, the general path", LATE_FRONT, n,
                     span(before[tiny]), "against {fig}x through the general path", bench))
    tiny = (2, "reduce_scatter_in_place", 4)
    out.append(Claim("2-core VM, in-place reduce_scatter of 4 B, the direct call", LATE_FRONT,
                     n, span(after[tiny]), "the in-place reduce_scatter of 4 B {fig}x", bench))
    out.append(Claim("2-core VM, in-place reduce_scatter of 4 B, the general path", LATE_FRONT,
                     n, span(before[tiny]), "against {fig}x through the general path", bench))
    for world in (2, 4):  # the VM on a third host day
        out += day_claims(DEC01_TRAIN, world, "2-core VM, Dec 1",
                          f"on 2026-12-01, DDP at world {world}: ours {{fig}}x the floor",
                          f"and {{fig}} of gloo's time above it (world {world}, 2026-12-01)",
                          " (2026-12-01)", bench)
    mlp = cases(DEC01_TRAIN, 2, "ddp", "mlp8") + cases(DEC01_TRAIN, 4, "ddp", "mlp8")
    out.append(Claim("2-core VM, Dec 1, DDP MLP over its memory floor with the waits",
                     DEC01_TRAIN, len(mlp) // 2, span(ratios(mlp, "coll_ms", "floor_mem_sync_ms")),
                     "ours {fig}x the memory floor with its waits", bench))
    cells = vs_faster_mpi(DEC01_GATHER, keep=lambda r: r["op"] == "all_gather")
    out.append(Claim("2-core VM, Dec 1, all_gather against the faster MPI", DEC01_GATHER,
                     launches(DEC01_GATHER), span(medians(cells)),
                     "all_gather's medians {fig}x the faster MPI's time (2026-12-01)", bench))
    out.append(Claim("2-core VM, Dec 1, all_gather at world 2, 4 MiB", DEC01_GATHER,
                     launches(DEC01_GATHER), span(cells[(2, "all_gather", 4 << 20)]),
                     "at world 2 and 4 MiB {fig}x per launch", bench))
    # the first round's figures (docs/benchmarks.md's section on that day's code)
    out.append(Claim("2026-11-21 torch gloo up to 64 KiB", NOV21, 1,
                     at_most(csv_vs(NOV21, "collectives:gloo", "torch:gloo", lambda k: k[2] <= SMALL)),
                     "at most {fig}x torch gloo's time up to 64 KiB", ("docs/benchmarks.md",)))
    out.append(Claim("2026-11-21 torch gloo at 16 MiB", NOV21, 1,
                     span(csv_vs(NOV21, "collectives:gloo", "torch:gloo", lambda k: k[2] == BIG)),
                     "{fig}x at 16 MiB, and", ("docs/benchmarks.md",)))
    out.append(Claim("2026-11-21 MPICH", NOV21, 1,
                     span(csv_vs(NOV21, "collectives:gloo", "mpi4py", lambda k: True)),
                     "{fig}x MPICH's in all", ("docs/benchmarks.md",)))
    return out


def render(claim):
    return claim.text.format(fig=claim.figure)


def paragraphs(name):
    """A document's paragraphs (blank-line separated; list items apart), each with its line
    breaks and runs of spaces as single spaces."""
    with open(DOCS[name]) as f:
        text = f.read().replace("\n- ", "\n\n- ")
    return [" ".join(p.split()) for p in text.split("\n\n")]


def problems():
    """What the documents state wrongly: a claim's text in no paragraph of a document that
    should hold it, or in none that also names the claim's data file and its launches (or
    rounds) per cell."""
    found = []
    for c in claims():
        stem = c.file.rsplit(".", 1)[0]
        for doc in c.where:
            paras = [p for p in paragraphs(doc) if render(c) in p]
            if not paras:
                found.append(f"{doc}: no {render(c)!r} ({c.name}, from {c.file})")
            elif not any(stem in p and (f"{c.launches} launch" in p or f"{c.launches} round" in p)
                         for p in paras):
                found.append(f"{doc}: {render(c)!r} is not beside {c.file} and its "
                             f"{c.launches} launches ({c.name})")
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where a document disagrees")
    args = ap.parse_args(argv)
    for c in claims():
        print(f"{c.name}: {c.figure} ({c.file}, {c.launches} launch(es) per cell; "
              f"stated in {', '.join(c.where)})")
    if args.check:
        bad = problems()
        for p in bad:
            print("claims:", p, file=sys.stderr)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
