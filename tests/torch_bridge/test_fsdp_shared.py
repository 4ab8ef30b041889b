"""collectives.torch_bridge.fsdp: FSDP2's all_gathers into outputs every rank maps.

- fully_shard a layer at a time with ``share_collectives`` (all_gathers alone, or both
  calls), or as the program wrote it (the default path on our groups), trains as one
  process on all ranks' data (worlds 2-3, 2 slots so that every other buffer reuses one;
  the property over random cases is test_torch_pg's FSDP flavours), and every call went
  through shared memory; the default path leaves FSDP2's own calls to torch's own
  groups, to ``COLLECTIVES_FSDP_SHARED=0`` and to ``keep_fsdp_defaults``;
- ranks in different shared calls (an all_gather against a reduce_scatter) all raise,
  naming what each was in; with ``fallback`` a rank that still holds its buffer gets one
  of its own for that call, and a /dev/shm without room turns the slots off on every rank;
- the shared output holds every rank's block after the call; the shared reduce_scatter
  gives each rank its block summed (SUM, AVG; MAX through torch's call on the same input),
  empty and odd lengths included;
- a rank that keeps an output past its slot raises at once; a peer that keeps one, or dies
  holding it, makes the others raise within ``timeout`` naming it;
- no segment is left in /dev/shm; misuse is a ValueError before anything is mapped.
"""
import glob
import importlib
import os
import time

import numpy as np
import pytest

from tests.support.ranks import backend_pool
from tests.support.requires import needs_gloo

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_api",
                    reason="FSDP2's custom all_gather (torch 2.7 on)")

from tests.support.torch_training import bridged as _bridged  # noqa: E402
from tests.support.torch_training import ddp_reference, fsdp_case  # noqa: E402

pytestmark = needs_gloo  # the rank pools run on the default backend


def _segments():
    return set(glob.glob(f"/dev/shm/collectives-fsdp-{os.getuid()}-*"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("flavor,shared_rs", [("fully_shard_shared", False),
                                              ("fully_shard_shared", True),
                                              ("fully_shard", None), ("fully_shard_own", None)])
def test_fully_shard_trains_as_one_process(world, flavor, shared_rs):
    """With ``share_collectives`` (the all_gathers alone, or both calls), as the program
    wrote it (on our groups its calls are shared by default), and with FSDP2's own calls;
    fsdp_case checks which calls ran."""
    case = {"members": None, "width": 5, "batch": 3, "bucket_mb": 25.0, "steps": 3,
            "accumulate": 2, "seed": 11, "flavor": flavor, "slots": 2, "shared_rs": shared_rs}
    results = backend_pool("gloo", world).run(fsdp_case, case, timeout=120)
    want = ddp_reference(case, list(range(world)))
    for r, params in enumerate(results):
        for k, (got, exp) in enumerate(zip(params, want)):
            np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-12,
                                       err_msg=f"rank {r} parameter {k}, world {world}")
    assert not _segments()


def gather_blocks(ctx, n, calls, torch_gloo=False):
    """Each call: allocate a shared output, write this rank's block (rank * 1000 + call +
    i), all_gather in place; the whole output as this rank sees it after each call. With
    ``torch_gloo``, over a group of torch's own gloo."""
    from collectives.torch_bridge.fsdp import SharedAllGather
    td = _bridged()
    group = td.new_group(backend="gloo") if torch_gloo else None
    comm = SharedAllGather(group, slots=2)
    out = []
    for call in range(calls):
        o = comm.allocate((n * ctx.world_size,), dtype=torch.float32, device=torch.device("cpu"))
        block = o.narrow(0, n * ctx.rank, n)
        block.copy_(torch.arange(n, dtype=torch.float32) + ctx.rank * 1000 + call)
        assert comm(o, block, group) is None
        out.append(o.clone().numpy())
        del o, block
    if group is not None:
        td.destroy_process_group(group)
    return out, comm.shared_calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,torch_gloo", [(0, False), (1, False), (7, False), (70000, False),
                                          (7, True)])
