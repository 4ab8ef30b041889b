"""collectives.torch_bridge.mapped: DDP's gradient buckets in memory every rank maps.

- DDP over a shared-memory group whose buckets pass ``COLLECTIVES_SHM_MAP_MIN`` trains as
  one process on all ranks' data (worlds 2-4, one bucket or one per parameter), its
  parameters bit-identical to the same training with the mapping off, and its later
  all_reduces took the mapped path (the engine counts them);
- the engine's mapped all_reduce over random dtypes, ops, lengths (odd, one element) and
  offsets into the registered buffer gives what the unmapped all_reduce gives, bit for
  bit, and the NumPy reference; where one rank calls on a buffer that is not the mapped
  one, every rank goes the usual way, with the same result;
- a rank that cannot move its bucket (no room) leaves it unmapped on every rank;
  all_reduces outside a backward pass never move a tensor; a registered bucket that dies
  is unregistered, and its place in the engine's table is taken again (more buffers in
  turn than the table holds all go mapped);
- which tensors may move, and a count of all_reduces dies with its tensor (no ranks);
- ``register`` names its argument on misuse, and raises on every rank where the ranks'
  tensors differ in size.
"""
import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.profiles import examples
from tests.support.environ import environ
from tests.support.ranks import backend_pool
from tests.support.requires import needs_gloo

torch = pytest.importorskip("torch")

from tests.support.torch_training import batch, bridged, ddp_reference, model_of  # noqa: E402

pytestmark = needs_gloo  # the rank pools run on the default backend

def _group(map_min, oneshot_max=4096):
    """A new group of every rank with the mapping from ``map_min`` bytes (0: off) and a
    small one-shot size, so that small buffers reach the large all_reduce's paths (rank 0's
    settings apply)."""
    import collectives as dist
    with environ({"COLLECTIVES_SHM_MAP_MIN": str(map_min),
                  "COLLECTIVES_SHM_ONESHOT_MAX": str(oneshot_max)}):
        return dist.new_group(list(range(dist.get_world_size())))


def _mapped_state(group):
    from collectives.torch_bridge import mapped
    return mapped._states.get(group.backend)


def ddp_mapped_case(ctx, case):
    """Run on every rank: DDP over a new group (mapping from ``map_min`` bytes); this rank's
    parameters after training, the group's mapped all_reduces, its live mapped buckets."""
    import collectives as dist
    bridged()
    group = _group(case["map_min"])
    try:
        assert type(group.backend).__name__ == "ShmBackend"
        model = model_of(case["width"], case["seed"] + ctx.rank).double()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=case["bucket_mb"],
                                                        process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(case["steps"]):
            opt.zero_grad()
            x, y = batch(case, ctx.rank, step, 0)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        state = _mapped_state(group)
        return ([p.detach().numpy().copy() for p in model.parameters()],
                group.backend.mapped_calls, 0 if state is None else len(state.live))
    finally:
        dist.destroy_process_group(group)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bucket_mb", [25.0, 1e-6])  # one bucket, or one per parameter
def test_ddp_buckets_mapped_train_as_one_process(world, bucket_mb):
    case = {"width": 700, "batch": 3, "bucket_mb": bucket_mb, "steps": 5, "accumulate": 1,
            "seed": 5, "map_min": 1}
    pool = backend_pool("gloo", world)
    mapped = pool.run(ddp_mapped_case, case, timeout=120)
    plain = pool.run(ddp_mapped_case, {**case, "map_min": 0}, timeout=120)
    want = ddp_reference(case, list(range(world)))
    for r in range(world):
        params, calls, live = mapped[r]
        # buckets over the one-shot size (4 KiB): the weights and the first layer's bias;
        # DDP rebuilds its buckets after step 1, they move at their second all_reduce
        # (step 3), and steps 3-5 go mapped
        assert calls >= 3, f"rank {r}: {calls} mapped all_reduces"
        assert live >= 1
        assert plain[r][1] == 0 and plain[r][2] == 0
        for k, (got, exp) in enumerate(zip(params, plain[r][0])):
            np.testing.assert_array_equal(got, exp, err_msg=f"rank {r} parameter {k}")
        for k, (got, exp) in enumerate(zip(params, want)):
            np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-12,
                                       err_msg=f"rank {r} parameter {k}, world {world}")


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
           "bfloat16": torch.bfloat16, "int64": torch.int64}
