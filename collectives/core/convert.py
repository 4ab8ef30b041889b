"""Tensors and arrays to Buffers on the front end's path, and the checks of what a call gets.

Kept lean: the blocking path of a small collective spends most of its front-end time
here, so the common case (a contiguous CPU torch tensor or NumPy array) takes one dict
lookup and a handful of attribute reads. ``buffer`` and ``buffers`` are the compiled ones
(``engines/_buffer.pyx``) where built, falling back to these for anything else.
"""
from ctypes import addressof, c_char

import numpy as np

from . import cuda as _cuda
from . import dtypes as D
from .tensors import Buffer, is_torch_tensor, to_buffer
from .views import _NP_CODES

_torch_tensor = None      # torch.Tensor once seen (torch is never imported here)
_torch_codes = {}
_strided = None


def _learn_torch():
    global _torch_tensor, _torch_codes, _strided
    import torch

    from .tensors import _torch_table
    _torch_codes = dict(_torch_table())
    _strided = torch.strided
    _torch_tensor = torch.Tensor
    if _fast is not None:
        _fast._configure(_py_buffer, _torch_tensor, _torch_codes, _strided)


def _py_buffer(t, name="tensor"):
    """``to_buffer(t, name)``, with a short path for plain contiguous CPU torch tensors
    and NumPy arrays (``_buffer.buffer`` is the same in C, falling back to this)."""
    if type(t) is _torch_tensor:
        code = _torch_codes.get(t.dtype)
        if (code is not None and t.is_cpu and t.layout is _strided and t.is_contiguous()
                and not t.is_conj() and not t.is_neg()):  # lazy views: to_buffer refuses them
            return Buffer(t.data_ptr(), t.numel(), code, -1, t)
    elif type(t) is np.ndarray:
        code = _NP_CODES.get(t.dtype)
        flags = t.flags
        if code is not None and t.size and flags.c_contiguous and flags.writeable:
            # ctypes reads the address ~5x faster than __array_interface__
            return Buffer(addressof(c_char.from_buffer(t)), t.size, code, -1, t)
    elif _torch_tensor is None and is_torch_tensor(t):
        _learn_torch()
    b = to_buffer(t, name)
    if b.device != -1:
        if not _cuda.backend_live():
            check_device(b, name)  # host C code must never get a device pointer
        _cuda.cuda_seen = True  # from now on every call checks its buffers against its backend,
        if _fast is not None:  # so CUDA tensors may take the C path
            _fast._allow_cuda()
    return b


try:
    from ..engines import _buffer as _fast
except ImportError:  # extensions not built
    _fast = None
    buffer = _py_buffer
else:
    _fast._learn_numpy(_NP_CODES)
    _fast._configure(_py_buffer)
    buffer = _fast.buffer


def _py_buffers(tensors, name, dtype=None, count=None, length=None):
    """Buffers of a list of tensors that share a dtype (and ``count`` elements, if given)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    if length is not None and len(tensors) != length:
        raise ValueError(f"{name} must hold {length} tensors (one per rank of the group), "
                         f"got {len(tensors)}")
    out = []
    for i, t in enumerate(tensors):
        b = buffer(t, f"{name}[{i}]")
        if dtype is None:
            dtype = b.dtype
        elif b.dtype != dtype:
            raise ValueError(f"{name}[{i}] has dtype {D.DTYPE_NAMES[b.dtype]}; expected "
                             f"{D.DTYPE_NAMES[dtype]} like the others")
        if count is not None and b.count != count:
            raise ValueError(f"{name}[{i}] has {b.count} elements; expected {count}")
        out.append(b)
    return out


def check_like(b, ref, name, refname, count=None):
    if b.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {D.DTYPE_NAMES[b.dtype]}; expected "
                         f"{D.DTYPE_NAMES[ref.dtype]} like {refname}")
    if count is not None and b.count != count:
        raise ValueError(f"{name} has {b.count} elements; expected {count}")


def check_device(b, name):
    if b.device != -1:
        raise ValueError(f"{name} is a CUDA tensor; this group's backend takes CPU tensors "
                         f"(use backend='nccl' for CUDA)")


def check_devices(pg, bufs, name):
    """ValueError unless ``bufs`` lie where ``pg``'s backend takes them: CUDA memory for a
    backend that takes CUDA (nccl), host memory otherwise. Needed once a CUDA backend is
    live: CUDA tensors then pass ``buffer``, and a host backend must never get one."""
    cuda = getattr(pg.backend, "takes_cuda", False)
    for b in bufs:
        if b is not None and (b.device != -1) != cuda:
            if cuda:
                raise ValueError(f"{name} is in host memory; the {pg.backend_name} group "
                                 f"takes CUDA tensors")
            check_device(b, name)


if _fast is not None:
    _fast._set_slow_list(_py_buffers)
buffers = _py_buffers if _fast is None else _fast.buffers

__all__ = ["buffer", "buffers", "check_like", "check_device", "check_devices"]
