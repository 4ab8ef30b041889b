"""Helpers shared by the front-end modules: tensor conversion, op plans, staging buffers.

Kept lean: the blocking path of a small collective spends most of its front-end
time here, so the common case (a contiguous CPU torch tensor or NumPy array)
takes one dict lookup and a handful of attribute reads.
"""
from ctypes import addressof, c_char

import numpy as np

from . import dtypes as D
from .errors import DistError
from .reduce_op import PremulSum, op_code
from .tensors import (_NP_CODES, Buffer, disjoint_gather, empty_like_buffer,  # noqa: F401
                      is_torch_tensor, overlaps, to_buffer)

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
        if not _cuda_backend_live():
            check_device(b, name)  # host C code must never get a device pointer
        global cuda_seen
        cuda_seen = True  # from now on every call checks its buffers against its backend,
        if _fast is not None:  # so CUDA tensors may take the C path
            _fast._allow_cuda()
    return b


#: whether a CUDA tensor was ever made a Buffer (a CUDA backend was live): until then the
#: front end's per-call check that a host backend gets no CUDA memory is skipped
cuda_seen = False


try:
    from .. import _buffer as _fast
except ImportError:  # extensions not built
    _fast = None
    buffer = _py_buffer
else:
    _fast._learn_numpy(_NP_CODES)
    _fast._configure(_py_buffer)
    buffer = _fast.buffer


def _cuda_backend_live():
    """Whether some live group's backend takes CUDA memory (nccl); only asked for CUDA tensors."""
    from .world import world
    return any(getattr(pg.backend, "takes_cuda", False) for pg in world.groups)


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


# ---- CUDA memory (only with a backend that takes it): torch ops on the current stream ---------

class _CudaMemory:
    """Raw device bytes, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


def device_view(buf):
    """A torch tensor over ``buf``'s CUDA memory, of its dtype (no copy)."""
    import torch
    dtype = _torch_dtype(buf.dtype)
    dev = torch.device("cuda", buf.device)
    if not buf.count:
        return torch.empty(0, dtype=dtype, device=dev)
    with torch.cuda.device(dev):
        raw = torch.as_tensor(_CudaMemory(buf.ptr, buf.nbytes), device=dev)
    return raw.view(dtype)


def _one_device(bufs, device=None):
    """The device all of ``bufs`` lie on (-1: host memory); ValueError for a mix."""
    if device is None:
        device = bufs[0].device if bufs else -1
    for b in bufs:
        if b.device != device:
            where = lambda d: "host memory" if d == -1 else f"CUDA device {d}"  # noqa: E731
            raise ValueError(f"the tensors of one call must lie on one device, got {where(device)} "
                             f"and {where(b.device)}")
    return device


def _torch_dtype(code):
    from .tensors import _torch_table
    return next(t for t, c in _torch_table().items() if c == code)


def _device_empty(count, dtype, device):
    import torch
    t = torch.empty(count, dtype=_torch_dtype(dtype), device=torch.device("cuda", device))
    return Buffer(t.data_ptr(), count, dtype, device, t)


# ---- reduction plans ---------------------------------------------------------------------

_VALID = frozenset((d, o) for d in D.DTYPE_NAMES for o in range(D.PREMUL_SUM) if D.op_valid(d, o))
_SCALABLE = D.FLOATING | D.COMPLEX


def reduce_plan(op, dtype):
    """``(backend op code, factor to pre-scale by or None, post-scale by 1/size?)``.

    AVG is SUM then a scale by 1/size; PREMUL_SUM(f) is a scale by f then SUM.
    ValueError (before any communication) for an op the dtype does not support.
    """
    code = op_code(op)
    if code == D.AVG or code == D.PREMUL_SUM:
        if dtype not in _SCALABLE:
            raise ValueError(f"op={D.OP_NAMES[code]} needs a floating or complex tensor, got "
                             f"{D.DTYPE_NAMES[dtype]} (integer averages would be truncated)")
        if code == D.AVG:
            return D.SUM, None, True
        return D.SUM, premul_factor(op), False
    if (dtype, code) not in _VALID:
        raise ValueError(f"op={D.OP_NAMES[code]} is not defined for {D.DTYPE_NAMES[dtype]} tensors")
    return code, None, False


def premul_factor(op):
    f = op.factor if isinstance(op, PremulSum) else op
    if hasattr(f, "item"):
        if getattr(f, "numel", lambda: getattr(f, "size", 1))() != 1:
            raise ValueError("ReduceOp.PREMUL_SUM factor must be a number or a one-element tensor")
        f = f.item()
    if not isinstance(f, (int, float)) or isinstance(f, bool):
        raise ValueError(f"ReduceOp.PREMUL_SUM factor must be a real number, got {f!r}")
    return float(f)


# ---- scaling (AVG, PREMUL_SUM) -----------------------------------------------------------