_OPS = ("SUM", "MAX", "MIN", "PRODUCT")


def _values(rank, i, dtype, count):
    rng = np.random.default_rng(1000 * i + rank)
    if dtype.is_floating_point:
        return torch.from_numpy(rng.uniform(-2, 2, count)).to(dtype)
    return torch.from_numpy(rng.integers(-50, 50, count)).to(dtype)


def mapped_all_reduces(ctx, cases, decline_rank=None, fail_rank=None):
    """Run on every rank: register one buffer by hand, then each case (dtype, count,
    offset, op) as an all_reduce on a view of it and on a plain tensor; the results and
    how many went mapped. ``decline_rank`` calls on a plain tensor instead of the view;
    ``fail_rank`` cannot move its buffer."""
    import collectives as dist
    from collectives.torch_bridge import mapped
    td = bridged()
    group = _group(1 << 40)  # the tests register by hand
    saved = mapped._move_to_shared
    if ctx.rank == fail_rank:
        mapped._move_to_shared = lambda t: -1
    try:
        capacity = 1 << 20
        buf = torch.zeros(capacity, dtype=torch.uint8)
        registered = mapped.register(buf, group)
        backend = group.backend
        out = []
        for i, (dname, count, offset, op) in enumerate(cases):
            dtype = _DTYPES[dname]
            size = torch.tensor([], dtype=dtype).element_size()
            at = offset * size
            view = buf[at:at + count * size].view(dtype)
            values = _values(ctx.rank, i, dtype, count)
            target = values.clone() if ctx.rank == decline_rank else view
            target.copy_(values)
            before = backend.mapped_calls
            td.all_reduce(target, op=getattr(td.ReduceOp, op), group=group)
            took = backend.mapped_calls - before
            plain = values.clone()
            td.all_reduce(plain, op=getattr(td.ReduceOp, op), group=group)
            out.append((target.float().numpy().copy() if dtype == torch.bfloat16
                        else target.numpy().copy(),
                        plain.float().numpy().copy() if dtype == torch.bfloat16
                        else plain.numpy().copy(), took))
        return registered, out
    finally:
        mapped._move_to_shared = saved
        dist.destroy_process_group(group)


