"""collectives.torch_bridge.torch_pg: torch.distributed's own process group, run by collectives.

Properties:

- DistributedDataParallel over it trains as one process does on all ranks' data: for
  any world of 1-4 ranks, model width, batch, bucket size (one bucket, or one per
  parameter), number of steps and gradient accumulation under ``no_sync``, every rank
  ends with the parameters of a single-process reference that averages the ranks'
  gradients (from rank 0's initial parameters, which DDP broadcasts: every rank starts
  from different ones), and with rank 0's initial buffers after DDP's construction.
  FSDP (torch's FullyShardedDataParallel on the CPU, and ``fully_shard``, also with its
  collectives through shared memory) ends with the same reference's parameters. So does
  DDP with a comm hook: torch's allreduce hook, one
  calling the group's ``allreduce([bucket])`` method and chaining callbacks on it, and
  one whose futures' callbacks issue collectives and wait on their futures (1-3 levels
  deep, or on a future taken before the callback ran), as PowerSGD's hook does; with
  PowerSGD's own hook (lossy) every member ends with the same parameters; and with
  torch's ZeroRedundancyOptimizer over SGD in place of SGD.
- torch.distributed's own functions (``torch.distributed.all_reduce``, ...), on torch's
  default group and on a ``torch.distributed.new_group`` subgroup, sync and async (waited
  on through ``wait()`` or the future), ``batch_isend_irecv`` around a ring of the members,
  and torch's functional collectives (all_reduce,
  all_gather_single, reduce_scatter_tensor), give the NumPy reference's results, for any
  world, op, root, dtype and shape (empty included).
- Collectives' own groups are torch's too, once torch is imported: DDP takes a subgroup
  from ``dist.new_group`` and trains as one process on its members' data; torch's
  functions on such a subgroup give the NumPy reference's results, and destroying it
  (through torch or collectives) takes it out of both.
- Life: ``dist.init_process_group`` in a program that imported torch sets up torch's
  default group (collectives' default group itself) and ``dist.destroy_process_group``
  removes it; ``COLLECTIVES_TORCH_BRIDGE=0`` leaves torch alone; ``torch.distributed.init_process_group(
  "collectives")`` runs on a collectives group over torch's store, and torch's
  ``destroy_process_group`` ends both.
"""
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool, free_port, get_pool
from tests.support.torch_training import batch as _batch
from tests.support.torch_training import bridged as _bridged
from tests.support.torch_training import ddp_reference, fsdp_case
from tests.support.torch_training import model_of as _model

torch = pytest.importorskip("torch")

CONFIGS = [c for c in available_configs() if c in ("gloo", "mpi")]
SETTINGS = settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])



# ---- DistributedDataParallel ------------------------------------------------------------------

def ddp_case(ctx, case):
    """Run on every rank: train with DDP (on the default group, or on a collectives
    subgroup made by ``dist.new_group``); this rank's buffers after construction and
    parameters after training, None off the subgroup."""
    import collectives as dist
    _bridged()
    group = None
    if case["members"] is not None:
        group = dist.new_group(case["members"])  # every rank calls it
        if ctx.rank not in case["members"]:
            return None
    try:
        return _train_ddp(ctx, case, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def _train_ddp(ctx, case, group):
    import torch

    model = _model(case["width"], case["seed"] + ctx.rank).double()  # different on every rank
    with torch.no_grad():
        model[1].running_mean.fill_(ctx.rank + 1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=case["bucket_mb"],
                                                    process_group=group)
    hook = case.get("hook")
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook == "nested":
        ddp.register_comm_hook(group, _nested_hook(case["depth"], case["early"]))
    elif hook == "method":
        ddp.register_comm_hook(group or torch.distributed.distributed_c10d._get_default_group(),
                               _method_hook)
    buffers = model[1].running_mean.clone().numpy()
    if case.get("zero"):  # each member steps its shard of the parameters, then broadcasts it
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                      process_group=group)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(case["steps"]):
        opt.zero_grad()
        for micro in range(case["accumulate"]):
            x, y = _batch(case, ctx.rank, step, micro)
            if micro < case["accumulate"] - 1:
                with ddp.no_sync():
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
            else:
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return buffers, [p.detach().numpy() for p in model.parameters()]


