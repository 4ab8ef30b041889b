"""Deterministic inputs, a rank-side runner and a NumPy reference for the collective tests.

A *case* is a dict: the group's members (global ranks), a seed, and a list of
steps (one collective each, possibly ``async_op``). Every rank builds its inputs
from ``(seed, rank, step, salt)``; the test process builds the same inputs for
every rank and computes what each rank must end up with.
"""
import importlib.util

import numpy as np

#: whether torch is installed: without it the cases draw NumPy arrays only (and no bfloat16,
#: which NumPy has not)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
LIBS = ("torch", "numpy") if HAVE_TORCH else ("numpy",)
DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "int8", "uint8", "int16", "int32", "int64", "bool"]
if not HAVE_TORCH:
    DTYPES.remove("bfloat16")
FLOATS = {"float16", "bfloat16", "float32", "float64"}
COMPLEX = {"complex64", "complex128"}
INTS = {"int8", "uint8", "int16", "int32", "int64"}
OPS_FOR = {
    "float": ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"],
    "complex": ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"],
    "int": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "bool": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"],
}
RTOL = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 1e-5, "float64": 1e-12,
        "complex64": 1e-5, "complex128": 1e-12}
# PREMUL_SUM factors that keep the data exactly representable
FACTORS = [0.5, 2.0, -1.0]


def family(dtype):
    if dtype in FLOATS:
        return "float"
    if dtype in COMPLEX:
        return "complex"
    return "bool" if dtype == "bool" else "int"


def value_dtype(dtype):
    """NumPy dtype that holds the values exactly (bfloat16 -> float64)."""
    if dtype == "bfloat16":
        return np.dtype(np.float64)
    return np.dtype(dtype)


def gen(seed, rank, step, salt, dtype, shape):
    """Inputs: halves in [-2, 2] for floats (exact in every float dtype), small ints, bools."""
    rng = np.random.default_rng([seed, rank, step, salt])
    fam = family(dtype)
    if fam == "float":
        vals = rng.integers(-4, 5, shape) / 2
    elif fam == "complex":
        vals = rng.integers(-4, 5, shape) / 2 + 1j * rng.integers(-4, 5, shape) / 2
    elif fam == "bool":
        vals = rng.integers(0, 2, shape)
    else:
        vals = rng.integers(*((0, 60) if dtype == "uint8" else (-40, 41)), shape)
    return np.asarray(vals).astype(value_dtype(dtype))  # 0-d stays an array


def split_matrix(seed, step, n):
    """sizes[i][j]: elements (rows) rank i sends to rank j, 0..3."""
    rng = np.random.default_rng([seed, 7777, step])
    return rng.integers(0, 4, (n, n)).tolist()


# ---- reference -----------------------------------------------------------------------------

def ref_reduce(arrays, dtype, op, factor=None):
    """Fold in rank order: float64/complex128 for floats, the dtype itself (wrapping) for ints."""
    fam = family(dtype)
    if fam in ("float", "complex"):
        arrs = [a.astype(np.complex128 if fam == "complex" else np.float64) for a in arrays]
    else:
        arrs = [a.copy() for a in arrays]
    if op == "PREMUL_SUM":
        arrs = [a * factor for a in arrs]
    acc = arrs[0].copy()
    with np.errstate(all="ignore"):
        for a in arrs[1:]:
            if fam == "bool":
                fn = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
                      "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
                      "BXOR": np.logical_xor}[op]
            else:
                fn = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply,
                      "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
                      "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
            acc = fn(acc, a)
    if op == "AVG":
        acc = acc / len(arrays)
    return acc


def assert_close(got, want, dtype, what):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype in RTOL:
        # relative to the data's scale: sums of halves, so absolute error scales with |want|
        tol = RTOL[dtype] * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
        np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=what)


# ---- rank side ------------------------------------------------------------------------------

def to_lib(arr, dtype, lib):
    """``lib``: 'numpy', 'torch' (CPU tensors) or 'cuda' (torch tensors on the current GPU)."""
    if lib == "numpy":
        return arr.astype(dtype, order="C")
    import torch
    t = torch.from_numpy(arr.copy(order="C"))
    t = t.to(getattr(torch, dtype)).contiguous()
    return t.cuda() if lib == "cuda" else t


