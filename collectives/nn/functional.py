"""Collectives that autograd differentiates, as ``torch.distributed.nn.functional``.

Each function returns new tensors (or, where torch's does, the output tensor it was
given) whose gradients flow back across the ranks: the backward of an all_gather is a
reduce_scatter of the gradients, of a broadcast a reduce to the source, and so on.
Every rank of the group must run the backward, as every rank ran the forward. Ranks
(``src``, ``dst``) are global ranks, as in torch.

Where torch's gradients are wrong, these are right (and the same wherever torch's are):

* ``all_reduce``, ``reduce`` and ``reduce_scatter`` give the gradient of the reduction
  for every op that has one: SUM, AVG and PREMUL_SUM (linear), MAX and MIN (the summed
  gradient goes to the ranks holding the extreme, split evenly among ties, as
  ``torch.amax``), PRODUCT (the product of the other ranks' inputs). torch applies the
  forward's op to the gradients, which is right for SUM and AVG only, and its
  reduce_scatter ignores the op (wrong for AVG).
* In a subgroup, ``src``/``dst`` are compared with this rank's global rank (torch's
  broadcast and gather compare them with the group rank).
* ``_all_gather_base`` has a backward on every backend (torch's raises off nccl).

Needs torch; NumPy arrays have no autograd, use the plain collectives for them.

Example:
    >>> import collectives as dist, collectives.nn
    >>> feats = dist.nn.all_gather(local_feats)      # a tuple, one tensor per rank
    >>> loss = contrastive(torch.cat(feats)); loss.backward()
"""
import torch
from torch.autograd import Function

from ..api import collective_ops as _c
from ..core import dtypes as D
from ..api.group import get_rank, get_world_size, resolve
from ..core.reduce_op import RedOpType, ReduceOp, op_code

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather",
           "reduce", "reduce_scatter", "scatter"]

_SUM = ReduceOp.SUM
_LINEAR = (D.SUM, D.AVG, D.PREMUL_SUM)
_DIFFERENTIABLE = _LINEAR + (D.MAX, D.MIN, D.PRODUCT)


# ---- argument checks (before any communication) --------------------------------------

def _tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (autograd needs one; for NumPy arrays "
                        f"use the plain collectives), got {type(t).__name__}")
    return t


def _tensors(ts, name, n=None):
    if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
        raise TypeError(f"{name} must be a list of torch.Tensor, got {type(ts).__name__}")
    for i, t in enumerate(ts):
        _tensor(t, f"{name}[{i}]")
    if n is not None and len(ts) != n:
        raise ValueError(f"{name} must hold one tensor per rank of the group ({n}), "
                         f"got {len(ts)}")
    return ts


def _size(group):
    """The group's size; ValueError if this rank is not in it (or nothing is initialised)."""
    if resolve(group) is None:
        raise ValueError(f"this rank (global rank {get_rank()}) is not a member of group; "
                         f"autograd collectives run on the group's ranks only")
    return get_world_size(group)


def _op(op, requires_grad):
    code = op_code(op, "op")
    if requires_grad and code not in _DIFFERENTIABLE:
        raise ValueError(f"op={op!r} has no gradient; a tensor that requires grad takes SUM, AVG, "
                         f"PREMUL_SUM, MAX, MIN or PRODUCT")
    return code


# ---- the gradient of a reduction -----------------------------------------------------

def _scale(op, code, n):
    """The factor the linear op ``code`` applies to each input (real: the front end takes
    no other), which the gradient takes too; None for SUM."""
    if code == D.AVG:
        return 1.0 / n
    if code == D.PREMUL_SUM:
        f = op.factor
        return f.item() if hasattr(f, "item") else f
    return None


def _scaled(t, factor):
    return t if factor is None else t * factor


def _once(code):
    """Refuse, before the backward's first message, to differentiate a MAX/MIN/PRODUCT
    gradient again: its collectives are plain ones, outside the graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"the gradient of a {RedOpType(code).name} reduction cannot be "
                           f"differentiated again (create_graph=True)")


def _nonlinear_grad(code, x, y, g, group, n):
    """This rank's gradient for the MAX/MIN/PRODUCT reduction of the ranks' ``x`` into
    ``y``, given ``g``, the gradient of ``y`` summed over every rank that holds it."""
    if code in (D.MAX, D.MIN):
        hit = (x == y).to(g.dtype)
        count = hit.clone()
        _c.all_reduce(count, group=group)  # how many ranks hold the extreme
        return g * hit / count.clamp(min=1)
    parts = [torch.empty_like(x) for _ in range(n)]
    _c.all_gather(parts, x.contiguous(), group=group)
    me = get_rank(group)
    others = torch.ones_like(x)
    for q, p in enumerate(parts):
        if q != me:
            others = others * p
    return g * others.conj()


# ---- the functions -------------------------------------------------------------------

def broadcast(tensor, src, group=None):
    """``src``'s tensor on every rank; its gradient sums every rank's gradient on ``src``
    (zero elsewhere)."""
    _tensor(tensor, "tensor")
    _size(group)
    return _Broadcast.apply(src, group, tensor)


def gather(tensor, dst=0, group=None):
    """Every rank's tensor, as a tuple on ``dst`` (zeros elsewhere)."""
    _tensor(tensor, "tensor")
    _size(group)
    return _Gather.apply(dst, group, tensor)


