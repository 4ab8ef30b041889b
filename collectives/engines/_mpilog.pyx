# cython: language_level=3
"""The 'mpi' backend's call log in C, and its hottest calls made from C.

:class:`CallLog` holds the fingerprints (kind, dtype, count, root, op) of a group's blocking
collectives since the ranks last compared them (see
:mod:`collectives.backends.mpi.fingerprint`) as machine words: appending one allocates
nothing. Its ``all_reduce``, ``broadcast`` and ``all_gather`` append the call's fingerprint
and make MPI's call; its ``barrier`` appends and compares the ranks' logs, the comparison's
all_reduce being the barrier; bound to the backend (``bind_backend``) they are its
methods of those names on the instance, with no Python frame of their own, so they mark
the call they have in MPI (``busy``, its number, and ``thread``) for the watchdog, and hand
a call made in ``async_mode`` to the backend's async form.

Given the MPI library's entry points (``bind_direct``: MPI_Allreduce, MPI_Bcast and
MPI_Allgather's addresses, and the communicator's, datatypes' and ops' handles as mpi4py's
``.handle`` gives them; ``bind_check``: the comparison's), those calls go to MPI by address, as
``collectives.engines._ncclcall`` calls NCCL: mpi4py's own call (argument parsing, a message
object, the buffer export) was ~200 ns of a 4-byte call's ~300 ns at world 1, which raw
mpi4py pays too, so that the backend's call stays within its front end's cost of raw
mpi4py's. The GIL is released around the call, as mpi4py does, and an MPI error raises
``MPI.Exception(code)``, as mpi4py's. Handles are ints (MPICH's ABI) or pointers (Open
MPI's, the standard ABI): ``handle_size`` says which. Without them (or for a count above
INT_MAX, a device buffer, a null pointer) the call goes through mpi4py as before.

Where this extension is not built the backend keeps the log as a Python list of tuples.
"""
cimport cython
from libc.limits cimport INT_MAX
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from cpython.pythread cimport PyThread_get_thread_ident

from collectives.engines._buffer cimport Buffer

cdef enum:
    CHECK_EVERY = 64   # FingerprintCheck.CHECK_EVERY
    FIELDS = 5         # kind, dtype, count, root, op
    N_OPS = 256        # the backend's op table: dtype * 16 + op
    N_DTYPES = 16      # dtype codes (the datatype table's length at most)

cdef int BARRIER = 1, BROADCAST = 2, ALL_REDUCE = 3, ALL_GATHER = 5, NO_DTYPE = 15
# (the codes of collectives.core.fingerprint)

# MPI's entry points, for int handles (MPICH's ABI: MPI_Comm, MPI_Datatype and MPI_Op are int)
ctypedef int (*allreduce_i)(const void *, void *, int, int, int, int) noexcept nogil
ctypedef int (*bcast_i)(void *, int, int, int, int) noexcept nogil
ctypedef int (*allgather_i)(const void *, int, int, void *, int, int, int) noexcept nogil
# ... and for pointer handles (Open MPI's ABI, the MPI standard ABI)
ctypedef int (*allreduce_p)(const void *, void *, int, void *, void *, void *) noexcept nogil
ctypedef int (*bcast_p)(void *, int, void *, int, void *) noexcept nogil
ctypedef int (*allgather_p)(const void *, int, void *, void *, int, void *, void *) noexcept nogil


