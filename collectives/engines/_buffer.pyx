# cython: language_level=3, boundscheck=False, wraparound=False
"""The Buffer type and the front end's tensor-to-Buffer step, in C.

Every collective call turns its tensors into Buffers first; for a small message
that step was most of the front end's time. Here a contiguous NumPy array is
read through the NumPy C API and a plain contiguous CPU torch tensor through
its attributes, and the Buffer is filled in C. Anything else goes to the
Python path in ``_frontend`` (which raises the errors), so behaviour is the same
with or without this module.
"""
cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES

import numpy as np

from ..core import dtypes as _D
from ..core.views import buffer_numpy, buffer_repr

cnp.import_array()

cdef extern from "kernels/reduce_kernels.h":
    enum:
        NUM_DTYPES "COLL_NUM_DTYPES"  # the dtype codes' one definition (dtypes.py repeats it)

cdef enum:
    MAX_TYPENUM = 64

cdef int _ITEMSIZE[NUM_DTYPES]
for _code, _size in _D.ITEMSIZE.items():
    _ITEMSIZE[_code] = _size

# NumPy type number -> our dtype code, -1 where we have none. Built from the same
# table as the Python path, so the aliases (long and longlong both int64) agree.
cdef int _CODE_OF_TYPENUM[MAX_TYPENUM]
for _i in range(MAX_TYPENUM):
    _CODE_OF_TYPENUM[_i] = -1


def _learn_numpy(np_codes):
    seen = set()
    for t in np.sctypeDict.values():
        try:
            dt = np.dtype(t)
        except TypeError:
            continue
        if dt.num in seen or not 0 <= dt.num < MAX_TYPENUM or not dt.isnative:
            continue
        seen.add(dt.num)
        code = np_codes.get(dt)
        if code is not None:
            _CODE_OF_TYPENUM[dt.num] = code


cdef char *_FORMAT_B = b"B"


@cython.freelist(16)  # one or two per call: reused instead of allocated
cdef class Buffer:
    """A contiguous block of elements: what a backend reads and writes.

    Attributes:
        ptr: address of the first element.
        count: number of elements.
        dtype: dtype code from :mod:`collectives.core.dtypes`.
        itemsize: bytes per element.
        device: -1 for host memory, else the CUDA device index.
        obj: the array or tensor that owns the memory (kept alive by the Buffer).
    """

    # fields: _buffer.pxd (collectives.engines._shm and collectives.engines._core read them in C)

    def __init__(self, ptr, count, dtype, device=-1, obj=None):
        if not 0 <= dtype < NUM_DTYPES:
            raise ValueError(f"dtype must be a dtype code in [0, {NUM_DTYPES}), got {dtype!r}")
        self.ptr = ptr
        self.count = count
        self.dtype = dtype
        self.itemsize = _ITEMSIZE[<int>dtype]
        self.device = device
        self.obj = obj

    @property
    def nbytes(self):
        return self.count * self.itemsize

    def numpy(self):
        """A NumPy view of host memory (bfloat16 as uint16 bits); zero-copy."""
        return buffer_numpy(self)

    def bytes_view(self):
        """A flat uint8 NumPy view of the same memory; zero-copy."""
        return self.numpy().view(np.uint8)

    def slice(self, start, stop):
        """Elements [start, stop) as a Buffer sharing this memory."""
        return _make(self.ptr + start * self.itemsize, stop - start, self.dtype, self.device, self.obj)

    def __repr__(self):
        return buffer_repr(self)

    def __getbuffer__(self, Py_buffer *view, int flags):
        """Host memory as writable bytes (the buffer protocol), so mpi4py and memoryview
        take a Buffer as it is; refused for device memory and for a null pointer."""
        if self.device != -1:
            raise BufferError("a CUDA Buffer has no host memory to export")
        if self.ptr == 0 and self.count != 0:
            raise BufferError("Buffer has a null pointer")
        self._shape[0] = self.count * self.itemsize
        self._stride[0] = 1
        view.buf = <void *>self.ptr
        view.obj = self
        view.len = self._shape[0]
        view.readonly = 0
        view.itemsize = 1
        view.format = _FORMAT_B if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = self._shape if flags & PyBUF_ND else NULL
        view.strides = self._stride if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL


cdef inline Buffer _make(size_t ptr, Py_ssize_t count, int dtype, int device, object obj):
    cdef Buffer b = Buffer.__new__(Buffer)
    b.ptr = ptr
    b.count = count
    b.dtype = dtype
    b.itemsize = _ITEMSIZE[dtype]
    b.device = device
    b.obj = obj
    return b


# torch, once the Python path has seen a tensor (torch is never imported here)
cdef object _torch_tensor = None
cdef dict _torch_codes = {}
cdef object _strided = None
cdef object _slow = None
cdef object _slow_list = None
cdef int _COMPLEX64 = _D.COMPLEX64
cdef int _COMPLEX128 = _D.COMPLEX128
# whether CUDA tensors take the C path: set once a CUDA backend was live (the front end then
# checks every call's buffers against its group's backend: core.cuda.cuda_seen)
cdef bint _cuda_ok = False


