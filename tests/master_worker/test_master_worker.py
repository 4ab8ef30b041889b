"""Master-worker mode (issue 31): remote tensors driven from rank 0.

One job (a master and two worker nodes, plain env:// ranks) is started per module and
reused: its master runs functions of tests/master_worker/mw_job.py sent from here, and the property
tests compare what comes back with the same program run on local NumPy arrays. The
lifecycle tests start their own small jobs and check that no process is left behind.
"""
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Listener

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as dist
import collectives.master_worker as mw
from tests.support import ROOT
from tests.master_worker import mw_job
from tests.support.requires import needs_gloo

pytestmark = needs_gloo  # the jobs' process group is gloo's

EXAMPLES = int(os.environ.get("MW_TEST_EXAMPLES", "25"))
HYP = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _free_port():
    from collectives.run import free_port
    return free_port()


def _env(world, extra=None):
    env = dict(os.environ)
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def _default_sigint():
    """SIGINT as a terminal's program gets it: a test run started in the background by a
    non-interactive shell ignores SIGINT, its children inherit that, and Python then
    installs no KeyboardInterrupt handler (the interrupted-master test would hang)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(world, args, extra=None):
    """``world`` ranks of ``python -m tests.master_worker.mw_job *args`` (env://), their own sessions."""
    env = _env(world, extra)
    procs = []
    for r in range(world):  # "{rank}" in an extra value becomes the rank (fake hosts)
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        e.update({k: v.format(rank=r) for k, v in (extra or {}).items() if "{rank}" in v})
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.master_worker.mw_job", *args], env=e,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True,
                                      preexec_fn=_default_sigint))

    return procs


def reap(procs, timeout):
    """Wait for every process; kill and fail on any still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = []
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            left.append(p.pid)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return left


def pid_running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Job:
    """A running master-worker job whose master executes mw_job functions for the test."""

    def __init__(self, world=3, extra=None):
        key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self.listener.address
        self.procs = spawn(world, [], dict(extra or {}, MW_TEST_ADDR=f"{host}:{port}",
                                           MW_TEST_KEY=key.hex()))
        sock = self.listener._listener._socket
        sock.settimeout(1.0)
        deadline = time.monotonic() + 120
        while True:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close()
                raise RuntimeError("the job did not start:\n" + self._stderr())
            try:
                self.conn = self.listener.accept()
                break
            except (socket.timeout, TimeoutError):
                continue

    def __call__(self, name, *args, timeout=120):
        self.conn.send((name, args))
        if not self.conn.poll(timeout):
            self.close()
            raise RuntimeError(f"{name} did not answer in {timeout}s:\n" + self._stderr())
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"{name} failed on the master:\n{value}")
        return value

    def _stderr(self):
        reap(self.procs, 1)
        return "\n".join(f"--- rank {r} ---\n{p.stderr.read()[-3000:]}" for r, p in enumerate(self.procs))

    def close(self):
        try:
            self.conn.send(None)
        except (AttributeError, OSError):
            pass
        left = reap(self.procs, 30)
        self.listener.close()
        return left


@pytest.fixture(scope="module")
def job():
    j = Job(3)
    yield j
    assert j.close() == [], "processes left running at the end"
    assert [p.returncode for p in j.procs] == [0, 0, 0]


@pytest.fixture(scope="module", params=["numpy", "torch"])
def lib_job(request):
    """The job of each library a worker may hold: NumPy arrays (``job``), torch tensors
    (``torch_job``, tests/master_worker/conftest.py); its results are compared with the same
    library's on local data."""
    return request.getfixturevalue("job" if request.param == "numpy" else "torch_job")


# ---- the seed's example --------------------------------------------------------------------------
@pytest.mark.timeout(200)
def test_seed_example_values(job):
    out = job("seed_example")
    assert out["z"] == (0, -1) and out["a"] == (1, -1)
    np.testing.assert_array_equal(out["z_val"], 4 + out["y"])


# ---- properties: remote results equal NumPy's ------------------------------------------------------
DTYPES = ["int32", "int64", "float32", "float64"]


