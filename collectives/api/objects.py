"""Python objects over the wire: all_gather_object, gather_object, broadcast_object_list,
scatter_object_list, send_object_list, recv_object_list.

Objects travel as pickles. Unpickling runs code chosen by the sender: use these
only between trusted peers, exactly as with torch.distributed (under collectives-run,
only processes holding the job's key are peers). ``safe=True`` on any of these calls, or
COLLECTIVES_SAFE_OBJECTS=1, unpickles in safe mode: plain data, NumPy arrays and torch
tensors only, anything else refused (:mod:`collectives.security.safe_pickle`).
"""
import pickle

import numpy as np

from ..core import dtypes as D
from ..security import safe_pickle
from ..core.world import current as _group
from ..core.tensors import Buffer
from .opspec import recv_peer, send_peer


_CODES = {np.dtype(np.uint8): D.UINT8, np.dtype(np.int64): D.INT64}


def _run(pg, fn, *args):
    """``fn(*args)`` as a collective of ``pg`` named after the backend call, through the
    group's dispatcher (recorded; one profiler span while torch's profiler runs, as torch
    records the collectives under its object calls).
    A backend that takes CUDA memory (nccl) gets copies on the current CUDA device, as
    torch's object calls use it, and the host arrays get the results back."""
    back = ()
    if getattr(pg.backend, "takes_cuda", False):
        args, back = _on_cuda(args)
    buf = args[1] if fn.__name__ in ("all_gather", "gather") else args[0]  # the same on every rank
    root = args[-1] if type(args[-1]) is int else -1
    pg.dispatch.call(fn.__name__, buf, root, -1, fn, tuple(args))
    _copy_back(back)


def _on_cuda(args):
    """``args`` with each host Buffer replaced by a CUDA copy; [(host array, CUDA tensor)]."""
    import torch
    dev = torch.device("cuda", torch.cuda.current_device())
    out, back = [], []
    for a in args:
        if isinstance(a, Buffer) and a.device == -1:
            host = a.obj
            t = torch.from_numpy(host if host.flags.writeable else host.copy()).to(dev)
            if host.flags.writeable:  # read-only ones are inputs (pickles)
                back.append((host, t))
            a = Buffer(t.data_ptr(), a.count, a.dtype, dev.index, t)
        out.append(a)
    return out, back


def _copy_back(back):
    for host, dev in back:
        host[...] = dev.cpu().numpy()


def _p2p(pg, post, buf, peer):
    """``post(buf, peer, 0).wait()`` as a blocking send or recv through the group's
    dispatcher (recorded; in a span while torch's profiler runs), through CUDA memory for
    a backend that takes it; returns the Request."""
    back = ()
    if getattr(pg.backend, "takes_cuda", False):
        (buf,), back = _on_cuda((buf,))
    req = pg.dispatch.post("send" if post.__name__ == "isend" else "recv", post, buf, peer, 0)
    req.wait()
    _copy_back(back)
    return req


def _buf(a):
    return Buffer(a.ctypes.data, a.size, _CODES[a.dtype], -1, a)


def _pickle(obj):
    return np.frombuffer(pickle.dumps(obj), np.uint8)


def _unpickle(a, safe, pg, r):
    return safe_pickle.loads(a.tobytes(), safe, f"rank {pg.ranks[r]}")


def _output_list(lst, n, name):
    if not isinstance(lst, list):
        raise TypeError(f"{name} must be a list, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{name} must hold {n} entries (one per rank of the group), got {len(lst)}")


def _all_gather_sizes(pg, nbytes):
    sizes = np.zeros(pg._size, np.int64)
    _run(pg, pg.backend.all_gather, _buf(sizes), _buf(np.array([nbytes], np.int64)))
    return sizes


def _padded(data, length):
    out = np.zeros(length, np.uint8)
    out[:data.size] = data
    return out


def all_gather_object(object_list, obj, group=None, *, safe=None):
    """``object_list[r]`` becomes rank r's ``obj``, on every rank (pickled: trusted peers only;
    ``safe``: see the module docstring)."""
    safe = safe_pickle.check_safe(safe)
    pg = _group(group)
    if pg is None:
        return None
    n = pg._size
    _output_list(object_list, n, "object_list")
    data = _pickle(obj)
    sizes = _all_gather_sizes(pg, data.size)
    width = int(sizes.max())
    out = np.empty(n * width, np.uint8)
    _run(pg, pg.backend.all_gather, _buf(out), _buf(_padded(data, width)))
    for r in range(n):
        object_list[r] = _unpickle(out[r * width:r * width + sizes[r]], safe, pg, r)
    return None