def scatter(tensors, src=0, group=None):
    """``src``'s ``tensors[i]`` on the group's rank i. Every rank passes a list: the
    others' give the output's shape and dtype (``tensors[0]``)."""
    n = _size(group)
    _tensors(tensors, "tensors", n if get_rank() == src else None)
    if not tensors:
        raise ValueError("tensors must hold at least one tensor, whose shape the output takes")
    return _Scatter.apply(src, group, *tensors)


def reduce(tensor, dst, op=_SUM, group=None):
    """The reduction of every rank's tensor, on ``dst`` (a copy: ``tensor`` is unchanged).
    What other ranks get back is unspecified, and their gradients for it are ignored."""
    _tensor(tensor, "tensor")
    _op(op, tensor.requires_grad)
    _size(group)
    return _Reduce.apply(dst, op, group, tensor)


def reduce_scatter(output, input_list, op=_SUM, group=None):
    """The reduction of every rank's ``input_list[i]`` into ``output`` on rank i; returns
    ``output`` (as torch, it is written to)."""
    _tensor(output, "output")
    n = _size(group)
    _tensors(input_list, "input_list", n)
    _op(op, any(t.requires_grad for t in input_list))
    return _ReduceScatter.apply(op, group, output, *input_list)


def all_gather(tensor, group=None):
    """Every rank's tensor, as a tuple; the gradient reduce-scatters the gradients."""
    _tensor(tensor, "tensor")
    _size(group)
    return _AllGather.apply(group, tensor)


def _all_gather_base(output_tensor, input_tensor, group=None):
    """Every rank's ``input_tensor`` back to back in ``output_tensor`` (returned)."""
    _tensor(output_tensor, "output_tensor")
    _tensor(input_tensor, "input_tensor")
    _size(group)
    return _AllGatherBase.apply(output_tensor, input_tensor, group)


def all_to_all(output_tensor_list, input_tensor_list, group=None):
    """``input_tensor_list[i]`` to rank i, into its ``output_tensor_list[me]``; returns
    the outputs as a tuple."""
    n = _size(group)
    _tensors(output_tensor_list, "output_tensor_list", n)
    _tensors(input_tensor_list, "input_tensor_list", n)
    return _AllToAll.apply(group, output_tensor_list, *input_tensor_list)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,  # noqa: A002
                      group=None):
    """``all_to_all_single`` (rows of dim 0 split by the sizes); returns ``output``."""
    _tensor(output, "output")
    _tensor(input, "input")
    _size(group)
    return _AllToAllSingle.apply(group, output, output_split_sizes, input_split_sizes, input)


def all_reduce(tensor, op=_SUM, group=None):
    """The reduction of every rank's tensor, on every rank (a copy: ``tensor`` is
    unchanged)."""
    _tensor(tensor, "tensor")
    _op(op, tensor.requires_grad)
    _size(group)
    return _AllReduce.apply(op, group, tensor)


# ---- the autograd functions ----------------------------------------------------------