@st.composite
def broadcast_pair(draw):
    nd = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd))
    other = [draw(st.sampled_from([d, 1])) for d in shape]
    drop = draw(st.integers(0, len(other)))
    dt_a, dt_b = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    a = draw(st.lists(st.integers(-50, 50), min_size=int(np.prod(shape)),
                      max_size=int(np.prod(shape))))
    b = draw(st.lists(st.integers(-50, 50), min_size=int(np.prod(other[drop:])),
                      max_size=int(np.prod(other[drop:]))))
    return (np.array(a, dt_a).reshape(shape), np.array(b, dt_b).reshape(other[drop:]))


@pytest.mark.timeout(600)
@HYP
@given(pair=broadcast_pair(), op=st.sampled_from(["add", "sub", "mul", "maximum", "minimum",
                                                  "eq", "lt", "ge"]),
       node=st.integers(0, 1))
def test_binary_broadcasting_matches_numpy(job, pair, op, node):
    a, b = pair
    got = job("binary", a, b, op, node)
    want = mw_job.interpret([(op, None)], a, b, False)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@st.composite
def programs(draw):
    """A start array, a same-shape operand, and a random sequence of ops that keeps shapes
    valid (shape-changing ops only where they apply)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dt = draw(st.sampled_from(DTYPES))
    n = int(np.prod(shape))
    a = np.array(draw(st.lists(st.integers(-9, 9), min_size=n, max_size=n)), dt).reshape(shape)
    b = np.array(draw(st.lists(st.integers(-9, 9), min_size=n, max_size=n)), dt).reshape(shape)
    prog, ndim, same = [], len(shape), True  # same: x still has b's shape (b may be used)
    for _ in range(draw(st.integers(1, 8))):
        choices = ["neg", "abs", "square", "clone", "fill_", "add_", "mul_", "rsub",
                   "astype", "reshape_flat"]
        if same:
            choices += ["add", "sub", "mul", "maximum", "minimum"]
        if ndim >= 1:
            choices += ["sum", "max", "min", "getitem"]
        if ndim == 2:
            choices.append("t")
        op = draw(st.sampled_from(choices))
        if op in ("sum", "max", "min"):
            dim = draw(st.one_of(st.none(), st.integers(0, ndim - 1)))
            keep = draw(st.booleans())
            prog.append((op, (dim, keep)))
            ndim = ndim if keep else (0 if dim is None else ndim - 1)
            same = same and keep and dim is not None and shape[dim] == 1
        elif op == "getitem":
            prog.append((op, (slice(None, None, draw(st.sampled_from([1, 2, -1]))),)))
            same = same and shape[0] == 1
        elif op == "t":
            prog.append((op, None))
            same = same and shape[0] == shape[1]
        elif op == "reshape_flat":
            prog.append((op, None))
            ndim, same = 1, same and ndim == 1
        elif op in ("fill_", "add_", "mul_", "rsub"):
            prog.append((op, draw(st.integers(-3, 3))))
        elif op == "astype":
            prog.append((op, draw(st.sampled_from(["float64", "int64"]))))
        else:
            prog.append((op, None))
    return a, b, prog


@pytest.mark.timeout(600)
@HYP
@given(case=programs(), node=st.integers(0, 1))
def test_op_sequences_match_numpy(job, case, node):
    a, b, prog = case
    got = job("run_program", a, b, prog, node)
    want = np.asarray(mw_job.interpret(prog, a.copy(), b.copy(), False))
    assert got.dtype == want.dtype and got.shape == want.shape, (prog, got, want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.timeout(300)
@HYP
@given(n=st.integers(1, 4), dt=st.sampled_from(DTYPES + ["uint8", "bool", "float16", "int8"]),
       op=st.sampled_from(["SUM", "MAX", "MIN", "broadcast", "all_gather"]),
       data=st.data())
def test_worker_collectives_match_numpy(job, n, dt, op, data):
    if dt == "bool" and op == "SUM":
        op = "MAX"
    arrays = [np.array(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), dt)
              for _ in range(2)]
    got = job("collectives_case", arrays, op)
    if op == "broadcast":
        want = [arrays[1], arrays[1]]
    elif op == "all_gather":
        want = [np.stack(arrays)] * 2
    else:
        f = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum}[op]
        want = [f(arrays[0], arrays[1]).astype(dt)] * 2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.timeout(120)
def test_collective_with_a_failed_input_fails_fast_on_every_node(job):
    out = job("collective_with_failed_input")
    assert out[1] is not None and "matmul" in out[1] and "node 1" in out[1]
    assert out[0] is not None and "all_reduce" in out[0] and "node 0" in out[0]
    assert out["secs"] < 20, out  # not the peers' 30 s timeout
    assert out["after"] == ([2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    errs, a = job("collective_size_mismatch")
    assert all(e is not None and "differ in size" in e for e in errs), errs
    assert a == [1.0] * 4  # untouched


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dt", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                                "float32", "float64", "complex64", "complex128"])
def test_send_and_copy_back_every_dtype(job, dt):
    a = (np.arange(24).reshape(2, 3, 4) % 7).astype(dt)
    got = job("echo", a, 1)
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, a)
    big = np.arange(3 * 2**20, dtype=np.float32)  # past the transport's eager size
    np.testing.assert_array_equal(job("echo", big, 0), big)
    np.testing.assert_array_equal(job("echo", np.float32(3.5), 0), np.float32(3.5))


@pytest.mark.timeout(120)
def test_tensor_api_values(job):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    b = np.arange(8, dtype=np.float32).reshape(4, 2) / 3
    out = job("misc_values", a, b)
    eq = np.testing.assert_allclose
    eq(out["getitem"], a[1:, ::2])
    eq(out["fancy"], a[[0, 2]])
    eq(out["mask"], a[a > 0])
    eq(out["matmul"], a @ b, rtol=1e-6)
    eq(out["t_matmul"], a.T @ a, rtol=1e-6)
    eq(out["reshape"], a.reshape(-1, 2))
    eq(out["permute"], a.reshape(3, 2, 2).transpose(2, 0, 1))
    assert out["unsq"] == (3, 4)
    assert len(out["rows"]) == 3 and all((r == a[i]).all() for i, r in enumerate(out["rows"]))
    c = a.copy()
    c[0] = 7.0
    c[1:, 1] = b[:2, 0]
    c += 1
    eq(out["setitem"], c)
    eq(out["orig"], a)  # clone() copied
    assert out["moved"][0] == 1
    eq(out["moved"][1], a * 2)
    assert out["meta"] == ((3, 4), "float32", 2, 12, 3, 4)
    assert out["lazy_meta"] == ((3, 2), "bool")
    s, m, mx, am, sd, var = out["reduce"]
    assert s == a.sum() and sd == pytest.approx(a.std(ddof=1), rel=1e-5)
    eq(m, a.mean(1))
    eq(mx, a.max(0, keepdims=True))
    eq(am, a.argmax(1))
    eq(var, a.var(0), rtol=1e-6)
    ex, relu, clamp, where = out["unary"]
    eq(ex, np.exp(a), rtol=1e-6)
    eq(relu, np.maximum(-a, 0))
    eq(clamp, np.clip(a, -0.5, 0.5))
    eq(where, np.where(a > 0, a, 0.0))
    eq(out["scalar_left"], (2.0 - a) / 4)
    eq(out["inplace_chain"], np.full(3, 14))
    assert out["typed"] == [("FloatTensor", "float32"), ("DoubleTensor", "float64"),
                            ("HalfTensor", "float16"), ("LongTensor", "int64"),
                            ("IntTensor", "int32"), ("ShortTensor", "int16"),
                            ("CharTensor", "int8"), ("ByteTensor", "uint8"),
                            ("BoolTensor", "bool")]
    eq(out["from_data"], np.array([1, 2, 3], np.float32))
    assert out["full"].dtype == np.int16 and (out["full"] == 9).all()
    same, lo, hi = out["rand"]
    assert same and 0 <= lo < 0.01 and 0.99 < hi < 1


# ---- NumPy mode: ufuncs and array functions (issue 42) ------------------------------------
@pytest.mark.timeout(300)
def test_numpy_ufuncs_on_remote_arrays_equal_numpy(job):
    ran, bad = job("numpy_ufuncs_case")
    assert len(ran) >= 60 and not bad, bad
    assert {"exp", "add", "arctan2", "logical_and", "sqrt"} <= set(ran)


@pytest.mark.timeout(300)
def test_numpy_array_functions_on_remote_arrays_equal_numpy(job):
    names, bad, kinds = job("numpy_functions_case")
    assert len(names) >= 40 and not bad, bad
    assert kinds["concatenate"] == "RemoteTensor" and kinds["allclose"] == "bool"
    assert kinds["split"] == "list" and kinds["mean"] == "RemoteTensor"  # 0-d stays remote


# ---- Python operators and NumPy's list-taking functions: remote equals local -----------------
OP_DTYPES = ["bool", "int32", "int64", "float32", "float64"]
LIST_FUNCTIONS = ("concatenate", "concat", "stack", "vstack", "hstack", "dstack", "column_stack",
                  "row_stack", "block")


def _values(draw, shape, dt):
    n = int(np.prod(shape))
    a = np.array(draw(st.lists(st.integers(-4, 4), min_size=n, max_size=n)), dt).reshape(shape)
    return a * np.array(0.5, dt) if a.dtype.kind == "f" else a


@st.composite
def operator_cases(draw):
    """An operator of operators.OPERATORS, one of its forms, and operands: a tensor of a
    random dtype and length (0, 1 and odd ones included), and a Python number or a tensor."""
    from collectives.master_worker.operators import OPERATORS
    op = draw(st.sampled_from(OPERATORS))
    forms = ["forward"]
    if op.arity == 2:
        forms += ["reflected", "local_left"] + (["inplace"] if op.inplace else [])
    form = draw(st.sampled_from(forms))
    n = draw(st.sampled_from([0, 1, 2, 3, 5]))
    shape = (n, n) if op.name == "matmul" else draw(st.sampled_from([(n,), (2, n)]))
    a = _values(draw, shape, draw(st.sampled_from(OP_DTYPES)))
    number = st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.5, 2.0]), st.booleans())
    if form == "reflected" or (form != "local_left" and draw(st.booleans())):
        b = draw(number)
    else:
        b = _values(draw, shape, draw(st.sampled_from(OP_DTYPES)))
    return op.name, form, a, b


def same_outcome(want, got):
    """Both raised, or both gave equal arrays (values, NaNs, dtypes, shapes)."""
    assert want[0] == got[0], (want, got)
    if want[0] == "err":
        return
    w, g = want[1], got[1]
    if isinstance(w, list):
        assert isinstance(g, list) and len(g) == len(w), (w, g)
    else:
        w, g = [w], [g]
    for x, y in zip(w, g):
        assert x.dtype == y.dtype and x.shape == y.shape, (x, y)
        np.testing.assert_array_equal(y, x)


def check_operator(job, case, node):
    name, form, a, b = case
    want, got = job("operator_case", name, form, a, b, node)
    same_outcome(want, got)


@st.composite
def list_function_cases(draw):
    """A NumPy function that takes a list of arrays, 1 to 3 arrays of one shape (lengths 0,
    1 and odd included) and random dtypes, and its axis argument where it has one."""
    name = draw(st.sampled_from(LIST_FUNCTIONS))
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=1, max_size=2)))
    arrays = [_values(draw, shape, draw(st.sampled_from(OP_DTYPES)))
              for _ in range(draw(st.integers(1, 3)))]
    kwargs = {}
    if name in ("concatenate", "concat"):
        kwargs["axis"] = draw(st.sampled_from([0, -1, None]))
    elif name == "stack":
        kwargs["axis"] = draw(st.sampled_from([0, -1, len(shape)]))
    return name, arrays, kwargs


def check_list_function(job, case, node):
    name, arrays, kwargs = case
    want, got = job("list_function_case", name, arrays, kwargs, node)
    same_outcome(want, got)


@pytest.mark.timeout(600)
@HYP
@given(case=operator_cases(), node=st.integers(0, 1))
def test_every_operator_form_on_remote_data_equals_local(lib_job, case, node):
    """``a ** b``, ``2 ** a``, ``a **= b``, ``local @ a``... give what they give on local
    arrays or tensors (operators.OPERATORS, each form), errors included."""
    check_operator(lib_job, case, node)


@pytest.mark.timeout(300)
def test_operators_as_written_equal_local(lib_job):
    out = lib_job("operator_spellings")
    assert len(out) >= 36 and all(out.values()), {k: v for k, v in out.items() if not v}


@pytest.mark.timeout(600)
@HYP
@given(case=list_function_cases(), node=st.integers(0, 1))
def test_numpy_list_functions_on_remote_data_equal_local(lib_job, case, node):
    """``np.concatenate([a, b])``, ``np.stack``, ``np.vstack``... of remote arrays or torch
    tensors give NumPy's array, as on local ones."""
    check_list_function(lib_job, case, node)


