#!/usr/bin/env python3
"""DDP and FSDP2 training steps against their no-communication floors, torch gloo against
collectives through both of its torch entry points, side by side.

    python bench/bench_train.py                                   # worlds 2 and 4, everything
    python bench/bench_train.py --worlds 2 --models mlp8 --kinds ddp --rounds 3 --markdown
    python bench/bench_train.py --worlds 2 --models mlp8 --kinds ddp --timeline t.json \\
        --plot bench/results/timeline.png

Implementations (``--impls``), each a launch of W ranks (``OMP_NUM_THREADS=1``, torch's
intra-op threads set per launch):

- ``gloo``: ``torch.distributed.init_process_group("gloo")``;
- ``coll``: ``collectives.init_process_group("gloo")`` (torch's default group then runs on
  collectives, see collectives/torch_bridge/torch_pg.py);
- ``coll_torch``: ``import collectives.torch_bridge.torch_pg`` (registers the backend),
  then ``torch.distributed.init_process_group("collectives")``;
- ``mixed``: one launch for both: torch's default group is gloo, and
  ``new_group(backend="collectives")`` makes ours; the model over gloo, over ours and the
  floor take turns in blocks (the order rotating), so that "ours / gloo" and "time above
  the floor, ours over gloo's" are read within one launch instead of across launches of
  unequal load. After the steps, each group's all_reduce of the whole gradient is timed
  alone: with no free core (ranks >= cores), ``floor + that`` is roughly the least a step
  can take. For DDP a fourth copy, ``floor_sync``, is the floor whose last bucket waits
  for every rank (a 4-byte all_reduce over ours): what the one wait of a real step costs,
  the ranks' drift apart included, with no gradient moved. Two more are DDP's memory
  floor (bench/memory_floor_pg.py's ``ddp_hook``: an all_reduce's least memory work on
  each bucket), ``floor_mem`` without waits and ``floor_mem_sync`` with one a bucket.

Models (``--models``): ``mlp8`` the comm-bound MLP 512 -> 2048 x4 -> 16 (17.9M float32
parameters, 68 MiB of gradients) at batch 8, ``mlp128`` the same at batch 128, ``tfm`` a
transformer encoder (6 layers, d=512, 8 heads, feed-forward 2048, no dropout; 18.9M
parameters) on a batch of ``--tfm-batch`` sequences of ``--tfm-seq`` tokens.

Kinds (``--kinds``) and their floors, measured in the same launch, on the same ranks and
data, blocks of ``--block`` steps alternating with the real thing:

- ``ddp``: ``DistributedDataParallel(model)`` (default buckets); its floor is a second
  DDP of the same model whose comm hook returns the bucket at once (no communication);
- ``fsdp``: FSDP2, ``fully_shard`` on every layer, then on the root, over the default
  group; its floor is the same model sharded the same way over torch's ``fake`` process
  group (torch.testing._internal.distributed.fake_pg: every collective returns at once,
  without touching the tensors), of the same world size: the same shards, the same
  copies in and out of FSDP's buffers, no communication. A mixed launch adds three more
  (bench/memory_floor_pg.py): ``floor_mem``, a group that sends nothing but writes every
  all_gather output and sums every reduce_scatter input from the rank's own memory (the
  memory work no implementation can skip; the fake floor's outputs are never written);
  ``floor_mem_sync``, the same plus one 4-byte all_reduce over ours after every call (the
  wait no all_gather can skip either: together a lower bound for any implementation); and
  ``floor_sync``, the fake floor plus those waits alone. On our groups FSDP2's calls go
  through shared memory from the first forward (collectives.torch_bridge.fsdp); they do
  less memory work than the memory floor (an all_gather becomes a barrier), so they can
  beat it. ``--shared`` adds copies: ``coll_own`` ours with FSDP2's own calls
  (``keep_fsdp_defaults``), ``coll`` ours through ``share_collectives`` (both calls),
  ``coll_gather`` the all_gathers alone, ``gloo`` and ``gloo_gather`` the same over torch
  gloo's group.

The first ``--early`` steps of each wrapped model are reported on their own (``first``):
they include DDP's bucket rebuild (after the first step) and collectives' first round of
measured algorithm choices for each bucket's size class
(collectives/engines/shm/shm_tune.c: calls 2-10 of a class are its trials, the 11th
publishes the times and the 12th decides), hence 15 by default: with fewer, the steady
window starts inside that round and times the slower arms' trials as steady steps. Then
``--steps`` steps of each, alternating in blocks; medians of those are the ``steady``
figures (they include the later rounds, 16, 32, 64... calls apart, as a long run does).

``--timeline FILE`` sets ``COLLECTIVES_TIMELINE=1`` for the collectives launches: rank 0
records, per step, when the backward pass began and ended and, for every bucket's
all_reduce, when it was posted (torch's reducer calling the group), started and finished
(on the group's progress thread) and when its torch future was completed
(collectives.core.timeline); the file holds them, the summary lines print the median
per-bucket delays, and ``--plot PNG`` draws the steady steps of the first case.
In a mixed launch, each rotation of blocks is labelled "near" or "far" by what rank 0's
shared-memory latency probes said at its end (the VM's two vCPUs share a cache or not,
switching every few seconds to minutes; bench_stream.py labels its samples the same way),
and the summary gives the ratios per label too. A mixed launch also reports every copy's
CPU time a step (user and system, all threads) summed over the ranks: with at least as
many ranks as cores, cores x step minus that sum is the cores' idle time a step, which
tells the time above a floor that is work from the time that is waiting.
Each round launches every implementation once, in a rotating order, so drift hits all
alike; the table gives medians over rounds. ``NAME@base`` runs an implementation on the
checkout ``--base-root`` (built in place): a before/after in one run. ``--variants``
alternates collectives runs between variants within each launch (``VARIANTS``: the
all_reduce algorithm forced, the segment stores, the gathers' single copy).
"""
import argparse
import collections
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import torch_ranks  # noqa: E402
IMPLS = ["gloo", "coll", "coll_torch", "mixed"]
MODELS = ["mlp8", "mlp128", "tfm"]
KINDS = ["ddp", "fsdp"]


