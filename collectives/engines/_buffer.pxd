# cython: language_level=3
# The Buffer type's C layout, for the extensions that read a Buffer's fields directly
# (collectives.engines._shm's collectives, collectives.engines._core's flight-recorder ring).

cdef class Buffer:
    cdef public size_t ptr
    cdef public Py_ssize_t count
    cdef public int dtype
    cdef public int itemsize
    cdef public int device
    cdef public object obj
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _stride[1]