@st.composite
def _cases(draw):
    dname = draw(st.sampled_from(sorted(_DTYPES)))
    size = torch.tensor([], dtype=_DTYPES[dname]).element_size()
    count = draw(st.one_of(st.integers(1, 3), st.integers(1025, 40000)))
    offset = draw(st.integers(0, (1 << 20) // size - count))
    op = draw(st.sampled_from(_OPS if dname != "bfloat16" else ("SUM", "MAX")))
    return dname, count, offset, op


def _reference(world, i, dname, count, op):
    vals = [_values(r, i, _DTYPES[dname], count).double().numpy() for r in range(world)]
    fn = {"SUM": np.sum, "MAX": np.max, "MIN": np.min, "PRODUCT": np.prod}[op]
    return fn(np.stack(vals), axis=0)


@pytest.mark.timeout(300)
@settings(max_examples=examples(8), deadline=None)
@given(world=st.integers(2, 4), cases=st.lists(_cases(), min_size=1, max_size=5),
       decline=st.booleans())
def test_mapped_all_reduce_matches_the_plain_one(world, cases, decline):
    decline_rank = world - 1 if decline else None
    results = backend_pool("gloo", world).run(mapped_all_reduces, cases, decline_rank,
                                              timeout=120)
    for r, (registered, out) in enumerate(results):
        assert registered
        for i, ((dname, count, _, op), (got, plain, took)) in enumerate(zip(cases, out)):
            big = count * torch.tensor([], dtype=_DTYPES[dname]).element_size() > 4096
            assert took == (1 if big and not decline else 0), (r, i, dname, count, took)
            np.testing.assert_array_equal(got, plain, err_msg=f"rank {r} case {i}")
            want = _reference(world, i, dname, count, op)
            tol = 0.1 if dname == "bfloat16" else 1e-5 if dname == "float32" else 1e-12
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"rank {r} case {i}")


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_move_its_buffer_leaves_it_unmapped_on_every_rank():
    cases = [("float32", 5000, 3, "SUM")]
    results = backend_pool("gloo", 3).run(mapped_all_reduces, cases, None, 1, timeout=60)
    for r, (registered, out) in enumerate(results):
        assert not registered, f"rank {r}"
        got, plain, took = out[0]
        assert took == 0
        np.testing.assert_array_equal(got, plain)
        np.testing.assert_allclose(got, _reference(3, 0, "float32", 5000, "SUM"), rtol=1e-5,
                                   atol=1e-5)


def outside_and_dead(ctx):
    """Run on every rank: large all_reduces outside backward never move the tensor; a
    registered bucket that dies leaves no live entry and its all_reduces go the usual way."""
    import collectives as dist
    from collectives.torch_bridge import mapped
    td = bridged()
    group = _group(4096)
    try:
        t = torch.ones(10000)
        ptr = t.data_ptr()
        for _ in range(3):
            group.allreduce([t]).wait()
        outside = (t.data_ptr() == ptr, not t.untyped_storage().is_shared(),
                   _mapped_state(group) is None or not _mapped_state(group).live)
        b = torch.ones(10000)
        assert mapped.register(b, group)
        state = _mapped_state(group)
        live = len(state.live)
        backend = group.backend
        before = backend.mapped_calls
        td.all_reduce(b, group=group)
        took = backend.mapped_calls - before
        del b
        gc.collect()
        c = torch.ones(10000)
        td.all_reduce(c, group=group)
        after = backend.mapped_calls - before
        return outside, live, took, len(state.live) + len(state.maps), after, float(c[0])
    finally:
        dist.destroy_process_group(group)


def registered_again_and_again(ctx, times):
    """Run on every rank: ``times`` buffers in turn, each registered, all-reduced and
    dropped; per buffer whether it registered, whether its all_reduce went mapped, and the
    value it reduced to."""
    import collectives as dist
    from collectives.torch_bridge import mapped
    td = bridged()
    group = _group(1 << 40)  # registered by hand
    try:
        backend, out = group.backend, []
        for i in range(times):
            b = torch.full((4096,), float(ctx.rank + i))
            ok = mapped.register(b, group)
            before = backend.mapped_calls
            td.all_reduce(b, group=group)
            out.append((ok, backend.mapped_calls - before, float(b[0])))
            del b
            gc.collect()  # (the bucket dies: its place in the engine's table is free)
        return out
    finally:
        dist.destroy_process_group(group)


@pytest.mark.timeout(180)
def test_a_dead_buckets_place_is_taken_again_past_the_tables_size():
    from collectives.torch_bridge import mapped
    times = mapped._MAX + 6
    for r, out in enumerate(backend_pool("gloo", 2).run(registered_again_and_again, times,
                                                          timeout=150)):
        assert out == [(True, 1, 2.0 * i + 1) for i in range(times)], f"rank {r}"


@pytest.mark.timeout(120)
def test_outside_backward_nothing_moves_and_a_dead_bucket_is_unregistered():
    results = backend_pool("gloo", 2).run(outside_and_dead, timeout=60)
    for r, (outside, live, took, live_after, after, value) in enumerate(results):
        assert outside == (True, True, True), f"rank {r}"
        assert (live, took, live_after, after, value) == (1, 1, 0, 1, 2.0), f"rank {r}"


def test_which_tensors_may_move():
    from collectives.torch_bridge.mapped import _eligible
    assert _eligible(torch.empty(1 << 18), 1 << 20)
    assert not _eligible(torch.empty(1 << 17), 1 << 20)  # too small
    assert not _eligible(torch.empty(1 << 19)[1:], 1 << 20)  # not at its storage's start
    assert not _eligible(torch.empty(1 << 19)[: 1 << 18], 1 << 20)  # a part of its storage
    assert not _eligible(torch.empty(1024, 512).t(), 1 << 20)  # not contiguous
    assert not _eligible(torch.from_numpy(np.zeros(1 << 18, np.float32)), 1 << 20)  # NumPy's
    assert not _eligible(torch.empty(1 << 18).share_memory_(), 1 << 20)  # shared already


def test_inside_backward_a_sparse_or_small_tensor_is_left_alone():
    """maybe_map in a backward pass (where DDP's reducer calls it), on tensors that may not
    move: no error, nothing seen."""
    from collectives.torch_bridge import mapped

    class Backend:
        map_min = 1024

    class Group:
        backend = Backend()

    group = Group()
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 5]]), torch.ones(2), (4096,),
                                     check_invariants=True)
    small = torch.ones(10)
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        for t in (sparse, [sparse], small, [small, small], []):
            mapped.maybe_map(group, t)
        return grad

    x.register_hook(hook)
    x.sum().backward()
    state = mapped._states.get(group.backend)
    assert state is not None and not state.seen and not state.live


