# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython kernels: elementwise reductions and flatten/unflatten, GIL released.

Every entry point validates its arguments with the GIL held (ValueError/TypeError
naming the argument), then runs one C call in a ``with nogil:`` block. Inputs
are NumPy arrays or torch CPU tensors, used in place (zero-copy).
"""
cimport cython
cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import operator

import numpy as np

from ..core import dtypes as _D
from ._buffer import Buffer

# core.tensors.to_buffer (a layer above): the conversion, and its errors, of what the kernels
# do not read in C; core.tensors hands it down when it is imported (_set_to_buffer)
to_buffer = None


def _set_to_buffer(fn):
    """Take the package's ``to_buffer`` (``core.tensors`` calls this at its import)."""
    global to_buffer
    to_buffer = fn


cnp.import_array()

cdef extern from "numpy/ndarraytypes.h":
    int NPY_HALF  # absent from numpy's __init__.pxd

cdef extern from "kernels/reduce_kernels.h" nogil:
    size_t COLL_CHUNK_BYTES_C "COLL_CHUNK_BYTES"
    enum:
        COLL_FLOAT16, COLL_BFLOAT16, COLL_FLOAT32, COLL_FLOAT64, COLL_COMPLEX64, COLL_COMPLEX128,
        COLL_INT8, COLL_UINT8, COLL_INT16, COLL_INT32, COLL_INT64, COLL_BOOL, COLL_NUM_DTYPES
    enum:
        COLL_SUM, COLL_AVG, COLL_PRODUCT, COLL_MIN, COLL_MAX, COLL_BAND, COLL_BOR, COLL_BXOR,
        COLL_PREMUL_SUM
    int COLL_OK
    int COLL_EDTYPE
    int COLL_EOP
    size_t coll_itemsize(int dtype)
    int coll_op_valid(int dtype, int op)
    int coll_reduce(void *dst, const void *src, size_t count, int dtype, int op)
    int coll_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op)
    int coll_reduce_many(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int op)
    int coll_scale(void *dst, size_t count, int dtype, double factor)
    size_t coll_chunk_elems(int dtype)
    void coll_copy(void *dst, const void *src, size_t nbytes)
    const char *coll_kernel_isa()
    int coll_force_isa(const char *name)
    ctypedef struct coll_kernel_api "struct coll_kernel_api":
        pass
    const coll_kernel_api *coll_kernel_api_get()

#: Bytes per chunk of the chunked kernels (reduce_many works chunk by chunk; a
#: transport can receive chunk k+1 while reducing chunk k).
CHUNK_BYTES = COLL_CHUNK_BYTES_C

# the C header's dtype and op codes (reduce_kernels.h), which collectives/core/dtypes.py repeats
# for the pure-Python path: tests/test_kernels.py checks that the two agree
C_CODES = {
    "FLOAT16": COLL_FLOAT16, "BFLOAT16": COLL_BFLOAT16, "FLOAT32": COLL_FLOAT32,
    "FLOAT64": COLL_FLOAT64, "COMPLEX64": COLL_COMPLEX64, "COMPLEX128": COLL_COMPLEX128,
    "INT8": COLL_INT8, "UINT8": COLL_UINT8, "INT16": COLL_INT16, "INT32": COLL_INT32,
    "INT64": COLL_INT64, "BOOL": COLL_BOOL, "NUM_DTYPES": COLL_NUM_DTYPES,
    "SUM": COLL_SUM, "AVG": COLL_AVG, "PRODUCT": COLL_PRODUCT, "MIN": COLL_MIN,
    "MAX": COLL_MAX, "BAND": COLL_BAND, "BOR": COLL_BOR, "BXOR": COLL_BXOR,
    "PREMUL_SUM": COLL_PREMUL_SUM,
}

#: The kernels' C table (struct coll_kernel_api, kernels/reduce_kernels.h) for collectives.engines._tcp and
#: collectives.engines._shm, which are built without a copy of the kernels and call this module's.
_C_API = PyCapsule_New(<void *>coll_kernel_api_get(), "collectives.engines._core._C_API", NULL)

include "_reduce.pxi"
include "_flatten.pxi"
include "_recorder.pxi"
include "_group_dispatcher.pxi"
