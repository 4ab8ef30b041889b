"""Staging: several tensors seen by the backend as one Buffer, and the copies around a call.

:func:`contiguous_span` finds tensors that already lie back to back; :func:`stage` copies
them into one new Buffer and :func:`unstage` back (one C loop in ``engines._core`` for host
memory, where built); :func:`copy_of` and :func:`copy_into` copy one Buffer.
"""
from . import cuda as _cuda
from .tensors import Buffer, empty_like_buffer, overlaps

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
    ``own_block_in_place`` (torch's in-place forms: the group's ``_own_block``, the rule the
    front end's direct call reads too)."""
    own = pg._own_block
    return overlaps(whole, part) and not (own >= 0 and part.ptr == whole.ptr + own * part.nbytes)


def _py_separate_blocks(outs, inp, rank):
    """Whether ``outs`` (an all_gather's list) do not lie back to back, so that a backend
    gathering into the list itself saves a staging copy, and none of them overlaps ``inp``
    but ``outs[rank]`` being ``inp`` itself. False for an empty list."""
    return bool(outs) and contiguous_span(outs) is None and not any(
        overlaps(b, inp) and not (q == rank and b.ptr == inp.ptr) for q, b in enumerate(outs))


try:
    from ..engines._buffer import separate_blocks
except ImportError:  # extensions not built (or hidden)
    separate_blocks = _py_separate_blocks


_kernels = False  # collectives.engines._core once looked up (None when not built)


def _flatten_kernels():
    global _kernels
    if _kernels is False:
        try:
            from ..engines import _core
            _kernels = _core
        except ImportError:
            _kernels = None
    return _kernels


def stage(bufs, dtype, copy_in):
    """A new Buffer holding all of ``bufs`` back to back (their data copied if ``copy_in``)."""
    total = sum(b.count for b in bufs)
    device = _cuda.one_device(bufs)
    if device != -1:
        st = _cuda.device_empty(total, dtype, device)
        if copy_in and total:
            flat, off = st.obj, 0
            for b in bufs:
                flat[off:off + b.count].copy_(_cuda.device_view(b))
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
    if _cuda.one_device(bufs, st.device) != -1:
        flat, off = _cuda.device_view(st), 0
        for b in bufs:
            if b.count:
                _cuda.device_view(b).copy_(flat[off:off + b.count])
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
            _cuda.device_view(dst).copy_(_cuda.device_view(src))
        else:
            dst.numpy()[...] = src.numpy()


def copy_of(buf):
    if buf.device != -1:
        st = _cuda.device_empty(buf.count, buf.dtype, buf.device)
        copy_into(st, buf)
        return st
    st = empty_like_buffer(buf.count, buf.dtype)
    copy_into(st, buf)
    return st


__all__ = ["contiguous_span", "needs_own_copy", "separate_blocks", "stage", "unstage",
           "copy_into", "copy_of"]