def test_a_count_dies_with_its_tensor(monkeypatch):
    """A tensor's all_reduces count toward its move only while it lives: a new tensor at a
    dead one's address starts again at one. (DDP's buckets rebuilt after step 1 may land
    at an old bucket's address on one rank and not on another; that rank alone would move
    its bucket a step early, and the ranks' collectives would differ: CI saw it.)"""
    from collectives.torch_bridge import mapped

    class Backend:
        map_min = 1024

    class Group:
        backend = Backend()

    group = Group()
    registered = []
    monkeypatch.setattr(mapped, "_register", lambda g, b, t, s: registered.append(t.data_ptr()))
    a = torch.ones(4096)
    ptr = a.data_ptr()
    mapped.maybe_map(group, [a])
    state = mapped._states[group.backend]
    assert state.seen == {ptr: 1}
    del a
    gc.collect()
    assert state.seen == {}
    b = torch.ones(4096)
    mapped.maybe_map(group, [b])
    assert registered == []
    mapped.maybe_map(group, [b])
    assert registered == [b.data_ptr()] and state.seen == {}


def register_misuse(ctx):
    """Run on every rank: register's argument checks (before any communication), then
    tensors whose sizes differ by rank: the error each rank raised."""
    import collectives as dist
    from collectives.torch_bridge import mapped
    bridged()
    group = _group(1 << 40)
    errors = []
    try:
        for bad in (np.zeros(1024), torch.from_numpy(np.zeros(1024)), torch.zeros(2048)[1:],
                    torch.zeros(1024).share_memory_(), torch.zeros(64, 64).t()):
            try:
                mapped.register(bad, group)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append((type(e).__name__, str(e).split(" ")[0]))
        try:
            mapped.register(torch.zeros(1024 + 8 * ctx.rank), group)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
        return errors
    finally:
        dist.destroy_process_group(group)


@pytest.mark.timeout(120)
def test_register_names_its_argument_and_refuses_sizes_that_differ():
    results = backend_pool("gloo", 2).run(register_misuse, timeout=60)
    for r, errors in enumerate(results):
        assert errors[:5] == [("TypeError", "tensor")] + [("ValueError", "tensor")] * 4, r
        assert errors[5] == ("tensor must have the same size on every rank: [4096, 4128] "
                             "bytes by rank"), f"rank {r}: {errors[5]}"
