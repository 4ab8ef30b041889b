"""The 'mpi' backend: every operation is the native MPI call, through mpi4py.

Launch with ``mpiexec -n 4 python prog.py`` and ``init_process_group('mpi')``: the
rank and world size come from MPI, no MASTER_ADDR or store is needed. Buffers go
to MPI as ``[buffer, datatype]`` (no copy): the compiled Buffer exports its memory
through the buffer protocol; the pure-Python one goes as
``MPI.buffer.fromaddress(ptr, nbytes)``.

* Reductions use MPI's predefined ops; bool maps SUM/MAX/BOR to LOR, PRODUCT/MIN/BAND
  to LAND and BXOR to LXOR (torch's gloo treats bool SUM as OR). float16 and
  bfloat16 have no portable MPI datatype: they travel as 16-bit words and reduce
  through a user-defined MPI op that calls our kernels (``collectives.engines._core``, or
  ``collectives.core.kernels_numpy``), so results match the other backends bit for bit.
* ``async_op`` collectives, ``isend`` and ``irecv`` are MPI's non-blocking calls
  (Iallreduce, Ibcast, ..., Isend, Irecv) behind :class:`MpiRequest`.
* ``new_group`` splits the communicator collectively (``Comm.Split``).
* Blocking collectives are MPI's blocking calls. MPI cannot time one out, and this
  MPICH cannot revoke a communicator (MPIX_Comm_revoke is not implemented), so a rank
  stuck in one cannot be made to raise: the watchdog (:mod:`.mpi_watchdog`) instead ends
  the job with MPI_Abort once such a call has run past its group's timeout, naming the
  call and printing where it was made (as torch's NCCL watchdog tears a stuck job down). Waits
  on requests (async ops, isend/irecv) raise DistBackendError at the timeout.
* Call fingerprints (always on): every 64th blocking call, and every barrier, compares a
  hash of the ranks' calls since the last comparison; where they differ every rank raises
  DistBackendError naming the first pair of calls that differed (see
  :mod:`.mpi_fingerprint`). A barrier is that comparison: its all_reduce synchronises the
  ranks as MPI_Barrier does, at MPI_Barrier's cost.
* The hot blocking calls (all_reduce, broadcast, barrier, the common all_gather) are made
  by the C call log (``collectives.engines._mpilog``) through MPI's entry points by address
  (:func:`.library.entry_points`), skipping mpi4py's per-call work; everything else, and those
  where the entry points cannot be found, goes through mpi4py.
"""
import importlib.util

from ...core import dtypes as D
from ...core import fingerprint as F
from ...core.tensors import disjoint_gather as _disjoint_gather
from ...core.errors import DistBackendError
from ...core.tensors import Buffer as _Buffer
from ...core.tensors import _PyBuffer
from . import request as _request
from ..base import Backend
from .fingerprint import CallLog as _CallLog
from .fingerprint import FingerprintCheck as _FingerprintCheck
from .request import MpiRequest
from .communicator import communicator as _communicator
from .library import displs as _displs
from .library import entry_points as _entry_points
from .library import handle as _handle
from .library import overlap as _overlap
from .library import reduce_kernel as _reduce_kernel
from .watchdog import watchdog as _watchdog

INSTALL_HINT = 'pip install "collectives[mpi]"'

_MPI = None          # the mpi4py.MPI module once loaded
_DATATYPE = None     # dtype code (index) -> MPI.Datatype
_OPS = None          # dtype code * 16 + op code -> MPI.Op (None: not made yet)
_IN_PLACE = None
_TAG_UB = 32767     # MPI_TAG_UB (the standard's floor until MPI is loaded)
_fromaddress = None
_ENTRY = None        # (MPI_Allreduce, MPI_Bcast, MPI_Allgather) addresses + handle size, or None
_EXPORTS = _Buffer is not _PyBuffer  # a Buffer is itself a buffer-protocol object
# the call log in C (collectives.engines._mpilog) makes all_reduce, broadcast and barrier's MPI call
# itself; it takes the compiled Buffer
_C_LOG = _EXPORTS and _CallLog is not None


def is_available():
    """Whether mpi4py is installed; never initialises MPI."""
    return importlib.util.find_spec("mpi4py") is not None