def _nested_hook(depth, early):
    """A DDP comm hook that averages a bucket as PowerSGD's hook waits: inside the
    callback of the sum's future it issues collectives of its own and waits on their
    futures, ``depth`` levels deep; with ``early`` the count it divides by was issued
    (and its future taken) before the sum, and is waited on in the innermost callback."""
    import torch.distributed as td

    def hook(group, bucket):
        buf = bucket.buffer()

        def count():
            return td.all_reduce(torch.ones(1, dtype=buf.dtype), group=group,
                                 async_op=True).get_future()

        first = count() if early else None

        def level(k, total):
            if k == depth:
                return total.div_((first or count()).wait()[0])
            z = td.all_reduce(torch.zeros(1, dtype=buf.dtype), group=group, async_op=True)
            return z.get_future().then(lambda _f: level(k + 1, total)).wait()

        fut = td.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: level(1, f.value()[0]))

    return hook


def _method_hook(group, bucket):
    """torch's own test hook: the group's allreduce method without options (its future is
    torch's), then callbacks chained on it."""
    fut = group.allreduce([bucket.buffer()]).get_future()
    return fut.then(lambda f: 2 * f.wait()[0]).then(lambda f: f.wait() / (2 * group.size()))


def _world_and_members(draw, subgroups=True):
    """A world of 1-4 ranks, and the members of a subgroup of it or None (the world)."""
    world = draw(st.integers(1, 4))
    members = None
    if subgroups and world > 1 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
    return world, members


@st.composite
def ddp_cases(draw, subgroups=True, hooks=False):
    world, members = _world_and_members(draw, subgroups)
    case = {
        "members": members,
        "width": draw(st.integers(1, 9)), "batch": draw(st.integers(2, 5)),
        "bucket_mb": draw(st.sampled_from([25.0, 1e-6])),  # one bucket, or one per parameter
        "steps": draw(st.integers(1, 3)), "accumulate": draw(st.integers(1, 2)),
        "seed": draw(st.integers(0, 2 ** 16))}
    if hooks:
        # a hook whose callbacks issue collectives (nested, PowerSGD's) gets one bucket: with
        # several, they would race the next bucket's call for the order of calls on the ranks
        case["hook"] = draw(st.sampled_from(["allreduce", "method", "nested", "powersgd"]))
        case["zero"] = draw(st.booleans())  # ZeroRedundancyOptimizer over SGD
        if case["hook"] == "method" and members is None:
            # a group made by dist.new_group once torch is imported is torch's too, and its
            # methods must hand torch's code torch's Work (the pools' default group was made
            # before torch was imported: torch sees it through a wrapper)
            case["members"] = list(range(world))
        if case["hook"] == "nested":
            case.update(depth=draw(st.integers(1, 3)), early=draw(st.booleans()), bucket_mb=25.0)
        elif case["hook"] == "powersgd":  # its third synced step is its first compressed one
            case.update(steps=3, bucket_mb=25.0)
    return world, case


@pytest.mark.slow
@pytest.mark.timeout(600)
@SETTINGS
@given(case=ddp_cases())
def test_ddp_trains_as_one_process_on_all_ranks_data(config, case):
    world, case = case
    results = backend_pool(config, world).run(ddp_case, case, timeout=120)
    ranks = case["members"] if case["members"] is not None else list(range(world))
    want = ddp_reference(case, ranks)
    for r, got in enumerate(results):
        if r not in ranks:
            assert got is None, f"rank {r} is outside the group"
            continue
        buffers, params = got
        np.testing.assert_array_equal(buffers, np.full_like(buffers, ranks[0] + 1.0),
                                      err_msg=f"rank {r} buffers")
        for k, (got, exp) in enumerate(zip(params, want)):
            np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-12,
                                       err_msg=f"rank {r} parameter {k} of {case}, world {world}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(SETTINGS, max_examples=examples(16))
