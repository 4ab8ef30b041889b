"""The op table (collectives.api.opspec): each collective described once, and the two ways in
made from it.

- Every collective the front end exports is made from its OpSpec; the free function and
  the ProcessGroup methods run the same body (``SPECS[name].run``), and the table names
  backend methods of the backend contract and kinds the flight recorder knows.
- Property (world of 3, gloo): for any reduction the table plans in more than one step
  (AVG, PREMUL_SUM, the others' single call), dtype, shape and root, the free function
  and the group's method give the same bits, both match the NumPy reference, and the
  inputs that must not change (reduce's on the non-roots, reduce_scatter's everywhere)
  do not.
"""
import inspect

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import collectives as dist
from collectives.api import collective_ops, opspec
from collectives.backends.base import Backend
from collectives.core.fingerprint import KIND_NAMES
from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool

CONFIGS = [c for c in available_configs() if c == "gloo"]

PUBLIC = ["all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
          "all_gather_single", "all_gather_into_tensor", "_all_gather_base",
          "all_gather_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_single",
          "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
          "barrier"]


# ---- the table ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PUBLIC)
def test_every_collective_is_made_from_its_opspec(name):
    fn = getattr(dist, name)
    assert fn is getattr(collective_ops, name)
    spec = next(s for s in opspec.SPECS.values() if s.free is fn)
    assert fn.__code__.co_filename == f"<opspec {spec.name}>"
    free = list(inspect.signature(fn).parameters)
    run = list(inspect.signature(spec.run).parameters)
    assert run == ["pg"] + [p for p in free if p != "group"]


@pytest.mark.parametrize("name", sorted(opspec.SPECS))
def test_the_free_function_and_the_method_run_one_body(name):
    spec = opspec.SPECS[name]
    text = opspec.source(spec)
    free, run = text.split("\ndef run(")
    body = ["    " + line for line in opspec.body(spec)]
    run_lines = run.splitlines()[1:]
    assert [ln for ln in run_lines if ln] == body
    free_lines = [ln for ln in free.splitlines()[1:] if ln]
    # the free function: the group resolved, then the same lines in the same order
    assert [ln for ln in free_lines if ln in body] == body
    assert free_lines[0].strip() == "pg = world.default if group is None else current(group)"


@pytest.mark.parametrize("name", sorted(opspec.SPECS))
def test_the_table_names_backend_methods_and_recorded_kinds(name):
    spec = opspec.SPECS[name]
    assert callable(getattr(Backend, spec.method))
    # the kind the backend fingerprints (isend and irecv: send, recv)
    assert KIND_NAMES[spec.fingerprint] == (spec.method if spec.peer is None else spec.method[1:])
    assert spec.kind in {"all_reduce", "all_reduce_coalesced", "reduce", "broadcast",
                         "all_gather", "all_gather_coalesced", "gather", "scatter",
                         "reduce_scatter", "all_to_all", "barrier",
                         "isend", "irecv", "send", "recv"}
    if spec.peer is not None:  # point to point: tests/api/test_opspec_p2p.py
        assert spec.record == ("buf", "peer", "tag")
    elif spec.fast is not False:  # one backend call: what the recorder takes is named
        buf, root, op = spec.record
        assert buf == "None" or buf in {r.var for r in spec.roles}
        assert root in ("-1", "root") and op in ("-1", "_SUM_CODE")
    assert spec.plan is not None or spec.fast is None  # some path for every call


def test_a_traceback_shows_the_tables_source():
    import traceback
    try:
        dist.all_reduce(np.ones(2, np.float32), group="no group")
    except TypeError:
        text = traceback.format_exc()
    assert "<opspec all_reduce>" in text and "current(group)" in text


# ---- the two ways in agree, against NumPy ------------------------------------------------------

WORLD = 3
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX"]


def _data(seed, rank, dtype, count):
    rng = np.random.default_rng(seed * 31 + rank)
    return rng.integers(-3, 4, count).astype(dtype)


def _op(name, factor):
    return dist.ReduceOp.PREMUL_SUM(factor) if name == "PREMUL_SUM" else getattr(dist.ReduceOp,
                                                                                 name)