def test_the_shared_output_holds_every_ranks_block(n, torch_gloo):
    world, calls = 3, 5
    res = backend_pool("gloo", world).run(gather_blocks, n, calls, torch_gloo)
    for call in range(calls):
        want = np.concatenate([np.arange(n, dtype=np.float32) + r * 1000 + call
                               for r in range(world)])
        for r, (outs, shared) in enumerate(res):
            np.testing.assert_array_equal(outs[call], want, err_msg=f"rank {r} call {call}")
            assert shared == (calls if n else 0)  # an empty output is torch.empty's
    assert not _segments()


def scatter_blocks(ctx, n, calls, op):
    """Each call: an input from the slots (rank r's element i of block b: r * 100 + b * 10
    + i + call), the output from torch.empty, as FSDP2 takes them; reduce_scatter; this
    rank's outputs."""
    import torch.distributed as td

    from collectives.torch_bridge.fsdp import SharedReduceScatter
    _bridged()
    comm = SharedReduceScatter(None, slots=2)
    w, out = ctx.world_size, []
    dev = torch.device("cpu")
    for call in range(calls):
        x = comm.allocate((n * w,), dtype=torch.float64, device=dev)
        o = comm.allocate((n,), dtype=torch.float64, device=dev)
        assert comm._slots.slot_of(o) is None  # the output is FSDP2's own memory
        x.copy_(torch.arange(n * w, dtype=torch.float64) % n + ctx.rank * 100 + call
                + 10 * (torch.arange(n * w) // max(n, 1)))
        comm(o, x, None, getattr(td.ReduceOp, op))
        out.append(o.numpy().copy())
        del x, o
    return out, comm.shared_calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [0, 1, 5, 30000])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_the_shared_reduce_scatter_gives_each_rank_its_reduced_block(n, op):
    world, calls = 3, 5
    res = backend_pool("gloo", world).run(scatter_blocks, n, calls, op)
    i = np.arange(n, dtype=np.float64)
    for call in range(calls):
        for r, (outs, shared) in enumerate(res):
            ins = [i + q * 100 + call + 10 * r for q in range(world)]
            want = {"SUM": sum(ins), "AVG": sum(ins) / world, "MAX": np.maximum.reduce(ins)}[op]
            np.testing.assert_array_equal(outs[call], want, err_msg=f"rank {r} call {call}")
            assert shared == (calls if n else 0)  # inputs from the slots (MAX: torch's call on them)
    assert not _segments()


def hold_outputs(ctx, holder, die, timeout):
    """slots=2: every rank allocates twice (making both slots); ``holder`` keeps its first
    output (or dies holding it), the others drop theirs and come back to slot 0. What
    each rank raised, or "ok"."""
    from collectives.torch_bridge.fsdp import SharedAllGather
    _bridged()
    comm = SharedAllGather(None, slots=2, timeout=timeout)
    dev = torch.device("cpu")
    kept = [comm.allocate((4,), dtype=torch.float32, device=dev),
            comm.allocate((4,), dtype=torch.float32, device=dev)]
    if ctx.rank == holder:
        if die:
            os._exit(3)
        kept = kept[:1]
    else:
        kept = []
    t0 = time.monotonic()
    try:
        comm.allocate((4,), dtype=torch.float32, device=dev)
    except RuntimeError as e:
        if kept:  # the holder keeps its output while the others wait for it
            time.sleep(timeout + 2)
        return str(e), time.monotonic() - t0
    return "ok", time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_rank_that_keeps_its_output_past_the_slot_raises_at_once():
    for msg in backend_pool("gloo", 2).run(_own_rank_keeps):
        assert "still holds its buffer 0 (slot 0) as its buffer 2 needs the slot" in msg, msg


def _own_rank_keeps(ctx):
    from collectives.torch_bridge.fsdp import SharedAllGather
    _bridged()
    comm = SharedAllGather(None, slots=2)
    dev = torch.device("cpu")
    kept = [comm.allocate((8,), dtype=torch.float32, device=dev) for _ in range(2)]
    try:
        comm.allocate((8,), dtype=torch.float32, device=dev)
    except RuntimeError as e:
        return str(e)
    return f"no error, {len(kept)} kept"


@pytest.mark.timeout(120)
def test_a_peer_that_keeps_its_output_makes_the_others_raise_naming_it():
    res = backend_pool("gloo", 3).run(hold_outputs, 1, False, 1.0)
    for r in (0, 2):
        msg, waited = res[r]
        assert "group rank(s) [1] did not drop their buffer in slot 0 within 1.0 s" in msg, res
        assert 0.9 < waited < 10, res
    assert "still holds" in res[1][0], res  # the holder itself comes back to its own slot


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_peer_that_dies_holding_its_output_makes_the_survivors_raise():
    pool = backend_pool("gloo", 3)
    answers, died = pool.run_dead_peer(hold_outputs, 1, True, 2.0, victims={1}, timeout=60)
    assert died == {1}
    for r in (0, 2):
        msg, waited = answers[r]
        assert "group rank(s) [1] did not drop" in msg, answers
        assert waited < 10, answers


def test_misuse_is_a_value_error_naming_the_argument():
    from collectives.torch_bridge.fsdp import SharedAllGather, share_all_gathers
    with pytest.raises(ValueError, match="slots must be an int of at least 2, got 1"):
        SharedAllGather(None, slots=1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        SharedAllGather(None, timeout=0)
    with pytest.raises(ValueError, match="no FSDP2 module"):
        share_all_gathers(torch.nn.Linear(2, 2))


def _wrong_group(ctx):
    """fully_shard over the default group, then share_collectives over another group of
    the same ranks: the ValueError's text, and the group taken when none is given."""
    import torch.distributed as td
    from torch.distributed.fsdp import fully_shard

    from collectives.torch_bridge.fsdp import share_collectives
    _bridged()
    other = td.new_group(list(range(ctx.world_size)))
    model = fully_shard(torch.nn.Linear(4, 4))
    try:
        share_collectives(model, group=other)
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    gather, _ = share_collectives(model)
    return msg, gather._slots.group is td.group.WORLD


@pytest.mark.timeout(120)
def test_a_group_other_than_the_fsdp_meshs_is_a_value_error():
    for msg, took_mesh_group in backend_pool("gloo", 2).run(_wrong_group):
        assert msg.startswith("group must be the FSDP mesh's group"), msg
        assert took_mesh_group


def default_path_kinds(ctx, how):
    """fully_shard a model (``how``: on our default group; with COLLECTIVES_FSDP_SHARED=0 at
    its first forward; on a group of torch's own, its ``fake`` backend), one step; the
    classes of its calls afterwards."""
    import torch.distributed as td
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tests.support.torch_training import fsdp_comms
    _bridged()
    mesh = fake = None
    if how == "fake":  # torch's fake backend: every call returns at once
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers it
        fake = td.new_group(backend="fake")
        mesh = DeviceMesh.from_group(fake, "cpu")
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                        mesh=mesh)
    if how == "off":
        os.environ["COLLECTIVES_FSDP_SHARED"] = "0"
    try:
        model(torch.ones(2, 4)).sum().backward()
    finally:
        os.environ.pop("COLLECTIVES_FSDP_SHARED", None)
    kinds = {(type(g).__name__, type(s).__name__) for g, s in fsdp_comms(model)}
    if fake is not None:  # (the pool's ranks run later tests)
        td.destroy_process_group(fake)
    return kinds


@pytest.mark.timeout(120)
def test_the_default_path_shares_our_groups_calls_only():
    pool = backend_pool("gloo", 2)
    shared, own = {("SharedAllGather", "SharedReduceScatter")}, {("DefaultAllGather",
                                                                 "DefaultReduceScatter")}
    assert pool.run(default_path_kinds, "on") == [shared, shared]
    assert pool.run(default_path_kinds, "off") == [own, own]
    assert pool.run(default_path_kinds, "fake") == [own, own]


def different_calls(ctx, made):
    """Rank 0 in a shared all_gather, the others in a shared reduce_scatter: what each
    raised. With ``made``, two calls of each first (slots=2: the slots exist, so the
    ranks meet in the calls themselves); without, the diverging calls make the slots."""
    import torch.distributed as td

    from collectives.torch_bridge.fsdp import SharedAllGather, SharedReduceScatter
    _bridged()
    gather, scatter = SharedAllGather(None, slots=2), SharedReduceScatter(None, slots=2)
    dev, w = torch.device("cpu"), ctx.world_size

    def all_gather():
        o = gather.allocate((4 * w,), dtype=torch.float32, device=dev)
        gather(o, o.narrow(0, 4 * ctx.rank, 4), None)

    def reduce_scatter():
        x = scatter.allocate((4 * w,), dtype=torch.float32, device=dev)
        o = scatter.allocate((4,), dtype=torch.float32, device=dev)
        scatter(o, x, None, td.ReduceOp.SUM)

    for _ in range(2 if made else 0):
        all_gather()
        reduce_scatter()
    try:
        all_gather() if ctx.rank == 0 else reduce_scatter()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("made", [False, True])
def test_ranks_in_different_shared_calls_all_raise_naming_them(made):
    call = 3 if made else 1
    for msg in backend_pool("gloo", 3).run(different_calls, made):
        assert "the ranks of the group are in different shared calls (group rank 0: " \
            f"all_gather call {call}" in msg, msg
        assert all(f"group rank {r}: reduce_scatter call {call}" in msg for r in (1, 2)), msg


def keep_with_fallback(ctx, n):
    """fallback=True, 2 slots: every rank keeps its first two outputs; the third call gets
    one of its own (on every rank) and still gathers every block; then the slots again."""
    from collectives.torch_bridge.fsdp import SharedAllGather
    _bridged()
    comm = SharedAllGather(None, slots=2, fallback=True)
    dev, w, out = torch.device("cpu"), ctx.world_size, []
    kept = []
    for call in range(4):
        o = comm.allocate((n * w,), dtype=torch.float32, device=dev)
        o.narrow(0, n * ctx.rank, n).fill_(ctx.rank + 10 * call)
        comm(o, o.narrow(0, n * ctx.rank, n), None)
        out.append((o.numpy().copy(), comm._slots.slot_of(o) is not None))
        if call < 2:
            kept.append(o)
        else:
            kept.clear()
        del o
    return out, comm._slots.fell_back


@pytest.mark.timeout(120)
def test_with_fallback_a_rank_still_holding_its_buffer_gets_one_of_its_own():
    n, world = 3, 2
    for outs, fell_back in backend_pool("gloo", world).run(keep_with_fallback, n):
        assert fell_back == 1
        assert [shared for _, shared in outs] == [True, True, False, True]
        for call, (got, _) in enumerate(outs):
            want = np.repeat(np.arange(world, dtype=np.float32) + 10 * call, n)
            np.testing.assert_array_equal(got, want, err_msg=f"call {call}")
    assert not _segments()


def no_room(ctx):
    """Rank 0's /dev/shm has no room for a segment: every rank's calls are FSDP2's own,
    with one warning; the gathered output is still every rank's blocks."""
    import warnings

    from collectives.torch_bridge import fsdp
    _bridged()
    create = fsdp._create_segment
    if ctx.rank == 0:  # (put back before returning: the pool's ranks run later tests)
        fsdp._create_segment = lambda size: None
    try:
        comm = fsdp.SharedAllGather(None)
        dev, w = torch.device("cpu"), ctx.world_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = []
            for _ in range(2):
                o = comm.allocate((2 * w,), dtype=torch.float32, device=dev)
                o.narrow(0, 2 * ctx.rank, 2).fill_(ctx.rank)
                comm(o, o.narrow(0, 2 * ctx.rank, 2).clone(), None)
                outs.append(o.tolist())
    finally:
        fsdp._create_segment = create
    return outs, comm.shared_calls, [str(c.message) for c in caught]


@pytest.mark.timeout(120)
def test_a_dev_shm_without_room_turns_the_slots_off_on_every_rank():
    for outs, shared, warned in backend_pool("gloo", 2).run(no_room):
        assert outs == [[0.0, 0.0, 1.0, 1.0]] * 2
        assert shared == 0
        assert len(warned) == 1 and "/dev/shm has no room" in warned[0], warned