def from_lib(t):
    """A NumPy copy with exact values (half types widened to float64)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64) if t.dtype == np.float16 else t.copy()
    import torch
    t = t.cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.double().numpy()
    return t.numpy().copy()


def raw_bytes(t):
    if isinstance(t, np.ndarray):
        return t.tobytes()
    import torch
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def make_op(dist, step):
    name = step.get("op")
    if name is None:
        return None
    if name == "PREMUL_SUM":
        return dist.ReduceOp.PREMUL_SUM(step["factor"])
    return getattr(dist.ReduceOp, name)


def _numel(shape):
    return int(np.prod(shape, dtype=np.int64))


def build_inputs(case, rank, i, step, n, me):
    """Rank ``rank``'s (group rank ``me``) input arrays for step ``i``, as plain NumPy values."""
    seed, dt, shape, kind = case["seed"], step["dtype"], tuple(step["shape"]), step["kind"]
    if kind in ("scatter", "reduce_scatter"):
        return [gen(seed, rank, i, j, dt, shape) for j in range(n)]
    if kind in ("reduce_scatter_single", "reduce_scatter_in_place"):
        return gen(seed, rank, i, 0, dt, (n * _numel(shape),))
    if kind in ("all_to_all", "all_to_all_single"):
        sizes = split_matrix(seed, i, n)[me]
        if kind == "all_to_all":
            return [gen(seed, rank, i, j, dt, (sizes[j],)) for j in range(n)]
        return gen(seed, rank, i, 0, dt, (sum(sizes), 2))
    if kind in ("all_reduce_coalesced", "all_gather_coalesced"):
        return [gen(seed, rank, i, j, dt, s) for j, s in enumerate([shape, (3,), (0,), (2, 2)])]
    return gen(seed, rank, i, 0, dt, shape)


def run_case(ctx, case):
    """Run on every rank: the case's steps, in order, async ones waited at the end."""
    import collectives as dist
    members = case["members"]
    key = ("group", tuple(members))
    if members == list(range(ctx.world_size)) and case.get("world", True):
        grp = None
    else:
        if key not in ctx.state:
            ctx.state[key] = dist.new_group(members)
        grp = ctx.state[key]
    if ctx.rank not in members:
        return None
    n, me = len(members), members.index(ctx.rank)
    outputs, works, keep = [], [], []
    for i, step in enumerate(case["steps"]):
        dt, lib, kind = step["dtype"], step["lib"], step["kind"]
        shape = tuple(step["shape"])
        root = members[step.get("root", 0) % n]
        op = make_op(dist, step)
        a = step["async"]
        inp = build_inputs(case, ctx.rank, i, step, n, me)
        T = (lambda x, dt=dt, lib=lib: to_lib(x, dt, lib))
        E = (lambda s, dt=dt, lib=lib: to_lib(np.zeros(s, value_dtype(dt)), dt, lib))
        if kind == "all_reduce":
            t = T(inp)
            w = dist.all_reduce(t, op=op, group=grp, async_op=a)
            outs = [t]
        elif kind == "reduce":
            t = T(inp)
            w = dist.reduce(t, root, op=op, group=grp, async_op=a)
            outs = [t]
        elif kind == "broadcast":
            t = T(inp)
            w = dist.broadcast(t, root, group=grp, async_op=a)
            outs = [t]
        elif kind == "all_gather":
            t, outs = T(inp), [E(shape) for _ in range(n)]
            w = dist.all_gather(outs, t, group=grp, async_op=a)
        elif kind == "all_gather_list_own":  # the input is this rank's own list entry
            outs = [E(shape) for _ in range(n)]
            outs[me] = T(inp)
            w = dist.all_gather(outs, outs[me], group=grp, async_op=a)
        elif kind == "all_gather_single":
            t, o = T(inp), E((n * _numel(shape),))
            w = dist.all_gather_into_tensor(o, t, group=grp, async_op=a)
            outs = [o]
        elif kind == "all_gather_in_place":  # the input is this rank's block of the output
            m = _numel(shape)
            o = E((n * m,))
            o[me * m:(me + 1) * m] = T(inp.reshape(-1))
            w = dist.all_gather_into_tensor(o, o[me * m:(me + 1) * m], group=grp, async_op=a)
            outs = [o]
        elif kind == "gather":
            t = T(inp)
            outs = [E(shape) for _ in range(n)] if ctx.rank == root else []
            w = dist.gather(t, outs if ctx.rank == root else None, root, group=grp, async_op=a)
        elif kind == "scatter":
            o = E(shape)
            lst = [T(x) for x in inp] if ctx.rank == root else None
            w = dist.scatter(o, lst, root, group=grp, async_op=a)
            outs = [o]
        elif kind == "reduce_scatter":
            o = E(shape)
            w = dist.reduce_scatter(o, [T(x) for x in inp], op=op, group=grp, async_op=a)
            outs = [o]
        elif kind == "reduce_scatter_single":
            o = E((_numel(shape),))
            w = dist.reduce_scatter_tensor(o, T(inp), op=op, group=grp, async_op=a)
            outs = [o]
        elif kind == "reduce_scatter_in_place":  # the output is this rank's block of the input
            m, t = _numel(shape), T(inp)
            o = t[me * m:(me + 1) * m]
            w = dist.reduce_scatter_tensor(o, t, op=op, group=grp, async_op=a)
            outs = [o]
        elif kind == "all_to_all":
            sizes = split_matrix(case["seed"], i, n)
            outs = [E((sizes[j][me],)) for j in range(n)]
            w = dist.all_to_all(outs, [T(x) for x in inp], group=grp, async_op=a)
        elif kind == "all_to_all_single":
            sizes = split_matrix(case["seed"], i, n)
            insz, outsz = sizes[me], [sizes[j][me] for j in range(n)]
            o = E((sum(outsz), 2))
            w = dist.all_to_all_single(o, T(inp), outsz, insz, group=grp, async_op=a)
            outs = [o]
        elif kind == "all_reduce_coalesced":
            outs = [T(x) for x in inp]
            w = dist.all_reduce_coalesced(outs, op=op, group=grp, async_op=a)
        elif kind == "all_gather_coalesced":  # outs[q][j]: rank q's j-th input
            lists = [[E(x.shape) for x in inp] for _ in range(n)]
            w = dist.all_gather_coalesced(lists, [T(x) for x in inp], group=grp, async_op=a)
            outs = [t for lst in lists for t in lst]
        elif kind == "barrier":
            w = dist.barrier(group=grp, async_op=a)
            outs = []
        else:
            raise ValueError(kind)
        if a:
            assert w is not None, f"{kind} async_op=True returned None"
            works.append(w)
        else:
            assert w is None, f"{kind} blocking returned {w!r}"
        keep.append(outs)
    for w in (reversed(works) if case.get("wait_reversed") else works):
        assert w.wait() is True
        assert w.is_completed() and w.is_success() and w.exception() is None
    for outs, step in zip(keep, case["steps"]):
        outputs.append({"values": [from_lib(t) for t in outs],
                        "raw": [raw_bytes(t) for t in outs] if step["kind"] == "all_reduce" else None})
    return outputs