# ---- errors: before anything is sent, and from the workers at sync points ------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case,exc,words", [
    ("cross_node_operands", "ValueError", ["node 1", "node 0", "to_node"]),
    ("local_operand", "TypeError", ["local tensor of 2400000 bytes", "mw.send"]),
    ("unknown_node", "ValueError", ["node must be in [0, 2)", "99"]),
    ("freed_handle", "ValueError", ["freed"]),
    ("bad_dtype", "ValueError", ["dtype must be one of"]),
    ("bad_shape", "ValueError", ["non-negative"]),
    ("init_pg_again", "RuntimeError", ["master-worker mode", "exclude"]),
    ("init_mw_again", "RuntimeError", ["twice"]),
])
def test_misuse_raises_clearly(job, case, exc, words):
    got = job("expect_error", case)
    assert got is not None, f"{case} did not raise"
    assert got[0] == exc, got
    for w in words:
        assert w in got[1], (w, got[1])


@pytest.mark.timeout(120)
def test_worker_error_surfaces_at_sync_naming_node_and_command(job):
    out = job("worker_error_at_sync")
    node, command, msg, n = out["sync"]
    assert node == 1 and "matmul" in command and "node 1" in msg
    assert n == 2, msg  # the matmul and the add that used its result
    assert "failed" in out["after"] and "matmul" in out["after"]
    assert out["dependent"][0] == "RuntimeError" and "failed" in out["dependent"][1]
    np.testing.assert_array_equal(out["still_works"], [3.0, 3.0])