cdef class CallLog:
    """Fingerprints of up to CHECK_EVERY calls. ``compare()`` (given at construction) runs
    when a call fills the log, before that call is made, and at ``append_and_compare`` (a
    barrier); it reads ``entries()`` or ``digest()`` and calls ``clear()``. Once bound
    (``bind_check``) the comparison is made here, by address, instead. ``failed`` set (a
    message): every later call raises ``error(...)``."""

    cdef int64_t e[CHECK_EVERY * FIELDS]
    cdef readonly int n
    cdef public object failed
    cdef object _compare, _error
    cdef object _allreduce, _bcast, _allgather, _in_place, _datatypes, _ops, _half_op
    # bind_direct's: MPI's entry points (NULL: through mpi4py), the handles, MPI.Exception
    cdef void *_f_allreduce
    cdef void *_f_bcast
    cdef void *_f_allgather
    cdef bint _int_handles
    cdef uintptr_t _comm, _in_place_addr
    cdef uintptr_t _dt[N_DTYPES]   # 0: none
    cdef uintptr_t _op[N_OPS]      # 0: not known yet (an op made later: half_op's)
    cdef object _mpi_error
    cdef object _mask            # the bits of a handle
    # bind_check's: the comparison made by address (MPI_Allreduce of (hash, ~hash) as two
    # 32-bit words, MIN, on the check's own communicator); _ccomm 0: made by compare() (Python)
    cdef uintptr_t _ccomm, _u32, _min
    cdef uint32_t _h[2]
    cdef object _mismatch
    cdef public long long compared  # calls compared so far (the numbering in messages)
    # bind_backend's: the group's size, the backend's async forms and its uncommon all_gather
    cdef Py_ssize_t _size
    cdef object _async_all_reduce, _async_broadcast, _async_barrier, _async_all_gather
    cdef object _all_gather_other
    cdef public bint async_mode   # the backend's: its progress thread runs a submitted call
    cdef readonly long long busy  # the number of the call in MPI now (calls made so far); 0: none
    cdef readonly unsigned long thread  # the thread that made it
    cdef long long _made

    def __init__(self, compare, error):
        self._compare = compare
        self._error = error
        self.failed = None
        self.n = 0
        self.compared = 0

    def bind(self, allreduce, bcast, allgather, in_place, list datatypes, list ops, half_op):
        """The MPI calls (the communicator's bound Allreduce, Bcast, Allgather), MPI.IN_PLACE,
        the datatype table (dtype code -> Datatype), the op table (dtype * 16 + op -> Op or
        None) and ``half_op(dtype, op)`` for the ops the table lacks."""
        if len(ops) != N_OPS:
            raise ValueError(f"ops must hold {N_OPS} entries, got {len(ops)}")
        self._allreduce, self._bcast, self._allgather = allreduce, bcast, allgather
        self._in_place, self._datatypes, self._ops, self._half_op = in_place, datatypes, ops, half_op

    def bind_direct(self, allreduce, bcast, allgather, int handle_size, comm, in_place,
                    list datatypes, list ops, mpi_error):
        """Call MPI by address: ``allreduce``, ``bcast``, ``allgather`` are MPI_Allreduce,
        MPI_Bcast and MPI_Allgather's addresses; ``handle_size`` the bytes of an MPI handle
        (``MPI._sizeof(MPI.Comm)``: 4, ints, or the size of a pointer); ``comm`` the
        communicator's handle, ``in_place`` MPI_IN_PLACE's address (``int(MPI.IN_PLACE)``),
        ``datatypes`` and ``ops`` the handles of bind's tables (None where an entry is None),
        ``mpi_error`` the exception an MPI error code raises (``MPI.Exception``)."""
        cdef int i
        if handle_size != 4 and handle_size != sizeof(void *):
            raise ValueError(f"handle_size must be 4 or {sizeof(void *)}, got {handle_size}")
        if len(datatypes) > N_DTYPES or len(ops) != N_OPS:
            raise ValueError(f"datatypes must hold at most {N_DTYPES} handles and ops {N_OPS}")
        # Python ints (C's int would overflow); mpi4py gives a negative int handle sign-extended
        mask = (1 << (8 * <object>handle_size)) - 1
        self._mask = mask
        self.unbind_direct()
        for i in range(len(datatypes)):
            self._dt[i] = 0 if datatypes[i] is None else <uintptr_t>(datatypes[i] & mask)
        for i in range(N_OPS):
            self._op[i] = 0 if ops[i] is None else <uintptr_t>(ops[i] & mask)
        self._comm = <uintptr_t>(comm & mask)
        ptr_bits = <object>(8 * sizeof(void *))  # a Python int: the mask below is one too
        self._in_place_addr = <uintptr_t>(in_place & ((1 << ptr_bits) - 1))
        self._int_handles = handle_size == 4
        self._mpi_error = mpi_error
        self._f_allreduce = <void *><uintptr_t>allreduce
        self._f_bcast = <void *><uintptr_t>bcast
        self._f_allgather = <void *><uintptr_t>allgather

    def bind_backend(self, Py_ssize_t size, async_all_reduce, async_broadcast, async_barrier,
                     async_all_gather, all_gather_other):
        """The group's ``size`` and the backend's calls the hot calls hand over to: their
        async forms (``async_mode`` set: MPI's non-blocking call, waited on) and
        ``all_gather_other(out, inp)``, an all_gather other than the common one."""
        self._size = size
        self._async_all_reduce, self._async_broadcast = async_all_reduce, async_broadcast
        self._async_barrier, self._async_all_gather = async_barrier, async_all_gather
        self._all_gather_other = all_gather_other

    def bind_check(self, comm, uint32, op_min, mismatch):
        """Compare by address (after ``bind_direct``): ``comm`` the handle of the check's
        communicator, ``uint32`` and ``op_min`` MPI_UINT32_T's and MPI_MIN's handles;
        ``mismatch()`` runs where the ranks' hashes differed (it gathers the logs and
        raises)."""
        if self._f_allreduce == NULL:
            raise ValueError("bind_check needs bind_direct first")
        self._ccomm = <uintptr_t>(comm & self._mask)
        self._u32 = <uintptr_t>(uint32 & self._mask)
        self._min = <uintptr_t>(op_min & self._mask)
        self._mismatch = mismatch

    def unbind_direct(self):
        """Make the calls through mpi4py again (the communicator is about to be freed)."""
        self._f_allreduce = self._f_bcast = self._f_allgather = NULL
        self._ccomm = 0
        for i in range(N_DTYPES):
            self._dt[i] = 0
        for i in range(N_OPS):
            self._op[i] = 0

    @property
    def direct(self):
        """Whether the calls go to MPI by address (``bind_direct``)."""
        return self._f_bcast != NULL

    cdef int _check(self, int code) except -1:
        if code != 0:
            raise self._mpi_error(code)
        return 0

    cdef int _put(self, int64_t kind, int64_t dtype, int64_t count, int64_t root,
                  int64_t op) except -1:
        if self.failed is not None:
            raise self._error(f"group unusable after an earlier failure: {self.failed}")
        if self.n >= CHECK_EVERY:  # a comparison raised (an MPI error) before clearing the log
            self.failed = "the comparison of the ranks' calls failed"
            raise self._error(f"group unusable after an earlier failure: {self.failed}")
        cdef int64_t *p = &self.e[self.n * FIELDS]
        p[0] = kind
        p[1] = dtype
        p[2] = count
        p[3] = root
        p[4] = op
        self.n += 1
        return 0

    cdef int _add(self, int64_t kind, int64_t dtype, int64_t count, int64_t root,
                  int64_t op) except -1:
        self._put(kind, dtype, count, root, op)
        if self.n >= CHECK_EVERY:
            self._compare_now()
        return 0

    cdef int _compare_now(self) except -1:
        """Compare the ranks' logs now (every rank of the group is here): by address where
        bound (``bind_check``), else through ``compare()``."""
        cdef uint32_t h
        cdef void *f = self._f_allreduce
        cdef int code
        if self._ccomm == 0 or f == NULL:
            self._enter()
            try:
                self._compare()
            finally:
                self.busy = 0
            return 0
        h = _fold(self._digest())
        self._h[0] = h
        self._h[1] = ~h
        self._enter()
        with nogil:
            if self._int_handles:
                code = (<allreduce_i>f)(<const void *>self._in_place_addr, self._h, 2,
                                        <int>self._u32, <int>self._min, <int>self._ccomm)
            else:
                code = (<allreduce_p>f)(<const void *>self._in_place_addr, self._h, 2,
                                        <void *>self._u32, <void *>self._min, <void *>self._ccomm)
        self.busy = 0
        self._check(code)
        if self._h[0] == h and self._h[1] == ~h:
            self.compared += self.n
            self.n = 0
            return 0
        self._mismatch()  # raises
        return 0

    def append(self, tuple entry):
        """Log one call's (kind, dtype, count, root, op); compare when the log is full."""
        kind, dtype, count, root, op = entry
        self._add(kind, dtype, count, root, op)

    def append_and_compare(self, tuple entry):
        """Log one call, then compare the ranks' logs: the comparison is that call (a
        barrier: an all_reduce synchronises as one does)."""
        kind, dtype, count, root, op = entry
        self._put(kind, dtype, count, root, op)
        self._compare_now()

    def entries(self):
        """The logged calls, oldest first, as (kind, dtype, count, root, op) tuples."""
        cdef int i
        return [tuple(self.e[i * FIELDS + k] for k in range(FIELDS)) for i in range(self.n)]

    def digest(self):
        """A 64-bit hash of the logged calls (FNV-1a over their words, then a final mix):
        equal on every rank whose calls were equal."""
        return self._digest()

    cdef uint64_t _digest(self) noexcept:
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
    # The backend's own methods (bind_backend): no Python frame of its own, so ``busy`` and
    # ``thread`` tell the watchdog which call is in MPI, and on which thread. A call made
    # while ``async_mode`` is set is the backend's async form (not logged, as natively
    # posted ones cannot be).
    cdef inline void _enter(self) noexcept:
        self._made += 1
        self.thread = PyThread_get_thread_ident()
        self.busy = self._made

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def all_reduce(self, Buffer buf, int op):
        """Log, then ``MPI_Allreduce(MPI_IN_PLACE, buf, count, datatype, mpi_op, comm)``."""
        if self.async_mode:
            return self._async_all_reduce(buf, op)
        cdef int dt = buf.dtype
        cdef Py_ssize_t key = dt * 16 + op
        cdef uintptr_t d, o, c = self._comm
        cdef void *p = <void *>buf.ptr
        cdef void *f = self._f_allreduce
        cdef const void *inp = <const void *>self._in_place_addr
        cdef int n = <int>buf.count, code
        self._add(ALL_REDUCE, dt, buf.count, -1, op)
        if f != NULL and 0 <= key < N_OPS and _direct_ok(buf) and 0 <= dt < N_DTYPES and self._dt[dt] != 0:
            d, o = self._dt[dt], self._op[key]
            if o == 0:  # an op the table lacked when bound: half_op makes it (once)
                self._op[key] = o = <uintptr_t>(self._half_op(dt, op).handle & self._mask)
            self._enter()
            with nogil:
                if self._int_handles:
                    code = (<allreduce_i>f)(inp, p, n, <int>d, <int>o, <int>c)
                else:
                    code = (<allreduce_p>f)(inp, p, n, <void *>d, <void *>o, <void *>c)
            self.busy = 0
            self._check(code)
            return
        mpi_op = self._ops[key] if 0 <= key < N_OPS else None
        if mpi_op is None:
            mpi_op = self._half_op(dt, op)
        self._enter()
        try:
            self._allreduce(self._in_place, (buf, self._datatypes[dt]), mpi_op)
        finally:
            self.busy = 0

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def broadcast(self, Buffer buf, int root):
        """Log, then ``MPI_Bcast(buf, count, datatype, root, comm)``."""
        if self.async_mode:
            return self._async_broadcast(buf, root)
        cdef int dt = buf.dtype, n = <int>buf.count, code
        cdef uintptr_t d, c = self._comm
        cdef void *p = <void *>buf.ptr
        cdef void *f = self._f_bcast
        self._add(BROADCAST, dt, buf.count, root, -1)
        if f != NULL and _direct_ok(buf) and 0 <= dt < N_DTYPES and self._dt[dt] != 0:
            d = self._dt[dt]
            self._enter()
            with nogil:
                if self._int_handles:
                    code = (<bcast_i>f)(p, n, <int>d, root, <int>c)
                else:
                    code = (<bcast_p>f)(p, n, <void *>d, root, <void *>c)
            self.busy = 0
            self._check(code)
            return
        self._enter()
        try:
            self._bcast((buf, self._datatypes[dt]), root)
        finally:
            self.busy = 0

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def barrier(self):
        """Log, then compare the ranks' logs: the comparison's MPI_Allreduce of (hash,
        ~hash) is the barrier (no rank leaves it before every rank has entered), so a
        barrier costs what one did and every barrier checks the calls before it."""
        if self.async_mode:
            return self._async_barrier()
        self._put(BARRIER, NO_DTYPE, 0, -1, -1)
        self._compare_now()

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def all_gather(self, Buffer out, Buffer inp):
        """Log, then, where ``out`` takes the group's size blocks like ``inp`` and shares no
        byte with it (the common call), ``MPI_Allgather``; else the backend's
        ``all_gather_other`` (in place, or from a private copy)."""
        if self.async_mode:
            return self._async_all_gather(out, inp)
        self._add(ALL_GATHER, inp.dtype, inp.count, -1, -1)
        cdef size_t onb = <size_t>out.count * out.itemsize, inb = <size_t>inp.count * inp.itemsize
        cdef uintptr_t d, c = self._comm
        cdef void *f = self._f_allgather
        cdef const void *ip = <const void *>inp.ptr
        cdef void *op = <void *>out.ptr
        cdef int n = <int>inp.count, code, dt = inp.dtype
        self._enter()
        try:
            if (out.dtype != dt or out.count != inp.count * self._size
                    or not (inb == 0 or out.ptr >= inp.ptr + inb or inp.ptr >= out.ptr + onb)):
                self._all_gather_other(out, inp)
                return
            if (f != NULL and _direct_ok(inp) and _direct_ok(out) and 0 <= dt < N_DTYPES
                    and self._dt[dt] != 0):
                d = self._dt[dt]
                with nogil:
                    if self._int_handles:
                        code = (<allgather_i>f)(ip, n, <int>d, op, n, <int>d, <int>c)
                    else:
                        code = (<allgather_p>f)(ip, n, <void *>d, op, n, <void *>d, <void *>c)
                self.busy = 0
                self._check(code)
                return
            dtype = self._datatypes[dt]
            self._allgather((inp, dtype), (out, dtype))
        finally:
            self.busy = 0


cdef inline uint32_t _fold(uint64_t h) noexcept:
    """The 32-bit word the ranks compare: ``digest() ^ (digest() >> 32)``, low half (two
    such words, 8 bytes, are MPICH's quickest all_reduce: 16 took ~1.6x as long)."""
    return <uint32_t>(h ^ (h >> 32))


cdef inline bint _direct_ok(Buffer b) noexcept:
    """Whether MPI can take ``b`` by address with an int count: host memory (mpi4py refuses
    a device Buffer's export), a pointer where there are elements."""
    return b.device == -1 and b.count <= INT_MAX and (b.ptr != 0 or b.count == 0)