@given(case=ddp_cases(hooks=True))
def test_ddp_comm_hooks_whose_callbacks_wait_on_collectives(config, case):
    """torch's allreduce hook and a hook that waits on collectives inside its futures'
    callbacks (as PowerSGD's does) train as one process, with SGD or with torch's
    ZeroRedundancyOptimizer over it; PowerSGD's (lossy) leaves every member with the same
    parameters."""
    world, case = case
    results = backend_pool(config, world).run(ddp_case, case, timeout=60)
    ranks = case["members"] if case["members"] is not None else list(range(world))
    want = ddp_reference(case, ranks)
    for r in ranks:
        params = results[r][1]
        exp = want if case["hook"] != "powersgd" else results[ranks[0]][1]
        for k, (got, e) in enumerate(zip(params, exp)):
            assert np.all(np.isfinite(got)), f"rank {r} parameter {k} of {case}"
            np.testing.assert_allclose(got, e, rtol=1e-9, atol=1e-12,
                                       err_msg=f"rank {r} parameter {k} of {case}, world {world}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(SETTINGS, max_examples=examples(8))
@given(case=ddp_cases(subgroups=False),
       flavor=st.sampled_from(["fsdp1", "fully_shard", "fully_shard_own", "fully_shard_shared"]),
       slots=st.integers(2, 4), shared_rs=st.booleans())
def test_fsdp_trains_as_one_process_on_all_ranks_data(config, case, flavor, slots, shared_rs):
    """FSDP1, fully_shard, and fully_shard a layer at a time with its all_gathers (and
    with ``shared_rs`` its reduce_scatters) through shared memory (``fully_shard_shared``:
    collectives.torch_bridge.fsdp, 2-4 slots reused) end with the single-process
    reference's parameters."""
    world, case = case
    case = dict(case, flavor=flavor, slots=slots, shared_rs=shared_rs)
    results = backend_pool(config, world).run(fsdp_case, case, timeout=120)
    want = ddp_reference(case, list(range(world)))
    for r, params in enumerate(results):
        for k, (got, exp) in enumerate(zip(params, want)):
            np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-12,
                                       err_msg=f"rank {r} parameter {k} of {case}, world {world}")


@pytest.mark.timeout(60)
@given(depth=st.integers(1, 6), idle=st.sampled_from([0.05, 0.2]))
@settings(max_examples=examples(10), deadline=None)
def test_futures_completer_settles_a_call_its_callback_waits_for_then_lets_threads_go(depth, idle):
    """Without ranks: each call's settling (a future's callbacks) waits for the next call,
    which it puts, ``depth`` deep; all settle, and the completer's threads end once idle."""
    from collectives.torch_bridge.torch_pg import _Completer

    def ours():
        return sum(t.name == "collectives-torch-futures" for t in threading.enumerate())

    before = ours()
    comp = _Completer()
    comp.IDLE_S = idle
    done = [threading.Event() for _ in range(depth + 1)]

    class Call:
        def __init__(self, k):
            self.k = k

        def _settle(self, _fut):
            if self.k < depth:
                comp.put(Call(self.k + 1), None)
                assert done[self.k + 1].wait(10), f"call {self.k + 1} was never settled"
            done[self.k].set()

    comp.put(Call(0), None)
    assert done[0].wait(20), f"call 0 of {depth + 1} nested ones was never settled"
    deadline = time.monotonic() + 10
    while ours() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ours() == before, f"{ours() - before} threads left after {idle} s idle"
    assert comp._idle == 0


# ---- torch.distributed's functions on it --------------------------------------------------------

KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather",
         "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
         "barrier", "send_recv", "recv_any", "batch_p2p", "funcol_all_reduce", "funcol_all_gather",
         "funcol_reduce_scatter")
# torch's functional collectives (DTensor's and torch.compile's): torch's C++ ops, which call
# the group's methods; their results are those of these kinds
FUNCOL = {"funcol_all_reduce": "all_reduce", "funcol_all_gather": "all_gather_into_tensor",
          "funcol_reduce_scatter": "reduce_scatter_tensor"}
OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
NP_OPS = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max, "AVG": np.mean}


def _data(case, rank, k=0):
    rng = np.random.default_rng([case["seed"], rank, k])
    return rng.integers(-3, 4, size=case["shape"]).astype(case["dtype"])


