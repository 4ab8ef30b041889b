"""Turn torch tensors and NumPy arrays into flat buffers, once, for every backend.

A backend never sees a torch tensor: it gets a :class:`Buffer` (pointer, element
count, dtype code, device). torch is imported only when a torch tensor is passed.
"""
import sys

import numpy as np

from . import dtypes as D

from .views import _NP_CODES, _NP_OF_CODE, buffer_numpy, buffer_repr

_torch_codes = None


def _torch_table():
    global _torch_codes
    if _torch_codes is None:
        import torch

        from . import profiling
        profiling.refresh()
        _torch_codes = {getattr(torch, name): code for code, name in D.DTYPE_NAMES.items()}
    return _torch_codes


class _PyBuffer:
    """A contiguous block of elements: what a backend reads and writes.

    Attributes:
        ptr: address of the first element.
        count: number of elements.
        dtype: dtype code from :mod:`collectives.core.dtypes`.
        itemsize: bytes per element.
        device: -1 for host memory, else the CUDA device index.
        obj: the array or tensor that owns the memory (kept alive by the Buffer).

    The compiled ``collectives.engines._buffer.Buffer`` is the same type in C (filled without
    Python calls on the front end's fast path); this one serves where it is not built.
    """

    __slots__ = ("ptr", "count", "dtype", "itemsize", "device", "obj")

    def __init__(self, ptr, count, dtype, device=-1, obj=None):
        if dtype not in D.ITEMSIZE:
            raise ValueError(f"dtype must be a dtype code in [0, {len(D.ITEMSIZE)}), got {dtype!r}")
        self.ptr = ptr
        self.count = count
        self.dtype = dtype
        self.itemsize = D.ITEMSIZE[dtype]
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
        return type(self)(self.ptr + start * self.itemsize, stop - start, self.dtype, self.device,
                          self.obj)

    def __repr__(self):
        return buffer_repr(self)


try:
    from ..engines._buffer import Buffer
except ImportError:  # extensions not built: the pure-Python type
    Buffer = _PyBuffer


def is_torch_tensor(obj):
    # torch may be half-imported by another thread: no Tensor yet means obj is not one
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor_type is not None and isinstance(obj, tensor_type)


def dtype_code(obj, name="tensor"):
    """The dtype code of a tensor or array; TypeError naming ``name`` for other dtypes."""
    if isinstance(obj, np.ndarray):
        code = _NP_CODES.get(obj.dtype)
        if code is None and obj.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            code = D.BFLOAT16
    elif is_torch_tensor(obj):
        code = _torch_table().get(obj.dtype)
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")
    if code is None:
        raise TypeError(f"{name} has unsupported dtype {obj.dtype}; expected one of "
                        + ", ".join(D.DTYPE_NAMES.values()))
    return code


def to_buffer(obj, name="tensor"):
    """The Buffer over ``obj``'s memory (zero-copy).

    Raises TypeError for an object that is not a tensor/array or has an unsupported
    dtype, and ValueError for a non-contiguous one, naming ``name``.
    """
    if isinstance(obj, np.ndarray):
        code = dtype_code(obj, name)
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous (C order). numpy.ascontiguousarray({name}) "
                             f"would be a copy: an in-place call (all_reduce, broadcast, recv...) writes "
                             f"its result there, not into {name}; pass a contiguous array you keep (and "
                             f"copy it back into the view where the view must hold the result)")
        if not obj.flags.writeable:
            raise ValueError(f"{name} must be writeable")
        return Buffer(obj.__array_interface__["data"][0], obj.size, code, -1, obj)
    if is_torch_tensor(obj):
        code = _torch_table().get(obj.dtype)
        if code is None:
            raise TypeError(f"{name} has unsupported dtype {obj.dtype}; expected one of "
                            + ", ".join(D.DTYPE_NAMES.values()))
        if not obj.is_contiguous():
            raise ValueError(f"{name} must be contiguous. {name}.contiguous() would be a copy: an "
                             f"in-place call (all_reduce, broadcast, recv...) writes its result there, "
                             f"not into {name}; pass a contiguous tensor you keep (and copy it back "
                             f"into the view where the view must hold the result)")
        if obj.is_sparse:
            raise ValueError(f"{name} must be a dense tensor, got a sparse one")
        if obj.is_conj() or obj.is_neg():
            # data_ptr() would point at the unconjugated / unnegated values
            raise ValueError(f"{name} is a lazy conjugate or negative view; call .resolve_conj() "
                             "and .resolve_neg() first")
        dev = obj.device
        device = -1 if dev.type == "cpu" else (dev.index or 0) if dev.type == "cuda" else None
        if device is None:
            raise ValueError(f"{name} is on device {dev}; expected cpu or cuda")
        return Buffer(obj.data_ptr(), obj.numel(), code, device, obj)
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def empty_like_buffer(count, dtype):
    """A new host Buffer of ``count`` elements of ``dtype``, backed by NumPy."""
    arr = np.empty(count, _NP_OF_CODE[dtype])
    return Buffer(arr.__array_interface__["data"][0], count, dtype, -1, arr)


def overlaps(a, b):
    """Whether Buffers ``a`` and ``b`` share a byte."""
    return a.count and b.count and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def _py_disjoint_gather(out, inp, size, own=-1):
    return out.dtype == inp.dtype and out.count == inp.count * size and (
        not overlaps(out, inp) or own >= 0 and inp.ptr == out.ptr + own * inp.nbytes)


try:  # whether a gather of ``size`` blocks like ``inp`` fits ``out`` without overlapping it
    # (or, ``own`` >= 0, with ``inp`` exactly block ``own`` of it)
    from ..engines._buffer import disjoint_gather
except ImportError:  # extensions not built
    disjoint_gather = _py_disjoint_gather


try:  # the compiled kernels take this to_buffer for what they do not read in C (its errors)
    from ..engines import _core as _kernels
except ImportError:  # extensions not built (or hidden)
    pass
else:
    _kernels._set_to_buffer(to_buffer)
