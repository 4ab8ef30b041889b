"""The op table (collectives.api.opspec): each collective described once, and the two ways in
made from it.

- Every collective the front end exports is written from its OpSpec into
  ``collectives/api/_generated.py`` (a real module: its functions are defined there, and
  regenerating it from the table changes nothing), once each: the ProcessGroup methods
  call the free function with ``group=``; its body is the table's statements, its long
  docstring the one copy in opdocs, and the table names backend methods of the backend
  contract and kinds the flight recorder knows. ``exec`` appears nowhere in the package.
- Property (world of 3, gloo): for any reduction the table plans in more than one step
  (AVG, PREMUL_SUM, the others' single call), dtype, shape and root, the free function
  and the group's method give the same bits, both match the NumPy reference, and the
  inputs that must not change (reduce's on the non-roots, reduce_scatter's everywhere)
  do not.

The point-to-point and ``*_multigpu`` entries:

- isend, irecv, send, recv and the five ``*_multigpu`` calls are written from their
  OpSpecs, as the collectives are; the p2p entries name the backend's isend/irecv, the
  kinds the backend fingerprints and what the recorder takes; the multigpu entries hand
  their plan the single-tensor entry's free function.
- The C dispatcher and its Python twin post and record every p2p call alike.
- Nothing in ``collectives/api/`` but the dispatcher writes the flight recorder's or the
  profiler's handling by hand.
- Property (world of 3, gloo): for any dtype, shape, tag, ring shift and seed, a ring of
  messages sent by the free functions (isend/irecv, send/recv, recv from any source) and
  by the group's methods (pg.send/pg.recv/pg.recv_anysource) delivers the NumPy
  reference on both ways, recv names the sender's global rank, and the flight recorder
  holds one entry per message with its kind, peer, tag, count and state; a peer that is
  this rank, outside the group or given twice is refused before anything is posted.
- Property (world of 3, gloo): each ``*_multigpu`` call by the free function and by the
  method agrees with NumPy and is recorded under its single-tensor entry's kind.
"""
import ast
import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import collectives as dist
from collectives.api import _generated, collective_ops, gen, opspec, p2p
from collectives.backends import registered_backends
from collectives.backends.base import Backend, DoneRequest
from collectives.core.fingerprint import KIND_NAMES
from collectives.store import HashStore
from tests.support.dispatchers import choose
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
    spec = opspec.SPECS[fn.__name__]
    assert fn is getattr(_generated, spec.name) and fn.__module__ == _generated.__name__
    assert fn.__code__.co_filename == _generated.__file__  # a real file: debuggers step in
    assert inspect.getdoc(fn).split() == spec.doc.split()  # the table's text, refilled
    assert list(inspect.signature(fn).parameters) == [p.split("=")[0].strip()
                                                      for p in spec.params.split(",")]


