# cython: language_level=3
"""The 'mpi' backend's call log in C, and its hottest calls made from C.

:class:`CallLog` holds the fingerprints (kind, dtype, count, root, op) of a group's blocking
collectives since the ranks last compared them (see
:mod:`collectives.backends.mpi.fingerprint`) as machine words: appending one allocates
nothing. Its ``all_reduce``, ``broadcast`` and ``barrier`` append the call's fingerprint
and make mpi4py's call with the buffer spec built in C (``(buffer, datatype)``), so the
backend's Python method is one call. The backend still calls them from its own Python
method: the watchdog recognises a blocking call by that method's frame.

Where this extension is not built the backend keeps the log as a Python list of tuples.
"""
from libc.stdint cimport int64_t, uint64_t

from collectives._buffer cimport Buffer

cdef enum:
    CHECK_EVERY = 64   # FingerprintCheck.CHECK_EVERY
    FIELDS = 5         # kind, dtype, count, root, op
    N_OPS = 256        # the backend's op table: dtype * 16 + op

cdef int BARRIER = 1, BROADCAST = 2, ALL_REDUCE = 3, ALL_GATHER = 5, NO_DTYPE = 15
# (the codes of collectives.core.fingerprint)


cdef class CallLog:
    """Fingerprints of up to CHECK_EVERY calls. ``compare()`` (given at construction) runs
    when a call fills the log, before that call is made; it reads ``entries()`` or
    ``digest()`` and calls ``clear()``. ``failed`` set (a message): every later call
    raises ``error(...)``."""

    cdef int64_t e[CHECK_EVERY * FIELDS]
    cdef readonly int n
    cdef public object failed
    cdef object _compare, _error
    cdef object _allreduce, _bcast, _barrier, _allgather, _in_place, _datatypes, _ops, _half_op

    def __init__(self, compare, error):
        self._compare = compare
        self._error = error
        self.failed = None
        self.n = 0

    def bind(self, allreduce, bcast, barrier, allgather, in_place, list datatypes, list ops,
             half_op):
        """The MPI calls (the communicator's bound Allreduce, Bcast, Barrier, Allgather), MPI.IN_PLACE,
        the datatype table (dtype code -> Datatype), the op table (dtype * 16 + op -> Op or
        None) and ``half_op(dtype, op)`` for the ops the table lacks."""
        if len(ops) != N_OPS:
            raise ValueError(f"ops must hold {N_OPS} entries, got {len(ops)}")
        self._allreduce, self._bcast, self._barrier = allreduce, bcast, barrier
        self._allgather = allgather
        self._in_place, self._datatypes, self._ops, self._half_op = in_place, datatypes, ops, half_op

    cdef int _add(self, int64_t kind, int64_t dtype, int64_t count, int64_t root,
                  int64_t op) except -1:
        if self.failed is not None:
            raise self._error(f"group unusable after an earlier failure: {self.failed}")
        cdef int64_t *p = &self.e[self.n * FIELDS]
        p[0] = kind
        p[1] = dtype
        p[2] = count
        p[3] = root
        p[4] = op
        self.n += 1
        if self.n >= CHECK_EVERY:
            self._compare()
        return 0

    def append(self, tuple entry):
        """Log one call's (kind, dtype, count, root, op); compare when the log is full."""
        kind, dtype, count, root, op = entry
        self._add(kind, dtype, count, root, op)

    def entries(self):
        """The logged calls, oldest first, as (kind, dtype, count, root, op) tuples."""
        cdef int i
        return [tuple(self.e[i * FIELDS + k] for k in range(FIELDS)) for i in range(self.n)]

    def digest(self):
        """A 64-bit hash of the logged calls (FNV-1a over their words, then a final mix):
        equal on every rank whose calls were equal."""
        cdef uint64_t h = 14695981039346656037ULL
        cdef int i
        for i in range(self.n * FIELDS):
            h = (h ^ <uint64_t>self.e[i]) * 1099511628211ULL
        h ^= h >> 33
        h *= 0xff51afd7ed558ccdULL
        h ^= h >> 33
        return h

    def clear(self):
        self.n = 0

    def __len__(self):
        return self.n

    # ---- the hot calls ------------------------------------------------------------
    def all_reduce(self, Buffer buf, int op):
        """Log, then ``Allreduce(IN_PLACE, (buf, datatype), mpi_op)``."""
        cdef int dt = buf.dtype
        cdef Py_ssize_t key = dt * 16 + op
        self._add(ALL_REDUCE, dt, buf.count, -1, op)
        mpi_op = self._ops[key] if 0 <= key < N_OPS else None
        if mpi_op is None:
            mpi_op = self._half_op(dt, op)
        self._allreduce(self._in_place, (buf, self._datatypes[dt]), mpi_op)

    def broadcast(self, Buffer buf, int root):
        """Log, then ``Bcast((buf, datatype), root)``."""
        cdef int dt = buf.dtype
        self._add(BROADCAST, dt, buf.count, root, -1)
        self._bcast((buf, self._datatypes[dt]), root)

    def barrier(self):
        """Log, then ``Barrier()``."""
        self._add(BARRIER, NO_DTYPE, 0, -1, -1)
        self._barrier()

    def all_gather(self, Buffer out, Buffer inp, Py_ssize_t size):
        """Log; then, where ``out`` takes ``size`` blocks like ``inp`` and shares no byte
        with it (the common call), ``Allgather`` and True; else False: the caller makes
        the call (in place, or from a private copy)."""
        self._add(ALL_GATHER, inp.dtype, inp.count, -1, -1)
        cdef size_t onb = <size_t>out.count * out.itemsize, inb = <size_t>inp.count * inp.itemsize
        if out.dtype != inp.dtype or out.count != inp.count * size:
            return False
        if not (inb == 0 or out.ptr >= inp.ptr + inb or inp.ptr >= out.ptr + onb):
            return False
        dt = self._datatypes[inp.dtype]
        self._allgather((inp, dt), (out, dt))
        return True