def _load_mpi():
    """Import mpi4py.MPI (initialising MPI) and build the lookup tables, once."""
    global _MPI, _DATATYPE, _OPS, _IN_PLACE, _fromaddress, _TAG_UB, _ENTRY
    if _MPI is not None:
        return _MPI
    if not is_available():
        raise DistBackendError(
            f"the 'mpi' backend needs mpi4py and an MPI library; install them with {INSTALL_HINT}")
    try:
        import mpi4py
        # ops may run on the progress thread while the main thread does p2p
        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:
        raise DistBackendError(
            f"the 'mpi' backend could not load mpi4py/MPI ({e}); install them with {INSTALL_HINT}") from None
    by_code = {
        D.FLOAT16: MPI.UINT16_T, D.BFLOAT16: MPI.UINT16_T, D.FLOAT32: MPI.FLOAT,
        D.FLOAT64: MPI.DOUBLE, D.COMPLEX64: MPI.C_FLOAT_COMPLEX, D.COMPLEX128: MPI.C_DOUBLE_COMPLEX,
        D.INT8: MPI.INT8_T, D.UINT8: MPI.UINT8_T, D.INT16: MPI.INT16_T, D.INT32: MPI.INT32_T,
        D.INT64: MPI.INT64_T, D.BOOL: MPI.C_BOOL,
    }
    _DATATYPE = [by_code.get(code) for code in range(max(by_code) + 1)]  # a list: cheapest lookup
    native = {D.SUM: MPI.SUM, D.PRODUCT: MPI.PROD, D.MIN: MPI.MIN, D.MAX: MPI.MAX,
              D.BAND: MPI.BAND, D.BOR: MPI.BOR, D.BXOR: MPI.BXOR}
    logical = {D.SUM: MPI.LOR, D.PRODUCT: MPI.LAND, D.MIN: MPI.LAND, D.MAX: MPI.LOR,
               D.BAND: MPI.LAND, D.BOR: MPI.LOR, D.BXOR: MPI.LXOR}
    ops = [None] * (16 * 16)
    for dtype in D.DTYPE_NAMES:
        for op in native:
            if not D.op_valid(dtype, op) or dtype in (D.FLOAT16, D.BFLOAT16):
                continue
            ops[dtype * 16 + op] = logical[op] if dtype == D.BOOL else native[op]
    _OPS = ops
    _IN_PLACE = MPI.IN_PLACE
    _fromaddress = MPI.buffer.fromaddress
    _TAG_UB = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or _TAG_UB
    _request.bind(MPI)
    _ENTRY = _entry_points(MPI) if _C_LOG else None
    _MPI = MPI
    return MPI


def _half_op(dtype, op):
    """The user-defined MPI op reducing float16/bfloat16 words with our kernels."""
    key = dtype * 16 + op
    mpi_op = _OPS[key]
    if mpi_op is not None:
        return mpi_op
    if dtype not in (D.FLOAT16, D.BFLOAT16) or not D.op_valid(dtype, op):
        raise ValueError(f"op {D.OP_NAMES.get(op, op)} is not supported for dtype "
                         f"{D.DTYPE_NAMES.get(dtype, dtype)} by the mpi backend")
    kernel = _reduce_kernel()

    def reduce_half(inbuf, inoutbuf, datatype):
        # MPI: inout = in (op) inout; our ops are commutative, so dst=inout, src=in
        kernel(inoutbuf.address, inbuf.address, len(inoutbuf) // 2, dtype, op)

    mpi_op = _MPI.Op.Create(reduce_half, commute=True)
    _OPS[key] = mpi_op
    return mpi_op


def _mpi_op(dtype, op):
    return _OPS[dtype * 16 + op] or _half_op(dtype, op)


def _spec(buf):
    """The mpi4py buffer spec over a Buffer's memory (zero-copy)."""
    return (buf if _EXPORTS else _fromaddress(buf.ptr, buf.count * buf.itemsize), _DATATYPE[buf.dtype])


def _private_copy(buf):
    """(spec, keepalive) over a copy of ``buf``: MPI forbids aliased send and receive buffers."""
    arr = buf.numpy().copy()
    return [arr, _DATATYPE[buf.dtype]], arr


def _check_tag(tag):
    if tag > _TAG_UB:
        raise ValueError(f"tag must be <= {_TAG_UB} (this MPI's MPI_TAG_UB), got {tag}")


def world_rank_size():
    """(rank, size) of this process in MPI_COMM_WORLD; initialises MPI."""
    world = _load_mpi().COMM_WORLD
    return world.Get_rank(), world.Get_size()


_BARRIER_ENTRY = (F.BARRIER, F.NO_DTYPE, 0, -1, -1)


class _AsyncCall:
    """``fn`` run on the progress thread with the backend in async mode."""

    def __init__(self, backend, fn):
        self.backend = backend
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "operation")

    def __call__(self, *args):
        be = self.backend
        be._async_mode = True
        try:
            self.fn(*args)
        finally:
            be._async_mode = False