def test_the_generated_module_is_what_the_table_makes():
    """``python -m collectives.api.gen --check``: regenerating changes nothing."""
    with open(gen.PATH) as f:
        assert f.read() == gen.module_text(), "run: python -m collectives.api.gen"
    root = os.path.dirname(os.path.dirname(os.path.dirname(gen.__file__)))
    done = subprocess.run([sys.executable, "-m", "collectives.api.gen", "--check"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_generated_module_defines_each_entry_once():
    """Each entry's free function is a plain ``def`` of _generated.py (greppable), once, in
    the table's order, and nothing else; every point-to-point entry, and no other, calls
    ``opspec._post``."""
    with open(gen.PATH) as f:
        tree = ast.parse(f.read())
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert defs == list(opspec.SPECS)
    calls = {n.name: {c.func.id for c in ast.walk(n) if isinstance(c, ast.Call)
                      and isinstance(c.func, ast.Name)}
             for n in tree.body if isinstance(n, ast.FunctionDef)}
    p2p = {name for name, spec in opspec.SPECS.items() if spec.peer is not None}
    assert p2p == {"isend", "irecv", "send", "recv"}
    assert {name for name, called in calls.items() if "_post" in called} == p2p


def test_each_long_docstring_has_one_copy():
    """opdocs' texts are not written into _generated.py: the module sets them, and each
    function's ``__doc__`` is the very text the table holds (help() and the docs see it)."""
    from collectives.api import opdocs
    with open(gen.PATH) as f:
        text = f.read()
    long = {name: doc for name, doc in vars(opdocs).items() if name.startswith("DOC_")}
    for spec in opspec.SPECS.values():
        fn = getattr(_generated, spec.name)
        assert fn.__doc__ == spec.doc or fn.__doc__.split() == spec.doc.split()
        if spec.doc in long.values():
            assert fn.__doc__ is spec.doc
    for name, doc in long.items():
        assert any(spec.doc is doc for spec in opspec.SPECS.values()), name  # each one used
        copied = [ln.strip() for ln in doc.splitlines() if len(ln.strip()) > 20
                  and ln.strip() in text]
        assert not copied, (name, copied)


def test_no_exec_in_the_package():
    """No module of the package compiles text at run time (the generator writes a file)."""
    pkg = os.path.dirname(dist.__file__)
    found = []
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith((".py", ".pyx", ".pxi")):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    for i, line in enumerate(fh, 1):
                        if re.search(r"(?<![\w.])(?<!def )(exec|eval)\(|compile\(.*[\"']exec",
                                     line.split("#")[0]):
                            found.append(f"{os.path.relpath(path, pkg)}:{i}: {line.strip()}")
    assert not found, found


PROLOGUE = "if (pg := world.default if group is None else current(group)) is None:"


def _code(stmts):
    """The statements, as text, the docstring aside."""
    if isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
        stmts = stmts[1:]
    return [ast.unparse(st) for st in stmts]


@pytest.mark.parametrize("name", sorted(opspec.SPECS))
def test_the_free_function_resolves_the_group_then_runs_the_body(name):
    """A collective with a one-call path (``pg.dispatch.call`` in its body) resolves the
    group in place, no frame between it and the dispatcher: the prologue (barrier: the
    group, its timeout, then the non-member's return, torch's order), then the body. A
    point-to-point call is one call of ``_post`` (its one frame, which resolves the group
    by the same rule; see below), every other entry one call of ``_in_group``, which
    resolves it so and runs the plan with the call's arguments, ``group`` aside, in the
    signature's order."""
    spec = opspec.SPECS[name]
    free, = ast.parse(gen.source(spec)).body
    assert free.name == name
    want = _code(ast.parse("def f():\n" + "\n".join("    " + ln for ln in gen.body(spec))).body[0].body)
    free_code = _code(free.body)
    body_text = "\n".join(gen.body(spec))
    one_call = "pg.dispatch.call(" in body_text or "_post(" in body_text
    assert gen.one_call(spec) == one_call
    assert gen.in_place(spec) == ("pg.dispatch.call(" in body_text)
    absent = "return _absent(group)"
    if spec.peer is not None:
        call, = free_code
        assert call == want[0] and call.startswith("return _post(group, ")
        return
    if not one_call:
        params = [p.split("=")[0].strip() for p in spec.params.split(",")]
        call, = free_code
        assert call == want[0]
        node = ast.parse(call).body[0].value
        assert ast.unparse(node.func) == "_in_group"
        assert [ast.unparse(a) for a in node.args[:2]] == ["group", gen.plan_name(spec)]
        passed = [ast.unparse(a) for a in node.args[2:]]
        assert [a for a in passed if a in params] == [p for p in params if p != "group"]
        assert set(passed) - set(params) <= {name[:-len("_multigpu")]}  # (multigpu's run)
        assert len(inspect.signature(spec.plan).parameters) == 1 + len(passed)
        return
    # the group resolved, then the same statements in the same order
    assert [st for st in free_code if st in want] == want
    if spec.timeout:
        assert free_code[0] == "pg = world.default if group is None else current(group)"
        assert free_code[1].startswith("if timeout is not None:")
        assert free_code[2] == f"if pg is None:\n    {absent}"
    else:
        assert free_code[0] == ast.unparse(ast.parse(f"{PROLOGUE}\n    {absent}"))


def test_in_group_and_post_resolve_the_group_as_the_prologue_does():
    """``_in_group``: the entries' prologue, then the plan on the group; ``_post`` the same
    prologue (torch's recv returns -1 on a rank outside the group). One rule, three places:
    in place in the collectives with a one-call path, in these two for the others."""
    fn, = ast.parse(inspect.getsource(opspec._in_group)).body
    assert _code(fn.body) == [ast.unparse(ast.parse(f"{PROLOGUE}\n    return _absent(group)")),
                              "return plan(pg, *args)"]
    post, = ast.parse(inspect.getsource(opspec._post)).body
    assert _code(post.body)[0] == ast.unparse(ast.parse(
        f"{PROLOGUE}\n    return _absent(group, -1 if wait and rule is recv_peer else None)"))
    outside = dist.GroupMember.NON_GROUP_MEMBER
    x = np.zeros(1, np.float32)
    assert [f(x, 0, group=outside) for f in (dist.isend, dist.irecv, dist.send, dist.recv)] == \
        [None, None, None, -1]
    def plan(pg, *args):
        ran.append((pg, args))
        return "ran"
    ran = []
    with pytest.raises(ValueError, match="init_process_group"):  # before init
        opspec._in_group(None, plan, 1)
    assert opspec._in_group(dist.GroupMember.NON_GROUP_MEMBER, plan, 1) is None and not ran
    if "plain-base" not in registered_backends():  # (any backend: the plan never reaches it)
        dist.register_backend("plain-base", lambda store, rank, size, timeout, options=None:
                              Backend(store, rank, size, timeout, options))
    dist.init_process_group("plain-base", store=HashStore(), rank=0, world_size=1)
    try:
        assert opspec._in_group(None, plan, 1, 2) == "ran"
        assert opspec._in_group(dist.group.WORLD, plan) == "ran"
        assert ran == [(dist.group.WORLD, (1, 2)), (dist.group.WORLD, ())]
    finally:
        dist.destroy_process_group()


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
    if spec.peer is not None:  # point to point: _post does it all (the p2p checks below)
        assert (spec.roles, spec.fast, spec.plan) == ((), False, None)
    elif spec.fast is not False:  # one backend call: what the recorder takes is named
        buf, root, op = spec.record
        assert buf == "None" or buf in {r.var for r in spec.roles}
        assert root in ("-1", "root") and op in ("-1", "_SUM_CODE")
    assert spec.plan is not None or spec.fast is None or spec.peer is not None  # some path


def test_a_traceback_shows_the_generated_source():
    import traceback
    try:
        dist.all_reduce(np.ones(2, np.float32), group="no group")
    except TypeError:
        text = traceback.format_exc()
    assert "_generated.py" in text and "current(group)" in text


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


# ---- point-to-point and *_multigpu entries -------------------------------------------------

P2P = {"isend": p2p, "irecv": p2p, "send": p2p, "recv": p2p}
MULTIGPU = {name: _generated for name in ("all_reduce_multigpu", "broadcast_multigpu",
                                          "reduce_multigpu", "all_gather_multigpu",
                                          "reduce_scatter_multigpu")}


# ---- the table ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted({**P2P, **MULTIGPU}))
def test_p2p_and_multigpu_calls_are_made_from_their_opspec(name):
    spec = opspec.SPECS[name]
    fn = getattr(dist, name)
    assert fn is getattr(_generated, name) and fn is getattr({**P2P, **MULTIGPU}[name], name)
    assert fn.__module__ == _generated.__name__ and fn.__code__.co_filename == _generated.__file__
    assert inspect.getdoc(fn).split() == spec.doc.split()  # the table's text, refilled
    assert list(inspect.signature(fn).parameters) == [p.split("=")[0].strip()
                                                      for p in spec.params.split(",")]


@pytest.mark.parametrize("name", sorted(P2P))
def test_a_p2p_entry_posts_the_backends_call_through_the_dispatcher(name):
    spec = opspec.SPECS[name]
    assert spec.method == ("isend" if name in ("isend", "send") else "irecv")
    assert callable(getattr(Backend, spec.method))
    assert KIND_NAMES[spec.fingerprint] == spec.method[1:]  # send, recv
    assert spec.kind == name and spec.blocking == (name in ("send", "recv"))
    assert spec.peer == ("dst" if spec.method == "isend" else "src")
    rule = f"{'send' if spec.peer == 'dst' else 'recv'}_peer"
    assert gen.body(spec) == [f"return _post(group, {name!r}, tensor, {spec.peer}, "
                              f"group_{spec.peer}, tag, {rule}, {spec.blocking})"]
    # _post resolves the group, then the peer (refused when it is this rank, by the rule),
    # checks the tag and the tensor, posts the backend's isend (a send's rule) or irecv
    # through the dispatcher, then waits where it is told to, in that order
    shared = inspect.getsource(opspec._post).splitlines()
    order = [next(i for i, ln in enumerate(shared) if what in ln)
             for what in (PROLOGUE, "peer = rule(pg, arg, group_arg)", "check_tag(tag)",
                          "buf = buffer(tensor)",
                          "fn = pg.backend.isend if rule is send_peer else pg.backend.irecv",
                          "req = pg.dispatch.post(kind, fn, buf, peer, tag)", "if not wait:",
                          "req.wait()")]
    assert order == sorted(order)


@pytest.mark.parametrize("name", sorted(MULTIGPU))
def test_a_multigpu_entry_runs_its_single_tensor_entry(name):
    spec = opspec.SPECS[name]
    single = name[:-len("_multigpu")]
    assert spec.kind == single and spec.method == single and spec.plan is not None
    assert KIND_NAMES[spec.fingerprint] == spec.method
    # the plan is handed the single-tensor entry's free function, and calls it on its group
    assert spec.plan_args.split(", ")[-1] == single
    assert list(inspect.signature(spec.plan).parameters)[-1] == "run"
    assert re.search(r"\brun\([^()]*, group=pg\)", inspect.getsource(spec.plan))
    assert gen.body(spec) == [f"return _in_group(group, {gen.plan_name(spec)}, {spec.plan_args})"]


def test_the_recorder_and_the_profiler_are_handled_in_the_dispatcher_only():
    """No module of collectives/api/ but group_dispatcher.py and its runners (tracked.py) writes the
    recorder's started/done/fail steps, records a p2p call, or tests the profiler's flag
    (monitored_barrier runs the runners' own Tracked hook: it is not queued, as torch's gloo
    runs it)."""
    api = os.path.dirname(opspec.__file__)  # the package under test, installed or not
    by_hand = re.compile(r"fr\.started\s*=|fr\.done\s*=|\.fail\(|_is_profiler_enabled|"
                         r"issue_p2p|tracked\.p2p|_profiling\.issue")
    found = []
    for f in sorted(os.listdir(api)):
        if f.endswith(".py") and f not in ("group_dispatcher.py", "tracked.py"):
            with open(os.path.join(api, f)) as fh:
                for i, line in enumerate(fh, 1):
                    if by_hand.search(line.split("#")[0]):
                        found.append(f"{f}:{i}: {line.strip()}")
    assert not found, found


# ---- the two dispatchers post alike ------------------------------------------------------------

class _AtOnce(Backend):
    """A backend whose isend and irecv complete at once (an any-source one from rank 1),
    and which posts a batch of them as one (as nccl does), counting the batches."""

    batches = 0

    def isend(self, buf, dst, tag=0):
        return DoneRequest(dst)

    def irecv(self, buf, src, tag=0):
        return DoneRequest(1 if src is None else src)

    def batch_p2p(self, ops):
        type(self).batches += 1
        return [DoneRequest(peer) for _, _, peer, _ in ops]


@pytest.fixture(params=["c", "python"])
def world2(request):
    """Rank 0 of a world of 2 over :class:`_AtOnce`, with the C dispatcher (where built)
    or the Python one."""
    if "p2p-at-once" not in registered_backends():
        dist.register_backend("p2p-at-once", lambda store, rank, size, timeout, options=None:
                              _AtOnce(store, rank, size, timeout, options))
    dist.init_process_group("p2p-at-once", store=HashStore(), rank=0, world_size=2)
    yield choose(dist, request.param)
    dist.destroy_process_group()


def test_each_dispatcher_posts_and_records_every_p2p_call(world2):
    pg = world2
    x = np.arange(3, dtype=np.float32)
    assert dist.isend(x, 1, tag=5).wait() and dist.irecv(x, 1, tag=6).wait()
    assert dist.send(x, 1, tag=7) is None and dist.recv(x, 1, tag=8) == 1
    assert dist.recv(x) == 1  # any source: the sender the backend named
    w = pg.recv_anysource([x], 10)
    assert pg.send([x], 1, 9).wait() and w.wait() and w.source_rank() == 1
    assert _new_p2p(pg.fr, 0) == [
        ("isend", 1, 5, 3, "completed"), ("irecv", 1, 6, 3, "completed"),
        ("send", 1, 7, 3, "completed"), ("recv", 1, 8, 3, "completed"),
        ("recv", -1, 0, 3, "completed"), ("irecv", -1, 10, 3, "completed"),
        ("isend", 1, 9, 3, "completed")]
    with pytest.raises(ValueError, match="destination rank"):
        dist.isend(x, 0)
    assert pg.fr.p2p_n == 7
    # batch_isend_irecv: one batch of the backend's, each op recorded
    batches = _AtOnce.batches
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 1, tag=11),
                                    dist.P2POp(dist.isend, x, 1, tag=12)])
    assert _AtOnce.batches == batches + 1 and all(w.wait() for w in works)
    assert _new_p2p(pg.fr, 7) == [("irecv", 1, 11, 3, "completed"),
                                  ("isend", 1, 12, 3, "completed")]