# ---- ranks ------------------------------------------------------------------------------------

def _init(impl):
    import torch.distributed as td
    impl = impl.partition("@")[0]
    if impl == "gloo":
        td.init_process_group("gloo")
    elif impl == "coll":
        import collectives
        collectives.init_process_group("gloo")
    elif impl == "coll_torch":
        import collectives.torch_bridge.torch_pg  # noqa: F401  (registers "collectives")
        td.init_process_group("collectives")
    else:
        raise ValueError(impl)
    return td


def _build(name, a):
    """(model, input) of case ``name``; the same on every rank (seed 0)."""
    import torch
    torch.manual_seed(0)
    if name.startswith("mlp"):
        layers = [torch.nn.Linear(512, 2048), torch.nn.ReLU()]
        for _ in range(4):
            layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(2048, 16))
        return torch.nn.Sequential(*layers), torch.randn(int(name[3:]), 512)
    if name == "tfm":
        layers = [torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
                  for _ in range(6)]
        return (torch.nn.Sequential(*layers, torch.nn.Linear(512, 16)),
                torch.randn(a.tfm_batch, a.tfm_seq, 512))
    raise ValueError(name)


def _noop_hook(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sync_hook(group, bucket):
    """The no-op hook, except that the backward pass's last bucket waits for every rank
    (a 4-byte all_reduce over ``group``): the floor with the one wait a real step has."""
    import torch
    import torch.distributed as td
    if bucket.is_last():
        td.all_reduce(torch.zeros(1), group=group)
    return _noop_hook(None, bucket)


def _wrap(kind, model, floor, fake, group=None, sync=None, hook=None):
    """``model`` under DDP or FSDP2 over ``group`` (None: the default group); the floor's
    (``floor``): DDP with the no-op hook (with ``sync``, a group: :func:`_sync_hook` over
    it), FSDP2 over ``fake``. ``hook``: DDP with this comm hook, its state ``sync``."""
    import torch
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        if hook is not None:
            ddp.register_comm_hook(sync, hook)
        elif floor:
            ddp.register_comm_hook(sync, _noop_hook if sync is None else _sync_hook)
        return ddp
    import torch.distributed as td
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if floor or group is not None:
        mesh = DeviceMesh.from_group(fake if floor else group, "cpu")
    else:  # what FSDP2 makes by default on a host without a GPU (a group of its own); named,
        # since where torch sees a GPU its default is a CUDA mesh, whose creation the CPU
        # ranks would wait in
        mesh = init_device_mesh("cpu", (td.get_world_size(),))
    for m in model:
        if any(p.requires_grad for p in m.parameters()):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


#: --shared's copies of an FSDP2 model in a mixed launch: name -> (group, whether its
#: reduce_scatters go through shared memory too; its all_gathers always do; None: FSDP2's
#: own calls, which our groups otherwise replace at the first forward)
SHARED = {"coll": ("coll", True), "coll_gather": ("coll", False), "coll_own": ("coll", None),
          "gloo": ("gloo", True), "gloo_gather": ("gloo", False)}


#: what a variant of the collectives run changes, between blocks of steps, on every rank
VARIANTS = {
    "default": "nothing (what the tree does)",
    "auto": "all_reduce algorithm measured (COLLECTIVES_SHM_AR_ALGO=auto)",
    "two_shot": "all_reduce two-shot only",
    "single_copy": "all_reduce single copy only (where the host allows it)",
    "plain": "segment writes with plain stores only (COLLECTIVES_SHM_STREAM=0)",
    "stream": "segment writes with streaming stores only (COLLECTIVES_SHM_STREAM=1)",
    "gather_timed": "all_gather blocks of every size measured (two-copy stores against the "
                    "single copy), the reduce_scatter's single copy off",
    "no_gather_cma": "the gathers' and the reduce_scatter's single copy off "
                     "(COLLECTIVES_SHM_CMA_MIN=0)",
}


def _variant(v):
    """Switch the collectives run to variant ``v`` (see VARIANTS); "default" puts back what
    the group applied at creation (rank 0's settings), after another variant's blocks."""
    from collectives.api import group as _groups
    backend = getattr(_groups.world.default, "backend", None)  # (no world: torch gloo's run)
    comm = getattr(backend, "_comm", None)
    if comm is None:
        if v == "default":
            return
        raise SystemExit(f"variant {v}: the default group's backend is not shm")
    # what the group applied at creation: rank 0's settings, the same on every rank
    tuning = backend.tuning
    algo, stream = tuning["COLLECTIVES_SHM_AR_ALGO"], int(tuning["COLLECTIVES_SHM_STREAM"])
    cma = [int(tuning[name]) for name in ("COLLECTIVES_SHM_CMA_MIN", "COLLECTIVES_SHM_CMA_BCAST_MIN",
                                          "COLLECTIVES_SHM_CMA_AR_MIN")]
    if v == "gather_timed":  # above every block: the all_gather's measured choice decides
        cma[0] = 1 << 50
    elif v == "no_gather_cma":
        cma[0] = 0
    if v in ("auto", "two_shot", "single_copy"):
        algo = v
    elif v in ("plain", "stream"):
        stream = 0 if v == "plain" else 1
    comm.set_ar_algo(algo)
    comm.set_stream(stream)
    comm.set_cma_min(*cma)


#: the process's minor page faults in each step, by copy (a step that frees and requests
#: memory glibc handed back to the kernel faults it in again: collectives/core/heap.py)
FAULTS = collections.defaultdict(list)
#: the process's CPU time (user and system, all its threads) in each step, ms, by copy: the
#: work a step costs a rank, apart from the time it waited (a mixed launch reports the sum
#: of every rank's median: with more ranks than cores, cores x step - that sum is the
#: cores' idle time a step)
CPU_MS = collections.defaultdict(list)


def _step(m, opt, x, which, steps, timeline, keep):
    """One training step of ``m``, appended to ``steps`` as (which, ms, marks); marks (the
    timeline's events and the step's phases) where ``which`` is in ``keep``."""
    if timeline is not None:
        timeline.take()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic_ns()
    opt.zero_grad(set_to_none=False)
    loss = m(x).float().square().mean()
    t1 = time.monotonic_ns()
    loss.backward()
    t2 = time.monotonic_ns()
    opt.step()
    t3 = time.monotonic_ns()
    marks = None
    if timeline is not None and which in keep:
        marks = {"t0": t0, "fwd": t1, "bwd": t2, "end": t3, "events": timeline.take()}
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    FAULTS[which].append(u1.ru_minflt - u0.ru_minflt)
    CPU_MS[which].append(1e3 * (u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime))
    steps.append((which, (t3 - t0) / 1e6, marks))


def _case(td, a, impl, name, kind, fake, timeline):
    """The result of one (model, kind) on this rank: first steps, then the wrapped model
    and its floor alternating in blocks (each variant in turn)."""
    import torch
    model, x = _build(name, a)
    floor_model, _ = _build(name, a)
    real = _wrap(kind, model, False, fake)
    floor = _wrap(kind, floor_model, True, fake)
    opt = {id(real): torch.optim.SGD(real.parameters(), lr=1e-4),
           id(floor): torch.optim.SGD(floor.parameters(), lr=1e-4)}
    steps = []  # (which, step ms, marks)
    variants = a.variants if impl != "gloo" else ["default"]
    keep = ("first", "real:" + variants[0])
    td.barrier()
    _variant(variants[0])
    for _ in range(a.early):
        _step(real, opt[id(real)], x, "first", steps, timeline, keep)
    for _ in range(a.early):
        _step(floor, opt[id(floor)], x, "floor_first", steps, timeline, keep)
    for i in range(0, a.steps, a.block):
        for v in [None] + variants:
            if v is not None and len(variants) > 1:
                td.barrier()  # every rank switches between the same two steps
                _variant(v)
            m = floor if v is None else real
            for _ in range(min(a.block, a.steps - i)):
                _step(m, opt[id(m)], x, "floor" if v is None else "real:" + v, steps, timeline,
                      keep)
    _variant(variants[0])
    td.barrier()

    def med(which):
        v = [ms for w, ms, _ in steps if w == which]
        return statistics.median(v) if v else None

    res = {"model": name, "kind": kind, "first_ms": med("first"),
           "ms": med("real:" + variants[0]), "floor_ms": med("floor"),
           "floor_first_ms": med("floor_first"),
           "variants": {v: med("real:" + v) for v in variants},
           "params": sum(p.numel() for p in model.parameters()) if kind == "ddp" else None}
    if timeline is not None:
        res["timeline"] = [m for w, _, m in steps if w == "real:" + variants[0]]
        res["timeline_first"] = [m for w, _, m in steps if w == "first"]
    return res


#: calls before timing a size class alone: past its first round of trials (the 12th call decides)
WARM_CALLS = 13


def _timed_all_reduce(td, pg, numel, reps):
    """Median ms of ``reps`` all_reduces of ``numel`` float32 on ``pg``, nothing else running
    (the communication's time alone, for the bound ``floor + this``), after ``WARM_CALLS``
    calls: the whole gradient is a size class of its own, whose first round of trials
    (collectives/engines/shm/shm_tune.c) would otherwise be timed."""
    import torch
    t = torch.ones(numel)
    for _ in range(WARM_CALLS):
        td.all_reduce(t, group=pg)
    out = []
    for _ in range(reps):
        td.barrier()
        t0 = time.monotonic_ns()
        td.all_reduce(t, group=pg)
        out.append((time.monotonic_ns() - t0) / 1e6)
    return statistics.median(out)


def _placement():
    """"near" or "far": what rank 0's shared-memory latency probes last said of its peers
    (collectives/engines/shm/shm_copy.c; on this project's VM the two vCPUs share a cache
    or not, switching every few seconds to minutes), None where no shm group is found."""
    from collectives.core.world import world
    for pg in list(world.groups):
        comm = getattr(getattr(pg, "backend", None), "_comm", None)
        if comm is not None and hasattr(comm, "far"):
            return "far" if comm.far else "near"
    return None


def _case_mixed(td, a, name, kind, fake, coll, mem):
    """One launch, the wrapped models on the same ranks and data: over torch gloo (the
    default group), over collectives (``coll``: ``new_group(backend="collectives")``), the
    floor and its variants (DDP's ``floor_sync``; FSDP2's ``floor_sync``, ``floor_mem`` and
    ``floor_mem_sync`` over the three groups of ``mem``, memory_floor_pg.py), in blocks of
    ``--block`` steps whose order rotates, so that every comparison is within the launch.
    Then each group's all_reduce of the whole gradient, alone."""
    import memory_floor_pg
    import torch
    pgs = {"gloo": None, "coll": coll}
    extra = ("floor_sync", "floor_mem", "floor_mem_sync")
    hooks = {}
    if kind == "ddp":  # the memory floor as a comm hook, with and without a wait a bucket
        hooks = {"floor_mem": memory_floor_pg.DdpHookState(),
                 "floor_mem_sync": memory_floor_pg.DdpHookState(coll)}
    elif mem:  # FSDP2's floor_sync: the fake floor plus a wait a call
        pgs.update(floor_mem=mem[0], floor_mem_sync=mem[1], floor_sync=mem[2])
    else:
        extra = ()
    shared = {}  # copy -> (group, with the reduce_scatter too)
    if kind == "fsdp":  # FSDP2's collectives through shared memory (--shared)
        shared = {"shared_" + s: SHARED[s] for s in a.shared}
        pgs.update({w: coll if g == "coll" else None for w, (g, _) in shared.items()})
        extra += tuple(shared)
    mods = {}
    for which in ("gloo", "coll", "floor") + extra:
        model, x = _build(name, a)
        ddp_sync = kind == "ddp" and which == "floor_sync"
        state = hooks.get(which)
        m = _wrap(kind, model, which == "floor" or ddp_sync, fake, pgs.get(which),
                  coll if ddp_sync else state,
                  memory_floor_pg.ddp_hook if state is not None else None)
        if which in shared:
            from collectives.torch_bridge import fsdp
            if shared[which][1] is None:
                fsdp.keep_fsdp_defaults(m)
            else:
                fsdp.share_collectives(m, group=pgs[which], reduce_scatter=shared[which][1])
        mods[which] = (m, torch.optim.SGD(m.parameters(), lr=1e-4))
    steps = []
    td.barrier()
    for which, (m, opt) in mods.items():
        for _ in range(a.early):
            _step(m, opt, x, "first:" + which, steps, None, ())
    order = list(mods)
    rounds = []  # (the round's steps, its placement label)
    for i in range(0, a.steps, a.block):
        first = len(steps)
        for which in order:
            td.barrier()
            m, opt = mods[which]
            for _ in range(min(a.block, a.steps - i)):
                _step(m, opt, x, which, steps, None, ())
        rounds.append((steps[first:], _placement()))
        order = order[1:] + order[:1]
    td.barrier()

    def med(which, among=steps):
        v = [ms for w, ms, _ in among if w == which]
        return statistics.median(v) if v else None

    by_place = {}
    for label in ("near", "far"):
        among = [s for r, lab in rounds if lab == label for s in r]
        if among:
            by_place[label] = {"rounds": sum(lab == label for _, lab in rounds),
                               **{w + "_ms": med(w, among) for w in mods}}

    cpu = [None] * td.get_world_size()  # every rank's CPU ms a step, by copy
    td.all_gather_object(cpu, {w: statistics.median(CPU_MS[w]) for w in mods})
    numel = sum(p.numel() for p in _build(name, a)[0].parameters())
    alone = {w: _timed_all_reduce(td, pgs[w], numel, 5) for w in ("gloo", "coll")}
    return {"model": name, "kind": kind, "gloo_ms": med("gloo"), "coll_ms": med("coll"),
            "floor_ms": med("floor"), "floor_sync_ms": med("floor_sync"),
            "floor_mem_ms": med("floor_mem"), "floor_mem_sync_ms": med("floor_mem_sync"),
            "shared_ms": {w[len("shared_"):]: med(w) for w in shared},
            "first_gloo_ms": med("first:gloo"), "placement": by_place,
            "first_coll_ms": med("first:coll"), "params": numel,
            "faults_per_step": {w: statistics.median(FAULTS[w]) for w in mods},
            "cpu_ms_per_step": {w: sum(c[w] for c in cpu) for w in mods},
            "all_reduce_alone_ms": alone,
            # what tests and the table read as the collectives cell:
            "ms": med("coll"), "first_ms": med("first:coll")}


def worker():
    import torch
    a = json.loads(os.environ["BENCH_TRAIN_ARGS"])
    a = argparse.Namespace(**a)
    impl = os.environ["IMPL"]
    torch.set_num_threads(int(os.environ["TORCH_THREADS"]))
    td = _init("gloo" if impl == "mixed" else impl)
    coll = None
    if impl == "mixed":
        import collectives  # noqa: F401  (registers the torch backend name "collectives")
        coll = td.new_group(backend="collectives")
    fake = mem = None
    if "fsdp" in a.kinds:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
        fake = td.new_group(backend="fake")
        if impl == "mixed":
            import memory_floor_pg
            mem = (memory_floor_pg.new_group(), memory_floor_pg.new_group(sync=coll),
                   memory_floor_pg.new_group(sync=coll, work=False))
    timeline = None
    if impl != "gloo" and os.environ.get("COLLECTIVES_TIMELINE") == "1":
        try:
            from collectives.core import timeline
        except ImportError:  # a tree from before the timeline (--base-root)
            timeline = None
    if impl == "mixed":
        results = [_case_mixed(td, a, name, kind, fake, coll, mem)
                   for name in a.models for kind in a.kinds]
    else:
        results = [_case(td, a, impl, name, kind, fake, timeline)
                   for name in a.models for kind in a.kinds]
    if td.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    td.barrier()
    td.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------------------

def launch(impl, world, threads, a, timeline):
    args = {"models": a.models, "kinds": a.kinds, "steps": a.steps, "early": a.early,
            "variants": a.variants, "shared": a.shared,
            "block": a.block, "tfm_batch": a.tfm_batch, "tfm_seq": a.tfm_seq}
    env = dict(IMPL=impl, TORCH_THREADS=str(threads), BENCH_TRAIN_ARGS=json.dumps(args))
    if timeline and impl != "gloo":
        env["COLLECTIVES_TIMELINE"] = "1"
    root = a.base_root if impl.endswith("@base") else ROOT
    return torch_ranks.launch(__file__, world, env, a.timeout, f"{impl} world {world}",
                              root=root, threads=threads)


def bucket_delays(marks):
    """Per step: [(bytes, posted, started, finished, done) ms from the step's start] for
    each all_reduce, and the step's (forward end, backward end, end) ms."""
    calls = {}
    for what, group, seq, t, extra in marks["events"]:
        c = calls.setdefault((group, seq), {})
        c[what] = (t - marks["t0"]) / 1e6
        if what == "post":
            c["bytes"] = extra
    rows = [c for c in calls.values() if {"post", "start", "end", "done"} <= c.keys()]
    rows.sort(key=lambda c: c["post"])
    return rows, ((marks["fwd"] - marks["t0"]) / 1e6, (marks["bwd"] - marks["t0"]) / 1e6,
                  (marks["end"] - marks["t0"]) / 1e6)


def summarize_timeline(steps):
    """Medians over steps: queue (post->start), run (start->end), handoff (end->done) per
    bucket, and the wait after the last post (last post -> backward end)."""
    queue, run, hand, tail, exposed = [], [], [], [], []
    for marks in steps:
        rows, (fwd, bwd, _end) = bucket_delays(marks)
        if not rows:
            continue
        for c in rows:
            queue.append(c["start"] - c["post"])
            run.append(c["end"] - c["start"])
            hand.append(c["done"] - c["end"])
        tail.append(bwd - rows[-1]["post"])
        exposed.append(bwd - max(c["done"] for c in rows))
    if not queue:
        return None
    m = statistics.median
    return {"queue_ms": m(queue), "run_ms": m(run), "handoff_ms": m(hand),
            "after_last_post_ms": m(tail), "backward_after_last_done_ms": m(exposed),
            "buckets": len(queue) // max(len(tail), 1)}


def plot(path, steps, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = steps[-3:]
    fig, axes = plt.subplots(len(steps), 1, figsize=(11, 2.0 + 1.2 * len(steps)), squeeze=False)
    for ax, marks in zip(axes[:, 0], steps):
        rows, (fwd, bwd, end) = bucket_delays(marks)
        ax.barh(0, fwd, left=0, color="#9ecae1", label="forward")
        ax.barh(0, bwd - fwd, left=fwd, color="#3182bd", label="backward (+ DDP's wait)")
        ax.barh(0, end - bwd, left=bwd, color="#c6dbef", label="optimizer")
        for i, c in enumerate(rows, 1):
            ax.barh(i, c["start"] - c["post"], left=c["post"], color="#fdae6b",
                    label="posted -> started" if i == 1 else None)
            ax.barh(i, c["end"] - c["start"], left=c["start"], color="#e6550d",
                    label="all_reduce running" if i == 1 else None)
            ax.barh(i, max(c["done"] - c["end"], 0.05), left=c["end"], color="#31a354",
                    label="finished -> future done" if i == 1 else None)
            ax.text(c["end"] + 0.3, i, f"{c['bytes'] / 2**20:.1f} MiB", va="center", fontsize=7)
        ax.set_yticks(range(len(rows) + 1), ["step"] + [f"bucket {i}" for i in range(1, len(rows) + 1)])
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.08)
    axes[-1, 0].set_xlabel("ms from the step's start (rank 0)")
    axes[0, 0].set_title(title, fontsize=9)
    axes[-1, 0].legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--threads", default="1,auto",
                    help="torch intra-op threads per rank, commas: a number or auto (cores/world)")
    ap.add_argument("--steps", type=int, default=20, help="steady steps of each (real and floor)")
    ap.add_argument("--early", type=int, default=15,
                    help="first steps, reported on their own (past the first round of trials)")
    ap.add_argument("--block", type=int, default=5, help="steps in a row before alternating")
    ap.add_argument("--tfm-batch", type=int, default=2)
    ap.add_argument("--tfm-seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--timeline", help="write the collectives launches' timelines here (JSON)")
    ap.add_argument("--plot", help="draw the first case's steady steps here (PNG; needs --timeline)")
    ap.add_argument("--json", help="write every launch's results here")
    ap.add_argument("--variants", default="default",
                    help="collectives runs: variants alternated in blocks within each launch, "
                    "commas: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    ap.add_argument("--base-root", help="another checkout of collectives (extensions built): "
                    "impls coll@base and coll_torch@base run on it, for a before/after in one run")
    ap.add_argument("--shared", default="",
                    help="mixed FSDP2 launches add copies whose collectives go through shared "
                    "memory (collectives.torch_bridge.fsdp), commas: " + "; ".join(
                        f"{k}: {g} with " + {True: "both calls", False: "the all_gathers alone",
                                             None: "FSDP2's own calls"}[rs]
                        for k, (g, rs) in SHARED.items()))
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        return worker()
    a.models, a.kinds, a.variants = a.models.split(","), a.kinds.split(","), a.variants.split(",")
    a.shared = [s for s in a.shared.split(",") if s]
    if set(a.shared) - set(SHARED):
        ap.error(f"--shared: unknown {sorted(set(a.shared) - set(SHARED))}; known {sorted(SHARED)}")
    for v in a.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; choose from {', '.join(VARIANTS)}")
    impls = a.impls.split(",")
    for v, allowed, what in ((impls, IMPLS, "impls"), (a.models, MODELS, "models"),
                             (a.kinds, KINDS, "kinds")):
        for x in v:
            if what == "impls" and x.endswith("@base") and x != "gloo@base":
                if not a.base_root:
                    ap.error(f"--impls {x}: give --base-root")
                x = x[:-5]
            if x not in allowed:
                ap.error(f"--{what}: unknown {x!r}; choose from {', '.join(allowed)}")
    cores = os.cpu_count() or 1
    runs = []  # (world, threads, impl, round, results)
    for world in [int(w) for w in a.worlds.split(",")]:
        threads = []
        for t in a.threads.split(","):
            n = max(1, cores // world) if t == "auto" else int(t)
            if n not in threads:
                threads.append(n)
        for nt in threads:
            for rnd in range(a.rounds):
                order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                for impl in order:
                    t0 = time.time()
                    res = launch(impl, world, nt, a, bool(a.timeline))
                    runs.append({"world": world, "threads": nt, "impl": impl, "round": rnd,
                                 "results": res})
                    for r in res:
                        print(f"# world={world} threads={nt} round={rnd + 1} {impl:>10} "
                              f"{r['model']:>6} {r['kind']}: first {r['first_ms']:.1f} "
                              f"steady {r['ms']:.1f} floor {r['floor_ms']:.1f} ms/step "
                              f"({time.time() - t0:.0f} s)" + (
                                  "; variants " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                            r["variants"].items())
                                  if len(r.get("variants", {})) > 1 else ""),
                              file=sys.stderr, flush=True)
                        if impl == "mixed":
                            print("#   " + mixed_line(r), file=sys.stderr, flush=True)
                        for label, tl in (("first", r.get("timeline_first")),
                                          ("steady", r.get("timeline"))):
                            s = summarize_timeline(tl) if tl else None
                            if s:
                                print(f"#   timeline medians, {label}: " + ", ".join(
                                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in s.items()), file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in run.items()} for run in runs], f)
    if a.timeline:
        with open(a.timeline, "w") as f:
            json.dump([run for run in runs if run["impl"] != "gloo"], f)
        if a.plot:
            for run in reversed(runs):  # the last launch that has one
                if run["impl"] != "gloo" and run["results"][0].get("timeline"):
                    r = run["results"][0]
                    plot(a.plot, r["timeline"], f"{run['impl']}, world {run['world']}, "
                         f"{r['model']} {r['kind']}: {r['ms']:.1f} ms/step, floor "
                         f"{r['floor_ms']:.1f} (medians); the last three steady steps")
                    break
    print_table([r for r in runs if r["impl"] != "mixed"], [i for i in impls if i != "mixed"],
                a.markdown)
    if "mixed" in impls:
        print_mixed([r for r in runs if r["impl"] == "mixed"], a.markdown)