def td_case(ctx, case):
    """Run on every rank: one torch.distributed call, on the default group or on a
    subgroup that torch's ``new_group`` or collectives' made; (outputs, sender) as arrays,
    None off the group."""
    import collectives as dist
    td = _bridged()
    members, maker = case["members"], case["maker"]
    group = None
    if members is not None:  # every rank calls it
        group = (td if maker == "torch" else dist).new_group(members)
    if members is not None and ctx.rank not in members:
        return None
    try:
        return _td_call(ctx, case, td, group)
    finally:
        if group is not None:
            (td if case["destroyer"] == "torch" else dist).destroy_process_group(group)
            assert group not in td.distributed_c10d._world.pg_map, "left in torch's table"
            ours = getattr(group, "collectives_group", None)
            if ours is not None and ours is not dist.group.WORLD:
                assert ours.destroyed, "torch destroyed it, collectives did not"


def _td_call(ctx, case, td, group):
    import numpy as np
    import torch

    members = case["members"]
    ranks = members if members is not None else list(range(ctx.world_size))
    n, me = len(ranks), ranks.index(ctx.rank)
    kind, root, op = case["kind"], case["root"], case["op"]
    rop = getattr(td.ReduceOp, op) if op else None
    a = lambda k=0: torch.from_numpy(_data(case, ctx.rank, k))  # noqa: E731
    like = lambda: torch.zeros(case["shape"], dtype=getattr(torch, case["dtype"]))  # noqa: E731
    asy = case["async"]
    sender = None

    def done(work):
        if asy == "wait":
            work.wait()
        elif asy == "future":
            work.get_future().wait()

    if kind == "all_reduce":
        outs = [a()]
        done(td.all_reduce(outs[0], op=rop, group=group, async_op=bool(asy)))
    elif kind == "reduce":
        outs = [a()]
        done(td.reduce(outs[0], dst=root, op=rop, group=group, async_op=bool(asy)))
        outs = outs if ctx.rank == root else []
    elif kind == "broadcast":
        outs = [a()]
        done(td.broadcast(outs[0], src=root, group=group, async_op=bool(asy)))
    elif kind == "all_gather":
        outs = [like() for _ in range(n)]
        done(td.all_gather(outs, a(), group=group, async_op=bool(asy)))
    elif kind == "all_gather_into_tensor":
        inp = a()
        outs = [torch.zeros((n * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype)]
        done(td.all_gather_into_tensor(outs[0], inp, group=group, async_op=bool(asy)))
    elif kind == "gather":
        outs = [like() for _ in range(n)] if ctx.rank == root else None
        done(td.gather(a(), outs, dst=root, group=group, async_op=bool(asy)))
        outs = outs or []
    elif kind == "scatter":
        outs = [like()]
        ins = [a(k) for k in range(n)] if ctx.rank == root else None
        done(td.scatter(outs[0], ins, src=root, group=group, async_op=bool(asy)))
    elif kind == "reduce_scatter":
        outs = [like()]
        done(td.reduce_scatter(outs[0], [a(k) for k in range(n)], op=rop, group=group,
                               async_op=bool(asy)))
    elif kind == "reduce_scatter_tensor":
        inp = a()  # shape[0] is a multiple of n here
        outs = [torch.zeros((inp.shape[0] // n,) + tuple(inp.shape[1:]), dtype=inp.dtype)]
        done(td.reduce_scatter_tensor(outs[0], inp, op=rop, group=group, async_op=bool(asy)))
    elif kind == "all_to_all":
        outs = [like() for _ in range(n)]
        done(td.all_to_all(outs, [a(k) for k in range(n)], group=group, async_op=bool(asy)))
    elif kind == "all_to_all_single":
        splits = case["splits"]  # splits[i][j]: rows rank i sends to rank j
        inp = torch.from_numpy(np.random.default_rng([case["seed"], ctx.rank]).integers(
            -3, 4, size=(sum(splits[me]), 2)).astype(case["dtype"]))
        outs = [torch.zeros((sum(s[me] for s in splits), 2), dtype=inp.dtype)]
        done(td.all_to_all_single(outs[0], inp, [s[me] for s in splits], splits[me], group=group,
                                  async_op=bool(asy)))
    elif kind == "barrier":
        outs = []
        done(td.barrier(group=group, async_op=bool(asy)))
    elif kind == "batch_p2p":  # a ring: each member sends to the next, receives from the last
        outs = [like()]
        nxt, prev = ranks[(me + 1) % n], ranks[(me - 1) % n]
        ops = [td.P2POp(td.isend, a(), nxt, group), td.P2POp(td.irecv, outs[0], prev, group)]
        for w in td.batch_isend_irecv(ops):
            w.wait()
    elif kind in FUNCOL:
        import torch.distributed._functional_collectives as funcol
        g = group if group is not None else td.group.WORLD
        if kind == "funcol_all_reduce":
            out = funcol.all_reduce(a(), op.lower(), g)
        elif kind == "funcol_all_gather":
            out = funcol.all_gather_single(a(), 0, g)
        else:
            out = funcol.reduce_scatter_tensor(a(), op.lower(), 0, g)
        outs = [funcol.wait_tensor(out)]
    else:  # send_recv / recv_any: every other member sends to root, root receives
        outs = []
        if ctx.rank != root:
            td.send(a(), dst=root, group=group)
        else:
            for q in ranks:
                if q == root:
                    continue
                t = like()
                if kind == "send_recv":
                    td.recv(t, src=q, group=group)
                    outs.append(t)
                else:
                    s = td.recv(t, group=group)
                    outs.append((s, t))
            if kind == "recv_any":
                sender = [s for s, _ in outs]
                outs = [t for _, t in sorted(outs, key=lambda st: st[0])]
    return [o.numpy() for o in outs], sender


def td_reference(case, world):
    members = case["members"] if case["members"] is not None else list(range(world))
    n = len(members)
    kind, root = case["kind"], case["root"]
    red = NP_OPS.get(case["op"])
    dtype = case["dtype"]

    def reduce_(arrs):
        out = red(np.stack(arrs), axis=0)
        if case["op"] == "AVG" and np.dtype(dtype).kind in "iu":
            out = np.floor_divide(np.sum(np.stack(arrs), axis=0), n)
        return out.astype(dtype)

    kind = FUNCOL.get(kind, kind)
    want = {}
    for i, r in enumerate(members):
        if kind == "all_reduce":
            want[r] = [reduce_([_data(case, q) for q in members])]
        elif kind == "reduce":
            want[r] = [reduce_([_data(case, q) for q in members])] if r == root else []
        elif kind == "broadcast":
            want[r] = [_data(case, root)]
        elif kind in ("all_gather", "gather"):
            parts = [_data(case, q) for q in members]
            want[r] = parts if kind == "all_gather" or r == root else []
        elif kind == "all_gather_into_tensor":
            want[r] = [np.concatenate([_data(case, q) for q in members])]
        elif kind == "scatter":
            want[r] = [_data(case, root, i)]
        elif kind == "reduce_scatter":
            want[r] = [reduce_([_data(case, q, i) for q in members])]
        elif kind == "reduce_scatter_tensor":
            full = reduce_([_data(case, q) for q in members])
            rows = full.shape[0] // n
            want[r] = [full[i * rows:(i + 1) * rows]]
        elif kind == "all_to_all":
            want[r] = [_data(case, q, i) for q in members]
        elif kind == "all_to_all_single":
            splits = case["splits"]
            pieces = []
            for j, q in enumerate(members):
                src = np.random.default_rng([case["seed"], q]).integers(
                    -3, 4, size=(sum(splits[j]), 2)).astype(dtype)
                start = sum(splits[j][:i])
                pieces.append(src[start:start + splits[j][i]])
            want[r] = [np.concatenate(pieces)]
        elif kind == "barrier":
            want[r] = []
        elif kind == "batch_p2p":
            want[r] = [_data(case, members[(i - 1) % n])]
        else:
            want[r] = [_data(case, q) for q in members if q != root] if r == root else []
    return want


@st.composite
def td_cases(draw):
    world, members = _world_and_members(draw)
    ranks = members if members is not None else list(range(world))
    n = len(ranks)
    kind = draw(st.sampled_from(KINDS if n > 1 else [k for k in KINDS if k != "batch_p2p"]))
    reducing = FUNCOL.get(kind, kind) in ("all_reduce", "reduce", "reduce_scatter",
                                          "reduce_scatter_tensor")
    op = draw(st.sampled_from(OPS)) if reducing else None
    dtypes = ["float32", "float64"] + ([] if op == "AVG" else ["int32", "int64"])
    shape = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 2)))]
    if FUNCOL.get(kind, kind) in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        shape = [n * draw(st.integers(kind in FUNCOL, 2))] + shape[:1]  # (funcol: empty is rare)
    p2p = kind in ("send_recv", "recv_any", "batch_p2p")
    maker = draw(st.sampled_from(["torch", "ours"]))
    return world, {
        "members": members, "maker": maker,
        "destroyer": draw(st.sampled_from(["torch", "ours"])) if maker == "ours" else "torch",
        "kind": kind, "op": op, "dtype": draw(st.sampled_from(dtypes)),
        "shape": shape,
        "root": draw(st.sampled_from(ranks)) if kind in ("reduce", "broadcast", "gather", "scatter")
        or p2p else None,
        "splits": [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(n)]
        if kind == "all_to_all_single" else None,
        "async": None if p2p or kind in FUNCOL else draw(st.sampled_from([None, "wait", "future"])),
        "seed": draw(st.integers(0, 2 ** 16))}


