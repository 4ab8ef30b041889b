# cython: language_level=3
"""NCCL's collective entry points called through their addresses, for the 'nccl' backend.

A ctypes call costs ~10,000 instructions (libffi and its argument conversion), more than
the rest of the backend's work per call; these make the same C call for ~200. The
addresses come from the ctypes library object (``ctypes.cast(lib.ncclAllReduce,
c_void_p).value``), so nothing here links against NCCL. The GIL is released around the
call, as ctypes does. Where this extension is not built the backend calls through ctypes.
"""
from libc.stdint cimport uintptr_t

# ncclAllReduce(send, recv, count, dtype, op, comm, stream); ncclBroadcast(send, recv,
# count, dtype, root, comm, stream) and ncclReduceScatter(send, recv, recvcount, dtype, op,
# comm, stream) have the same shape
ctypedef int (*call7_t)(const void *, void *, size_t, int, int, void *, void *) noexcept nogil
# ncclReduce(send, recv, count, dtype, op, root, comm, stream)
ctypedef int (*call8_t)(const void *, void *, size_t, int, int, int, void *, void *) noexcept nogil
# ncclAllGather(send, recv, sendcount, dtype, comm, stream)
ctypedef int (*call6_t)(const void *, void *, size_t, int, void *, void *) noexcept nogil


def call7(uintptr_t fn, uintptr_t send, uintptr_t recv, size_t count, int a, int b,
          comm, uintptr_t stream):
    """``fn(send, recv, count, a, b, comm, stream)``; ``comm`` an address or None."""
    cdef uintptr_t c = comm or 0
    cdef int code
    with nogil:
        code = (<call7_t>fn)(<const void *>send, <void *>recv, count, a, b, <void *>c,
                             <void *>stream)
    return code


def call8(uintptr_t fn, uintptr_t send, uintptr_t recv, size_t count, int a, int b, int d,
          comm, uintptr_t stream):
    """``fn(send, recv, count, a, b, d, comm, stream)``; ``comm`` an address or None."""
    cdef uintptr_t c = comm or 0
    cdef int code
    with nogil:
        code = (<call8_t>fn)(<const void *>send, <void *>recv, count, a, b, d, <void *>c,
                             <void *>stream)
    return code


def call6(uintptr_t fn, uintptr_t send, uintptr_t recv, size_t count, int a, comm,
          uintptr_t stream):
    """``fn(send, recv, count, a, comm, stream)``; ``comm`` an address or None."""
    cdef uintptr_t c = comm or 0
    cdef int code
    with nogil:
        code = (<call6_t>fn)(<const void *>send, <void *>recv, count, a, <void *>c,
                             <void *>stream)
    return code
