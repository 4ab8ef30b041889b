"""CUDA memory (only with a backend that takes it: nccl) and the process's CUDA state.

``cuda_seen``: whether a CUDA tensor was ever made a Buffer (a CUDA backend was live);
until then the front end's per-call check that a host backend gets no CUDA memory is
skipped. The device helpers are torch ops on the current stream.
"""
from .tensors import Buffer

#: whether a CUDA tensor was ever made a Buffer (a CUDA backend was live): until then the
#: front end's per-call check that a host backend gets no CUDA memory is skipped
cuda_seen = False


def backend_live():
    """Whether some live group's backend takes CUDA memory (nccl); only asked for CUDA tensors."""
    from .world import world
    return any(getattr(pg.backend, "takes_cuda", False) for pg in world.groups)


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


def one_device(bufs, device=None):
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


def device_empty(count, dtype, device):
    import torch
    t = torch.empty(count, dtype=_torch_dtype(dtype), device=torch.device("cuda", device))
    return Buffer(t.data_ptr(), count, dtype, device, t)
