"""Collectives: broadcast, all_reduce, reduce, all_gather, gather, scatter, reduce_scatter,
all_to_all, barrier (torch.distributed signatures).

Each function has the same steps: resolve the group (return None if this rank is not a
member), check and convert the tensors, plan the op (the backend method and the steps
around it), and hand it to the group's dispatcher (``pg.dispatch.call``: see
:mod:`collectives.dispatch`), which records it, runs it blocking or queues it, and returns
a Work when async. The common call of each (one op and one step) goes to the dispatcher
as it is; a call of several steps through :func:`_launch`.
Lists of tensors reach the backend as one Buffer (a staging buffer, or the tensors'
own memory when they already lie back to back).
"""

import numpy as np

from . import _frontend as _fe
from . import dtypes as D
from ._frontend import (Steps, buffer, buffers, check_devices, check_like, contiguous_span, copy_into,
                        copy_of, disjoint_gather, needs_own_copy, overlaps, reduce_plan, scale,
                        separate_blocks, settle, stage, unstage)
from ._world import NOT_INITIALIZED, current, world
from .reduce_op import ReduceOp
from .tensors import Buffer
from .work import timeout_seconds
from ._monitored_barrier import monitored_barrier  # point to point, not a collective call

_SUM = ReduceOp.SUM


def _absent(group):
    """What a call returns on a rank outside ``group`` (None); ValueError before init."""
    if group is None:
        raise ValueError(NOT_INITIALIZED)
    return None


def _launch(pg, async_op, outputs, name, steps, buf, root=-1, op=-1, timeout=None):
    """Run ``steps`` as collective ``name``, recorded with ``buf``'s count and dtype, ``root``
    and ``op`` (a ReduceOp or code; -1: none)."""
    if _fe.cuda_seen:  # a CUDA tensor must not reach a host backend, nor host memory nccl
        for _, args in steps:
            check_devices(pg, [a for a in args if isinstance(a, Buffer)], name)
    fn, args = (Steps(name, steps), ()) if len(steps) > 1 else steps[0]
    return pg.dispatch.call(name, buf, root, int(op), fn, args, async_op, outputs, timeout)


# ---- all_reduce / reduce / broadcast ------------------------------------------------------

def all_reduce(tensor, op=_SUM, group=None, async_op=False):
    """Reduce ``tensor`` across the group, in place, on every rank.

    Args:
        tensor: a contiguous torch CPU tensor or NumPy array (any shape).
        op: a ReduceOp (AVG and PREMUL_SUM need floating or complex tensors).
        group: the group (default: the world).
        async_op: return a Work instead of waiting.

    Example:
        >>> t = torch.ones(2); dist.all_reduce(t)   # t == world_size
    """
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    buf = buffer(tensor)
    be = pg.backend
    if buf.device != -1:
        check_devices(pg, (buf,), "tensor")
    if op is _SUM:
        return pg.dispatch.call("all_reduce", buf, -1, D.SUM, be.all_reduce, (buf, D.SUM),
                                async_op, (tensor,))
    code, pre, avg = reduce_plan(op, buf.dtype)
    steps = [(be.all_reduce, (buf, code))]
    if pre is not None:
        steps.insert(0, (scale, (buf, pre)))
    elif avg:
        steps.append((scale, (buf, 1.0 / pg._size)))
    return _launch(pg, async_op, [tensor], "all_reduce", steps, buf, -1, op)


def _some_buffers(tensors, name):
    """Buffers of a non-empty list of tensors of one dtype."""
    bufs = buffers(tensors, name)
    if not bufs:
        raise ValueError(f"{name} must hold at least one tensor")
    return bufs


def _flat_input(pg, bufs):
    """One Buffer over ``bufs``: their own memory when back to back, else a copy made now
    (after the group's queued work, which may still write them)."""
    flat = contiguous_span(bufs)
    if flat is None:
        settle(pg)
        flat = stage(bufs, bufs[0].dtype, copy_in=True)
    return flat