class _Broadcast(Function):
    @staticmethod
    def forward(ctx, src, group, tensor):
        ctx.src, ctx.group = src, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        _c.broadcast(out, src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        gx = _Reduce.apply(ctx.src, _SUM, ctx.group, grad)
        if get_rank() != ctx.src:
            gx = torch.zeros_like(gx)
        return None, None, gx


class _Gather(Function):
    @staticmethod
    def forward(ctx, dst, group, tensor):
        ctx.dst, ctx.group = dst, group
        tensor = tensor.contiguous()
        outs = [torch.zeros_like(tensor) for _ in range(get_world_size(group))]
        _c.gather(tensor, outs if get_rank() == dst else None, dst, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, _Scatter.apply(ctx.dst, ctx.group, *grads))


class _Scatter(Function):
    @staticmethod
    def forward(ctx, src, group, *tensors):
        ctx.src, ctx.group = src, group
        if any(t.shape != tensors[0].shape for t in tensors):
            raise ValueError(f"tensors must all have one shape, got "
                             f"{[tuple(t.shape) for t in tensors]}")
        out = torch.zeros_like(tensors[0], memory_format=torch.contiguous_format)
        mine = get_rank() == src
        _c.scatter(out, [t.contiguous() for t in tensors] if mine else None, src, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + _Gather.apply(ctx.src, ctx.group, grad)


class _Reduce(Function):
    @staticmethod
    def forward(ctx, dst, op, group, tensor):
        ctx.dst, ctx.op, ctx.group = dst, op, group
        ctx.code = op_code(op)
        out = tensor.clone(memory_format=torch.contiguous_format)
        _c.reduce(out, dst, op=op, group=group)
        if ctx.code not in _LINEAR:
            ctx.save_for_backward(tensor, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = get_world_size(ctx.group)
        if ctx.code in _LINEAR:
            gx = _scaled(_Broadcast.apply(ctx.dst, ctx.group, grad), _scale(ctx.op, ctx.code, n))
            return None, None, None, gx
        _once(ctx.code)
        x, y = ctx.saved_tensors
        g = grad.clone(memory_format=torch.contiguous_format)
        _c.broadcast(g, ctx.dst, group=ctx.group)
        y = y.clone()
        _c.broadcast(y, ctx.dst, group=ctx.group)
        return None, None, None, _nonlinear_grad(ctx.code, x, y, g, ctx.group, n)


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, op, group, output, *inputs):
        ctx.op, ctx.group = op, group
        ctx.code = op_code(op)
        output = output.contiguous()
        inputs = tuple(t.contiguous() for t in inputs)
        _c.reduce_scatter(output, list(inputs), op=op, group=group)
        if ctx.code not in _LINEAR:
            ctx.save_for_backward(output, *inputs)
        return output

    @staticmethod
    def backward(ctx, grad):
        n = get_world_size(ctx.group)
        if ctx.code in _LINEAR:
            factor = _scale(ctx.op, ctx.code, n)
            return (None, None, None) + tuple(
                _scaled(g, factor) for g in _AllGather.apply(ctx.group, grad))
        _once(ctx.code)
        y, *xs = ctx.saved_tensors
        grad = grad.contiguous()
        gs = [torch.empty_like(grad) for _ in range(n)]
        _c.all_gather(gs, grad, group=ctx.group)
        ys = [torch.empty_like(y) for _ in range(n)]
        _c.all_gather(ys, y, group=ctx.group)
        gx = _nonlinear_grad(ctx.code, torch.stack(xs), torch.stack(ys), torch.stack(gs),
                             ctx.group, n)
        return (None, None, None) + tuple(gx.unbind(0))


class _AllGather(Function):
    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        tensor = tensor.contiguous()
        outs = [torch.empty_like(tensor) for _ in range(get_world_size(group))]
        _c.all_gather(outs, tensor, group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        gx = torch.empty_like(grads[get_rank(ctx.group)], memory_format=torch.contiguous_format)
        return None, _ReduceScatter.apply(_SUM, ctx.group, gx, *grads)


class _AllGatherBase(Function):
    @staticmethod
    def forward(ctx, output, tensor, group):
        ctx.group = group
        _c._all_gather_base(output, tensor.contiguous(), group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        n = get_world_size(ctx.group)
        shape = list(grad.shape)
        if not shape or shape[0] % n:
            raise RuntimeError(f"the gradient of _all_gather_base has shape {tuple(shape)}, whose "
                               f"first dimension does not divide by the group's size ({n})")
        shape[0] //= n
        gx = grad.new_empty(shape)
        _c._reduce_scatter_base(gx, grad.contiguous(), _SUM, group=ctx.group)
        return None, gx, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, group, outs, *tensors):
        ctx.group = group
        ctx.shapes = [t.shape for t in tensors]
        _c.all_to_all(outs, [t.contiguous() for t in tensors], group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        back = [grads[0].new_empty(s) for s in ctx.shapes]
        return (None, None) + _AllToAll.apply(ctx.group, back, *grads)


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx, group, output, output_split_sizes, input_split_sizes, tensor):
        ctx.group = group
        ctx.shape = tensor.shape
        ctx.splits = (input_split_sizes, output_split_sizes)  # the backward's out, in
        _c.all_to_all_single(output, tensor.contiguous(), output_split_sizes=output_split_sizes,
                             input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(ctx.shape)
        out_splits, in_splits = ctx.splits
        return (None, None, None, None,
                _AllToAllSingle.apply(ctx.group, back, out_splits, in_splits, grad.contiguous()))


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, op, group, tensor):
        ctx.op, ctx.group = op, group
        ctx.code = op_code(op)
        out = tensor.clone(memory_format=torch.contiguous_format)
        _c.all_reduce(out, op=op, group=group)
        if ctx.code not in _LINEAR:
            ctx.save_for_backward(tensor, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.code in _LINEAR:  # SUM, AVG and PREMUL_SUM(real f) are their own adjoints
            return None, None, _AllReduce.apply(ctx.op, ctx.group, grad)
        _once(ctx.code)
        x, y = ctx.saved_tensors
        g = grad.clone(memory_format=torch.contiguous_format)
        _c.all_reduce(g, group=ctx.group)
        return None, None, _nonlinear_grad(ctx.code, x, y, g, ctx.group,
                                           get_world_size(ctx.group))