def test_calls_before_init_raise():
    with pytest.raises(RuntimeError, match="init_master_worker"):
        mw.ones(3)
    with pytest.raises(RuntimeError, match="init_master_worker"):
        dist.FloatTensor(2, 2)
    with pytest.raises(RuntimeError, match="init_master_worker"):
        mw.synchronize()
    with pytest.raises(ValueError, match="backend"):
        dist.init_master_worker(backend="nccl")


# ---- streams, collectives, rpc, lifetime -------------------------------------------------------------
@pytest.mark.timeout(120)
def test_event_and_synchronize(job):
    done, x = job("events_and_sync")
    assert done is True
    np.testing.assert_array_equal(x, np.full(1000, 50.0, np.float32))


@pytest.mark.timeout(120)
def test_rpc_registered_functions_only(job):
    out = job("rpc_case")
    np.testing.assert_array_equal(out["sync"], np.arange(3.0) + 1)
    assert out["async"] == {"kind": "int", "extra": [1, "x"]}
    np.testing.assert_array_equal(out["scaled"], np.full(4, 3.0, np.float32))
    assert out["remote"][0] == 0
    np.testing.assert_array_equal(out["remote"][1], np.arange(5.0) * 2)
    assert "kaput" in out["boom"] and "node 0" in out["boom"]
    assert "not registered" in out["unregistered"]
    assert "not plain data" in out["not_plain"]