# ---- point to point, both ways, against NumPy ------------------------------------------------

WORLD = 3


def _message(seed, src, dst, dtype, shape):
    rng = np.random.default_rng([seed, src, dst])
    return rng.integers(-50, 50, shape).astype(dtype)


def _new_p2p(fr, n0):
    """The recorder's p2p entries after number ``n0``: (kind, peer, tag, count, state)."""
    return [tuple(e[1:5]) + (e[7],) for e in sorted((e for e in fr.p2p if e is not None
                                                     and e[0] > n0), key=lambda e: e[0])]


_TO_SELF = {"dst": "Invalid destination rank: destination rank should not be the same as the "
                   "rank of the current process.",
            "src": "Invalid source rank: source rank should not be the same as the rank of the "
                   "current process."}


def _refused(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


def p2p_both_ways(ctx, case):
    """Run on every rank: a ring (rank r sends to r + shift) by the free functions and by the
    group's methods; what each received, the senders recv named, the recorder's entries."""
    dtype, shape, tag, shift, seed = (case[k] for k in ("dtype", "shape", "tag", "shift",
                                                        "seed"))
    pg = dist.group.WORLD
    me = ctx.rank
    nxt, prv = (me + shift) % WORLD, (me - shift) % WORLD
    out = _message(seed, me, nxt, dtype, shape)
    got = {}
    for way in ("isend", "method", "blocking", "any"):
        inp = np.zeros(shape, dtype)
        n0 = pg.fr.p2p_n
        if way == "isend":
            works = [dist.irecv(inp, prv, tag=tag), dist.isend(out, nxt, tag=tag)]
            for w in works:
                w.wait()
        elif way == "method":
            works = [pg.recv([inp], prv, tag), pg.send([out], nxt, tag)]
            for w in works:
                w.wait()
        else:  # blocking: in turn, each rank sends while its receiver waits for it
            for k in range(WORLD):
                if me == k:
                    dist.send(out, nxt, tag=tag)
                elif me == (k + shift) % WORLD:
                    got[way + "_sender"] = (dist.recv(inp, prv, tag=tag) if way == "blocking"
                                            else dist.recv(inp, tag=tag))
                dist.barrier()
        got[way] = inp.tolist()
        got[way + "_fr"] = _new_p2p(pg.fr, n0)
    # a peer that is this rank, outside the group or given twice: refused before any post
    n0 = pg.fr.p2p_n
    x = np.zeros(shape, dtype)
    got["refused"] = [_refused(f) for f in (
        lambda: dist.send(x, me), lambda: dist.isend(x, me), lambda: dist.recv(x, me),
        lambda: dist.irecv(x, me), lambda: pg.send([x], me), lambda: pg.recv([x], me),
        lambda: dist.isend(x, WORLD + 4), lambda: dist.irecv(x, src=nxt, group_src=nxt),
        lambda: dist.isend(x, nxt, tag=-1), lambda: dist.send(x))]
    got["refused_fr"] = _new_p2p(pg.fr, n0)
    return got


@st.composite
def p2p_cases(draw):
    return {"dtype": draw(st.sampled_from(["float32", "float64", "int32", "int64", "uint8"])),
            "shape": draw(st.sampled_from([(1,), (5,), (3, 2), (0,), (257,)])),
            "tag": draw(st.integers(0, 2**31 - 1)), "shift": draw(st.integers(1, WORLD - 1)),
            "seed": draw(st.integers(0, 1000))}


@pytest.mark.timeout(600)
@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=p2p_cases())
@example(case={"dtype": "float32", "shape": (5,), "tag": 0, "shift": 1, "seed": 1})
@example(case={"dtype": "int64", "shape": (3, 2), "tag": 2**31 - 1, "shift": 2, "seed": 2})
def test_p2p_free_functions_and_methods_agree_with_numpy(config, case):
    results = backend_pool(config, WORLD).run(p2p_both_ways, case, timeout=90)
    dtype, shape, tag, shift = (case[k] for k in ("dtype", "shape", "tag", "shift"))
    count = int(np.prod(shape, dtype=np.int64))
    for r, got in enumerate(results):
        prv, nxt = (r - shift) % WORLD, (r + shift) % WORLD
        want = _message(case["seed"], prv, r, dtype, shape).tolist()
        for way in ("isend", "method", "blocking", "any"):
            assert got[way] == want, (r, way)
        assert got["blocking_sender"] == prv and got["any_sender"] == prv
        # one recorder entry per message, under the call's kind, completed
        assert got["isend_fr"] == [("irecv", prv, tag, count, "completed"),
                                   ("isend", nxt, tag, count, "completed")]
        assert got["method_fr"] == got["isend_fr"]
        assert sorted(got["blocking_fr"]) == [("recv", prv, tag, count, "completed"),
                                              ("send", nxt, tag, count, "completed")]
        assert sorted(got["any_fr"]) == [("recv", -1, tag, count, "completed"),
                                         ("send", nxt, tag, count, "completed")]
        refused = got["refused"]
        assert all(x is not None for x in refused), (r, refused)
        for i in (0, 1, 4):  # send, isend, pg.send to this rank
            assert refused[i] == ("ValueError", _TO_SELF["dst"]), (r, i, refused[i])
        for i in (2, 3, 5):  # recv, irecv, pg.recv from this rank
            assert refused[i] == ("ValueError", _TO_SELF["src"]), (r, i, refused[i])
        assert refused[6][0] == "ValueError" and str(WORLD + 4) in refused[6][1]
        assert refused[7][0] == "ValueError" and "group_src" in refused[7][1]
        assert refused[8][0] == "ValueError" and "tag" in refused[8][1]
        assert refused[9][0] == "ValueError" and "dst" in refused[9][1]
        assert got["refused_fr"] == []  # nothing was posted