def _load_scale():
    """``scale_ptr`` of the C kernels, else of their NumPy twin (the same bits: half types
    scaled in float32 and rounded once)."""
    try:
        from .._core import scale_ptr
    except ImportError:  # extensions not built
        from .kernels_numpy import scale_ptr
    return lambda buf, factor: scale_ptr(buf.ptr, buf.count, buf.dtype, factor)


_scale_impl = None


def scale(buf, factor):
    """``buf *= factor`` in place (floating and complex dtypes)."""
    global _scale_impl
    if buf.device != -1:
        if buf.count:
            device_view(buf).mul_(factor)
        return
    if _scale_impl is None:
        _scale_impl = _load_scale()
    if buf.count:
        _scale_impl(buf, factor)


# ---- staging: several tensors seen by the backend as one Buffer ------------------------------

def contiguous_span(bufs):
    """One Buffer over ``bufs`` if they lie back to back in memory, else None."""
    if not bufs:
        return None
    first = bufs[0]
    ptr = first.ptr
    for b in bufs:
        if b.ptr != ptr and b.count:
            return None
        ptr += b.nbytes
    return Buffer(first.ptr, sum(b.count for b in bufs), first.dtype, first.device, bufs)


def needs_own_copy(pg, whole, part):
    """Whether ``part`` (all_gather's input, reduce_scatter's output) overlaps ``whole`` in a
    way the backend cannot take: anything but exactly this rank's block of a backend with
    ``own_block_in_place`` (torch's in-place forms)."""
    return overlaps(whole, part) and not (pg.backend.own_block_in_place
                                          and part.ptr == whole.ptr + pg._rank * part.nbytes)


def _py_separate_blocks(outs, inp, rank):
    """Whether ``outs`` (an all_gather's list) do not lie back to back, so that a backend
    gathering into the list itself saves a staging copy, and none of them overlaps ``inp``
    but ``outs[rank]`` being ``inp`` itself. False for an empty list."""
    return bool(outs) and contiguous_span(outs) is None and not any(
        overlaps(b, inp) and not (q == rank and b.ptr == inp.ptr) for q, b in enumerate(outs))


separate_blocks = _py_separate_blocks if _fast is None else _fast.separate_blocks
if _fast is not None:
    _fast._set_slow_list(_py_buffers)
buffers = _py_buffers if _fast is None else _fast.buffers


_kernels = False  # collectives._core once looked up (None when not built)


def _flatten_kernels():
    global _kernels
    if _kernels is False:
        try:
            from .. import _core
            _kernels = _core
        except ImportError:
            _kernels = None
    return _kernels


def stage(bufs, dtype, copy_in):
    """A new Buffer holding all of ``bufs`` back to back (their data copied if ``copy_in``)."""
    total = sum(b.count for b in bufs)
    device = _one_device(bufs)
    if device != -1:
        st = _device_empty(total, dtype, device)
        if copy_in and total:
            flat, off = st.obj, 0
            for b in bufs:
                flat[off:off + b.count].copy_(device_view(b))
                off += b.count
        return st
    st = empty_like_buffer(total, dtype)
    if copy_in and total:
        core = _flatten_kernels()
        if core is not None:  # one C loop, GIL released
            core.flatten(bufs, out=st.bytes_view())
            return st
        flat = st.numpy()
        off = 0
        for b in bufs:
            flat[off:off + b.count] = b.numpy()
            off += b.count
    return st


def unstage(st, bufs):
    """Copy consecutive slices of ``st`` back into ``bufs``."""
    if not st.count:
        return
    if _one_device(bufs, st.device) != -1:
        flat, off = device_view(st), 0
        for b in bufs:
            if b.count:
                device_view(b).copy_(flat[off:off + b.count])
            off += b.count
        return
    core = _flatten_kernels()
    if core is not None:
        core.unflatten(st, bufs)
        return
    flat = st.numpy()
    off = 0
    for b in bufs:
        if b.count:
            b.numpy()[...] = flat[off:off + b.count]
        off += b.count


def copy_into(dst, src):
    if dst.count:
        if dst.device != -1:
            device_view(dst).copy_(device_view(src))
        else:
            dst.numpy()[...] = src.numpy()


def copy_of(buf):
    if buf.device != -1:
        st = _device_empty(buf.count, buf.dtype, buf.device)
        copy_into(st, buf)
        return st
    st = empty_like_buffer(buf.count, buf.dtype)
    copy_into(st, buf)
    return st


class Steps:
    """Several calls run as one queued operation (so async work keeps its copy-out steps)."""

    __slots__ = ("__name__", "steps")

    def __init__(self, name, steps):
        self.__name__ = name
        self.steps = steps

    def __call__(self):
        for fn, args in self.steps:
            fn(*args)


__all__ = ["buffer", "buffers", "reduce_plan", "scale", "stage", "unstage", "contiguous_span",
           "overlaps", "copy_of", "copy_into", "Steps", "DistError"]


def _nothing():
    pass


def settle(pg):
    """Wait for ``pg``'s queued async work: an input copied at issue time must hold the value
    that issue order gives it, not one an earlier async op is still about to write."""
    pg.run(_nothing)
