# cython: language_level=3
"""The TCP transport engine (collectives/engines/tcp/tcp_engine.c) for the 'gloo' backend.

Thin wrappers: arguments are prepared with the GIL held, then each call runs in
one ``with nogil:`` block; a failure comes back as DistBackendError. Every collective
takes ``fp``, this rank's fingerprint of the call (:func:`collectives.core.fingerprint.pack`);
a peer whose fingerprint differs fails the call on every rank with
:func:`collectives.core.fingerprint.mismatch_message`.
"""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

from ..core.errors import DistBackendError
from ..core.engine_errors import expand as _expand
from ..core.fingerprint import mismatch_message

include "_tcp_decl.pxi"
include "_kernels_import.pxi"

DEF ERRLEN = 1024

TUNE_SPIN_US = TCP_TUNE_SPIN_US
TUNE_ALLREDUCE_RD_MAX = TCP_TUNE_ALLREDUCE_RD_MAX
TUNE_BCAST_TREE_MAX = TCP_TUNE_BCAST_TREE_MAX
TUNE_SEGMENT = TCP_TUNE_SEGMENT
TUNE_GATHER_DIRECT_MAX = TCP_TUNE_GATHER_DIRECT_MAX
TUNE_ALLREDUCE_DIRECT_WORLD = TCP_TUNE_ALLREDUCE_DIRECT_WORLD
TUNE_DUPLEX_CHUNK = TCP_TUNE_DUPLEX_CHUNK
TUNE_LOWAT = TCP_TUNE_LOWAT
TUNE_FP_DIRECT_WORLD = TCP_TUNE_FP_DIRECT_WORLD
TUNE_SEG_SPLIT = TCP_TUNE_SEG_SPLIT
TUNE_ALLREDUCE_HD_MAX = TCP_TUNE_ALLREDUCE_HD_MAX
WIRE_VERSION = TCP_WIRE_VERSION
NO_DTYPE = TCP_NO_DTYPE
HEADER_BYTES = 48
HEADER_FIELDS = ("magic", "version", "ftype", "kind", "dtype", "flags", "group", "tag", "seq",
                 "fp", "aux", "len")

cdef enum:  # the collectives of _collective
    _BARRIER, _BROADCAST, _ALLREDUCE, _REDUCE, _ALLGATHER, _GATHER, _SCATTER, _REDUCE_SCATTER, _ALLTOALL


cdef int *_int_array(values, int n, int hole) except NULL:
    """A malloc'd copy of the ``n`` ints ``values`` (entry ``hole`` set to -1; -1: none), for
    the caller to free."""
    cdef int *a = <int *>malloc(sizeof(int) * n)
    if a == NULL:
        raise MemoryError()
    for i in range(n):
        a[i] = -1 if i == hole else int(values[i])
    return a


cdef str _text(char *err, eng):
    """The engine's error text for users (collectives.core.engine_errors: dtype codes named, a
    fingerprint mismatch spelled out from the engine's record)."""
    return _expand(err.decode("utf-8", "replace"),
                   mismatch=eng.mismatch_message if eng is not None else None)


cdef int _check(int rc, char *err, eng) except -1:
    if rc != 0:
        raise DistBackendError(_text(err, eng))
    return 0


def wire_header(int ftype, int kind, int dtype, uint32_t group, int32_t tag, uint64_t seq,
                uint64_t fp, uint64_t aux, uint64_t length):
    """The 48 bytes the engine sends as a frame header (little-endian, this wire version)."""
    cdef unsigned char out[48]
    tcp_wire_header(out, ftype, kind, dtype, group, tag, seq, fp, aux, length)
    return bytes(out[:48])


def parse_wire_header(const unsigned char[:] data):
    """The fields (:data:`HEADER_FIELDS`, in order) of a 48-byte frame header as the engine
    reads it."""
    cdef uint64_t f[12]
    if data.shape[0] != 48:
        raise ValueError(f"a frame header has 48 bytes, got {data.shape[0]}")
    tcp_wire_header_parse(&data[0], f)
    out = [f[i] for i in range(12)]
    out[7] = <int32_t>(<int64_t>f[7])  # tag is signed
    return tuple(out)