# ---- the *_multigpu calls, both ways, against NumPy ------------------------------------------

def _entries(ctx, seed, k, count, dtype):
    rng = np.random.default_rng([seed, ctx.rank])
    return [rng.integers(-5, 6, count).astype(dtype) for _ in range(k)]


def multigpu_both_ways(ctx, case):
    """Run on every rank: the case's ``*_multigpu`` call by the free function and by the
    method; the results and how many calls the recorder took, with the last one's kind."""
    name, k, count, dtype, seed, root = (case[x] for x in ("name", "k", "count", "dtype",
                                                           "seed", "root"))
    pg = dist.group.WORLD
    op = getattr(dist.ReduceOp, case["op"])
    got = {}
    for way in ("free", "method"):
        ts = _entries(ctx, seed, k, count, dtype)
        s0 = pg.fr.seq
        if name == "all_reduce_multigpu":
            if way == "free":
                dist.all_reduce_multigpu(ts, op)
            else:
                pg.allreduce(ts, op).wait()
            out = ts
        elif name == "broadcast_multigpu":
            if way == "free":
                dist.broadcast_multigpu(ts, root, src_tensor=k - 1)
            else:
                o = dist.BroadcastOptions()
                o.rootRank, o.rootTensor = root, k - 1
                pg.broadcast(ts, o).wait()
            out = ts
        elif name == "reduce_multigpu":
            if way == "free":
                dist.reduce_multigpu(ts, root, op)
            else:
                pg.reduce(ts, root, op).wait()
            out = ts
        elif name == "all_gather_multigpu":
            out = [[np.zeros(count, dtype) for _ in range(WORLD * k)] for _ in range(k)]
            if way == "free":
                dist.all_gather_multigpu(out, ts)
            else:
                pg.allgather(out, ts).wait()
            out = [t for lst in out for t in lst]
        else:  # reduce_scatter_multigpu: inputs k lists of WORLD * k entries
            ins = [_entries(ctx, seed + i, WORLD * k, count, dtype) for i in range(k)]
            out = [np.zeros(count, dtype) for _ in range(k)]
            if way == "free":
                dist.reduce_scatter_multigpu(out, ins, op)
            else:  # (the legacy positional op)
                pg.reduce_scatter(out, ins, op).wait()
        got[way] = [t.tolist() for t in out]
        last = pg.fr.entry(pg.fr.seq)
        got[way + "_fr"] = (pg.fr.seq - s0, last[1] if last is not None else None)
    return got