def all_reduce_coalesced(tensors, op=_SUM, group=None, async_op=False):
    """all_reduce of several tensors of one dtype in one backend call."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    bufs = _some_buffers(tensors, "tensors")
    code, pre, avg = reduce_plan(op, bufs[0].dtype)
    flat = _flat_input(pg, bufs)
    steps = []
    if pre is not None:
        steps.append((scale, (flat, pre)))
    steps.append((pg.backend.all_reduce, (flat, code)))
    if avg:
        steps.append((scale, (flat, 1.0 / pg._size)))
    if flat.obj is not bufs:
        steps.append((unstage, (flat, bufs)))
    return _launch(pg, async_op, list(tensors), "all_reduce_coalesced", steps,
                   flat, -1, op)


def reduce(tensor, dst=None, op=_SUM, group=None, async_op=False, group_dst=None):
    """Reduce ``tensor`` across the group into ``dst``'s tensor; the others keep theirs."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    root = pg.group_of_global.get(dst) if type(dst) is int and group_dst is None else None
    if root is None:  # (a plain global rank: one dict lookup)
        root = pg.peer(dst, group_dst, "dst", default=0)
    buf = buffer(tensor)
    be = pg.backend
    if op is _SUM:
        if buf.device != -1:
            check_devices(pg, (buf,), "tensor")
        return pg.dispatch.call("reduce", buf, root, D.SUM, be.reduce, (buf, D.SUM, root),
                                async_op, (tensor,))
    code, pre, avg = reduce_plan(op, buf.dtype)
    if pre is not None:  # scale a copy: non-root inputs must not change
        settle(pg)
        tmp = copy_of(buf)
        steps = [(scale, (tmp, pre)), (be.reduce, (tmp, code, root))]
        if pg._rank == root:
            steps.append((copy_into, (buf, tmp)))
    else:
        steps = [(be.reduce, (buf, code, root))]
        if avg and pg._rank == root:
            steps.append((scale, (buf, 1.0 / pg._size)))
    return _launch(pg, async_op, [tensor], "reduce", steps, buf, root, op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy ``src``'s tensor into every rank's ``tensor``."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    buf = buffer(tensor)  # (the tensor first, as torch checks it)
    root = pg.group_of_global.get(src) if type(src) is int and group_src is None else None
    if root is None:  # (a plain global rank: one dict lookup)
        root = pg.peer(src, group_src, "src", default=0)
    if buf.device != -1:
        check_devices(pg, (buf,), "tensor")
    return pg.dispatch.call("broadcast", buf, root, -1, pg.backend.broadcast, (buf, root),
                            async_op, (tensor,))


# ---- gathers ----------------------------------------------------------------------------

def _output_span(bufs, dtype, inp):
    """A Buffer the backend can write all of ``bufs`` into, and whether it must be copied out."""
    span = contiguous_span(bufs)
    if span is not None and (inp is None or not overlaps(span, inp)):
        return span, False
    return stage(bufs, dtype, copy_in=False), True


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank) on every rank."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    inp = buffer(tensor)
    outs = buffers(tensor_list, "tensor_list", inp.dtype, inp.count, pg._size)
    if pg.backend.gathers_into_list and separate_blocks(outs, inp, pg._rank):
        # separate tensors, as torch programs allocate them: the backend fills each one
        return _launch(pg, async_op, list(tensor_list), "all_gather",
                       [(pg.backend.all_gather_list, (outs, inp))], inp)
    out, copy_out = _output_span(outs, inp.dtype, inp)
    steps = [(pg.backend.all_gather, (out, inp))]
    if copy_out:
        steps.append((unstage, (out, outs)))
    return _launch(pg, async_op, list(tensor_list), "all_gather", steps, inp)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (size * numel elements)."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    inp = buffer(input_tensor, "input_tensor")
    out = buffer(output_tensor, "output_tensor")
    if disjoint_gather(out, inp, pg._size):  # the common call: checked, as the backend takes it
        if inp.device != -1 or out.device != -1:
            check_devices(pg, (out, inp), "output_tensor and input_tensor")
        return pg.dispatch.call("all_gather", inp, -1, -1, pg.backend.all_gather, (out, inp),
                                async_op, (output_tensor,))
    check_like(out, inp, "output_tensor", "input_tensor", inp.count * pg._size)
    if needs_own_copy(pg, out, inp):
        settle(pg)
        inp = copy_of(inp)
    return _launch(pg, async_op, [output_tensor], "all_gather",
                   [(pg.backend.all_gather, (out, inp))], inp)