cdef inline int _collective(eng, tcp_engine *e, int kind, uintptr_t out, uintptr_t inp, size_t n,
                            int dtype, int op, int root, uint64_t fp, const size_t *ob,
                            const size_t *ib) except -1:
    """The one nogil call of every collective of ``eng`` (its engine ``e``): ``kind`` picks the
    engine's entry (inlined into each wrapper, where it is a constant), ``n`` is its count or
    byte size, ``out``/``inp`` its buffers (one buffer: ``out``)."""
    cdef char err[ERRLEN]
    cdef int rc
    with nogil:
        if kind == _BARRIER:
            rc = tcp_barrier(e, fp, err, ERRLEN)
        elif kind == _BROADCAST:
            rc = tcp_broadcast(e, <void *>out, n, root, fp, err, ERRLEN)
        elif kind == _ALLREDUCE:
            rc = tcp_allreduce(e, <void *>out, n, dtype, op, fp, err, ERRLEN)
        elif kind == _REDUCE:
            rc = tcp_reduce(e, <void *>out, n, dtype, op, root, fp, err, ERRLEN)
        elif kind == _ALLGATHER:
            rc = tcp_allgather(e, <void *>out, <const void *>inp, n, fp, err, ERRLEN)
        elif kind == _GATHER:
            rc = tcp_gather(e, <void *>out, <const void *>inp, n, root, fp, err, ERRLEN)
        elif kind == _SCATTER:
            rc = tcp_scatter(e, <void *>out, <const void *>inp, n, root, fp, err, ERRLEN)
        elif kind == _REDUCE_SCATTER:
            rc = tcp_reduce_scatter(e, <void *>out, <const void *>inp, n, dtype, op, fp,
                                    err, ERRLEN)
        else:
            rc = tcp_alltoall(e, <void *>out, <const void *>inp, ob, ib, fp, err, ERRLEN)
    return _check(rc, err, eng)