_NP = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum}


def _multigpu_reference(case, rank):
    name, k, count, dtype, seed, root = (case[x] for x in ("name", "k", "count", "dtype",
                                                           "seed", "root"))
    fn = _NP[case["op"]]

    class Ctx:
        def __init__(self, r):
            self.rank = r
    per_rank = [_entries(Ctx(r), seed, k, count, dtype) for r in range(WORLD)]
    if name in ("all_reduce_multigpu", "reduce_multigpu"):
        every = [t for ts in per_rank for t in ts]
        acc = every[0].copy()
        for t in every[1:]:
            acc = fn(acc, t)
        if name == "all_reduce_multigpu":
            return [acc.tolist()] * k
        mine = [t.tolist() for t in per_rank[rank]]  # reduce: only the root's first entry
        return [acc.tolist()] + mine[1:] if rank == root else mine
    if name == "broadcast_multigpu":
        return [per_rank[root][k - 1].tolist()] * k
    if name == "all_gather_multigpu":
        flat = [t.tolist() for r in range(WORLD) for t in per_rank[r]]
        return flat * k
    # reduce_scatter_multigpu: entry i of rank r reduces every rank's and list's [r * k + i]
    ins = [[_entries(Ctx(q), seed + i, WORLD * k, count, dtype) for i in range(k)]
           for q in range(WORLD)]
    out = []
    for i in range(k):
        parts = [lst[rank * k + i] for q in range(WORLD) for lst in ins[q]]
        acc = parts[0].copy()
        for t in parts[1:]:
            acc = fn(acc, t)
        out.append(acc.tolist())
    return out


