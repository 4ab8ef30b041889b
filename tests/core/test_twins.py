"""Every hot object in C and its pure-Python twin, run on the same inputs and compared.

The package picks one of each pair with ``try/except ImportError`` (the twin serves where
the extensions are not built, or where COLLECTIVES_NO_EXTENSIONS hides them). Here both are
imported in one process: the C object from its extension module, the twin by its own name
in the module that falls back to it. Each test states the property (same results, same
state after, same exception type and message), then hypothesis draws the inputs: every
dtype, lengths 0, 1 and odd ones, valid and invalid arguments.

The pairs (C, Python):

=========================  ================================  ===============================
what                       C                                 Python
=========================  ================================  ===============================
Buffer                     engines._buffer.Buffer            core.tensors._PyBuffer
tensor -> Buffer           _buffer.buffer, buffers           core.convert._py_buffer(s)
all_gather's list check    _buffer.separate_blocks           core.staging._py_separate_blocks
gather's in/out check      _buffer.disjoint_gather           core.tensors._py_disjoint_gather
Counter                    engines._core.Counter             core.work._PyCounter
flight recorder ring       _core.CallRing                    diagnostics.flight_recorder
                                                             ._PyCallRing
group dispatcher           _core.Dispatcher                  api.group_dispatcher
                                                             ._PyDispatcher
reduction kernels          _core (reduce_into, scale...)     core.kernels_numpy
staging copy               _core.flatten (in staging.stage)  staging.stage's NumPy loop
AVG/PREMUL_SUM scaling     _core.scale_ptr (reduction.scale) core.kernels_numpy.scale_ptr
mpi call log               engines._mpilog.CallLog           backends.mpi.fingerprint.PyCallLog
=========================  ================================  ===============================

``collectives.engines._ncclcall`` (NCCL by address) and its ctypes twin need libnccl and a GPU;
tests/backends/test_nccl.py runs them where there are.

The inputs are those the package's callers pass: integers in the C fields' ranges, Buffers,
arrays and tensors. Outside that domain the pairs part on purpose: Cython converts and
checks each typed argument (a float count, a negative address, a str root raise
TypeError/OverflowError in C), where a twin takes what it is given; and a C Buffer exports
the buffer protocol (memoryview, mpi4py), which a Python class cannot on Python < 3.12 (the
mpi backend asks ``.numpy()`` of a twin Buffer instead: ``backends/mpi`` ``_EXPORTS``).
"""
import sys
import time
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.profiles import examples

from collectives.core import dtypes as D

_buffer = pytest.importorskip("collectives.engines._buffer", reason="the C twins need the extensions: "
                              "setup.py build_ext --inplace")
_core = pytest.importorskip("collectives.engines._core", reason="the C twins need the extensions: "
                            "setup.py build_ext --inplace")

from collectives.api import group_dispatcher as api_dispatch  # noqa: E402
from collectives.api import tracked  # noqa: E402
from collectives.core import convert, kernels_numpy, reduction, staging, tensors, work  # noqa: E402
from collectives.diagnostics import flight_recorder  # noqa: E402
from collectives.core.errors import DistError  # noqa: E402