def _rooted(group, rank, group_rank, name):
    """(the group, the root's group rank) of a rooted object call, or (None, None) on a
    rank outside ``group``."""
    pg = _group(group)
    if pg is None:
        return None, None
    return pg, pg.peer(rank, group_rank, name, default=0)


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None, *,
                  safe=None):
    """``object_gather_list[r]`` on ``dst`` becomes rank r's ``obj`` (pickled: trusted peers
    only; ``safe``: see the module docstring)."""
    safe = safe_pickle.check_safe(safe)
    pg, root = _rooted(group, dst, group_dst, "dst")
    if pg is None:
        return None
    if pg._rank == root:
        if object_gather_list is None:
            raise ValueError("object_gather_list must be given on the destination rank")
        _output_list(object_gather_list, pg._size, "object_gather_list")
    elif object_gather_list:
        raise ValueError("Argument ``object_gather_list`` must NOT be specified on non-destination ranks.")
    data = _pickle(obj)
    sizes = _all_gather_sizes(pg, data.size)
    width = int(sizes.max())
    out = np.empty(pg._size * width, np.uint8) if pg._rank == root else None
    _run(pg, pg.backend.gather, None if out is None else _buf(out), _buf(_padded(data, width)), root)
    if out is not None:
        for r in range(pg._size):
            object_gather_list[r] = _unpickle(out[r * width:r * width + sizes[r]], safe, pg, r)
    return None


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None, *,
                          safe=None):
    """Every rank's ``object_list`` entries become ``src``'s (same length on every rank;
    ``safe``: see the module docstring)."""
    safe = safe_pickle.check_safe(safe)
    pg, root = _rooted(group, src, group_src, "src")
    if pg is None:
        return None
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    k = len(object_list)
    be = pg.backend
    sizes = np.zeros(k, np.int64)
    if pg._rank == root:
        parts = [_pickle(o) for o in object_list]
        sizes[:] = [p.size for p in parts]
        data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    _run(pg, be.broadcast, _buf(sizes), root)
    if pg._rank != root:
        data = np.empty(int(sizes.sum()), np.uint8)
    _run(pg, be.broadcast, _buf(data), root)
    if pg._rank != root:
        off = 0
        for i in range(k):
            object_list[i] = _unpickle(data[off:off + sizes[i]], safe, pg, root)
            off += int(sizes[i])
    return None


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                        group=None, group_src=None, *, safe=None):
    """``scatter_object_output_list[0]`` on rank r becomes ``src``'s
    ``scatter_object_input_list[r]`` (``safe``: see the module docstring)."""
    safe = safe_pickle.check_safe(safe)
    pg, root = _rooted(group, src, group_src, "src")
    if pg is None:
        return None
    n = pg._size
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    be = pg.backend
    sizes = np.zeros(n, np.int64)
    if pg._rank == root:
        _output_list(scatter_object_input_list, n, "scatter_object_input_list")
        parts = [_pickle(o) for o in scatter_object_input_list]
        sizes[:] = [p.size for p in parts]
    _run(pg, be.broadcast, _buf(sizes), root)
    width = int(sizes.max())
    inp = None
    if pg._rank == root:
        inp = _buf(np.concatenate([_padded(p, width) for p in parts]))
    out = np.empty(width, np.uint8)
    _run(pg, be.scatter, _buf(out), inp, root)
    scatter_object_output_list[0] = _unpickle(out[:sizes[pg._rank]], safe, pg, root)
    return None


def send_object_list(object_list, dst=None, group=None, device=None, group_dst=None,
                     use_batch=False):
    """Send the objects of ``object_list`` to ``dst`` (pickled: trusted peers only).
    ``use_batch`` (torch's choice of batch_isend_irecv over send) changes nothing here: the
    backend's sends are posted without blocking either way."""
    pg = _group(group)
    if pg is None:
        return None
    peer = send_peer(pg, dst, group_dst)
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    parts = [_pickle(o) for o in object_list]
    sizes = np.array([p.size for p in parts], np.int64)
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    be = pg.backend
    _p2p(pg, be.isend, _buf(sizes), peer)
    _p2p(pg, be.isend, _buf(data), peer)
    return None


def recv_object_list(object_list, src=None, group=None, device=None, group_src=None,
                     use_batch=False, *, safe=None):
    """Fill ``object_list`` with objects sent by ``src`` (None: any rank). Returns the sender's
    global rank. ``use_batch`` changes nothing (as in send_object_list); ``safe``: see the
    module docstring."""
    safe = safe_pickle.check_safe(safe)
    pg = _group(group)
    if pg is None:
        return -1
    peer = recv_peer(pg, src, group_src)
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    be = pg.backend
    sizes = np.zeros(len(object_list), np.int64)
    req = _p2p(pg, be.irecv, _buf(sizes), peer)
    if peer is None:
        peer = req.source
    data = np.empty(int(sizes.sum()), np.uint8)
    _p2p(pg, be.irecv, _buf(data), peer)
    off = 0
    for i in range(len(object_list)):
        object_list[i] = _unpickle(data[off:off + sizes[i]], safe, pg, peer)
        off += int(sizes[i])
    return pg.ranks[peer]


__all__ = ["all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
           "send_object_list", "recv_object_list"]