class _PyHotCalls:
    """The four hot blocking calls of :class:`MpiBackend` in Python, its per-instance calls
    where the call log is not the C one (``collectives.engines._mpilog``, whose own methods are
    used otherwise). A class of their own, so that ``MpiBackend``'s slots of those names
    (a specialised attribute load per call) do not clash with methods of its own."""

    # Each appends its fingerprint to the call log (which compares the ranks' logs when
    # full, see the module docstring) and makes MPI's call. Where the log is C
    # (collectives.engines._mpilog) the log's methods, which make MPI's call themselves, are the
    # instance's instead (a Python frame here was ~900 instructions against a 4-byte
    # MPI_Allreduce's ~2,000). The watchdog knows a blocking call by its frame here, or by
    # the C log's ``busy``.
    def all_reduce(self, buf, op):
        if self._async_mode:  # async calls are not checked: natively posted ones cannot be
            return self._iall_reduce(buf, op).wait()
        dt = buf.dtype
        self._fp_log.append((F.ALL_REDUCE, dt, buf.count, -1, op))
        self._allreduce(_IN_PLACE, _spec(buf), _OPS[dt * 16 + op] or _half_op(dt, op))

    def broadcast(self, buf, root):
        if self._async_mode:
            return self._ibroadcast(buf, root).wait()
        self._fp_log.append((F.BROADCAST, buf.dtype, buf.count, root, -1))
        self._bcast(_spec(buf), root)

    def all_gather(self, out, inp):
        self._checked((F.ALL_GATHER, inp.dtype, inp.count, -1, -1), self._all_gather, out, inp)

    def barrier(self):
        # the ranks compare their logs now, and that comparison (an all_reduce on the check's
        # communicator: no rank leaves before every rank has entered) is the barrier
        if self._async_mode:
            return self._ibarrier().wait()
        self._fp_log.append_and_compare(_BARRIER_ENTRY)


