# The reduction kernels, called through collectives.engines._core's table (kernels/reduce_kernels_import.h).
# They are compiled once, into _core: this module's C code runs _core's instruction-set
# dispatch, so forcing an instruction set there (_core._force_isa) switches it here too.
# Included from _tcp.pyx and _shm.pyx; runs at module import, before any C call.
from cpython.pycapsule cimport PyCapsule_GetPointer

cdef extern from "kernels/reduce_kernels_import.h":
    int coll_kernels_set(const void *api)
    const char *coll_kernel_isa()

try:
    from . import _core as _kernels_module
except ImportError as _exc:
    raise ImportError(f"{__name__} calls the reduction kernels of collectives.engines._core, which cannot "
                      f"be imported ({_exc}); build the extensions together: "
                      f"python setup.py build_ext --inplace") from _exc
if coll_kernels_set(PyCapsule_GetPointer(_kernels_module._C_API, "collectives.engines._core._C_API")) != 0:
    raise ImportError(f"{__name__} and collectives.engines._core were built from different sources "
                      f"(their kernel tables differ); rebuild both: python setup.py build_ext --inplace")
del _kernels_module


def kernel_isa():
    """The instruction set of the reduction kernels this module's collectives run (``_core``'s)."""
    return coll_kernel_isa().decode()
