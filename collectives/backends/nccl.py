"""'nccl': collectives on CUDA tensors through NCCL, called with ctypes.

The library is the one a CUDA build of torch brings (the ``nvidia-nccl-cu*``
wheel), or any ``libnccl.so.2`` the loader finds (``COLLECTIVES_NCCL_LIB``
names a path). Operations are enqueued on the tensor's device's current torch
stream, as torch's ProcessGroupNCCL does; ``Request.wait`` synchronises it.

The communicator is non-blocking (``ncclConfig_t.blocking = 0``): its setup and every
call are polled, so a peer that never arrives or dies makes the others raise
DistBackendError within the group's timeout instead of hanging. A watchdog thread
aborts the communicator when work enqueued but never waited for outlives the timeout
or NCCL reports an error; every later call on the group then raises.

Limits, as NCCL's: no any-source receive, no BAND/BOR/BXOR, no int16 and no
complex PRODUCT/MIN/MAX; these raise ValueError before anything is enqueued.
"""
import ctypes
import functools
import glob
import importlib.util
import os
import sys
import threading
import time

from .. import config
from ..core import dtypes as D
from ..core.errors import DistBackendError
from .base import Backend, Request

# ncclDataType_t and ncclRedOp_t values from nccl.h
_NCCL_DTYPE = {
    D.INT8: 0, D.UINT8: 1, D.BOOL: 1, D.INT32: 2, D.INT64: 4, D.FLOAT16: 6,
    D.FLOAT32: 7, D.FLOAT64: 8, D.BFLOAT16: 9,
    D.COMPLEX64: 7, D.COMPLEX128: 8,  # as pairs of reals, for SUM only
}
_NCCL_OP = {D.SUM: 0, D.PRODUCT: 1, D.MAX: 2, D.MIN: 3}
# bool follows torch's gloo: SUM is OR (MAX), PRODUCT is AND (MIN)
_BOOL_OP = {D.SUM: 2, D.PRODUCT: 3, D.MAX: 2, D.MIN: 3}
# dtype code * 16 + op code -> (ncclDataType_t, elements per element, ncclRedOp_t): every
# pair NCCL reduces (the others go through NcclBackend._dtype, which names what is missing)
_REDUCE = [None] * 256
for _dt, _nccl_dt in _NCCL_DTYPE.items():
    for _op in (_BOOL_OP if _dt == D.BOOL else _NCCL_OP):
        if _dt in D.COMPLEX and _op != D.SUM:
            continue
        _REDUCE[_dt * 16 + _op] = (_nccl_dt, 2 if _dt in D.COMPLEX else 1,
                                   (_BOOL_OP if _dt == D.BOOL else _NCCL_OP)[_op])
_U8 = _NCCL_DTYPE[D.UINT8]  # byte moves (broadcast, all_gather) go as uint8
_UNIQUE_ID_BYTES = 128
_SUCCESS, _INVALID_USAGE, _IN_PROGRESS = 0, 5, 7
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21700  # the oldest ncclConfig_t layout (NCCL 2.17); newer NCCLs read it
_UNDEF_INT = -2**31

_lib = None

try:  # NCCL's collectives called by address (a ctypes call costs more than the rest of one)
    from ..engines import _ncclcall
except ImportError:  # extensions not built: through ctypes
    _ncclcall = None


def _entry(lib, name, arity):
    """``f(*args, comm, stream)``: NCCL's ``name`` (``arity`` arguments), ``comm`` and
    ``stream`` as addresses; by address through collectives.engines._ncclcall where built."""
    fn = getattr(lib, name)
    if _ncclcall is None:
        return fn  # its argtypes take ints and None
    call = {6: _ncclcall.call6, 7: _ncclcall.call7, 8: _ncclcall.call8}[arity]
    return functools.partial(call, ctypes.cast(fn, ctypes.c_void_p).value)