class MpiBackend(_PyHotCalls, Backend):
    """A group's backend over one MPI communicator (owned: freed at shutdown).

    Args:
        comm: the communicator; the group's rank and size are its own.
        timeout: seconds a wait on a request may take, and a blocking collective may run
            before the watchdog ends the job.
        options: unused (kept for the factory signature).
    """

    # the hot calls, set per instance (the C log's methods, or _PyHotCalls'): a slot is a
    # specialised attribute load at every call (an instance attribute shadowing a method is not)
    __slots__ = ("all_reduce", "broadcast", "barrier", "all_gather")
    name = "mpi"
    own_block_in_place = True
    # the blocking collectives: each waits in one MPI call, which the watchdog bounds
    BLOCKING = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                "reduce_scatter", "all_to_all", "barrier")

    @property
    def max_tag(self):
        return _TAG_UB  # MPI_TAG_UB (2**29 - 1 with MPICH), known once MPI is loaded

    def __init__(self, comm, timeout, options=None):
        super().__init__(None, comm.Get_rank(), comm.Get_size(), timeout, options)
        self.comm = comm
        self._fp = _FingerprintCheck(comm, f"mpi group (size {self.size})", _MPI, _C_LOG)
        self._fp_log = self._fp.log  # this group's calls since the last comparison
        if _C_LOG:
            log = self._fp_log
            log.bind(comm.Allreduce, comm.Bcast, comm.Allgather, _IN_PLACE, _DATATYPE, _OPS,
                     _half_op)
            log.bind_backend(self.size, self._async_all_reduce, self._async_broadcast,
                             self._async_barrier, self._async_all_gather, self._all_gather)
            if _ENTRY is not None:  # MPI's calls by address: mpi4py's per-call work skipped
                *fns, size = _ENTRY
                self._fp_log.bind_direct(*fns, size, comm.handle, int(_IN_PLACE),
                                         [_handle(t) for t in _DATATYPE],
                                         [_handle(o) for o in _OPS], _MPI.Exception)
                self._fp.bind_direct(_handle)
        # the hot calls: the C log's own methods (no Python frame per call; the watchdog
        # reads the log's ``busy`` instead), else _PyHotCalls'
        if _C_LOG:
            log = self._fp_log
            self.all_reduce = log.all_reduce
            self.broadcast = log.broadcast
            self.barrier = log.barrier
            self.all_gather = log.all_gather
        else:
            self.all_reduce = _PyHotCalls.all_reduce.__get__(self)
            self.broadcast = _PyHotCalls.broadcast.__get__(self)
            self.barrier = _PyHotCalls.barrier.__get__(self)
            self.all_gather = _PyHotCalls.all_gather.__get__(self)
        _watchdog.watch(self)
        self._allreduce = comm.Allreduce
        self._bcast = comm.Bcast
        self._allgather = comm.Allgather

    # True while the progress thread runs a submitted (async) call: its collectives then
    # use MPI's non-blocking forms, as natively posted async ones do. MPI never matches a
    # blocking collective with a non-blocking one, and whether a front-end call is posted
    # natively or queued (it may stage lists first) can differ by rank; async_op, which
    # every rank agrees on, decides the form. Kept in the call log, whose hot calls read it.
    @property
    def _async_mode(self):
        return self._fp_log.async_mode

    @_async_mode.setter
    def _async_mode(self, value):
        self._fp_log.async_mode = value

    def _async_all_reduce(self, buf, op):
        return self._iall_reduce(buf, op).wait()

    def _async_broadcast(self, buf, root):
        return self._ibroadcast(buf, root).wait()

    def _async_barrier(self):
        return self._ibarrier().wait()

    def _async_all_gather(self, out, inp):
        return self._iall_gather(out, inp).wait()

    def _checked(self, entry, fn, *args):
        if self._async_mode:  # as in all_reduce: async calls are not checked
            return fn(*args)
        self._fp_log.append(entry)
        fn(*args)

    def reduce(self, buf, op, root):
        self._checked((F.REDUCE, buf.dtype, buf.count, root, op), self._reduce, buf, op, root)

    def _reduce(self, buf, op, root):
        if self._async_mode:
            return self._ireduce(buf, op, root).wait()
        # root reduces in place; the others' buf is MPI's send buffer, which MPI never writes
        dt = buf.dtype
        spec = [buf if _EXPORTS else _fromaddress(buf.ptr, buf.count * buf.itemsize), _DATATYPE[dt]]
        mpi_op = _OPS[dt * 16 + op] or _half_op(dt, op)
        if self.rank == root:
            self.comm.Reduce(_IN_PLACE, spec, mpi_op, root)
        else:
            self.comm.Reduce(spec, None, mpi_op, root)

    def _all_gather(self, out, inp):
        if self._async_mode:
            return self._iall_gather(out, inp).wait()
        dt = _DATATYPE[inp.dtype]
        if _disjoint_gather(out, inp, self.size):  # the common case, checked in C
            self._allgather([inp if _EXPORTS else _fromaddress(inp.ptr, inp.count * inp.itemsize), dt],
                            [out if _EXPORTS else _fromaddress(out.ptr, out.count * out.itemsize), dt])
            return
        n = inp.count * inp.itemsize
        iptr, optr, total = inp.ptr, out.ptr, out.count * out.itemsize
        keep = None
        if iptr + n <= optr or iptr >= optr + total or not n:
            send = [inp if _EXPORTS else _fromaddress(iptr, n), dt]
        elif iptr == optr + self.rank * n:  # this rank's slot of out: MPI's in-place form
            send = _IN_PLACE
        else:
            send, keep = _private_copy(inp)
        self._allgather(send, [out if _EXPORTS else _fromaddress(optr, total), dt])
        del keep

    def gather(self, out, inp, root):
        self._checked((F.GATHER, inp.dtype, inp.count, root, -1), self._gather, out, inp, root)

    def _gather(self, out, inp, root):
        if self._async_mode:
            return self._igather(out, inp, root).wait()
        send, recv, _keep = self._gather_specs(out, inp, root)
        self.comm.Gather(send, recv, root)

    def scatter(self, out, inp, root):
        if self._async_mode:
            return self._iscatter(out, inp, root).wait()
        self._fp_log.append((F.SCATTER, out.dtype, out.count, root, -1))
        send, recv, _keep = self._scatter_specs(out, inp, root)
        self.comm.Scatter(send, recv, root)

    def reduce_scatter(self, out, inp, op):
        self._checked((F.REDUCE_SCATTER, out.dtype, out.count, -1, op), self._reduce_scatter,
                      out, inp, op)

    def _reduce_scatter(self, out, inp, op):
        if self._async_mode:
            return self._ireduce_scatter(out, inp, op).wait()
        send, _keep = self._send_spec(out, inp)
        self.comm.Reduce_scatter_block(send, _spec(out), _mpi_op(out.dtype, op))

    def all_to_all(self, out, inp, out_counts, in_counts):
        self._checked((F.ALL_TO_ALL, inp.dtype, 0, -1, -1), self._all_to_all, out, inp, out_counts,
                      in_counts)

    def _all_to_all(self, out, inp, out_counts, in_counts):
        if self._async_mode:
            return self._iall_to_all(out, inp, out_counts, in_counts).wait()
        send, recv, _keep = self._alltoall_specs(out, inp, out_counts, in_counts)
        self.comm.Alltoallv(send, recv)

    # ---- point to point ----------------------------------------------------------
    def isend(self, buf, dst, tag=0):
        _check_tag(tag)
        req = self.comm.Isend(_spec(buf), dst, tag)
        return MpiRequest(req, buf, f"mpi isend to rank {dst} (tag {tag})", self.timeout)

    def irecv(self, buf, src, tag=0):
        _check_tag(tag)
        source = _MPI.ANY_SOURCE if src is None else src
        req = self.comm.Irecv(_spec(buf), source, tag)
        peer = "any rank" if src is None else f"rank {src}"
        return MpiRequest(req, buf, f"mpi irecv from {peer} (tag {tag})", self.timeout,
                          want_source=True)

    # ---- async: MPI's non-blocking collectives -------------------------------------
    def submit(self, fn, *args):
        """Run ``fn(*args)`` as an async operation, after every earlier submission.

        One of this backend's collectives is posted at once as MPI's non-blocking form
        when nothing is queued; anything else (or anything while the queue is busy)
        runs on the progress thread, its collectives again in non-blocking form."""
        if not self.pending.n:
            owner = getattr(fn, "__self__", None)
            # one of this backend's collectives (a hot call may be the C log's method)
            if owner is self or owner is self._fp_log:
                start = _NATIVE.get(fn.__name__)
                if start is not None:
                    return start(self, *args)
        return super().submit(_AsyncCall(self, fn), *args)

    def _request(self, req, keep, what):
        return MpiRequest(req, keep, f"mpi {what}", self.timeout)

    def _iall_reduce(self, buf, op):
        return self._request(self.comm.Iallreduce(_IN_PLACE, _spec(buf), _mpi_op(buf.dtype, op)),
                             buf, "all_reduce")

    def _ibroadcast(self, buf, root):
        return self._request(self.comm.Ibcast(_spec(buf), root), buf, "broadcast")

    def _ireduce(self, buf, op, root):
        if self.rank == root:
            req = self.comm.Ireduce(_IN_PLACE, _spec(buf), _mpi_op(buf.dtype, op), root)
        else:
            req = self.comm.Ireduce(_spec(buf), None, _mpi_op(buf.dtype, op), root)
        return self._request(req, buf, "reduce")

    def _iall_gather(self, out, inp):
        send, keep = self._gather_send(out, inp)
        return self._request(self.comm.Iallgather(send, _spec(out)), (out, inp, keep), "all_gather")

    def _igather(self, out, inp, root):
        send, recv, keep = self._gather_specs(out, inp, root)
        return self._request(self.comm.Igather(send, recv, root), (out, inp, keep), "gather")

    def _iscatter(self, out, inp, root):
        send, recv, keep = self._scatter_specs(out, inp, root)
        return self._request(self.comm.Iscatter(send, recv, root), (out, inp, keep), "scatter")

    def _ireduce_scatter(self, out, inp, op):
        send, keep = self._send_spec(out, inp)
        req = self.comm.Ireduce_scatter_block(send, _spec(out), _mpi_op(out.dtype, op))
        return self._request(req, (out, inp, keep), "reduce_scatter")

    def _iall_to_all(self, out, inp, out_counts, in_counts):
        send, recv, keep = self._alltoall_specs(out, inp, out_counts, in_counts)
        req = self.comm.Ialltoallv(send, recv)
        return self._request(req, (out, inp, keep), "all_to_all")

    def _ibarrier(self):
        return self._request(self.comm.Ibarrier(), None, "barrier")

    # ---- buffer specs for ops with separate input and output -------------------------
    def _gather_send(self, out, inp):
        """Send spec for (all_)gather: IN_PLACE when inp is this rank's slot of out."""
        if inp.count and inp.ptr == out.ptr + self.rank * inp.count * inp.itemsize:
            return _IN_PLACE, None
        return self._send_spec(out, inp)

    def _gather_specs(self, out, inp, root):
        """(send, recv, keepalive) of (I)gather: root receives into out, the others send only."""
        if self.rank == root:
            send, keep = self._gather_send(out, inp)
            return send, _spec(out), keep
        return _spec(inp), None, None

    def _scatter_specs(self, out, inp, root):
        """(send, recv, keepalive) of (I)scatter: root sends inp, every rank receives into out."""
        if self.rank == root:
            send, keep = self._send_spec(out, inp)
            return send, _spec(out), keep
        return None, _spec(out), None

    @staticmethod
    def _send_spec(out, inp):
        if _overlap(out, inp):
            return _private_copy(inp)
        return _spec(inp), None

    def _alltoall_specs(self, out, inp, out_counts, in_counts):
        """Alltoallv specs, always: a rank sees only its own counts, so one whose counts
        happen to be even cannot know whether the others' are, and MPI never matches
        MPI_Alltoall with MPI_Alltoallv."""
        send, keep = self._send_spec(out, inp)
        in_counts, out_counts = list(in_counts), list(out_counts)
        send = [send[0], (in_counts, _displs(in_counts)), _DATATYPE[inp.dtype]]
        out_mem = _spec(out)[0]
        recv = [out_mem, (out_counts, _displs(out_counts)), _DATATYPE[out.dtype]]
        return send, recv, keep

    # ---- groups --------------------------------------------------------------------
    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        _watchdog.watch(self)  # it samples often enough for the new timeout

    def split(self, ranks, timeout, options=None):
        """The subgroup of ``ranks`` (this group's ranks, sorted) by ``MPI_Comm_split``,
        called on every rank of this group; None on non-members."""
        result = []

        def do_split():
            member = self.rank in ranks
            color = 0 if member else _MPI.UNDEFINED
            key = list(ranks).index(self.rank) if member else 0
            comm = self.comm.Split(color, key)
            result.append(MpiBackend(comm, timeout, options) if member else None)

        # after anything queued on the progress thread, as every collective
        self.run(do_split)
        return result[0]

    def split_local(self, ranks, timeout, options=None, tag=0):
        """The subgroup of ``ranks`` (this group's ranks, sorted) by
        ``MPI_Comm_create_group``, called by the members only (``tag`` tells apart
        creations that may overlap)."""
        result = []

        def do_create():
            grp = self.comm.Get_group().Incl(list(ranks))
            try:
                comm = self.comm.Create_group(grp, tag)
            finally:
                grp.Free()
            result.append(MpiBackend(comm, timeout, options))

        self.run(do_create)
        return result[0]

    def shutdown(self):
        super().shutdown()
        comm, self.comm = self.comm, None
        if comm is not None and _MPI is not None and not _MPI.Is_finalized():
            if _C_LOG:  # its handle of the communicator is about to be freed
                self._fp_log.unbind_direct()
            self._fp.free()
            try:
                comm.Free()
            except _MPI.Exception:
                pass


# a collective's name -> its non-blocking form (MpiBackend.submit)
_NATIVE = {
    "all_reduce": MpiBackend._iall_reduce,
    "broadcast": MpiBackend._ibroadcast,
    "reduce": MpiBackend._ireduce,
    "all_gather": MpiBackend._iall_gather,
    "gather": MpiBackend._igather,
    "scatter": MpiBackend._iscatter,
    "reduce_scatter": MpiBackend._ireduce_scatter,
    "all_to_all": MpiBackend._iall_to_all,
    "barrier": MpiBackend._ibarrier,
}


def create_mpi_backend(store, rank, size, timeout, options=None):
    """The backend for ``init_process_group('mpi')``; ``store`` may be None under mpiexec."""
    return MpiBackend(_communicator(store, rank, size, _load_mpi), timeout, options)


create_mpi_backend.world_rank_size = world_rank_size