def mixed_line(r):
    """A mixed launch's case: the three steps, and the ratios the issue asks for."""
    g, c, f = r["gloo_ms"], r["coll_ms"], r["floor_ms"]
    alone = r["all_reduce_alone_ms"]
    above = (c - f) / (g - f) if g > f else float("nan")
    return (f"gloo {g:.1f} coll {c:.1f} floor {f:.1f} ms: coll/floor {c / f:.2f} "
            f"gloo/floor {g / f:.2f} coll/gloo {c / g:.2f} above-floor coll/gloo {above:.2f}; "
            f"all_reduce of the gradient alone: coll {alone['coll']:.1f} gloo "
            f"{alone['gloo']:.1f} ms (floor + coll's: {(f + alone['coll']) / f:.2f}x floor)"
            + (f"; floor with its waits (DDP: one a step, FSDP2: one a call): "
               f"{r['floor_sync_ms'] / f:.2f}x floor" if r.get("floor_sync_ms") else "")
            + (f"; memory floor {r['floor_mem_ms']:.1f} ms: {r['floor_mem_ms'] / f:.2f}x floor, "
               f"{r['floor_mem_ms'] / g:.2f}x gloo, coll/memory floor "
               f"{c / r['floor_mem_ms']:.2f}" if r.get("floor_mem_ms") else "")
            + (f"; memory floor with a wait a call {r['floor_mem_sync_ms']:.1f} ms: "
               f"{r['floor_mem_sync_ms'] / f:.2f}x floor, {r['floor_mem_sync_ms'] / g:.2f}x gloo"
               if r.get("floor_mem_sync_ms") else "")
            + "".join(f"; shared {w} {ms:.1f} ms ({ms / g:.2f}x gloo, {ms / f:.2f}x floor)"
                      for w, ms in r.get("shared_ms", {}).items())
            + ("; page faults a step (rank 0): " + ", ".join(
                f"{w} {n:g}" for w, n in r["faults_per_step"].items())
               if r.get("faults_per_step") else "")
            + ("; CPU ms a step (every rank's, all threads, summed): " + ", ".join(
                f"{w} {ms:.1f}" for w, ms in r["cpu_ms_per_step"].items())
               if r.get("cpu_ms_per_step") else "")
            + "".join(f"; {lab} ({p['rounds']} rounds): coll/floor "
                      f"{p['coll_ms'] / p['floor_ms']:.2f} coll/gloo {p['coll_ms'] / p['gloo_ms']:.2f}"
                      for lab, p in r.get("placement", {}).items()))