def _library_paths():
    env = config.get("COLLECTIVES_NCCL_LIB")
    if env:
        yield env
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            yield from sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
    yield "libnccl.so.2"


def _load():
    global _lib
    if _lib is None:
        errors = []
        for path in _library_paths():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise RuntimeError("NCCL library not found (" + "; ".join(errors) + ")")
        if not hasattr(lib, "ncclCommInitRankConfig"):  # NCCL < 2.14: no non-blocking setup
            raise RuntimeError(f"{path} is older than NCCL 2.14 (no ncclCommInitRankConfig)")
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                               _UniqueId, ctypes.c_int,
                                               ctypes.POINTER(_Config)]
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        if hasattr(lib, "ncclGetLastError"):
            lib.ncclGetLastError.restype = ctypes.c_char_p
            lib.ncclGetLastError.argtypes = [ctypes.c_void_p]
        _set_argtypes(lib)
        _lib = lib
    return _lib


def _set_argtypes(lib):
    """The per-call entry points take Python ints for pointers and counts (and None for
    NULL): ctypes converts them by these types."""
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, args in (("ncclAllReduce", [vp, vp, sz, i, i, vp, vp]),
                       ("ncclBroadcast", [vp, vp, sz, i, i, vp, vp]),
                       ("ncclReduce", [vp, vp, sz, i, i, i, vp, vp]),
                       ("ncclAllGather", [vp, vp, sz, i, vp, vp]),
                       ("ncclReduceScatter", [vp, vp, sz, i, i, vp, vp]),
                       ("ncclSend", [vp, sz, i, i, vp, vp]),
                       ("ncclRecv", [vp, sz, i, i, vp, vp])):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = args


def is_available():
    """True when torch sees a CUDA device and libnccl loads (nothing is initialised)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        _load()
    except RuntimeError:
        return False
    return True


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _UNIQUE_ID_BYTES)]

    def raw(self):
        # not bytes(self.internal) of a c_char array: that stops at the first NUL byte
        return ctypes.string_at(ctypes.addressof(self), _UNIQUE_ID_BYTES)


class _Config(ctypes.Structure):
    """ncclConfig_t as NCCL 2.17 laid it out (size and version tell NCCL which layout)."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int),
                ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


def _nonblocking_config():
    return _Config(ctypes.sizeof(_Config), _CONFIG_MAGIC, _CONFIG_VERSION, 0,
                   _UNDEF_INT, _UNDEF_INT, _UNDEF_INT, None)


#: finished events kept for reuse (a pass of the watchdog, 50 ms, sees thousands of calls)
_SPARE_EVENTS = 8192


def _pause(spins):
    """Spin a little, then sleep longer and longer (up to 1 ms) while polling."""
    if spins > 100:
        time.sleep(min(0.001, 2e-6 * (spins - 100)))


class _StreamRequest(Request):
    """Finished when the stream it was enqueued on has reached it."""

    def __init__(self, backend, event, what, source=-1):
        self._backend = backend
        self._event = event
        self._what = what
        self._source = source
        self._exc = None

    def wait(self, timeout=None):
        try:
            self._backend._await(self._event, self._what, timeout)
        except DistBackendError as e:
            self._exc = e
            raise

    def test(self):
        return self._exc is not None or self._event.query()


