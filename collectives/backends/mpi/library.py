"""What the mpi backend finds in the MPI library and the package around it: the entry
points the C call log calls by address, MPI handles, the reduction kernel of the
float16/bfloat16 ops, and the launcher's world size; plus two pure helpers of the
buffer specs. Nothing here holds state."""
import importlib
import os

from ...core.errors import DistBackendError

ENTRY_NAMES = ("MPI_Allreduce", "MPI_Bcast", "MPI_Allgather")


def entry_points(MPI):
    """The addresses of the MPI functions the C call log calls directly, in the library
    mpi4py loaded (found through mpi4py's own module, whose dependency it is), or None
    where they cannot be found, mpi4py gives no handles (``.handle``: mpi4py 4) or the
    handles are neither ints nor pointers (the calls then go through mpi4py)."""
    try:
        import ctypes
        if not hasattr(MPI.COMM_WORLD, "handle"):
            return None
        size = MPI._sizeof(MPI.Comm)
        if size not in (4, ctypes.sizeof(ctypes.c_void_p)) or any(
                MPI._sizeof(t) != size for t in (MPI.Datatype, MPI.Op)):
            return None
        lib = ctypes.CDLL(MPI.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in ENTRY_NAMES) + (size,)
    except (ImportError, OSError, AttributeError, TypeError):
        return None


def handle(obj):
    return None if obj is None else obj.handle


def reduce_kernel():
    """``reduce_ptr(dst, src, count, dtype, op)`` from _core, else the pure-Python fallback."""
    for name in ("collectives.engines._core", "collectives.core.kernels_numpy"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(mod, "reduce_ptr", None)
        if fn is not None:
            return fn
    raise DistBackendError("float16/bfloat16 reductions need collectives.engines._core (build it with "
                           "setup.py build_ext) or collectives.core.kernels_numpy; neither "
                           "provides reduce_ptr")


def overlap(a, b):
    return (a.count and b.count and a.ptr < b.ptr + b.count * b.itemsize
            and b.ptr < a.ptr + a.count * a.itemsize)


def displs(counts):
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def launcher_world_size():
    """The number of processes mpiexec started (1 when not under an MPI launcher)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1