def print_mixed(runs, markdown):
    """One row per mixed launch and case (every ratio within its launch), then medians."""
    head = ["world", "threads", "round", "model", "kind", "gloo ms", "coll ms", "floor ms",
            "coll/floor", "gloo/floor", "coll/gloo", "above floor coll/gloo",
            "all_reduce alone coll / gloo ms", "(floor + coll alone)/floor",
            "floor with its waits/floor", "memory floor/gloo", "coll/memory floor"]
    sep = " | " if markdown else "  "
    print(("| " + sep.join(head) + " |") if markdown else sep.join(head))
    if markdown:
        print("|" + "---|" * len(head))
    for run in runs:
        for r in run["results"]:
            g, c, f = r["gloo_ms"], r["coll_ms"], r["floor_ms"]
            al = r["all_reduce_alone_ms"]
            row = [str(run["world"]), str(run["threads"]), str(run["round"] + 1), r["model"],
                   r["kind"], f"{g:.1f}", f"{c:.1f}", f"{f:.1f}", f"{c / f:.2f}",
                   f"{g / f:.2f}", f"{c / g:.2f}",
                   f"{(c - f) / (g - f):.2f}" if g > f else "",
                   f"{al['coll']:.1f} / {al['gloo']:.1f}", f"{(f + al['coll']) / f:.2f}",
                   f"{r['floor_sync_ms'] / f:.2f}" if r.get("floor_sync_ms") else ""]
            fm = r.get("floor_mem_ms")
            row += [f"{fm / g:.2f}", f"{c / fm:.2f}"] if fm else ["", ""]
            print(("| " + sep.join(row) + " |") if markdown else sep.join(row))