class NcclBackend(Backend):
    """One NCCL communicator per group, built from a unique id shared through the store."""

    name = "nccl"
    takes_cuda = True

    def __init__(self, store, rank, size, timeout, options=None):
        super().__init__(store, rank, size, timeout, options)
        import torch
        self._torch = torch
        self._lib = _load()
        self._device = torch.cuda.current_device()
        # the current stream as (stream_id, device_index, device_type): one C call, no object
        self._stream_key = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._cur = (None, None, None)  # (that key, raw pointer, torch Stream) last seen
        self._one = None  # barrier's one-element scratch on the device, made at its first use
        self._comm = ctypes.c_void_p()
        lib = self._lib
        self._nccl_all_reduce = _entry(lib, "ncclAllReduce", 7)
        self._nccl_broadcast = _entry(lib, "ncclBroadcast", 7)
        self._nccl_reduce = _entry(lib, "ncclReduce", 8)
        self._nccl_all_gather = _entry(lib, "ncclAllGather", 6)
        self._nccl_reduce_scatter = _entry(lib, "ncclReduceScatter", 7)
        self._failed = None  # why the communicator was aborted
        # (event, deadline, what, reusable) enqueued and not yet seen finished, oldest first
        self._pending = []
        self._spare = []  # finished events no request holds, recorded again by _post
        self._lock = threading.RLock()  # guards the communicator (see _enqueue)
        self._plock = threading.Lock()  # guards _pending
        self._watchdog = None
        uid = _UniqueId()
        if rank == 0:
            self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            store.set("nccl/unique_id", uid.raw())
        else:
            raw = bytes(store.get("nccl/unique_id"))
            if len(raw) != _UNIQUE_ID_BYTES:
                raise DistBackendError(f"nccl: rank 0's unique id has {len(raw)} bytes, "
                                       f"expected {_UNIQUE_ID_BYTES}")
            ctypes.memmove(ctypes.byref(uid), raw, _UNIQUE_ID_BYTES)
        config = _nonblocking_config()
        code = self._lib.ncclCommInitRankConfig(ctypes.byref(self._comm), size, uid, rank,
                                                ctypes.byref(config))
        self._check(code, "ncclCommInitRankConfig")
        if self._comm:
            self._settle("communicator setup (ncclCommInitRankConfig)")

    # ---- helpers ---------------------------------------------------------------
    def _error_text(self, code):
        msg = self._lib.ncclGetErrorString(code).decode()
        last = getattr(self._lib, "ncclGetLastError", None)
        if last is not None:
            detail = last(self._comm or None)
            if detail:
                msg += f" ({detail.decode(errors='replace').strip()})"
        return f"{msg} (code {code})"

    def _check(self, code, what):
        """Raise for an NCCL error code; wait for a call a non-blocking communicator left
        in progress."""
        if code == _IN_PROGRESS:
            self._settle(what)
        elif code != _SUCCESS:
            raise DistBackendError(f"nccl {what} failed on rank {self.rank}: "
                                   f"{self._error_text(code)}")

    def _state(self):
        """NCCL's asynchronous state of the communicator (an error once it is aborted)."""
        state = ctypes.c_int(0)
        with self._lock:
            if not self._comm:
                return _INVALID_USAGE
            code = self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(state))
        return code if code != _SUCCESS else state.value

    def _settle(self, what, timeout=None):
        """Poll the communicator until its last call is no longer in progress."""
        self._poll(what, lambda: self._state() == _SUCCESS, timeout)

    def _abort(self, reason):
        """Abort the communicator (its kernels return); later calls raise with ``reason``."""
        with self._lock:
            if self._failed is not None:
                return
            self._failed = reason
            with self._plock:
                self._pending = []
            if self._comm:
                comm, self._comm = self._comm, ctypes.c_void_p()
                self._lib.ncclCommAbort(comm)

    def _live(self):
        if self._failed is not None:
            raise DistBackendError(f"nccl communicator of rank {self.rank} was aborted: "
                                   f"{self._failed}")

    def _await(self, event, what, timeout=None):
        """Wait for ``event`` (recorded after ``what``) within the timeout."""
        self._poll(what, event.query, timeout)

    def _poll(self, what, finished, timeout=None):
        """Poll until ``finished()``, watching the communicator: on NCCL's error, or past
        the timeout, abort it and raise DistBackendError."""
        self._live()
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        spins = 0
        while not finished():
            self._live()  # the watchdog may have aborted it meanwhile
            state = self._state()
            if state not in (_SUCCESS, _IN_PROGRESS):
                self._abort(f"{what}: {self._error_text(state)}")
                self._live()
            if time.monotonic() > deadline:
                self._abort(f"{what}: not finished within {limit:g} s")
                raise DistBackendError(f"nccl {what} on rank {self.rank}: Timed out after "
                                       f"{limit:g} s (a peer died or never arrived?); the "
                                       f"communicator was aborted")
            spins += 1
            _pause(spins)

    def _stream(self):
        """The device's current torch stream (the calling thread's) as (key, raw pointer,
        Stream): the Stream object is made once per stream, not per call (a Stream is its
        (stream_id, device_index, device_type), which the key is)."""
        key = self._stream_key(self._device) if self._stream_key is not None else None
        cur = self._cur
        if key is None or cur[0] != key:
            st = self._torch.cuda.current_stream(self._device)
            cur = (key, st.cuda_stream, st)
            if key is not None:
                self._cur = cur  # one tuple, replaced whole: other threads see old or new
        return cur

    @staticmethod
    def _on_device(*bufs):
        for buf in bufs:
            if buf is not None and buf.device < 0:
                raise ValueError("nccl backend needs CUDA tensors, got host memory")

    def _dtype(self, buf, op=None):
        self._on_device(buf)
        if buf.dtype not in _NCCL_DTYPE:
            raise ValueError(f"nccl has no type for {D.DTYPE_NAMES[buf.dtype]}")
        count = buf.count * 2 if buf.dtype in D.COMPLEX else buf.count
        if op is None:
            return _NCCL_DTYPE[buf.dtype], count
        if buf.dtype in D.COMPLEX and op != D.SUM:
            raise ValueError(f"nccl reduces complex tensors with SUM only, got {D.OP_NAMES[op]}")
        table = _BOOL_OP if buf.dtype == D.BOOL else _NCCL_OP
        if op not in table:
            raise ValueError(f"nccl has no {D.OP_NAMES[op]} reduction")
        return _NCCL_DTYPE[buf.dtype], count, table[op]

    def _record(self, what, stream=None, reusable=False):
        """An event after the work just enqueued on ``stream`` (a torch Stream; None: the
        current one), watched until it finishes. ``reusable``: no request will hold it, so
        once finished it is recorded again by a later call (creating a CUDA event costs
        more than recording one)."""
        spare = self._spare
        ev = spare.pop() if reusable and spare else self._torch.cuda.Event()
        ev.record(stream if stream is not None else self._stream()[2])
        with self._plock:
            self._pending.append((ev, time.monotonic() + self.timeout, what, reusable))
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="collectives-nccl-watchdog",
                                                  daemon=True)
                self._watchdog.start()
        return ev

    def _done(self, what, source=-1):
        return _StreamRequest(self, self._record(what), what, source)

    def _watch(self):
        """Abort the communicator when enqueued work outlives the timeout or NCCL reports
        an error, as torch's watchdog does; the ranks' next calls then raise."""
        while not self._closed and self._failed is None:
            time.sleep(0.05)
            with self._plock:
                # oldest first, up to the first unfinished one: work on one stream finishes
                # in order, so one query a call, not one per pending event per pass; an
                # event of another stream behind it waits its turn. The first unfinished
                # one has the earliest deadline.
                pending, i = self._pending, 0
                while i < len(pending) and pending[i][0].query():
                    i += 1
                done, self._pending = pending[:i], pending[i:]
                late = (self._pending[0] if self._pending
                        and time.monotonic() > self._pending[0][1] else None)
            spare = self._spare
            spare.extend(p[0] for p in done if p[3])
            del spare[:-_SPARE_EVENTS]
            if not self._comm or self._failed is not None:
                break
            state = self._state()
            if state not in (_SUCCESS, _IN_PROGRESS):
                reason = f"watchdog: {self._error_text(state)}"
            elif late is not None:
                reason = f"watchdog: {late[2]} not finished within {self.timeout:g} s"
            else:
                continue
            self._abort(reason)
            print(f"collectives: rank {self.rank}: nccl communicator aborted ({reason}); the "
                  f"output of unfinished collectives is undefined", file=sys.stderr, flush=True)

    # ---- collectives -------------------------------------------------------------
    def _enqueue(self, what, call):
        """``call(comm, stream)`` (NCCL calls on the communicator, ``stream`` its raw
        pointer) under the communicator's lock, which the watchdog's abort also takes: NCCL
        must never be handed a communicator another thread is tearing down. Then an event
        watches the work."""
        with self._lock:
            self._live()
            cur = self._stream()
            call(self._comm, cur[1])
        return self._record(what, cur[2])

    def _post(self, what, fn, *args):
        """``fn(*args, comm, stream)`` (an ``_entry``), one NCCL collective, as
        ``_enqueue`` makes it (the collectives' path: no closure per call); raises on its
        error code."""
        with self._lock:
            if self._failed is not None:
                self._live()
            cur = self._stream()
            code = fn(*args, self._comm.value, cur[1])
            if code:
                self._check(code, what)
        self._record(what, cur[2], True)

    def _reduction(self, buf, op):
        """(ncclDataType_t, count, ncclRedOp_t) of a reduction of ``buf`` by ``op``."""
        spec = _REDUCE[buf.dtype * 16 + op] if 0 <= op < 16 else None
        if spec is None or buf.device < 0:
            return self._dtype(buf, op)  # raises ValueError naming what NCCL lacks
        return spec[0], buf.count * spec[1], spec[2]

    def _device_ptr(self, buf):
        if buf.device < 0:
            self._on_device(buf)  # raises
        return buf.ptr

    def all_reduce(self, buf, op):
        dt, n, rop = self._reduction(buf, op)
        p = buf.ptr
        self._post("ncclAllReduce", self._nccl_all_reduce, p, p, n, dt, rop)

    def broadcast(self, buf, root):
        p = self._device_ptr(buf)
        self._post("ncclBroadcast", self._nccl_broadcast, p, p, buf.nbytes, _U8, root)

    def reduce(self, buf, op, root):
        dt, n, rop = self._reduction(buf, op)
        p = buf.ptr
        # non-root buffers stay unchanged: NCCL writes recvbuff on root only
        self._post("ncclReduce", self._nccl_reduce, p, p, n, dt, rop, root)

    def all_gather(self, out, inp):
        self._post("ncclAllGather", self._nccl_all_gather, self._device_ptr(inp),
                   self._device_ptr(out), inp.nbytes, _U8)

    def reduce_scatter(self, out, inp, op):
        dt, n, rop = self._reduction(out, op)
        self._post("ncclReduceScatter", self._nccl_reduce_scatter, self._device_ptr(inp),
                   out.ptr, n, dt, rop)

    def _grouped(self, sends, recvs, what):
        """sends/recvs: lists of (ptr, nbytes, peer); one ncclGroupStart/End around them."""
        u8 = _NCCL_DTYPE[D.UINT8]
        lib = self._lib

        def post(comm, stream):
            self._check(lib.ncclGroupStart(), "ncclGroupStart")
            try:
                for ptr, nbytes, peer in sends:
                    self._check(lib.ncclSend(ptr, nbytes, u8, peer, comm, stream), what)
                for ptr, nbytes, peer in recvs:
                    self._check(lib.ncclRecv(ptr, nbytes, u8, peer, comm, stream), what)
            finally:
                self._check(lib.ncclGroupEnd(), what)
        return self._enqueue(what, post)

    def gather(self, out, inp, root):
        self._on_device(out, inp)
        nb = inp.nbytes
        if self.rank == root:
            recvs = [(out.ptr + r * nb, nb, r) for r in range(self.size)]
            self._grouped([(inp.ptr, nb, root)], recvs, "gather")
        else:
            self._grouped([(inp.ptr, nb, root)], [], "gather")

    def scatter(self, out, inp, root):
        self._on_device(out, inp)
        nb = out.nbytes
        sends = [(inp.ptr + r * nb, nb, r) for r in range(self.size)] if self.rank == root else []
        self._grouped(sends, [(out.ptr, nb, root)], "scatter")

    def all_to_all(self, out, inp, out_counts, in_counts):
        self._on_device(out, inp)
        isz = inp.itemsize
        sends, recvs, so, ro = [], [], 0, 0
        for r in range(self.size):
            sends.append((inp.ptr + so * isz, in_counts[r] * isz, r))
            recvs.append((out.ptr + ro * isz, out_counts[r] * isz, r))
            so += in_counts[r]
            ro += out_counts[r]
        self._grouped(sends, recvs, "all_to_all")

    def barrier(self):
        one = self._one
        if one is None:  # one scratch element per group; MAX keeps it 1 (its value is unused)
            one = self._one = self._torch.ones(1, device=self._device)
        p = one.data_ptr()
        ev = self._enqueue("barrier", lambda comm, stream: self._check(
            self._lib.ncclAllReduce(p, p, 1, _NCCL_DTYPE[D.FLOAT32], _NCCL_OP[D.MAX], comm,
                                    stream), "barrier"))
        self._await(ev, "barrier")

    # ---- point to point ------------------------------------------------------------
    def batch_p2p(self, ops):
        """``batch_isend_irecv``'s ops [(is_send, buf, peer, tag)] in one NCCL group, as torch
        does (separate sends and receives on one stream can wait on each other forever)."""
        for _, buf, peer, _ in ops:
            self._on_device(buf)
            if peer is None:
                raise ValueError("nccl cannot receive from any source; pass src")
        ev = self._grouped([(b.ptr, b.nbytes, q) for s, b, q, _ in ops if s],
                           [(b.ptr, b.nbytes, q) for s, b, q, _ in ops if not s], "batch_isend_irecv")
        return [_StreamRequest(self, ev, "batch_isend_irecv", -1 if s else q) for s, _, q, _ in ops]

    def isend(self, buf, dst, tag=0):
        self._on_device(buf)
        ev = self._grouped([(buf.ptr, buf.nbytes, dst)], [], "send")
        return _StreamRequest(self, ev, "send")

    def irecv(self, buf, src, tag=0):
        if src is None:
            raise ValueError("nccl cannot receive from any source; pass src")
        self._on_device(buf)
        ev = self._grouped([], [(buf.ptr, buf.nbytes, src)], "recv")
        return _StreamRequest(self, ev, "recv", src)

    def submit(self, fn, *args):
        # NCCL ops are already asynchronous on the stream: enqueue now, finish on wait
        fn(*args)
        return self._done(getattr(fn, "__name__", "operation"))

    def shutdown(self):
        self._closed = True
        dog = self._watchdog
        if dog is not None and dog is not threading.current_thread():
            dog.join()  # it looks at the closed flag every 50 ms
        with self._lock:
            if self._comm:
                comm, self._comm = self._comm, ctypes.c_void_p()
                self._lib.ncclCommDestroy(comm)
        super().shutdown()


def create_nccl_backend(store, rank, size, timeout, options=None):
    """The factory registered as 'nccl'; a clear error where NCCL cannot run."""
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the nccl backend needs torch with CUDA: pip install 'collectives[torch]' "
                           "with a CUDA build of torch")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device; torch.cuda.is_available() is False "
                           "(use backend='gloo' for CPU tensors)")
    try:
        _load()
    except RuntimeError as e:
        raise RuntimeError(f"the nccl backend needs libnccl: {e}; install torch's CUDA build "
                           "(it brings nvidia-nccl) or set COLLECTIVES_NCCL_LIB") from None
    return NcclBackend(store, rank, size, timeout, options)


__all__ = ["NcclBackend", "create_nccl_backend", "is_available"]