@pytest.mark.timeout(120)
def test_commands_and_replies_larger_than_a_frame(job):
    n = 50_000  # 400 KB arrays: past the 16 KiB frame, through the continuation tags
    r, picked = job("big_frames", n)
    np.testing.assert_array_equal(r, np.arange(n, dtype=np.float64) + 1)
    np.testing.assert_array_equal(picked, np.arange(0, n, 3, dtype=np.float64))


def _memory_flat_over(job, n, timeout):
    job("leak_case", 2000)  # warm up the allocator and the free lists
    before, after, secs = job("leak_case", n, timeout=timeout)
    # every dropped handle was freed (at most one unflushed batch of frees remains)
    assert after["live"] - before["live"] <= 2 * 512, (before, after)
    assert after["failed"] == 0
    assert after["rss"] - before["rss"] < 8 * 2**20, (before, after)
    assert after["seq"] - before["seq"] >= 2 * n


@pytest.mark.slow  # quick: the 10k sibling
@pytest.mark.timeout(600)
def test_worker_memory_flat_over_100k_dropped_tensors(job):
    _memory_flat_over(job, 100_000, 550)


@pytest.mark.timeout(300)
def test_worker_memory_flat_over_10k_dropped_tensors(job):
    """The quick suite's instance of the test above (which is slow)."""
    _memory_flat_over(job, 10_000, 250)


# ---- lifecycle: nothing is left behind ----------------------------------------------------------------
def _pids(proc0, timeout=60):
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc0.stdout.readline()
        if line.startswith("PIDS"):
            return [int(x) for x in line.split()[1:]]
        if not line and proc0.poll() is not None:
            break
    raise AssertionError(f"no PIDS line from the master: {line!r} {proc0.stderr.read()[-2000:]}")