def both_ways(ctx, case):
    """Run on every rank: the case's collective by the free function and by the method."""
    kind, dtype, count, root, seed = (case[k] for k in ("kind", "dtype", "count", "root", "seed"))
    op = _op(case["op"], case.get("factor"))
    pg = dist.group.WORLD
    got = {}
    for way in ("free", "method"):
        x = _data(seed, ctx.rank, dtype, count * WORLD if kind == "reduce_scatter" else count)
        x0 = x.copy()
        if kind == "all_reduce":
            if way == "free":
                dist.all_reduce(x, op)
            else:
                o = dist.AllreduceOptions()
                o.reduceOp = op
                pg.allreduce([x], o).wait()
            out = x
        elif kind == "all_reduce_coalesced":
            y = x[::-1].copy()
            if way == "free":
                dist.all_reduce_coalesced([x, y], op)
            else:
                o = dist.AllreduceCoalescedOptions()
                o.reduceOp = op
                pg.allreduce_coalesced([x, y], o).wait()
            out = np.concatenate([x, y])
        elif kind == "reduce":
            if way == "free":
                dist.reduce(x, dst=root, op=op)
            else:
                o = dist.ReduceOptions()
                o.reduceOp, o.rootRank = op, root
                pg.reduce([x], o).wait()
            out = x
        else:  # reduce_scatter (the tensor form)
            out = np.zeros(count, dtype)
            if way == "free":
                dist.reduce_scatter_tensor(out, x, op)
            else:
                o = dist.ReduceScatterOptions()
                o.reduceOp = op
                pg._reduce_scatter_base(out, x, o).wait()
            got[way + "_input"] = (x.tolist(), x0.tolist())
        got[way] = out.tolist()
        if kind == "reduce":
            got[way + "_input"] = (x.tolist(), x0.tolist())
    return got


def _reference(case):
    kind, dtype, count, seed = (case[k] for k in ("kind", "dtype", "count", "seed"))
    dtype = np.dtype(dtype).type
    n = count * WORLD if kind == "reduce_scatter" else count
    xs = [_data(seed, r, dtype, n) for r in range(WORLD)]
    if kind == "all_reduce_coalesced":
        xs = [np.concatenate([x, x[::-1]]) for x in xs]
    name = case["op"]
    if name == "PREMUL_SUM":
        xs = [x * dtype(case["factor"]) for x in xs]
    fn = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply,
          "MIN": np.minimum, "MAX": np.maximum}[name]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = fn(acc, x)
    if name == "AVG":
        acc = acc / dtype(WORLD)
    return acc.astype(dtype), xs


@st.composite
def reduction_cases(draw):
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "int64"]))
    kind = draw(st.sampled_from(["all_reduce", "all_reduce_coalesced", "reduce",
                                 "reduce_scatter"]))
    op = draw(st.sampled_from(FLOAT_OPS if dtype.startswith("float") else INT_OPS))
    case = {"kind": kind, "dtype": dtype, "op": op, "count": draw(st.integers(1, 7)),
            "root": draw(st.integers(0, WORLD - 1)), "seed": draw(st.integers(0, 1000))}
    if op == "PREMUL_SUM":
        case["factor"] = draw(st.sampled_from([0.5, 2.0, -1.0]))
    return case


@pytest.mark.timeout(600)
@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=reduction_cases())
@example(case={"kind": "reduce", "dtype": "float32", "op": "PREMUL_SUM", "factor": 2.0,
               "count": 5, "root": 1, "seed": 3})
@example(case={"kind": "reduce_scatter", "dtype": "float64", "op": "PREMUL_SUM",
               "factor": -1.0, "count": 3, "root": 0, "seed": 4})
@example(case={"kind": "all_reduce_coalesced", "dtype": "float32", "op": "AVG", "count": 4,
               "root": 0, "seed": 5})
@example(case={"kind": "reduce", "dtype": "float64", "op": "AVG", "count": 2, "root": 2,
               "seed": 6})
def test_free_function_and_method_agree_with_numpy(config, case):
    results = backend_pool(config, WORLD).run(both_ways, case, timeout=90)
    dtype = np.dtype(case["dtype"]).type
    want, _ = _reference(case)
    count, kind = case["count"], case["kind"]
    for r, got in enumerate(results):
        assert got["free"] == got["method"], (r, got)  # the same body: the same bits
        out = np.array(got["free"], dtype)
        if kind == "reduce_scatter":
            np.testing.assert_allclose(out, want[r * count:(r + 1) * count], rtol=1e-5)
        elif kind != "reduce" or r == case["root"]:
            np.testing.assert_allclose(out, want, rtol=1e-5)
        for way in ("free", "method"):
            if kind == "reduce_scatter" or (kind == "reduce" and r != case["root"]):
                after, before = got[way + "_input"]
                assert after == before, (r, way, "an input that must not change changed")
