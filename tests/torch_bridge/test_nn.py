"""collectives.nn: collectives that autograd differentiates (torch.distributed.nn).

Property: for any world of 1-6 ranks, the world or a random subgroup of it, any of
the ten functions, op, root, shape (empty included), dtype (real and complex) and data
(random, or small integers, so that MAX/MIN tie), every rank's outputs equal the
reference, and after every rank calls ``backward`` on its loss, every rank's input
gradients equal the gradient of the sum of the ranks' losses computed in one process
by torch autograd on the same formula (torch.amax/amin split ties evenly).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import collectives as dist
from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool

torch = pytest.importorskip("torch", reason="autograd collectives need torch")

CONFIGS = [c for c in available_configs() if c in ("gloo", "mpi")]
SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])

REDUCING = ("all_reduce", "reduce", "reduce_scatter")
KINDS = REDUCING + ("broadcast", "gather", "scatter", "all_gather", "_all_gather_base",
                    "all_to_all", "all_to_all_single")
LISTS = ("scatter", "reduce_scatter", "all_to_all")  # each rank passes one tensor per rank
OPS = ("SUM", "AVG", "PREMUL_SUM", "MAX", "MIN", "PRODUCT")



def data(seed, key, shape, dtype, ties):
    """The array rank data key ``key`` holds (the same in the ranks and the reference)."""
    rng = np.random.default_rng([seed, key])
    if ties:
        a = rng.integers(-1, 2, size=shape).astype(np.float64)
    else:
        a = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * (rng.integers(-1, 2, size=shape) if ties else rng.standard_normal(shape))
    return a.astype(dtype)


def _op(case):
    if case["op"] == "PREMUL_SUM":
        return dist.ReduceOp.PREMUL_SUM(case["factor"])
    return getattr(dist.ReduceOp, case["op"])


def nn_case(ctx, case):
    """Run on every rank: one function forward and backward; (outputs, grads) as arrays,
    None off the group."""
    import numpy as np
    import torch

    import collectives as dist
    import collectives.nn.functional as F

    members = case["members"]
    group = dist.new_group(members) if members is not None else None
    try:
        if members is not None and ctx.rank not in members:
            return None
        n = len(members) if members is not None else ctx.world_size
        me = sorted(members).index(ctx.rank) if members is not None else ctx.rank
        seed, shape, dtype, ties = case["seed"], tuple(case["shape"]), case["dtype"], case["ties"]
        kind, root = case["kind"], case["root"]

        def t(key, shp=shape, grad=True):
            return torch.tensor(data(seed, key, shp, dtype, ties), requires_grad=grad)

        def w(key, shp=shape):
            return torch.tensor(data(seed + 1, key, shp, dtype, False))

        r = ctx.rank
        ins = [t(r * 100 + k) for k in range(n)] if kind in LISTS else [t(r * 100)]
        if kind == "all_reduce":
            outs = [F.all_reduce(ins[0], _op(case), group)]
        elif kind == "reduce":
            outs = [F.reduce(ins[0], root, _op(case), group)]
        elif kind == "reduce_scatter":
            outs = [F.reduce_scatter(torch.empty(shape, dtype=ins[0].dtype), ins, _op(case), group)]
        elif kind == "broadcast":
            outs = [F.broadcast(ins[0], root, group)]
        elif kind == "gather":
            outs = list(F.gather(ins[0], root, group))
        elif kind == "scatter":
            outs = [F.scatter(ins, root, group)]
        elif kind == "all_gather":
            outs = list(F.all_gather(ins[0], group))
        elif kind == "_all_gather_base":
            big = (n * shape[0],) + shape[1:]
            outs = [F._all_gather_base(torch.empty(big, dtype=ins[0].dtype), ins[0], group)]
        elif kind == "all_to_all":
            outs = list(F.all_to_all([torch.empty_like(x) for x in ins], ins, group))
        else:  # all_to_all_single: rows split by case["splits"][sender][receiver]
            splits = case["splits"]
            rest = shape[1:]
            ins = [t(r * 100, (sum(splits[me]),) + rest)]
            rows = sum(splits[j][me] for j in range(n))
            outs = [F.all_to_all_single(torch.empty((rows,) + rest, dtype=ins[0].dtype), ins[0],
                                        [splits[j][me] for j in range(n)], splits[me], group)]
        loss = sum(torch.real((w(r * 100 + k, o.shape) * o).sum()) for k, o in enumerate(outs))
        loss.backward()
        return ([o.detach().numpy().copy() for o in outs],
                [x.grad.numpy().copy() if x.grad is not None else np.zeros(tuple(x.shape), dtype)
                 for x in ins])
    finally:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def _reduction(case, stack):
    op = case["op"]
    if op == "SUM":
        return stack.sum(0)
    if op == "AVG":
        return stack.mean(0)
    if op == "PREMUL_SUM":
        return case["factor"] * stack.sum(0)
    if op == "MAX":
        return stack.amax(0)
    if op == "MIN":
        return stack.amin(0)
    return stack.prod(0)


def reference(case, world):
    """{global rank: (outputs, grads)} for the case, by autograd in this process; outputs
    that the function leaves unspecified (reduce off dst) are None and count for nothing."""
    members = sorted(case["members"]) if case["members"] is not None else list(range(world))
    n = len(members)
    seed, shape, dtype, ties = case["seed"], tuple(case["shape"]), case["dtype"], case["ties"]
    kind, root = case["kind"], case["root"]
    root_i = members.index(root) if root is not None else None

    def t(key, shp=shape):
        return torch.tensor(data(seed, key, shp, dtype, ties), requires_grad=True)

    if kind in LISTS:
        ins = {r: [t(r * 100 + k) for k in range(n)] for r in members}
    elif kind == "all_to_all_single":
        splits = case["splits"]
        ins = {r: [t(r * 100, (sum(splits[i]),) + shape[1:])] for i, r in enumerate(members)}
    else:
        ins = {r: [t(r * 100)] for r in members}
    outs = {}
    for i, r in enumerate(members):
        if kind == "all_reduce":
            outs[r] = [_reduction(case, torch.stack([ins[q][0] for q in members]))]
        elif kind == "reduce":
            outs[r] = [_reduction(case, torch.stack([ins[q][0] for q in members]))] \
                if i == root_i else None
        elif kind == "reduce_scatter":
            outs[r] = [_reduction(case, torch.stack([ins[q][i] for q in members]))]
        elif kind == "broadcast":
            outs[r] = [ins[root][0] * 1]
        elif kind == "gather":
            outs[r] = [ins[q][0] * 1 for q in members] if i == root_i \
                else [torch.zeros(shape, dtype=ins[r][0].dtype) for _ in members]
        elif kind == "scatter":
            outs[r] = [ins[root][i] * 1]
        elif kind in ("all_gather", "_all_gather_base"):
            parts = [ins[q][0] * 1 for q in members]
            outs[r] = [torch.cat(parts)] if kind == "_all_gather_base" else parts
        elif kind == "all_to_all":
            outs[r] = [ins[q][i] * 1 for q in members]
        else:
            splits = case["splits"]
            pieces = []
            for j, q in enumerate(members):
                start = sum(splits[j][:i])
                pieces.append(ins[q][0][start:start + splits[j][i]])
            outs[r] = [torch.cat(pieces)]
    loss = 0
    for r in members:
        for k, o in enumerate(outs[r] or []):
            wk = torch.tensor(data(seed + 1, r * 100 + k, tuple(o.shape), dtype, False))
            loss = loss + torch.real((wk * o).sum())
    if torch.is_tensor(loss) and loss.requires_grad:
        loss.backward()
    return {r: (None if outs[r] is None else [o.detach().numpy() for o in outs[r]],
                [x.grad.numpy() if x.grad is not None else np.zeros(tuple(x.shape), dtype)
                 for x in ins[r]]) for r in members}


@st.composite
def nn_cases(draw):
    world = draw(st.integers(1, 6))
    members = None
    if world > 1 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world - 1), min_size=1)))
    n = len(members) if members is not None else world
    kind = draw(st.sampled_from(KINDS))
    op = draw(st.sampled_from(OPS)) if kind in REDUCING else None
    complex_ok = op not in ("MAX", "MIN")
    dtype = draw(st.sampled_from(["float32", "float64"] + (["complex128"] if complex_ok else [])))
    ndim = draw(st.integers(1 if kind in ("_all_gather_base", "all_to_all_single") else 0, 3))
    shape = [draw(st.integers(0 if ndim else 1, 3)) for _ in range(ndim)]
    factor = None
    if op == "PREMUL_SUM":
        factor = draw(st.sampled_from([0.5, -2.0, 3.0]))  # the front end takes real factors
    rooted = kind in ("reduce", "broadcast", "gather", "scatter")
    root = draw(st.sampled_from(members if members is not None else list(range(world)))) \
        if rooted else None
    splits = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(n)] \
        if kind == "all_to_all_single" else None
    return world, {"members": members, "kind": kind, "op": op, "factor": factor, "dtype": dtype,
                   "shape": shape, "root": root, "splits": splits,
                   "ties": op in ("MAX", "MIN", "PRODUCT") and draw(st.booleans()),
                   "seed": draw(st.integers(0, 2 ** 16))}


def _close(got, want, dtype, what):
    tol = 1e-5 if dtype in ("float32",) else 1e-10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.timeout(900)
def _fixed(world, kind, op, members=None, root=None, shape=(5,), dtype="float64"):
    return world, {"members": members, "kind": kind, "op": op, "factor": None, "dtype": dtype,
                   "shape": list(shape), "root": root, "splits": None, "ties": True, "seed": 7}


@SETTINGS
@given(case=nn_cases())
# always: ties for MAX/MIN (split evenly), zeros in a PRODUCT, a complex PRODUCT (the
# gradient conjugates), a subgroup's root
@pytest.mark.slow
@example(case=_fixed(4, "all_reduce", "MAX"))
@example(case=_fixed(3, "reduce_scatter", "MIN", shape=(2, 3)))
@example(case=_fixed(4, "reduce", "PRODUCT", members=[0, 2, 3], root=3))
@example(case=_fixed(3, "all_reduce", "PRODUCT", dtype="complex128"))
@example(case=_fixed(5, "broadcast", None, members=[1, 3, 4], root=3))
def test_outputs_and_gradients_match_autograd_in_one_process(config, case):
    world, case = case
    results = backend_pool(config, world).run(nn_case, case, timeout=120)
    want = reference(case, world)
    for r in range(world):
        if r not in want:
            assert results[r] is None
            continue
        outs, grads = results[r]
        ref_outs, ref_grads = want[r]
        if ref_outs is not None:
            assert len(outs) == len(ref_outs)
            for k, (g, e) in enumerate(zip(outs, ref_outs)):
                _close(g, e, case["dtype"], f"rank {r} output {k} of {case}")
        assert len(grads) == len(ref_grads)
        for k, (g, e) in enumerate(zip(grads, ref_grads)):
            _close(g, e, case["dtype"], f"rank {r} gradient {k} of {case}")


# ---- misuse and the plain paths -------------------------------------------------------

def misuse_case(ctx):
    """Run on every rank of 2: each misuse raises before any message; returns the errors."""
    import numpy as np
    import torch

    import collectives as dist
    import collectives.nn.functional as F
    x = torch.ones(3, requires_grad=True)
    got = {}
    for name, call in [
        ("numpy", lambda: F.all_reduce(np.ones(3))),
        ("band", lambda: F.all_reduce(x, dist.ReduceOp.BAND)),
        ("badop", lambda: F.all_reduce(x, "sum")),
        ("list", lambda: F.all_gather([x])),
        ("scatter_len", lambda: F.scatter([x], src=ctx.rank)),
        ("rs_len", lambda: F.reduce_scatter(torch.empty(3), [x])),
        ("a2a_len", lambda: F.all_to_all([torch.empty(3)], [x, x])),
    ]:
        try:
            call()
            got[name] = None
        except (TypeError, ValueError) as e:
            got[name] = (type(e).__name__, str(e))
    # still in step: a real call after the misuse
    y = F.all_reduce(torch.full((2,), float(ctx.rank + 1), requires_grad=True))
    got["after"] = y.tolist()
    got["lazy"] = dist.nn.all_reduce is F.all_reduce
    return got


@pytest.mark.timeout(300)
def test_misuse_raises_before_any_message_and_dist_nn_is_the_module():
    if "gloo" not in CONFIGS:
        pytest.skip("the gloo configuration is not available")
    results = backend_pool("gloo", 2).run(misuse_case, timeout=60)
    for got in results:
        assert got["numpy"][0] == "TypeError" and "torch.Tensor" in got["numpy"][1]
        assert got["band"][0] == "ValueError" and "no gradient" in got["band"][1]
        assert got["badop"][0] == "ValueError" and "op" in got["badop"][1]
        assert got["list"][0] == "TypeError" and "tensor" in got["list"][1]
        assert got["scatter_len"][0] == "ValueError" and "tensors" in got["scatter_len"][1]
        assert got["rs_len"][0] == "ValueError" and "input_list" in got["rs_len"][1]
        assert got["a2a_len"][0] == "ValueError" and "output_tensor_list" in got["a2a_len"][1]
        assert got["after"] == [3.0, 3.0]
        assert got["lazy"]


def double_backward_case(ctx):
    """Run on every rank of 3: the gradient of an all_reduce SUM is itself differentiable
    (create_graph), through the collective of its backward; MAX's says it is not."""
    import torch

    import collectives as dist
    import collectives.nn.functional as F
    x = torch.tensor([float(ctx.rank + 2)], requires_grad=True)
    y = F.all_reduce(x)  # S = sum_j x_j on every rank; the ranks' losses add to n S^3
    (g,) = torch.autograd.grad((y ** 3).sum(), x, create_graph=True)  # 3 n S^2
    (gg,) = torch.autograd.grad(g.sum(), x)  # d(sum of the ranks' g = 3 n^2 S^2) = 6 n^2 S
    z = F.all_reduce(x * 1, dist.ReduceOp.MAX)
    try:
        torch.autograd.grad(z.sum(), x, create_graph=True)
        err = None
    except RuntimeError as e:
        err = str(e)
    return g.item(), gg.item(), err


@pytest.mark.timeout(300)
def test_double_backward_through_sum_and_a_clear_error_for_max():
    if "gloo" not in CONFIGS:
        pytest.skip("the gloo configuration is not available")
    results = backend_pool("gloo", 3).run(double_backward_case, timeout=60)
    n, s = 3, 2 + 3 + 4
    for g, gg, err in results:
        assert g == pytest.approx(3 * n * s * s)
        assert gg == pytest.approx(6 * n * n * s)
        assert err is not None and "MAX" in err