def _allow_cuda():
    """Let CUDA tensors take the C path from now on (``core.convert._py_buffer`` calls it)."""
    global _cuda_ok
    _cuda_ok = True


def _configure(slow, torch_tensor=None, torch_codes=None, strided=None):
    """Set the Python fallback and, once torch is known, its tensor type and dtype table."""
    global _slow, _torch_tensor, _torch_codes, _strided
    _slow = slow
    if torch_tensor is not None:
        _torch_tensor, _torch_codes, _strided = torch_tensor, dict(torch_codes), strided


cdef object _fast_buffer(object t):
    """The Buffer over ``t`` where the C path takes it (a contiguous NumPy array or plain
    CPU torch tensor; a CUDA one too once ``_allow_cuda`` was called), else None."""
    cdef cnp.ndarray arr
    cdef int code, typenum
    if type(t) is cnp.ndarray:
        arr = <cnp.ndarray>t
        typenum = cnp.PyArray_TYPE(arr)
        if 0 <= typenum < MAX_TYPENUM:
            code = _CODE_OF_TYPENUM[typenum]
            if (code >= 0 and cnp.PyArray_SIZE(arr) > 0 and cnp.PyArray_IS_C_CONTIGUOUS(arr)
                    and cnp.PyArray_ISWRITEABLE(arr) and cnp.PyArray_ISNOTSWAPPED(arr)):
                return _make(<size_t>cnp.PyArray_DATA(arr), cnp.PyArray_SIZE(arr), code, -1, t)
    elif type(t) is _torch_tensor:
        c = _torch_codes.get(t.dtype)
        # lazy views (the Python path refuses them): the conjugate bit exists on complex
        # tensors only, the negative bit on any
        if (c is not None and t.layout is _strided and t.is_contiguous()
                and not ((c == _COMPLEX64 or c == _COMPLEX128) and t.is_conj())
                and not t.is_neg()):
            if t.is_cpu:
                return _make(t.data_ptr(), t.numel(), c, -1, t)
            if _cuda_ok and t.is_cuda:
                return _make(t.data_ptr(), t.numel(), c, t.get_device(), t)
    return None


@cython.binding(False)  # a plain builtin function: a cheaper call (once per tensor per call)
def buffer(t, name="tensor"):
    """The Buffer over ``t`` (zero-copy); errors and rare cases go to the Python path."""
    b = _fast_buffer(t)
    return b if b is not None else _slow(t, name)


def _set_slow_list(slow_list):
    """Set the Python path of ``buffers`` (``_frontend._py_buffers``)."""
    global _slow_list
    _slow_list = slow_list


def buffers(tensors, name, dtype=None, count=None, length=None):
    """``_frontend.buffers`` for the common case, a list or tuple of tensors the C path takes
    that agree in dtype (and count); anything else, errors included, goes to the Python path."""
    if not isinstance(tensors, (list, tuple)) or (length is not None and len(tensors) != length):
        return _slow_list(tensors, name, dtype, count, length)
    cdef list out = []
    for t in tensors:
        b = _fast_buffer(t)
        if b is None or (dtype is not None and b.dtype != dtype) or (count is not None
                                                                     and b.count != count):
            return _slow_list(tensors, name, dtype, count, length)
        dtype = b.dtype
        out.append(b)
    return out


def separate_blocks(list outs, Buffer inp not None, Py_ssize_t rank):
    """Whether ``outs`` (an all_gather's list) do not lie back to back, so that a backend
    gathering into the list itself saves a staging copy, and none of them overlaps ``inp``
    but ``outs[rank]`` being ``inp`` itself (``_frontend._py_separate_blocks`` in C)."""
    cdef Py_ssize_t i, n = len(outs)
    cdef Buffer b
    cdef size_t ip = inp.ptr, inb = <size_t>inp.count * inp.itemsize, bn, ptr
    cdef bint contiguous = True
    if n == 0:
        return False
    ptr = (<Buffer?>outs[0]).ptr
    for i in range(n):
        b = <Buffer?>outs[i]
        bn = <size_t>b.count * b.itemsize
        if b.ptr != ptr and b.count:
            contiguous = False
        ptr += bn
        if bn and inb and b.ptr < ip + inb and ip < b.ptr + bn and not (i == rank and b.ptr == ip):
            return False
    return not contiguous


def disjoint_gather(Buffer out not None, Buffer inp not None, Py_ssize_t size,
                    Py_ssize_t own=-1):
    """Whether ``out`` takes ``size`` copies of ``inp`` (same dtype) and shares no byte
    with it, or (``own`` >= 0) ``inp`` is exactly block ``own`` of it (torch's in-place
    forms, for a backend that takes them): the cases the front end hands to the backend
    without further checks."""
    cdef size_t onb = <size_t>out.count * out.itemsize, inb = <size_t>inp.count * inp.itemsize
    if out.dtype != inp.dtype or out.count != inp.count * size:
        return False
    if own >= 0 and inp.ptr == out.ptr + <size_t>own * inb:
        return True
    return inb == 0 or onb == 0 or out.ptr >= inp.ptr + inb or inp.ptr >= out.ptr + onb