# ---- reference side ----------------------------------------------------------------------------

def expected(case, world_size):
    """For each member (by global rank), the list of expected outputs per step (None: unchecked)."""
    members = case["members"]
    n = len(members)
    result = {r: [] for r in members}
    for i, step in enumerate(case["steps"]):
        dt, kind, shape = step["dtype"], step["kind"], tuple(step["shape"])
        root_g = step.get("root", 0) % n
        ins = [build_inputs(case, r, i, step, n, g) for g, r in enumerate(members)]
        op, f = step.get("op"), step.get("factor")
        for g, r in enumerate(members):
            if kind == "all_reduce":
                out = [ref_reduce(ins, dt, op, f)]
            elif kind == "reduce":
                out = [ref_reduce(ins, dt, op, f) if g == root_g else ins[g]]
            elif kind == "broadcast":
                out = [ins[root_g]]
            elif kind in ("all_gather", "all_gather_list_own"):
                out = list(ins)
            elif kind in ("all_gather_single", "all_gather_in_place"):
                out = [np.concatenate([x.reshape(-1) for x in ins])]
            elif kind == "gather":
                out = list(ins) if g == root_g else []
            elif kind == "scatter":
                out = [ins[root_g][g]]
            elif kind == "reduce_scatter":
                out = [ref_reduce([ins[q][g] for q in range(n)], dt, op, f)]
            elif kind in ("reduce_scatter_single", "reduce_scatter_in_place"):
                m = _numel(shape)
                out = [ref_reduce([x[g * m:(g + 1) * m] for x in ins], dt, op, f)]
            elif kind == "all_to_all":
                out = [ins[q][g] for q in range(n)]
            elif kind == "all_to_all_single":
                sizes = split_matrix(case["seed"], i, n)
                parts = []
                for q in range(n):
                    off = sum(sizes[q][:g])
                    parts.append(ins[q][off:off + sizes[q][g]])
                out = [np.concatenate(parts)]
            elif kind == "all_reduce_coalesced":
                out = [ref_reduce([x[j] for x in ins], dt, op, f) for j in range(len(ins[0]))]
            elif kind == "all_gather_coalesced":
                out = [x for lst in ins for x in lst]
            elif kind == "barrier":
                out = []
            result[r].append(out)
    return result


def check(case, results, world_size):
    """Compare the ranks' results with the reference; all_reduce must be bitwise equal on all ranks."""
    want = expected(case, world_size)
    for r in range(world_size):
        if r not in case["members"]:
            assert results[r] is None, f"rank {r} is not a member but returned {results[r]!r}"
    for i, step in enumerate(case["steps"]):
        for r in case["members"]:
            got = results[r][i]["values"]
            exp = want[r][i]
            assert len(got) == len(exp), \
                f"step {i} {step['kind']} rank {r}: {len(got)} outputs, want {len(exp)}"
            for j, (g, e) in enumerate(zip(got, exp)):
                assert_close(g, e, step["dtype"], f"step {i} {step} rank {r} output {j}")
        if step["kind"] == "all_reduce":
            raws = {results[r][i]["raw"][0] for r in case["members"]}
            assert len(raws) == 1, f"step {i} all_reduce results differ bitwise between ranks"