all_gather_into_tensor = all_gather_single
_all_gather_base = all_gather_single


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    """Gather every rank's ``input_tensor_list`` in one backend call (torch's deprecated
    coalesced form): ``output_tensor_lists[r][i]`` receives rank r's ``input_tensor_list[i]``.
    The tensors share one dtype, as torch's gloo requires; their shapes may differ."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    ins = _some_buffers(input_tensor_list, "input_tensor_list")
    if not isinstance(output_tensor_lists, (list, tuple)):
        raise TypeError(f"output_tensor_lists must be a list of lists of tensors (one list per "
                        f"rank), got {type(output_tensor_lists).__name__}")
    if len(output_tensor_lists) != pg._size:
        raise ValueError(f"output_tensor_lists must hold {pg._size} lists (one per rank of the "
                         f"group), got {len(output_tensor_lists)}")
    dtype = ins[0].dtype
    outs = []
    for r, tensors in enumerate(output_tensor_lists):
        name = f"output_tensor_lists[{r}]"
        for i, (b, a) in enumerate(zip(buffers(tensors, name, dtype, None, len(ins)), ins)):
            check_like(b, a, f"{name}[{i}]", f"input_tensor_list[{i}]", a.count)
            outs.append(b)
    inp = _flat_input(pg, ins)
    out, copy_out = _output_span(outs, dtype, inp)
    steps = [(pg.backend.all_gather, (out, inp))]
    if copy_out:
        steps.append((unstage, (out, outs)))
    return _launch(pg, async_op, [t for tensors in output_tensor_lists for t in tensors],
                   "all_gather_coalesced", steps, inp)


def _rooted(group, rank, group_rank, name, tensor, tensors, list_name, where):
    """gather's and scatter's checks: (the group, the root, ``tensor``'s Buffer, the Buffers
    of ``tensors``, one per rank, on the root and None elsewhere, where ``tensors`` must be
    empty), or None on a rank outside the group."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    root = pg.peer(rank, group_rank, name, default=0)
    buf = buffer(tensor)
    if pg._rank != root:
        if tensors:
            raise ValueError(f"Argument ``{list_name}`` must NOT be specified on non-{where} ranks.")
        return pg, root, buf, None
    if tensors is None:
        raise ValueError(f"{list_name} must be given on the {where} rank")
    return pg, root, buf, buffers(tensors, list_name, buf.dtype, buf.count, pg._size)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (None elsewhere)."""
    got = _rooted(group, dst, group_dst, "dst", tensor, gather_list, "gather_list", "destination")
    if got is None:
        return None
    pg, root, inp, outs = got
    if outs is None:
        return _launch(pg, async_op, [], "gather", [(pg.backend.gather, (None, inp, root))], inp,
                       root)
    out, copy_out = _output_span(outs, inp.dtype, inp)
    steps = [(pg.backend.gather, (out, inp, root))]
    if copy_out:
        steps.append((unstage, (out, outs)))
    return _launch(pg, async_op, list(gather_list), "gather", steps, inp, root)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Rank r receives ``scatter_list[r]`` of ``src`` into ``tensor``."""
    got = _rooted(group, src, group_src, "src", tensor, scatter_list, "scatter_list", "source")
    if got is None:
        return None
    pg, root, out, ins = got
    inp = None if ins is None else contiguous_span(ins)
    if ins is not None and (inp is None or overlaps(inp, out)):
        settle(pg)
        inp = stage(ins, out.dtype, copy_in=True)
    return _launch(pg, async_op, [tensor], "scatter", [(pg.backend.scatter, (out, inp, root))],
                   out, root)


# ---- reduce_scatter ------------------------------------------------------------------------

def _reduce_scatter(pg, out, inp, op, async_op, outputs, staged_from=None):
    code, pre, avg = reduce_plan(op, out.dtype)
    steps = []
    if pre is not None:
        if staged_from is None:  # the caller's input must not change
            settle(pg)
            inp = copy_of(inp)
        steps.append((scale, (inp, pre)))
    steps.append((pg.backend.reduce_scatter, (out, inp, code)))
    if avg:
        steps.append((scale, (out, 1.0 / pg._size)))
    return _launch(pg, async_op, outputs, "reduce_scatter", steps, out, -1, op)


