"""DeviceMesh / init_device_mesh and dist.breakpoint.

Property: for any world size 1-6 and any mesh over some of its ranks (random shape,
random rank order, names), each dimension's group on every rank holds exactly the
ranks that differ from it only in that coordinate, an all_reduce in it sums them, and
slicing and flattening give the sub-meshes NumPy indexing gives.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as dist
from collectives.torch_bridge.device_mesh import MeshDimError
from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool, get_pool
from tests.support.requires import needs_gloo

CONFIGS = [c for c in available_configs() if c in ("gloo", "mpi", "gloo-hier")]
SETTINGS = settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_module_keeps_torchs_path():
    """torch.distributed.device_mesh's path names the module in torch_bridge/ (as
    dist.device_mesh does), so ``from collectives.device_mesh import ...`` still works."""
    import importlib

    from collectives.torch_bridge import device_mesh
    assert importlib.import_module("collectives.device_mesh") is device_mesh
    assert dist.device_mesh is device_mesh and dist.DeviceMesh is device_mesh.DeviceMesh


def _owned_groups(mesh, extra=()):
    seen, out = set(), []
    for g in list(mesh.get_all_groups()) + list(extra):
        if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def mesh_case(ctx, ranks, names):
    """Run on every rank: build the mesh, reduce in every dimension's group, slice it with
    the names reversed, flatten its first two dimensions; returns what this rank saw."""
    import numpy as np

    import collectives as dist
    mesh = dist.DeviceMesh("cpu", ranks, mesh_dim_names=names)
    out = {"coord": mesh.get_coordinate(), "groups": [], "sums": [], "local": []}
    for d in range(mesh.ndim):
        g = mesh.get_group(names[d] if d % 2 else d)  # by name and by index
        out["local"].append(mesh.get_local_rank(d))
        if not isinstance(g, dist.ProcessGroup):
            out["groups"].append(None)
            continue
        out["groups"].append(dist.get_process_group_ranks(g))
        t = np.array([ctx.rank + 1], np.int64)
        dist.all_reduce(t, group=g)
        out["sums"].append(int(t[0]))
    sub = mesh[tuple(reversed(names))]
    out["sub"] = np.asarray(sub.mesh).tolist()
    out["sub_groups_shared"] = all(
        sub.get_group(n) is mesh.get_group(n) for n in names)
    flat = None
    if mesh.ndim >= 2:
        flat = mesh[names[:2]]._flatten()
        assert mesh["_".join(names[:2])] is flat
        g = flat.get_group()
        out["flat"] = np.asarray(flat.mesh).tolist()
        if isinstance(g, dist.ProcessGroup):
            t = np.array([ctx.rank + 1], np.int64)
            dist.all_reduce(t, group=g)
            out["flat_group"] = (dist.get_process_group_ranks(g), int(t[0]))
        else:
            out["flat_group"] = None
    for g in _owned_groups(mesh, [flat.get_group()] if flat is not None else []):
        dist.destroy_process_group(g)
    return out


@st.composite
def mesh_cases(draw):
    world = draw(st.integers(1, 6))
    total = draw(st.integers(1, world))
    dims = []
    left = total
    for f in range(2, total + 1):  # a random factorisation of total
        while left % f == 0 and draw(st.booleans()):
            dims.append(f)
            left //= f
    if left > 1:
        dims.append(left)
    dims = draw(st.permutations(dims)) if dims else [1]
    if draw(st.booleans()):
        dims = list(dims) + [1]  # a dimension of size 1
    order = draw(st.permutations(range(world)))[:total]
    ranks = np.array(order, np.int64).reshape(dims).tolist()
    names = tuple(f"d{i}" for i in range(len(dims)))
    return world, ranks, names


def _slice(arr, coord, keep):
    """Ranks along dimensions ``keep`` (in that order) through ``coord``."""
    idx = tuple(slice(None) if d in keep else coord[d] for d in range(arr.ndim))
    kept = sorted(keep)
    return np.transpose(arr[idx], [kept.index(d) for d in keep])


@pytest.mark.timeout(600)
@SETTINGS
@given(case=mesh_cases())
def test_mesh_groups_hold_the_ranks_of_each_dimension(config, case):
    world, ranks, names = case
    results = backend_pool(config, world).run(mesh_case, ranks, names, timeout=120)
    arr = np.array(ranks)
    nd = arr.ndim
    for r in range(world):
        got = results[r]
        hit = np.argwhere(arr == r)
        if not len(hit):
            assert got["coord"] is None and got["groups"] == [None] * nd, (r, got)
            assert got["local"] == [-1] * nd
            continue
        coord = tuple(int(i) for i in hit[0])
        assert got["coord"] == coord
        for d in range(nd):
            line = sorted(_slice(arr, coord, [d]).ravel().tolist())
            assert got["groups"][d] == line, (r, d, got)
            assert got["sums"][d] == sum(x + 1 for x in line)
            assert got["local"][d] == line.index(r)
        rev = list(reversed(range(nd)))
        assert got["sub"] == _slice(arr, coord, rev).tolist()
        assert got["sub_groups_shared"]
        if nd >= 2:
            part = _slice(arr, coord, [0, 1]).ravel().tolist()
            assert got["flat"] == part
            assert got["flat_group"] == (sorted(part), sum(x + 1 for x in part))


def init_mesh_case(ctx):
    """Run on every rank of a world of 4: the README's 2-D example, with the world group
    reused for a 1-D mesh of every rank."""
    import numpy as np

    import collectives as dist
    mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.shape == (2, 2) and mesh.ndim == 2 and mesh.size() == 4 and mesh.size(1) == 2
    assert mesh.size("dp") == 2 and mesh.device_type == "cpu" and mesh.get_rank() == ctx.rank
    one = dist.init_device_mesh("cpu", (4,))
    assert one.get_group() is dist.group.WORLD and one.get_local_rank() == ctx.rank
    t = np.full(3, float(ctx.rank), np.float32)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    again = dist.DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
    res = (t.tolist(), np.asarray(tp.mesh).tolist(), np.asarray(dp.mesh).tolist(),
           tp.get_local_rank(), dp.get_local_rank(), again == tp, repr(mesh))
    for g in _owned_groups(mesh):
        dist.destroy_process_group(g)
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "gloo-hier"])
def test_init_device_mesh_two_by_two(config):
    results = backend_pool(config, 4).run(init_mesh_case, timeout=120)
    for r, (t, tp, dp, tl, dl, same, text) in enumerate(results):
        row, col = divmod(r, 2)
        assert t == [float(2 * row + 2 * row + 1)] * 3  # ranks 2*row and 2*row+1
        assert tp == [2 * row, 2 * row + 1] and dp == [col, col + 2]
        assert (tl, dl) == (col, row) and same
        assert text == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"


def misuse_case(ctx):
    """Run on every rank: misuse raises before any group is made, and says what it wanted."""
    import collectives as dist
    from collectives.torch_bridge.device_mesh import MeshDimError
    out = []
    for call in [
        lambda: dist.init_device_mesh("cpu", (3,)),
        lambda: dist.init_device_mesh("cuda:0", (2,)),
        lambda: dist.init_device_mesh("cpu", (2, 0)),
        lambda: dist.init_device_mesh("cpu", (2,), mesh_dim_names=("a", "b")),
        lambda: dist.init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "a")),
        lambda: dist.init_device_mesh("cpu", (2,), backend_override={"x": "gloo"}),
        lambda: dist.DeviceMesh("cpu", [0, 0]),
        lambda: dist.DeviceMesh("cpu", [[0, 1], [2]]),
        lambda: dist.DeviceMesh("cpu", [0.0, 1.0]),
        lambda: dist.DeviceMesh("cpu", [0, 5]),
    ]:
        try:
            call()
            out.append(None)
        except (ValueError, TypeError) as e:
            out.append((type(e).__name__, str(e), isinstance(e, MeshDimError)))
    count = dist.get_pg_count()
    mesh = dist.init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    for call in [lambda: mesh["y"], lambda: mesh.get_group("y"), lambda: mesh.get_group(1)]:
        try:
            call()
            out.append(None)
        except (KeyError, ValueError) as e:
            out.append((type(e).__name__, str(e), isinstance(e, (KeyError, ValueError))))
    out.append(dist.get_pg_count() - count)
    return out


@pytest.mark.timeout(300)
def test_mesh_misuse_raises_naming_the_argument():
    if "gloo" not in CONFIGS:
        pytest.skip("the gloo configuration is not available")
    res = backend_pool("gloo", 2).run(misuse_case, timeout=120)[0]
    expect = ["mesh_shape (3,) needs 3 ranks; the default group has 2",
              "device_type must be a device type without an index",
              "mesh_shape must hold positive ints",
              "mesh_dim_names must name each of the mesh's 1 dimensions",
              "mesh_dim_names must be unique",
              "backend_override: mesh dimension 'x' does not exist",
              "mesh must name each rank once, got rank 0 more than once",
              "mesh must be a rectangular array",
              "mesh must hold int ranks",
              "mesh must hold global ranks in [0, 2)"]
    for got, want in zip(res, expect):
        assert got is not None and want in got[1], (got, want)
    assert res[5][2]  # an unknown dimension name is a MeshDimError (KeyError and ValueError)
    assert "mesh dimension 'y' does not exist" in res[10][1] and res[10][0] == "MeshDimError"
    assert "mesh dimension 'y' does not exist" in res[11][1]
    assert "mesh_dim must be in [0, 1)" in res[12][1]
    assert res[13] == 0  # a 1-D mesh of the whole world reuses the default group


def test_mesh_dim_error_is_a_key_and_value_error():
    e = MeshDimError("mesh dimension 'y' does not exist")
    assert isinstance(e, KeyError) and isinstance(e, ValueError)
    assert str(e) == "mesh dimension 'y' does not exist"


# ---- dist.breakpoint -------------------------------------------------------------------------

class _FakePdb:
    """Stands in for pdb on the breaking rank: sleeps instead of reading commands."""

    def __init__(self, seconds, log):
        self.seconds, self.log = seconds, log

    def message(self, text):
        self.log.append(text)

    def set_trace(self, frame):
        import time
        self.log.append(frame.f_code.co_name)
        time.sleep(self.seconds)


def init_short_timeout(ctx):
    """Pool setup: the default group with a 2 s timeout (env://), destroyed at pool close."""
    from datetime import timedelta

    import collectives as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    ctx.state["atexit"].append(dist.destroy_process_group)


def breakpoint_case(ctx, rank, skip, calls, seconds):
    """Run on every rank: ``calls`` dist.breakpoint calls from one line; returns, per call,
    how long this rank spent in it, what the fake debugger saw, and the misuse errors."""
    import time

    import collectives as dist
    from collectives.api import breakpoint as _breakpoint
    errors = []
    for kw in ({"rank": 3}, {"skip": -1}, {"timeout_s": 0}, {"rank": True}):
        try:
            dist.breakpoint(**kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    log = []
    _breakpoint._make_pdb = lambda: _FakePdb(seconds, log)
    spent = []
    for _ in range(calls):
        t0 = time.perf_counter()
        dist.breakpoint(rank=rank, skip=skip)
        spent.append(time.perf_counter() - t0)
    return spent, log, errors


@pytest.mark.faults
@pytest.mark.slow  # waits out a 7 s timeout
@pytest.mark.timeout(300)
@needs_gloo
def test_breakpoint_stops_one_rank_and_the_others_wait_past_the_group_timeout():
    # the group timeout is 2 s and the debugger holds rank 1 for 3 s
    res = get_pool(3, init_short_timeout).run(breakpoint_case, 1, 1, 3, 3.0, timeout=120)
    for r, (spent, log, errors) in enumerate(res):
        assert spent[0] < 1.0, (r, spent)          # skipped everywhere
        assert min(spent[1:]) > 2.5, (r, spent)    # everyone waited for rank 1, twice
        if r == 1:
            assert log[1::2] == ["breakpoint"] * 2 and "rank 1 stopped" in log[0]
        else:
            assert log == []
        assert "rank must be a global rank in [0, 3), got 3" in errors[0]
        assert "skip must be an int >= 0, got -1" in errors[1]
        assert "timeout_s must be a positive number of seconds or None, got 0" in errors[2]
        assert "got True" in errors[3]