@pytest.mark.timeout(120)
def test_master_exit_ends_workers_cleanly():
    procs = spawn(3, ["exit"])
    assert len(_pids(procs[0])) == 2
    assert reap(procs, 60) == []
    assert [p.returncode for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]


@pytest.mark.timeout(120)
def test_master_exception_ends_workers():
    procs = spawn(3, ["raise"])
    _pids(procs[0])
    assert reap(procs, 60) == []
    assert procs[0].returncode == 1 and [p.returncode for p in procs[1:]] == [0, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["crash", "sigkill", "sigint"])
def test_master_death_leaves_no_worker(how):
    procs = spawn(3, ["crash" if how == "crash" else "hang"])
    pids = _pids(procs[0])
    if how == "sigkill":
        os.kill(procs[0].pid, signal.SIGKILL)
    elif how == "sigint":
        os.kill(procs[0].pid, signal.SIGINT)
    assert reap(procs, 60) == [], f"workers still running after the master's {how}"
    assert not any(pid_running(p) for p in pids)
    if how == "sigint":  # an interrupted master shuts its workers down in order
        assert [p.returncode for p in procs[1:]] == [0, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{"COLLECTIVES_TRANSPORT": "tcp"},
                                 {"COLLECTIVES_HOST_ID": "fakehost{rank}"}],
                         ids=["tcp", "three-hosts"])
def test_seed_example_over_tcp(env):
    procs = spawn(3, ["seed"], env)
    assert reap(procs, 90) == []
    out = procs[0].stdout.read()
    assert [p.returncode for p in procs] == [0, 0, 0], procs[0].stderr.read()[-2000:]
    assert "SEED OK (0, -1) (1, -1)" in out


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_master_crash_on_another_host_leaves_no_worker():
    """Workers on other (faked) hosts cannot watch the master's pid: the closed TCP
    connection ends them."""
    procs = spawn(3, ["hang"], {"COLLECTIVES_HOST_ID": "fakehost{rank}"})
    pids = _pids(procs[0])
    os.kill(procs[0].pid, signal.SIGKILL)
    assert reap(procs, 60) == [], "workers still running after the master was killed"
    assert not any(pid_running(p) for p in pids)


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_killed_worker_raises_on_master_within_timeout():
    j = Job(3, {"MW_TEST_TIMEOUT": "20"})
    try:
        got = j("kill_worker_midstream", 1, timeout=120)
        assert got is not None
        name, msg, secs = got
        assert name == "DistBackendError" and "node 1" in msg, got
        assert secs < 20, got
        # the other node still serves
        np.testing.assert_array_equal(j("echo", np.arange(3.0), 0), np.arange(3.0))
    finally:
        left = j.close()
    assert left == []


# ---- launchers and the torch library --------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_seed_example_under_collectives_run():
    env = _env(3)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "collectives.run", "--nproc-per-node", "3",
                        "-m", "tests.master_worker.mw_job", "seed"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SEED OK (0, -1) (1, -1)" in p.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["tcp", "mpi"])
def test_seed_example_under_mpiexec(backend):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    if backend == "mpi" and not dist.is_mpi_available():
        pytest.skip("mpi backend unavailable (mpi4py missing)")
    env = _env(3, {"MW_TEST_BACKEND": backend})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    p = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "tests.master_worker.mw_job", "seed"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SEED OK (0, -1) (1, -1)" in p.stdout


@pytest.mark.timeout(200)
def test_example_trains_a_module_with_an_optimizer_on_two_workers():
    """examples/master_worker_train.py: an nn.Module and SGD on two nodes, data parallel,
    equal to the same training run locally (the script asserts it)."""
    pytest.importorskip("torch")
    env = _env(3)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "collectives.run", "-n", "3",
                        os.path.join(ROOT, "examples", "master_worker_train.py"), "--steps", "60"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "max |node params - local params|" in p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_on_a_worker_makes_a_device_tensor_there():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none on this machine)")
    j = Job(2, {"MW_TEST_LIBRARY": "torch"})
    try:
        got = j("cuda_case")
    finally:
        left = j.close()
    assert left == []
    assert got == (-1, 0, 0, 0, "cpu", [8.0, 12.0, 16.0], -1), got