def reduce_scatter(output, input_list, op=_SUM, group=None, async_op=False):
    """Rank r's ``output`` gets the reduction over ranks of their ``input_list[r]``."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    out = buffer(output, "output")
    ins = buffers(input_list, "input_list", out.dtype, out.count, pg._size)
    inp = contiguous_span(ins)
    staged = None
    if inp is None or overlaps(inp, out):
        settle(pg)
        inp = staged = stage(ins, out.dtype, copy_in=True)
    return _reduce_scatter(pg, out, inp, op, async_op, [output], staged)


def reduce_scatter_single(output, input, op=_SUM, group=None, async_op=False):  # noqa: A002
    """Rank r's ``output`` gets the reduction of slice r of every rank's ``input``."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    out = buffer(output, "output")
    inp = buffer(input, "input")
    if op is _SUM and disjoint_gather(inp, out, pg._size):  # (FSDP's gradients): as all_gather's
        if inp.device != -1 or out.device != -1:
            check_devices(pg, (out, inp), "output and input")
        return pg.dispatch.call("reduce_scatter", out, -1, D.SUM, pg.backend.reduce_scatter,
                                (out, inp, D.SUM), async_op, (output,))
    check_like(inp, out, "input", "output", out.count * pg._size)
    staged = None
    if needs_own_copy(pg, inp, out):
        settle(pg)
        inp = staged = copy_of(inp)
    return _reduce_scatter(pg, out, inp, op, async_op, [output], staged)


reduce_scatter_tensor = reduce_scatter_single
_reduce_scatter_base = reduce_scatter_single


# ---- all_to_all ----------------------------------------------------------------------------

def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Rank r sends ``input_tensor_list[q]`` to rank q, which receives it in ``output_tensor_list[r]``."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    n = pg._size
    ins = buffers(input_tensor_list, "input_tensor_list", length=n)
    outs = buffers(output_tensor_list, "output_tensor_list", ins[0].dtype if ins else None, length=n)
    in_counts = [b.count for b in ins]
    out_counts = [b.count for b in outs]
    inp = contiguous_span(ins)
    out = contiguous_span(outs)
    copy_out = out is None
    if copy_out:
        out = stage(outs, ins[0].dtype, copy_in=False)
    if inp is None or overlaps(inp, out):
        settle(pg)
        inp = stage(ins, ins[0].dtype, copy_in=True)
    steps = [(pg.backend.all_to_all, (out, inp, out_counts, in_counts))]
    if copy_out:
        steps.append((unstage, (out, outs)))
    return _launch(pg, async_op, list(output_tensor_list), "all_to_all", steps, inp)


def _rows(t):
    shape = tuple(t.shape)
    return (shape[0] if shape else 1), shape


def _split_counts(sizes, rows, row_elems, n, name):
    if sizes is None or (hasattr(sizes, "__len__") and len(sizes) == 0):
        if rows % n:
            raise ValueError(f"{name} is None, so dim 0 ({rows}) must divide evenly by the group size {n}")
        return [rows // n * row_elems] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"{name} must hold {n} non-negative sizes (one per rank), got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{name} sums to {sum(sizes)}; expected dim 0 of the tensor, {rows}")
    return [s * row_elems for s in sizes]


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,  # noqa: A002
                      group=None, async_op=False):
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``), send part q to rank q;
    receive rank r's part into ``output``'s r-th slice (``output_split_sizes``)."""
    pg = world.default if group is None else current(group)
    if pg is None:
        return _absent(group)
    n = pg._size
    inp = buffer(input, "input")
    out = buffer(output, "output")
    check_like(out, inp, "output", "input")
    in_rows, in_shape = _rows(input)
    out_rows, out_shape = _rows(output)
    in_row = inp.count // in_rows if in_rows else int(np.prod(in_shape[1:], dtype=np.int64))
    out_row = out.count // out_rows if out_rows else int(np.prod(out_shape[1:], dtype=np.int64))
    in_counts = _split_counts(input_split_sizes, in_rows, in_row, n, "input_split_sizes")
    out_counts = _split_counts(output_split_sizes, out_rows, out_row, n, "output_split_sizes")
    if overlaps(inp, out):
        settle(pg)
        inp = copy_of(inp)
    return _launch(pg, async_op, [output], "all_to_all",
                   [(pg.backend.all_to_all, (out, inp, out_counts, in_counts))], inp)


# ---- barriers ------------------------------------------------------------------------------

def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Block until every rank of the group has reached this barrier.

    ``timeout`` (a timedelta or seconds, > 0) bounds this barrier instead of the group's
    timeout; past it, DistBackendError ("Timed out waiting <n>ms ..."), as torch's gloo.
    """
    pg = world.default if group is None else current(group)
    if timeout is not None:
        timeout = timeout_seconds(timeout, "timeout", positive=True)
    if pg is None:
        return _absent(group)
    return pg.dispatch.call("barrier", None, -1, -1, pg.backend.barrier, (), async_op, (), timeout)


__all__ = ["all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
           "all_gather_single", "all_gather_into_tensor", "all_gather_coalesced",
           "_all_gather_base", "gather", "scatter",
           "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
           "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier",
           "monitored_barrier"]