SETTINGS = settings(max_examples=examples(60), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
CODES = sorted(D.DTYPE_NAMES)
NP_OF = {c: np.dtype("uint16" if c == D.BFLOAT16 else D.DTYPE_NAMES[c]) for c in CODES}
LENGTHS = st.sampled_from([0, 1, 2, 3, 5, 7, 16, 33])


def outcome(fn, *args, **kwargs):
    """("ok", result) or ("raise", exception type, message) of ``fn(*args, **kwargs)``."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001  (the exception is what is compared)
        return ("raise", type(e), str(e))


def outcomes(c_fn, p_fn, *args, **kwargs):
    """The outcomes of a C original and of its Python twin on the same arguments."""
    return outcome(c_fn, *args, **kwargs), outcome(p_fn, *args, **kwargs)


def same_raise(c, p, message=True):
    """Both raised the same exception type (and message, unless ``message`` is False: a
    Cython argument check words its own), or neither raised."""
    assert c[0] == p[0], (c, p)
    if c[0] == "raise":
        assert c[1] is p[1], (c, p)
        if message:
            assert c[2] == p[2], (c, p)


def fields(b):
    return (b.ptr, b.count, b.dtype, b.itemsize, b.device, b.nbytes)


def array(draw, code, n):
    """A host array of dtype ``code`` (bfloat16 as uint16 bits) and length ``n``."""
    dt = NP_OF[code]
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    a = np.frombuffer(raw, dtype=np.uint8).copy().view(dt) if n else np.empty(0, dt)
    return a if code != D.BOOL else a.view(np.uint8).__and__(1).view(np.bool_)


# ---- Buffer --------------------------------------------------------------------------------
@SETTINGS
@given(dtype=st.integers(-2, len(CODES) + 1), count=st.integers(0, 1 << 40),
       ptr=st.integers(0, (1 << 63) - 1), device=st.integers(-1, 7),
       start=st.integers(0, 64), stop=st.integers(0, 64))
def test_buffer_fields_slices_and_errors_are_the_same(dtype, count, ptr, device, start, stop):
    owner = object()
    c, p = outcomes(_buffer.Buffer, tensors._PyBuffer, ptr, count, dtype, device, owner)
    same_raise(c, p)
    if c[0] == "ok":
        cb, pb = c[1], p[1]
        assert fields(cb) == fields(pb) and cb.obj is pb.obj is owner
        assert repr(cb) == repr(pb)
        cs, ps = cb.slice(start, stop), pb.slice(start, stop)
        assert fields(cs) == fields(ps) and cs.obj is ps.obj is owner


@SETTINGS
@given(data=st.data(), code=st.sampled_from(CODES), n=LENGTHS)
def test_buffer_views_of_host_memory_are_the_same(data, code, n):
    a = array(data.draw, code, n)
    addr = a.__array_interface__["data"][0]
    cb, pb = _buffer.Buffer(addr, n, code, -1, a), tensors._PyBuffer(addr, n, code, -1, a)
    cv, pv = cb.numpy(), pb.numpy()
    assert cv.dtype == pv.dtype and cv.shape == pv.shape == (n,)
    np.testing.assert_array_equal(cv.view(np.uint8), pv.view(np.uint8))
    assert np.shares_memory(cv, a) or n == 0
    np.testing.assert_array_equal(cb.bytes_view(), pb.bytes_view())
    assert bytes(memoryview(cb)) == pb.bytes_view().tobytes()  # what each hands to mpi4py
    cuda = (_buffer.Buffer(addr, n, code, 0, a), tensors._PyBuffer(addr, n, code, 0, a))
    same_raise(outcome(cuda[0].numpy), outcome(cuda[1].numpy))


# ---- tensor -> Buffer, and the list and overlap checks --------------------------------------
@st.composite
def host_tensors(draw, torch_too=True):
    """A NumPy array or torch tensor the front end may be given: any dtype (some it refuses),
    contiguous or not, writable or not, byte-swapped, empty; or something else entirely."""
    kind = draw(st.sampled_from(["numpy", "torch", "other"] if torch_too else ["numpy", "other"]))
    if kind == "other":
        return draw(st.sampled_from([None, 3, [1.0, 2.0], "x", b"\0\0\0\0"]))
    n = draw(LENGTHS)
    if kind == "numpy":
        dt = draw(st.sampled_from(["float32", "float64", "int64", "int32", "bool", "uint8",
                                   "float16", "complex64", "uint16", "uint32", ">f4", "<i8"]))
        a = np.arange(2 * n).astype(dt)
        how = draw(st.sampled_from(["plain", "strided", "readonly", "2d"]))
        if how == "strided":
            return a[::2]
        if how == "readonly":
            a.flags.writeable = False
        if how == "2d":
            return a.reshape(2, n)
        return a
    torch = pytest.importorskip("torch")
    dt = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool,
                               torch.bfloat16, torch.complex64, torch.uint16, torch.float16]))
    t = torch.arange(2 * n).to(dt)
    how = draw(st.sampled_from(["plain", "strided", "neg", "conj", "sparse"]))
    if how == "strided":
        return t[::2]
    if how == "neg" and dt.is_complex:
        return t._neg_view()
    if how == "conj" and dt.is_complex:
        return t.conj()
    if how == "sparse" and dt == torch.float32:
        return t.reshape(2, n).to_sparse()
    return t


@SETTINGS
@given(t=host_tensors(), name=st.sampled_from(["tensor", "output_tensor"]))
def test_buffer_of_a_tensor_is_the_same(t, name):
    c, p = outcomes(_buffer.buffer, convert._py_buffer, t, name)
    same_raise(c, p)
    if c[0] == "ok":
        assert fields(c[1]) == fields(p[1]) and c[1].obj is p[1].obj


@SETTINGS
@given(ts=st.lists(host_tensors(), max_size=4) | st.tuples(host_tensors(), host_tensors()),
       dtype=st.sampled_from([None, D.FLOAT32, D.INT64]), count=st.sampled_from([None, 0, 3, 5]),
       length=st.sampled_from([None, 0, 1, 2, 3]))
def test_buffers_of_a_list_are_the_same(ts, dtype, count, length):
    c, p = outcomes(_buffer.buffers, convert._py_buffers, ts, "tensor_list", dtype, count, length)
    same_raise(c, p)
    if c[0] == "ok":
        assert [fields(b) for b in c[1]] == [fields(b) for b in p[1]]


@st.composite
def blocks(draw):
    """Buffers over one array at drawn offsets (touching, overlapping, apart, empty), an
    input among them or not, and a rank."""
    code = draw(st.sampled_from(CODES))
    size = NP_OF[code].itemsize
    base = np.zeros(64, np.uint64)
    addr = base.__array_interface__["data"][0]

    def block():
        off = draw(st.integers(0, 20))
        return _buffer.Buffer(addr + off * size, draw(st.integers(0, 6)), code, -1, base)
    outs = [block() for _ in range(draw(st.integers(0, 4)))]
    if outs and draw(st.booleans()):  # back to back, as a list viewing one tensor
        ptr = outs[0].ptr
        for i, b in enumerate(outs):
            outs[i] = _buffer.Buffer(ptr, b.count, code, -1, base)
            ptr += b.nbytes
    rank = draw(st.integers(0, 4))
    if outs and draw(st.booleans()):
        inp = outs[draw(st.integers(0, len(outs) - 1))]
    else:
        inp = block()
    return outs, inp, rank


@SETTINGS
@given(case=blocks())
def test_separate_blocks_is_the_same(case):
    c, p = outcomes(_buffer.separate_blocks, staging._py_separate_blocks, *case)  # outs, inp, rank
    same_raise(c, p)
    assert c == p, (c, p)


@SETTINGS
@given(case=blocks(), size=st.integers(0, 5), other_dtype=st.booleans())
def test_disjoint_gather_is_the_same(case, size, other_dtype):
    outs, inp, _ = case
    out = outs[0] if outs else inp
    if other_dtype:
        code = (inp.dtype + 1) % len(CODES)
        inp = _buffer.Buffer(inp.ptr, inp.count, code, -1, inp.obj)
    assert bool(_buffer.disjoint_gather(out, inp, size)) == \
        bool(tensors._py_disjoint_gather(out, inp, size))


@SETTINGS
@given(count=st.integers(0, 9), size=st.integers(1, 5), data=st.data())
def test_disjoint_gather_takes_the_own_block_alone_in_both(count, size, data):
    """With ``own`` >= 0, an input that is exactly block ``own`` of the output passes; any
    other block of it (or every block, with ``own`` -1) overlaps and fails, as before."""
    own = data.draw(st.integers(-1, size - 1), "own")
    k = data.draw(st.integers(0, size - 1), "block")
    arr = np.zeros(count * size, np.float32)
    out = tensors.to_buffer(arr)
    inp = tensors.to_buffer(arr[k * count:(k + 1) * count])
    want = count == 0 or own == k
    assert bool(_buffer.disjoint_gather(out, inp, size, own)) == want
    assert bool(tensors._py_disjoint_gather(out, inp, size, own)) == want


def test_an_empty_output_inside_the_inputs_bytes_shares_none_of_them():
    arr = np.zeros(2, np.float16)
    inp = tensors.to_buffer(arr)
    out = _buffer.Buffer(inp.ptr + 2, 0, inp.dtype, -1, arr)  # zero bytes, inside inp's four
    assert _buffer.disjoint_gather(out, inp, 0) and tensors._py_disjoint_gather(out, inp, 0)
    assert not _buffer.disjoint_gather(inp, inp, 1)  # (and a buffer overlaps itself)


# ---- Counter, CallRing ------------------------------------------------------------------------
@SETTINGS
@given(values=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=5))
def test_counter_counts_the_same(values):
    c, p = _core.Counter(), work._PyCounter()
    assert c.n == p.n == 0
    for v in values:
        c.n, p.n = v, v
        c.n += 1 if v < (1 << 63) - 1 else 0
        p.n += 1 if v < (1 << 63) - 1 else 0
        assert c.n == p.n


def ring_ops(kinds=st.sampled_from(["all_reduce", "broadcast", "barrier", "isend", 7])):
    """A ring size and a sequence of issue / issue_buffer calls and started/done stores."""
    num = st.integers(-(1 << 31), (1 << 31) - 1)
    issue = st.tuples(st.just("issue"), kinds, st.integers(0, 1 << 40),
                      st.integers(-1, len(CODES) - 1), num, st.one_of(st.none(), num))
    issue_buffer = st.tuples(st.just("issue_buffer"), kinds, LENGTHS,
                             st.sampled_from(CODES), num, num)
    store = st.tuples(st.sampled_from(["started", "done"]), st.integers(0, 20))
    return st.tuples(st.integers(-1, 6), st.booleans(),
                     st.lists(st.one_of(issue, issue_buffer, store), max_size=20))


def _stack():
    return (("file.py", 1, "caller"),)


def _run_ring(ring_type, size, stacked, ops):
    made = outcome(ring_type, size, _stack if stacked else None)
    if made[0] == "raise":
        return made, None
    ring, log = made[1], []
    for op in ops:
        if op[0] == "issue":
            t0 = time.monotonic_ns()
            log.append(outcome(ring.issue, *op[1:]))
            e = ring.entry(ring.seq)
            assert e is not None and t0 <= e[6] <= time.monotonic_ns()
        elif op[0] == "issue_buffer":
            buf = _buffer.Buffer(4096, op[2], op[3])
            log.append(outcome(ring.issue_buffer, op[1], buf, op[4], op[5]))
        else:
            setattr(ring, op[0], op[1])
        log.append((ring.seq, ring.started, ring.done, ring.size))
    entries = [e[:6] + e[7:] for e in ring.entries()]
    by_seq = [None if e is None else e[:6] + e[7:]
              for e in map(ring.entry, range(-1, ring.seq + 3))]
    return log, (entries, by_seq)


@SETTINGS
@given(case=ring_ops())
def test_call_ring_records_the_same(case):
    c, p = (_run_ring(ring, *case) for ring in (_core.CallRing, flight_recorder._PyCallRing))
    if c[1] is None or p[1] is None:
        same_raise(c[0], p[0])
        return
    assert c == p


# ---- Dispatcher ------------------------------------------------------------------------------
class _Ring:
    """A ring whose fail() is logged (the Recorder's: dump and annotate, not needed here)."""

    def fail(self, s, exc):
        self.fails.append((s, str(exc)))


class _CRing(_Ring, _core.CallRing):
    def __init__(self, size):
        super().__init__(size)
        self.fails = []


class _PyRing(_Ring, flight_recorder._PyCallRing):
    def __init__(self, size):
        super().__init__(size)
        self.fails = []


class _Prof:
    def __init__(self, on):
        self._is_profiler_enabled = on


@st.composite
def dispatch_cases(draw):
    path = dict(inline=draw(st.booleans()), pending=draw(st.sampled_from([0, 0, 1])),
                timed=draw(st.sampled_from([0, 0, 2])), prof=draw(st.sampled_from([None, False,
                                                                                   True])))
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.integers(0, 3)) == 0:
            calls.append(("post", draw(st.sampled_from(["isend", "irecv"])), draw(LENGTHS),
                          draw(st.integers(0, 3)), draw(st.integers(0, 9))))
            continue
        calls.append(("call", draw(st.sampled_from(["all_reduce", "barrier", "broadcast"])),
                      draw(st.one_of(st.none(), LENGTHS)), draw(st.integers(-1, 3)),
                      draw(st.integers(-1, 8)), draw(st.sampled_from(["ok", "dist", "value"])),
                      draw(st.booleans()), draw(st.sampled_from([None, 2.0]))))
    return path, calls


def _run_dispatcher(twin, path, calls, monkeypatch):
    log = []

    def general(pg, kind, buf, root, op, fn, args, async_op, outputs, timeout):
        log.append(("general", pg, kind, buf and fields(buf), root, op, args, async_op,
                    outputs, timeout))
        return "work"

    def general_post(pg, kind, fn, buf, peer, tag):
        log.append(("general_post", kind, peer, tag))
        return "request"

    def track(pg, kind, req, peer, tag, buf):
        log.append(("track", kind, req, peer, tag, buf.count))
        return "tracked"

    def fn(what, *args):
        log.append(("fn", what) + args)
        if what == "dist":
            raise DistError("peer 1 left")
        if what == "value":
            raise ValueError("bad tensor")

    def post_fn(buf, peer, tag):
        log.append(("post_fn", buf.count, peer, tag))
        return "req"

    prof = None if path["prof"] is None else _Prof(path["prof"])
    if twin == "c":
        fr, pending, timed = _CRing(8), _core.Counter(), _core.Counter()
        tap = _core.ProfilerTap(None)
        tap["_prof"] = prof
        pending.n, timed.n = path["pending"], path["timed"]
        d = _core.Dispatcher("pg", fr, "backend", path["inline"], pending, general, timed,
                             tap, DistError, track, general_post)
    else:
        fr, pending, timed = _PyRing(8), work._PyCounter(), work._PyCounter()
        pending.n, timed.n = path["pending"], path["timed"]
        monkeypatch.setattr(api_dispatch, "general", general)
        monkeypatch.setattr(api_dispatch, "general_post", general_post)
        monkeypatch.setattr(api_dispatch, "timed", timed)
        monkeypatch.setattr(tracked, "p2p", track)
        monkeypatch.setitem(api_dispatch._state, "_prof", prof or _Prof(False))
        d = api_dispatch._PyDispatcher("pg", fr, "backend", path["inline"], pending)
    base = np.zeros(64)
    for call in calls:
        if call[0] == "post":
            _, kind, n, peer, tag = call
            buf = _buffer.Buffer(base.__array_interface__["data"][0], n, D.FLOAT64, -1, base)
            log.append(outcome(d.post, kind, post_fn, buf, peer, tag))
        else:
            _, kind, n, root, op, what, async_op, timeout = call
            buf = None if n is None else _buffer.Buffer(4096, n, D.FLOAT32)
            log.append(outcome(d.call, kind, buf, root, op, fn, (what, n), async_op,
                               ("out",), timeout))
        log.append((fr.seq, fr.started, fr.done, list(fr.fails)))
    log.append([e[:6] for e in fr.entries()])
    return log


@SETTINGS
@given(case=dispatch_cases())
def test_dispatcher_takes_the_same_path_and_records_the_same(case, monkeypatch):
    """The cheap path (record, run, complete; a DistError recorded and re-raised) or the
    general one, chosen by the same switches, with the same calls in the same order."""
    path, calls = case
    with monkeypatch.context() as m:
        py = _run_dispatcher("py", path, calls, m)
    assert _run_dispatcher("c", path, calls, monkeypatch) == py


class _RootGroup:
    """What a dispatcher's ``root`` reads of its group: the global -> group rank map and
    ``peer`` (here a log of its calls, raising as the group's does for a rank outside)."""

    def __init__(self, ranks, mapping=dict):
        self.group_of_global = mapping({g: r for r, g in enumerate(ranks)})
        self.calls = []

    def peer(self, arg, group_arg, name, default=None):
        self.calls.append((arg, group_arg, name, default))
        if arg is None and group_arg is None:
            return default
        if group_arg is not None:
            if arg is not None:
                raise ValueError(f"give {name} or group_{name}, not both")
            return group_arg
        if arg not in self.group_of_global:
            raise ValueError(f"{name}={arg!r} is not a rank of the group")
        return self.group_of_global[arg]


@SETTINGS
@given(ranks=st.lists(st.integers(0, 9), min_size=1, max_size=5, unique=True),
       arg=st.one_of(st.none(), st.integers(-1, 10), st.booleans(), st.just(2.0)),
       group_arg=st.one_of(st.none(), st.integers(0, 4)),
       name=st.sampled_from(["src", "dst"]),
       mapping=st.sampled_from([dict, types.MappingProxyType]))
def test_dispatcher_root_is_the_same(ranks, arg, group_arg, name, mapping):
    """A collective's root: a global rank of the group by one lookup, every other argument
    (None, a group rank, a bool, a float, a rank outside) through the group's ``peer``,
    with the same result or exception and the same calls of ``peer`` (the group's map a
    dict, which C keeps, or another mapping, which it reads each call)."""
    out = []
    for make in (lambda pg: _core.Dispatcher(pg, _CRing(8), "backend", True, _core.Counter(),
                                             None, _core.Counter(), _core.ProfilerTap(None),
                                             DistError, None, None),
                 lambda pg: api_dispatch._PyDispatcher(pg, _PyRing(8), "backend", True,
                                                       work._PyCounter())):
        pg = _RootGroup(ranks, mapping)
        out.append((outcome(make(pg).root, arg, group_arg, name), pg.calls))
    assert out[0] == out[1]


# ---- the reduction kernels, staging and scaling ----------------------------------------------
OPS = [D.SUM, D.PRODUCT, D.MIN, D.MAX, D.BAND, D.BOR, D.BXOR, D.AVG, 99]


def _bits(a):
    return a.view(np.uint8).tobytes()


@st.composite
def kernel_cases(draw):
    code = draw(st.sampled_from(CODES))
    n = draw(LENGTHS)
    k = draw(st.integers(1, 3))
    return code, draw(st.sampled_from(OPS)), [array(draw, code, n) for _ in range(k + 1)]


def _canon(code, a):
    """``a``'s bytes with every NaN made one NaN (the kernels promise values, not payloads)."""
    if code in (D.BFLOAT16,):
        f = (a.astype(np.uint32) << 16).view(np.float32)
        return _bits(np.where(np.isnan(f), np.uint16(0x7FC0), a))
    if a.dtype.kind in "fc":
        flat = a.view(a.real.dtype) if a.dtype.kind == "c" else a
        return _bits(np.where(np.isnan(flat), np.array(np.nan, flat.dtype), flat))
    return _bits(a)


@SETTINGS
@given(case=kernel_cases())
def test_reduce_kernels_give_the_same_bits_and_errors(case):
    code, op, arrays = case
    for name in ("reduce_into", "reduce_many"):
        got = []
        for impl in (_core, kernels_numpy):
            dst = arrays[0].copy()
            srcs = [a.copy() for a in arrays[1:]]
            with np.errstate(all="ignore"):
                r = outcome(getattr(impl, name), dst, srcs[0] if name == "reduce_into" else srcs,
                            op)
            got.append((r if r[0] == "raise" else ("ok",), _canon(code, dst)))
        same_raise(got[0][0], got[1][0])
        assert got[0][1] == got[1][1], (name, code, op)
    for impl_pair in ((_core.op_valid, kernels_numpy.op_valid),
                      (_core.chunk_elems, kernels_numpy.chunk_elems)):
        args = (code, op) if impl_pair[0] is _core.op_valid else (code,)
        assert outcome(impl_pair[0], *args) == outcome(impl_pair[1], *args)


def _addr(a):
    return a.__array_interface__["data"][0]


@SETTINGS
@given(case=kernel_cases(), count_delta=st.sampled_from([0, 0, 0, -1, -(1 << 40)]),
       overlap=st.sampled_from([None, 0, 1]), null=st.booleans())
def test_pointer_kernels_give_the_same_bits_and_errors(case, count_delta, overlap, null):
    """The kernels' address forms (the mpi backend's user op, the shm engine): reduce_ptr,
    reduce_many_ptr, copy_ptr, on the same memory; a negative count, a null address with
    elements, and a destination that partly overlaps a source raise the same."""
    code, op, arrays = case
    n = arrays[0].size + count_delta
    for name in ("reduce_ptr", "reduce_many_ptr", "copy_ptr"):
        got = []
        for impl in (_core, kernels_numpy):
            work = np.concatenate([a.view(np.uint8) for a in arrays]).view(arrays[0].dtype) \
                if arrays[0].size else np.zeros(0, arrays[0].dtype)
            size = arrays[0].size
            parts = [work[i * size:(i + 1) * size] for i in range(len(arrays))]
            dst = 0 if null and n > 0 else _addr(parts[0])
            srcs = [_addr(x) for x in parts[1:]]
            if overlap is not None and size > 1:  # the destination one element into a source
                srcs[0] = dst + overlap * arrays[0].itemsize
            with np.errstate(all="ignore"):
                if name == "reduce_ptr":
                    r = outcome(impl.reduce_ptr, dst, srcs[0], n, code, op)
                elif name == "reduce_many_ptr":
                    r = outcome(impl.reduce_many_ptr, dst, srcs, n, code, op)
                else:
                    r = outcome(impl.copy_ptr, dst, srcs[0], n * arrays[0].itemsize)
            got.append((r if r[0] == "raise" else ("ok",), _canon(code, work)))
        same_raise(got[0][0], got[1][0])
        assert got[0][1] == got[1][1], (name, code, op)


@SETTINGS
@given(data=st.data(), code=st.sampled_from(CODES), n=LENGTHS,
       factor=st.sampled_from([0.5, 1.0 / 3, -2.5, 1e-3, 7.0, 0.1]))
def test_scaling_gives_the_same_bits(data, code, n, factor):
    """AVG's and PREMUL_SUM's scaling: the C kernel, its NumPy twin, and reduction.scale with
    the kernels hidden (the fallback the package takes without _core)."""
    a = array(data.draw, code, n)
    outs = []
    for fn in (_core.scale_ptr, kernels_numpy.scale_ptr):
        x = a.copy()
        with np.errstate(all="ignore"):
            r = outcome(fn, x.__array_interface__["data"][0], n, code, factor)
        outs.append((r[:2] if r[0] == "raise" else "ok", _canon(code, x)))
    assert outs[0] == outs[1]
    if outs[0][0] == "ok" and n:
        x = a.copy()
        with pytest.MonkeyPatch.context() as m:  # what reduction.scale runs without _core
            m.setitem(sys.modules, "collectives.engines._core", None)
            m.setattr(reduction, "_scale_impl", None)
            with np.errstate(all="ignore"):
                reduction.scale(tensors.Buffer(x.__array_interface__["data"][0], n, code, -1, x),
                            factor)
        assert _canon(code, x) == outs[0][1]


@SETTINGS
@given(data=st.data(), codes=st.lists(st.sampled_from(CODES), min_size=1, max_size=4),
       n=LENGTHS)
def test_flatten_unflatten_and_staging_give_the_same_bytes(data, codes, n):
    arrays = [array(data.draw, c, data.draw(LENGTHS)) for c in codes]
    c, p = outcome(_core.flatten, arrays), outcome(kernels_numpy.flatten, arrays)
    same_raise(c, p)
    if c[0] == "raise":  # uint16 (bfloat16's bits) is no dtype of a tensor to send
        return
    c_flat, p_flat = c[1], p[1]
    assert bytes(c_flat) == bytes(p_flat)
    targets = [[np.zeros_like(a) for a in arrays] for _ in range(2)]
    same_raise(outcome(_core.unflatten, c_flat, targets[0]),
               outcome(kernels_numpy.unflatten, p_flat, targets[1]))
    assert [_bits(a) for a in targets[0]] == [_bits(a) for a in targets[1]]
    bufs = [tensors.Buffer(a.__array_interface__["data"][0], a.size, codes[0], -1, a)
            for a in arrays if a.dtype == arrays[0].dtype] if codes[0] != D.BFLOAT16 else []
    if bufs:
        saved = staging._kernels
        try:
            staging._kernels = _core
            c_stage = staging.stage(bufs, codes[0], True)
            staging._kernels = None  # stage's NumPy loop, as without _core
            p_stage = staging.stage(bufs, codes[0], True)
        finally:
            staging._kernels = saved
        assert _bits(c_stage.numpy()) == _bits(p_stage.numpy())


# ---- the mpi backend's call log ---------------------------------------------------------------
@SETTINGS
@given(ops=st.lists(st.one_of(
    st.tuples(st.sampled_from(["append", "append_and_compare"]),
              st.tuples(*[st.integers(-(1 << 63), (1 << 63) - 1)] * 5)),
    st.tuples(st.sampled_from(["append", "append_and_compare"]),
              st.sampled_from([(1, 2, 3), [1, 2, 3, 4, 5], (1, 2, 3, 4, 5, 6)])),
    st.tuples(st.sampled_from(["clear", "digest", "entries", "len", "fail_compare"]))),
    max_size=80))
def test_mpi_call_log_logs_compares_and_fails_the_same(ops):
    """The log of blocking calls: appended, hashed, compared when full (CHECK_EVERY) or at
    once, and unusable once a comparison failed without clearing it."""
    _mpilog = pytest.importorskip("collectives.engines._mpilog", reason="build the _mpilog extension")
    from collectives.backends.mpi.fingerprint import PyCallLog
    from collectives.core.errors import DistBackendError

    def run(log_type):
        trace = []
        state = {"fail": False}

        def compare():  # FingerprintCheck.compare's bookkeeping, without MPI
            trace.append(("compare", len(log), log.entries()))
            if state["fail"]:
                raise DistBackendError("MPI_Allreduce failed")
            log.compared += len(log)
            log.clear()
        log = log_type(compare, DistBackendError)
        for op in ops:
            if op[0] in ("append", "append_and_compare"):
                r = outcome(getattr(log, op[0]), op[1])
                trace.append(r if r[0] == "ok" else r[:2])
            elif op[0] == "fail_compare":
                state["fail"] = True
            elif op[0] == "len":
                trace.append(len(log))
            else:
                trace.append(getattr(log, op[0])())
            trace.append((log.failed, log.compared))
        return trace

    assert run(_mpilog.CallLog) == run(PyCallLog)


#: what the package imports from its extensions with a twin to fall back to, each compared
#: above (or, _ncclcall, where NCCL runs): (extension, name; "" for the module itself)
COMPARED = {("_buffer", "Buffer"), ("_buffer", "disjoint_gather"), ("", "_buffer"),
            ("_buffer", "separate_blocks"),
            ("_core", "Counter"), ("_core", "Dispatcher"), ("_core", "ProfilerTap"),
            ("_core", "CallRing"), ("_core", "scale_ptr"), ("_core", "reduce_many_ptr"),
            ("", "_core"),
            ("_mpilog", "CallLog"), ("", "_ncclcall")}
#: imports under ``except ImportError`` that have no twin: the feature is off without them
NO_TWIN = {("", "_shm")}  # backends.shm.shm_available(): no shm backend without _shm


def _fallback_imports(text):
    """``(module, names)`` of each ``from module import names`` inside a ``try:`` whose
    handler is ``except ImportError``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip().startswith("try:"):
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                if nxt.strip().startswith("except ImportError"):
                    for b in body:
                        words = b.split("#")[0].split()
                        if len(words) >= 4 and words[0] == "from" and words[2] == "import":
                            yield words[1], " ".join(words[3:])
                break
            body.append(nxt)


def test_every_twin_the_package_falls_back_to_is_compared_here():
    """A new ``try: from .._ext import X / except ImportError`` in the package must be
    added to this module (and to COMPARED)."""
    import pathlib

    import collectives
    root = pathlib.Path(collectives.__file__).resolve().parent  # the package under test
    found = set()
    for path in root.rglob("*.py"):
        for module, names in _fallback_imports(path.read_text()):
            ext = module.lstrip(".").rsplit(".", 1)[-1]
            for name in names.split(","):
                name = name.split(" as ")[0].strip()
                if ext in _EXTENSIONS:
                    found.add((ext, name))
                elif name in _EXTENSIONS:
                    found.add(("", name))
    assert len(found) >= 8, f"the scan finds too few twins ({found}): it is out of date"
    missing = found - COMPARED - NO_TWIN
    assert missing == set(), f"twins not compared here: {missing}"


_EXTENSIONS = ("_core", "_buffer", "_tcp", "_shm", "_mpilog", "_ncclcall")