@pytest.mark.timeout(600)
@settings(SETTINGS, max_examples=examples(60))
@given(case=td_cases())
def test_torch_distributed_calls_match_numpy(config, case):
    world, case = case
    results = backend_pool(config, world).run(td_case, case, timeout=120)
    want = td_reference(case, world)
    for r in range(world):
        if r not in want:
            assert results[r] is None, f"rank {r} is outside the group"
            continue
        outs, sender = results[r]
        assert len(outs) == len(want[r]), f"rank {r} of {case}"
        for k, (got, exp) in enumerate(zip(outs, want[r])):
            assert got.dtype == exp.dtype and got.shape == exp.shape, f"rank {r} output {k} of {case}"
            np.testing.assert_allclose(got, exp, rtol=1e-6, err_msg=f"rank {r} output {k} of {case}")
        if case["kind"] == "recv_any" and r == case["root"]:
            ranks = case["members"] if case["members"] is not None else list(range(world))
            assert sorted(sender) == [q for q in ranks if q != r]


def group_timeout_case(ctx, secs):
    """Run on every rank: torch's ``new_group`` of all ranks with a timeout of its own;
    rank 0 alone calls barrier on it: (what it raised, after how long)."""
    import datetime
    import time
    td = _bridged()
    g = td.new_group(timeout=datetime.timedelta(seconds=secs))
    got = None
    try:
        if ctx.rank == 0:
            t0 = time.monotonic()
            try:
                td.barrier(group=g)
                got = ("passed", "", time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001  (reported to the test)
                got = (type(e).__name__, str(e), time.monotonic() - t0)
        td.barrier()  # the others stay until rank 0 is done
    finally:
        td.destroy_process_group(g)
    return got


@pytest.mark.faults
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_torchs_new_group_of_all_ranks_keeps_its_own_timeout(config, world):
    """It was the default group under another name, with the default group's timeout."""
    if config == "mpi":
        pytest.skip("on mpi a blocking collective past its timeout ends the job (the watchdog: "
                    "MPI cannot cancel it)")
    secs = 1.5
    name, msg, took = backend_pool(config, world).run(group_timeout_case, secs, timeout=120)[0]
    assert name in ("DistBackendError", "DistNetworkError", "DistError"), (name, msg)
    assert secs - 0.1 <= took < secs + 5, f"raised after {took:.2f} s: {msg}"


# ---- life: who sets up and tears down torch's default group ---------------------------------------

def life_case(ctx, port, how):
    """Run on every rank of a pool with no group: set up, use, tear down; what each
    side saw."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as td

    import collectives as dist
    url = f"tcp://127.0.0.1:{port}"
    seen = {}
    if how in ("bridge", "off"):
        if how == "off":
            os.environ["COLLECTIVES_TORCH_BRIDGE"] = "0"
        try:
            dist.init_process_group("gloo", init_method=url, rank=ctx.rank, world_size=ctx.world_size)
            seen["torch_after_init"] = td.is_initialized()
            seen["torch_groups"] = isinstance(dist.group.WORLD, td.ProcessGroup)
            if td.is_initialized():
                seen["torch_rank"] = (td.get_rank(), td.get_world_size(), td.get_backend())
                seen["same_world"] = td.group.WORLD is dist.group.WORLD
                sub = dist.new_group([0, 1])  # torch's functions take collectives' groups
                if ctx.rank < 2:
                    t = torch.tensor([ctx.rank + 1.0])
                    td.all_reduce(t, group=sub)
                    seen["sub"] = (td.get_process_group_ranks(sub), td.get_rank(sub), t.item())
                    dist.destroy_process_group(sub)
                    seen["sub_in_torch_after_destroy"] = sub in td.distributed_c10d._world.pg_map
                # a group of torch's own gloo meets through the job's store (torch's
                # default group holds it), not a store of this process alone
                theirs = td.new_group(backend="gloo", timeout=timedelta(seconds=30))
                t = torch.tensor([ctx.rank + 1.0])
                td.all_reduce(t, group=theirs)
                seen["torch_gloo"] = (type(theirs).__name__, t.item())
                td.destroy_process_group(theirs)
            dist.destroy_process_group()
            seen["torch_after_destroy"] = td.is_initialized()
        finally:
            os.environ.pop("COLLECTIVES_TORCH_BRIDGE", None)
    elif how == "stuck":  # rank 0 calls collectives the others never call
        import time
        dist.init_process_group("gloo", init_method=url, rank=ctx.rank, world_size=ctx.world_size,
                                timeout=2)
        if ctx.rank == 0:
            t0 = time.monotonic()
            for call in (lambda: td.all_reduce(torch.ones(2)),
                         lambda: td.all_reduce(torch.ones(2), async_op=True).wait(),
                         lambda: td.broadcast(torch.ones(2), 1, async_op=True).get_future().wait()):
                try:
                    call()
                    seen.setdefault("errors", []).append(None)
                except Exception as e:  # noqa: BLE001
                    seen.setdefault("errors", []).append(type(e).__name__)
            seen["took"] = time.monotonic() - t0
        else:
            time.sleep(8)  # alive, just never calling
        dist.destroy_process_group()
    else:  # a program written for torch.distributed, given the "collectives" backend
        import collectives.torch_bridge.torch_pg  # noqa: F401  (registers it)
        td.init_process_group("collectives", init_method=url, rank=ctx.rank,
                              world_size=ctx.world_size)
        seen["ours_after_init"] = (dist.is_initialized(), dist.get_rank(), dist.get_world_size())
        t = torch.tensor([float(ctx.rank + 1)])
        td.all_reduce(t)
        seen["sum"] = t.item()
        td.destroy_process_group()
        seen["ours_after_destroy"] = dist.is_initialized()
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif("gloo" not in CONFIGS, reason="the gloo configuration is not available")
def test_who_sets_up_and_tears_down_torchs_default_group():
    pool = get_pool(3)
    for r, got in enumerate(pool.run(life_case, free_port(), "bridge", timeout=120)):
        assert got["torch_after_init"] and not got["torch_after_destroy"]
        assert got["torch_groups"] and got["same_world"], got
        assert got["torch_rank"] == (r, 3, "collectives"), got
        if r < 2:
            assert got["sub"] == ([0, 1], r, 3.0) and not got["sub_in_torch_after_destroy"], got
        assert got["torch_gloo"] == ("ProcessGroup", 6.0), got
    for got in pool.run(life_case, free_port(), "off", timeout=120):
        assert got == {"torch_after_init": False, "torch_groups": False,
                       "torch_after_destroy": False}
    got = pool.run(life_case, free_port(), "torch", timeout=120)
    assert got == [{"ours_after_init": (True, r, 3), "sum": 6.0, "ours_after_destroy": False}
                   for r in range(3)]


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif("gloo" not in CONFIGS, reason="the gloo configuration is not available")
def test_a_peer_that_never_arrives_makes_torchs_calls_raise_within_the_timeout():
    got = get_pool(3).run(life_case, free_port(), "stuck", timeout=120)[0]
    assert all(e is not None for e in got["errors"]) and len(got["errors"]) == 3, got
    assert got["took"] < 8, got  # 2 s for the first; the group is broken for the rest