def print_table(runs, impls, markdown):
    cells = {}
    for run in runs:
        for r in run["results"]:
            key = (run["world"], run["threads"], r["model"], r["kind"])
            cells.setdefault(key, {}).setdefault(run["impl"], []).append(r)
    head = ["world", "threads", "model", "kind"]
    head += [f"{i} ms" for i in impls] + ["floor ms"]
    head += [f"{i} first" for i in impls]
    head += [f"{i}/floor" for i in impls if i != "gloo"]
    head += [f"{i}/gloo" for i in impls if i != "gloo"]
    head += [f"{i} above floor / gloo's" for i in impls if i != "gloo"]
    sep = " | " if markdown else "  "
    print(("| " + sep.join(head) + " |") if markdown else sep.join(head))
    if markdown:
        print("|" + "---|" * len(head))
    m = statistics.median
    for key, by in sorted(cells.items()):
        ms = {i: m(r["ms"] for r in by[i]) for i in impls if i in by}
        first = {i: m(r["first_ms"] for r in by[i]) for i in impls if i in by}
        above = {i: m(r["ms"] - r["floor_ms"] for r in by[i]) for i in impls if i in by}
        floor = m(r["floor_ms"] for i in by for r in by[i])
        row = [str(key[0]), str(key[1]), key[2], key[3]]
        row += [f"{ms[i]:.1f}" if i in ms else "" for i in impls] + [f"{floor:.1f}"]
        row += [f"{first[i]:.1f}" if i in first else "" for i in impls]
        for i in impls:
            if i != "gloo":
                row.append(f"{m(r['ms'] / r['floor_ms'] for r in by[i]):.2f}" if i in by else "")
        for i in impls:
            if i != "gloo":
                row.append(f"{ms[i] / ms['gloo']:.2f}" if i in ms and "gloo" in ms else "")
        for i in impls:
            if i != "gloo":
                ok = i in above and "gloo" in above and above["gloo"] > 0
                row.append(f"{above[i] / above['gloo']:.2f}" if ok else "")
        print(("| " + sep.join(row) + " |") if markdown else sep.join(row))


if __name__ == "__main__":
    main()