@st.composite
def multigpu_cases(draw):
    name = draw(st.sampled_from(sorted(MULTIGPU)))
    return {"name": name, "k": draw(st.integers(1, 3)), "count": draw(st.integers(1, 6)),
            "dtype": draw(st.sampled_from(["float64", "int32", "int64"])),
            "op": draw(st.sampled_from(sorted(_NP))), "seed": draw(st.integers(0, 1000)),
            "root": draw(st.integers(0, WORLD - 1))}


@pytest.mark.timeout(600)
@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=multigpu_cases())
@example(case={"name": "reduce_multigpu", "k": 2, "count": 3, "dtype": "int64", "op": "MAX",
               "seed": 1, "root": 2})
@example(case={"name": "reduce_scatter_multigpu", "k": 2, "count": 2, "dtype": "float64",
               "op": "SUM", "seed": 2, "root": 0})
@example(case={"name": "all_gather_multigpu", "k": 2, "count": 1, "dtype": "int32",
               "op": "SUM", "seed": 3, "root": 0})
def test_multigpu_free_functions_and_methods_agree_with_numpy(config, case):
    results = backend_pool(config, WORLD).run(multigpu_both_ways, case, timeout=90)
    kind = case["name"][:-len("_multigpu")]
    for r, got in enumerate(results):
        assert got["free"] == got["method"], (r, got)
        np.testing.assert_allclose(np.array(got["free"], np.float64),
                                   np.array(_multigpu_reference(case, r), np.float64))
        for way in ("free", "method"):  # recorded, under the single-tensor entry's kind
            calls, last = got[way + "_fr"]
            assert calls >= 1 and last == kind, (r, way, got[way + "_fr"])
