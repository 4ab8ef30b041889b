"""Raw memory as NumPy arrays: the views both Buffers give (the compiled one in
``engines/_buffer.pyx`` and its Python twin in :mod:`collectives.core.tensors`), and their
repr. Below the engines: it imports only NumPy and the dtype codes.
"""
import numpy as np

from . import dtypes as D

# NumPy's dtypes by our codes, named as dtypes.DTYPE_NAMES names them (the one list of the
# dtypes); bfloat16 has no NumPy dtype
_NP_CODES = {np.dtype(name): code for code, name in D.DTYPE_NAMES.items() if code != D.BFLOAT16}
_NP_OF_CODE = {code: dt for dt, code in _NP_CODES.items()}
# bfloat16 has no NumPy dtype; arrays of it are viewed as uint16 bits
_NP_OF_CODE[D.BFLOAT16] = np.dtype(np.uint16)


def buffer_repr(b):
    """``Buffer(ptr=..., count=..., dtype=..., device=...)`` for either Buffer."""
    return f"Buffer(ptr=0x{b.ptr:x}, count={b.count}, dtype={D.DTYPE_NAMES[b.dtype]}, device={b.device})"


def buffer_numpy(b):
    """``b.numpy()`` for either Buffer: its owner array reshaped where it is that very
    memory, else a view (host memory only)."""
    if b.device != -1:
        raise ValueError("Buffer.numpy() needs host memory, got a CUDA buffer")
    obj = b.obj
    if (isinstance(obj, np.ndarray) and obj.dtype == _NP_OF_CODE[b.dtype]
            and obj.size == b.count and obj.__array_interface__["data"][0] == b.ptr):
        return obj.reshape(-1)
    return view_numpy(b.ptr, b.count, b.dtype, b.obj)


class _Holder:
    """Exposes raw memory through __array_interface__, keeping its owner alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, ptr, nbytes, owner):
        self.owner = owner
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


def view_numpy(ptr, count, dtype, owner=None):
    """A writable NumPy array of ``count`` elements of ``dtype`` at ``ptr`` (no copy)."""
    nbytes = count * D.ITEMSIZE[dtype]
    if nbytes == 0:
        return np.empty(0, _NP_OF_CODE[dtype])
    return np.asarray(_Holder(ptr, nbytes, owner)).view(_NP_OF_CODE[dtype])