cdef class Engine:
    """The connections of one group and the collectives over them.

    Args:
        rank: this process's rank in the group.
        size: the group's size.
        fds: connected non-blocking socket fds, one per rank (ignored at ``rank``); owned from now on.
        group: a 32-bit id every rank of the group agrees on (checked in every frame).
        timeout: seconds any operation may wait.
    """
    cdef tcp_engine *e
    cdef readonly int rank
    cdef readonly int size
    cdef object names

    def __cinit__(self, int rank, int size, fds, uint32_t group, double timeout):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if len(fds) != size:
            raise ValueError(f"fds must have {size} entries, got {len(fds)}")
        cdef int *cfds = _int_array(fds, size, rank)
        self.e = tcp_engine_new(rank, size, cfds, group, timeout)
        free(cfds)
        if self.e == NULL:
            raise MemoryError("could not allocate the tcp engine")
        self.rank = rank
        self.size = size

    def __dealloc__(self):
        if self.e != NULL:
            with nogil:
                tcp_engine_free(self.e)
            self.e = NULL

    cdef tcp_engine *_eng(self) except NULL:
        if self.e == NULL:
            raise DistBackendError("the tcp backend is shut down")
        return self.e

    def close(self):
        """Flush queued sends, tell the peers, close the sockets. Idempotent."""
        cdef tcp_engine *e = self.e
        if e != NULL:
            with nogil:
                tcp_engine_close(e)

    def set_tuning(self, int key, int64_t value):
        tcp_set_tuning(self._eng(), key, value)

    def get_tuning(self, int key):
        return tcp_get_tuning(self._eng(), key)

    def set_timeout(self, double timeout):
        tcp_set_timeout(self._eng(), timeout)

    def set_rank_names(self, names):
        """Call rank r ``names[r]`` in messages (None: r), for an engine whose group sits
        inside another one (the host leaders of a hierarchical group)."""
        cdef tcp_engine *e = self._eng()
        cdef int *cnames = NULL
        if names is not None:
            if len(names) != self.size:
                raise ValueError(f"names must have {self.size} entries, got {len(names)}")
            cnames = _int_array(names, self.size, -1)
        rc = tcp_set_rank_names(e, cnames)
        free(cnames)
        if rc != 0:
            raise MemoryError()
        self.names = list(names) if names is not None else None

    def mismatch(self):
        """(seq, a, fp_a, b, fp_b) of the first fingerprint mismatch this engine saw or was
        told of (rank a called fp_a where rank b called fp_b), or None."""
        cdef uint64_t seq = 0, fa = 0, fb = 0
        cdef int a = 0, b = 0
        if self.e == NULL or not tcp_mismatch(self.e, &seq, &a, &fa, &b, &fb):
            return None
        return seq, a, fa, b, fb

    def mismatch_message(self):
        """:func:`collectives.core.fingerprint.mismatch_message` of :meth:`mismatch` (None if none)."""
        mm = self.mismatch()
        if mm is None:
            return None
        seq, a, fa, b, fb = mm
        names = self.names
        return mismatch_message(seq, a, fa, b, fb,
                                rank_name=(lambda r: names[r]) if names is not None else None)

    def fail_next(self, text):
        """Fail the next collective on every rank with ``text``, without taking part in it
        (a hierarchical group's leader whose host's part of it failed)."""
        b = str(text).encode("utf-8", "replace")
        cdef const char *c = b
        tcp_fail_next(self._eng(), c)

    def set_seq_shift(self, int shift):
        """Number the caller's collective s as s << shift here, its pieces after it, and name
        s in messages (tcp_number_next); once, before any collective."""
        if not 0 <= shift < 32:
            raise ValueError(f"shift must be in [0, 32), got {shift}")
        tcp_set_seq_shift(self._eng(), shift)

    def number_next(self, uint64_t seq):
        """The next collective begins the caller's collective ``seq``."""
        tcp_number_next(self._eng(), seq)

    @property
    def seq(self):
        """Sequence number of the last collective started."""
        return tcp_engine_seq(self._eng())

    # ---- collectives (fp: this rank's fingerprint of the call) ----------------------
    def barrier(self, uint64_t fp):
        _collective(self, self._eng(), _BARRIER, 0, 0, 0, 0, 0, 0, fp, NULL, NULL)

    def broadcast(self, uintptr_t ptr, size_t nbytes, int root, uint64_t fp):
        _collective(self, self._eng(), _BROADCAST, ptr, 0, nbytes, 0, 0, root, fp, NULL, NULL)

    def all_reduce(self, uintptr_t ptr, size_t count, int dtype, int op, uint64_t fp):
        _collective(self, self._eng(), _ALLREDUCE, ptr, 0, count, dtype, op, 0, fp, NULL, NULL)

    def reduce(self, uintptr_t ptr, size_t count, int dtype, int op, int root, uint64_t fp):
        _collective(self, self._eng(), _REDUCE, ptr, 0, count, dtype, op, root, fp, NULL, NULL)

    def all_gather(self, uintptr_t out, uintptr_t inp, size_t nbytes, uint64_t fp):
        _collective(self, self._eng(), _ALLGATHER, out, inp, nbytes, 0, 0, 0, fp, NULL, NULL)

    def gather(self, uintptr_t out, uintptr_t inp, size_t nbytes, int root, uint64_t fp):
        _collective(self, self._eng(), _GATHER, out, inp, nbytes, 0, 0, root, fp, NULL, NULL)

    def scatter(self, uintptr_t out, uintptr_t inp, size_t nbytes, int root, uint64_t fp):
        _collective(self, self._eng(), _SCATTER, out, inp, nbytes, 0, 0, root, fp, NULL, NULL)

    def reduce_scatter(self, uintptr_t out, uintptr_t inp, size_t count, int dtype, int op, uint64_t fp):
        _collective(self, self._eng(), _REDUCE_SCATTER, out, inp, count, dtype, op, 0, fp, NULL, NULL)

    def all_to_all(self, uintptr_t out, uintptr_t inp, out_bytes, in_bytes, uint64_t fp):
        cdef int n = self.size
        if len(out_bytes) != n or len(in_bytes) != n:
            raise ValueError(f"out_bytes and in_bytes must have {n} entries")
        cdef size_t *ob = <size_t *>malloc(sizeof(size_t) * 2 * n)
        if ob == NULL:
            raise MemoryError()
        cdef size_t *ib = ob + n
        for i in range(n):
            ob[i] = out_bytes[i]
            ib[i] = in_bytes[i]
        try:
            _collective(self, self._eng(), _ALLTOALL, out, inp, 0, 0, 0, 0, fp, ob, ib)
        finally:
            free(ob)

    # ---- point to point ------------------------------------------------------
    def isend(self, uintptr_t ptr, size_t nbytes, int dtype, int dst, int32_t tag, keep=None):
        """Post a send of ``nbytes`` of ``dtype`` (a dtype code, :data:`NO_DTYPE`: bytes) at
        ``ptr``; ``keep`` is held until it finishes."""
        return _post(self, True, ptr, nbytes, dtype, dst, tag, keep)

    def irecv(self, uintptr_t ptr, size_t nbytes, int dtype, int src, int32_t tag, keep=None):
        """Post a receive into ``nbytes`` of ``dtype`` at ``ptr`` from ``src`` (-1: any rank);
        a message of another size or dtype fails it."""
        return _post(self, False, ptr, nbytes, dtype, src, tag, keep)


