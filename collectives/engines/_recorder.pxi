# The flight recorder's ring of collectives (collectives.diagnostics.flight_recorder.Recorder's base),
# included by _core.pyx. flight_recorder._PyCallRing is the same in Python.
from libc.stdlib cimport calloc
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ._buffer cimport Buffer as _CBuffer


cdef inline long long _monotonic_ns() noexcept nogil:
    """time.monotonic_ns(), in C (the same clock)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <long long>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class CallRing:
    """A group's last ``size`` collectives, in C arrays, and ``seq``, the last issued.
    Recording a call is one method call that stores seven numbers and the kind (the
    front end's per-call cost); the entries are read back as tuples
    ``(seq, kind, count, dtype, root, op, time_ns[, stack])``.

    ``stack``: None, or a function whose result (the caller's stack) each entry keeps.
    ``started`` and ``done`` are the last collectives started and completed (set by the
    group's Dispatcher, in C on its cheap path).
    """

    cdef readonly long long seq
    cdef public long long started
    cdef public long long done
    cdef readonly Py_ssize_t size
    cdef long long *_seq
    cdef long long *_count
    cdef long long *_time
    cdef int *_dtype
    cdef int *_root
    cdef int *_op
    cdef list _kind
    cdef list _stack
    cdef object _stack_fn

    def __init__(self, Py_ssize_t size, stack=None):
        if self._seq != NULL:
            raise RuntimeError("CallRing is initialised once")
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self._seq = <long long *>calloc(size, sizeof(long long))
        self._count = <long long *>calloc(size, sizeof(long long))
        self._time = <long long *>calloc(size, sizeof(long long))
        self._dtype = <int *>calloc(3 * size, sizeof(int))
        if (self._seq == NULL or self._count == NULL or self._time == NULL
                or self._dtype == NULL):
            raise MemoryError()
        self._root = self._dtype + size
        self._op = self._root + size
        self.size = size
        self._kind = [None] * size
        if stack is not None:
            self._stack_fn = stack
            self._stack = [None] * size

    def __dealloc__(self):
        free(self._seq)
        free(self._count)
        free(self._time)
        free(self._dtype)

    cdef long long _put(self, kind, long long count, int dtype, int root, int op) except -1:
        if self._seq == NULL:
            raise RuntimeError("CallRing.__init__ was not called")
        cdef long long s = self.seq + 1
        cdef Py_ssize_t i = s % self.size
        self._seq[i] = s
        self._kind[i] = kind
        self._count[i] = count
        self._dtype[i] = dtype
        self._root[i] = root
        self._op[i] = op
        self._time[i] = _monotonic_ns()
        if self._stack is not None:
            self._stack[i] = self._stack_fn()
        self.seq = s
        return s

    def issue(self, kind, long long count=0, int dtype=-1, int root=-1, op=-1):
        """Record collective ``kind`` issued now; its sequence number. ``root``: a group
        rank (-1: none); ``op``: a reduce-op code (-1 or None: none)."""
        return self._put(kind, count, dtype, root, -1 if op is None else int(op))

    def issue_buffer(self, kind, _CBuffer buf not None, int root=-1, int op=-1):
        """``issue(kind, buf.count, buf.dtype, root, op)``: the front end's hot paths."""
        return self._put(kind, buf.count, buf.dtype, root, op)

    def entry(self, long long s):
        """Collective ``s``'s entry, or None when it left the ring (or never was)."""
        if s <= 0 or self._seq == NULL:
            return None
        cdef Py_ssize_t i = s % self.size
        if self._seq[i] != s:
            return None
        e = (s, self._kind[i], self._count[i], self._dtype[i], self._root[i], self._op[i],
             self._time[i])
        if self._stack is not None:
            e += (self._stack[i],)
        return e

    def entries(self):
        """The entries in the ring, oldest first."""
        cdef long long s
        out = []
        for s in range(max(1, self.seq - self.size + 1), self.seq + 1):
            e = self.entry(s)
            if e is not None:
                out.append(e)
        return out