cdef inline PendingOp _post(Engine eng, bint send, uintptr_t ptr, size_t nbytes, int dtype,
                            int peer, int32_t tag, keep):
    """isend (``send``) or irecv: the one nogil call that posts a request."""
    cdef tcp_engine *e = eng._eng()
    cdef char err[ERRLEN]
    cdef tcp_req *r
    with nogil:
        if send:
            r = tcp_isend(e, <const void *>ptr, nbytes, dtype, peer, tag, err, ERRLEN)
        else:
            r = tcp_irecv(e, <void *>ptr, nbytes, dtype, peer, tag, err, ERRLEN)
    if r == NULL:
        _check(-1, err, eng)
    return PendingOp._make(eng, r, keep)


cdef class PendingOp:
    """A posted isend/irecv. ``wait`` raises DistBackendError if it failed."""
    cdef tcp_req *r
    cdef Engine eng
    cdef object keep
    cdef int state  # 0 pending, 1 done, -1 failed
    cdef object error

    @staticmethod
    cdef PendingOp _make(Engine eng, tcp_req *r, keep):
        cdef PendingOp p = PendingOp.__new__(PendingOp)
        p.r = r
        p.eng = eng
        p.keep = keep
        p.state = 0
        return p

    def __dealloc__(self):
        if self.r != NULL and self.eng is not None and self.eng.e != NULL:
            tcp_req_free(self.eng.e, self.r)
        self.r = NULL

    cdef _finish(self, int rc, char *err):
        if rc == 0:
            self.state = 1
        else:
            self.state = -1
            self.error = DistBackendError(_text(err, self.eng))
        self.keep = None

    def wait(self, double timeout=-1.0):
        """Block until done (``timeout`` seconds, negative: the group timeout)."""
        if self.state == 0:
            _progress(self, True, timeout)
        if self.state < 0:
            raise self.error

    def test(self):
        """True when finished (successfully or not); makes progress without blocking."""
        if self.state == 0:
            _progress(self, False, 0.0)
        return self.state != 0

    def exception(self):
        return self.error

    @property
    def source(self):
        return tcp_req_source(self.r) if self.state == 1 else -1

    @property
    def nbytes(self):
        return tcp_req_nbytes(self.r) if self.state == 1 else 0


cdef inline int _progress(PendingOp req, bint block, double timeout) except -1:
    """Wait for the request (``block``: up to ``timeout`` seconds) or test it once, and
    record how it finished; a wait that timed out raises and leaves it posted."""
    cdef char err[ERRLEN]
    cdef int rc
    cdef tcp_engine *e = req.eng._eng()
    with nogil:
        if block:
            rc = tcp_req_wait(e, req.r, timeout, err, ERRLEN)
            if rc == 0:
                rc = 1  # tcp_req_test's "done"
        else:
            rc = tcp_req_test(e, req.r, err, ERRLEN)
    if rc == -2:  # timed out: still posted, a later wait may finish it
        raise DistBackendError(_text(err, req.eng))
    if rc != 0:
        req._finish(0 if rc > 0 else -1, err)
    return 0
