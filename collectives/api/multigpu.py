"""The old ``*_multigpu`` calls: a list of tensors per rank (one per device in torch).

On CPU backends the list is reduced locally first, then across ranks, then copied
back to every entry; a one-element list behaves like the plain call.

Each is an entry of the op table (:data:`collectives.api.opspec.SPECS`, entered here by
:func:`~collectives.api.opspec.add`, beside its plan): the free function and the
ProcessGroup methods' many-tensor form (``pg.allreduce([t0, t1])``) are written from it
into :mod:`collectives.api._generated`. Its plan does the local part and calls the
single-tensor entry's free function on the group, which it is handed (``run``:
``all_reduce``..., called with ``group=pg``), so the call across ranks takes that entry's
path through the group's dispatcher (recorded under its name: all_reduce, broadcast, ...).
"""
import numpy as np

from ..core import dtypes as D
from ..core.convert import buffer, buffers
from ..core.queued import settle
from ..core.reduction import reduce_plan, scale
from .opspec import OpSpec, add, call_args
from ..core.reduce_op import op_code
from ..core.work import Work

_NP_OPS = {D.SUM: np.add, D.PRODUCT: np.multiply, D.MIN: np.minimum, D.MAX: np.maximum,
           D.BAND: np.bitwise_and, D.BOR: np.bitwise_or, D.BXOR: np.bitwise_xor}
_BOOL_OPS = {D.SUM: np.logical_or, D.PRODUCT: np.logical_and, D.MIN: np.logical_and,
             D.MAX: np.logical_or, D.BAND: np.logical_and, D.BOR: np.logical_or,
             D.BXOR: np.logical_xor}


def _local_reduce(dst, src, code):
    """``dst = op(dst, src)`` elementwise, on the tensors themselves (torch or NumPy)."""
    if hasattr(dst, "numpy") and not isinstance(dst, np.ndarray):  # torch: keeps bf16/fp16 rounding
        import torch
        fn = {D.SUM: torch.add, D.PRODUCT: torch.mul, D.MIN: torch.minimum, D.MAX: torch.maximum,
              D.BAND: torch.bitwise_and, D.BOR: torch.bitwise_or, D.BXOR: torch.bitwise_xor}[code]
        if dst.dtype == torch.bool and code in (D.SUM, D.PRODUCT):
            fn = torch.logical_or if code == D.SUM else torch.logical_and
        dst.copy_(fn(dst, src))
    else:
        table = _BOOL_OPS if dst.dtype == np.bool_ else _NP_OPS
        table[code](dst, src, out=dst)


def _copy(dst, src):
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def _all_reduce(pg, tensor_list, op, async_op, run):
    settle(pg)  # local reads and writes below follow queued async work
    bufs = buffers(tensor_list, "tensor_list")
    if not bufs:
        raise ValueError("tensor_list must hold at least one tensor")
    for i, b in enumerate(bufs[1:], 1):
        if b.count != bufs[0].count:
            raise ValueError(f"tensor_list[{i}] has {b.count} elements; expected {bufs[0].count}")
    reduce_plan(op, bufs[0].dtype)  # validates op for the dtype
    kind = op_code(op)
    first = tensor_list[0]
    for t in tensor_list[1:]:
        _local_reduce(first, t, D.SUM if kind in (D.AVG, D.PREMUL_SUM) else kind)
    if kind == D.AVG and len(tensor_list) > 1:  # the mean over every entry of every rank
        run(first, group=pg)
        scale(buffer(first), 1.0 / (len(tensor_list) * pg._size))
    else:
        run(first, op, group=pg)
    for t in tensor_list[1:]:
        _copy(t, first)
    return _sync_work(async_op, tensor_list)


def _sync_work(async_op, outputs):
    """The multigpu calls finish before returning; async_op gets an already-done Work."""
    if not async_op:
        return None
    from ..backends.base import DoneRequest
    return Work(DoneRequest(), list(outputs))


def _broadcast(pg, tensor_list, src, async_op, src_tensor, run):
    buffers(tensor_list, "tensor_list")
    if not isinstance(src_tensor, int) or not 0 <= src_tensor < len(tensor_list):
        raise ValueError(f"src_tensor must index tensor_list (0..{len(tensor_list) - 1}), got {src_tensor!r}")
    main = tensor_list[src_tensor]
    run(main, src, group=pg)
    for t in tensor_list:
        if t is not main:
            _copy(t, main)
    return _sync_work(async_op, tensor_list)


def _reduce(pg, tensor_list, dst, op, async_op, dst_tensor, run):
    settle(pg)  # local reads and writes below follow queued async work
    bufs = buffers(tensor_list, "tensor_list")
    if not isinstance(dst_tensor, int) or not 0 <= dst_tensor < len(tensor_list):
        raise ValueError(f"dst_tensor must index tensor_list (0..{len(tensor_list) - 1}), got {dst_tensor!r}")
    code, _, _ = reduce_plan(op, bufs[0].dtype)
    if op_code(op) in (D.AVG, D.PREMUL_SUM):
        raise ValueError(f"reduce_multigpu supports SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR; got {op!r}")
    acc = tensor_list[dst_tensor]
    if pg.ranks[pg._rank] != dst:  # non-destination entries must not change: reduce a copy
        acc = acc.clone() if hasattr(acc, "clone") else acc.copy()
    for i, t in enumerate(tensor_list):
        if i != dst_tensor:
            _local_reduce(acc, t, code)
    run(acc, dst, op, group=pg)
    return _sync_work(async_op, tensor_list)


def _per_rank_lists(pg, tensors, name, lists, lists_name):
    """The Buffers of ``tensors`` (k of them, after the group's queued work), once
    ``lists`` is checked to hold k lists of size * k tensors like them
    (all_gather_multigpu's outputs, reduce_scatter_multigpu's inputs)."""
    settle(pg)  # local reads and writes below follow queued async work
    bufs = buffers(tensors, name)
    k = len(bufs)
    if k == 0 or not isinstance(lists, list) or len(lists) != k:
        raise ValueError(f"{lists_name} must hold one list per entry of {name}")
    for i, lst in enumerate(lists):
        buffers(lst, f"{lists_name}[{i}]", bufs[0].dtype, bufs[0].count, pg._size * k)
    return bufs


def _all_gather(pg, output_tensor_lists, input_tensor_list, async_op, run):
    ins = _per_rank_lists(pg, input_tensor_list, "input_tensor_list", output_tensor_lists,
                          "output_tensor_lists")
    k = len(ins)
    mod = np if isinstance(input_tensor_list[0], np.ndarray) else None
    if mod is None:
        import torch
        stacked = torch.cat([t.reshape(-1) for t in input_tensor_list])
        gathered = [torch.empty_like(stacked) for _ in range(pg._size)]
    else:
        stacked = np.concatenate([t.reshape(-1) for t in input_tensor_list])
        gathered = [np.empty_like(stacked) for _ in range(pg._size)]
    run(gathered, stacked, group=pg)
    n = ins[0].count
    for lst in output_tensor_lists:
        for r in range(pg._size):
            for j in range(k):
                _copy(lst[r * k + j], gathered[r][j * n:(j + 1) * n].reshape(lst[r * k + j].shape))
    return _sync_work(async_op, [t for lst in output_tensor_lists for t in lst])


def _reduce_scatter(pg, output_tensor_list, input_tensor_lists, op, async_op, run):
    outs = _per_rank_lists(pg, output_tensor_list, "output_tensor_list", input_tensor_lists,
                           "input_tensor_lists")
    code, _, _ = reduce_plan(op, outs[0].dtype)
    if op_code(op) in (D.AVG, D.PREMUL_SUM):
        raise ValueError("reduce_scatter_multigpu supports SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR; "
                         f"got {op!r}")
    n, k = pg._size, len(outs)
    # combine the k lists locally; then rank r's share is the k consecutive entries r*k..r*k+k-1
    combined = [t.clone() if hasattr(t, "clone") else t.copy() for t in input_tensor_lists[0]]
    for lst in input_tensor_lists[1:]:
        for c, t in zip(combined, lst):
            _local_reduce(c, t, code)
    if isinstance(combined[0], np.ndarray):
        chunks = [np.concatenate([c.reshape(-1) for c in combined[r * k:(r + 1) * k]]) for r in range(n)]
        mine = np.empty_like(chunks[0])
    else:
        import torch
        chunks = [torch.cat([c.reshape(-1) for c in combined[r * k:(r + 1) * k]]) for r in range(n)]
        mine = torch.empty_like(chunks[0])
    run(mine, chunks, op, group=pg)
    m = outs[0].count
    for i, t in enumerate(output_tensor_list):
        _copy(t, mine[i * m:(i + 1) * m].reshape(t.shape))
    return _sync_work(async_op, output_tensor_list)


# ---- the entries: each plan is handed the call's arguments and its single-tensor entry's function

def _entry(name, params, plan, doc):
    """The entry ``name`` (``X_multigpu``): recorded as X, its plan handed the call's
    arguments, then X's free function (``run``)."""
    single = name[:-len("_multigpu")]
    return OpSpec(name, params, single, method=single, plan=plan,
                  plan_args=f"{call_args(params)}, {single}", doc=doc)


add(_entry("all_reduce_multigpu", "tensor_list, op=_SUM, group=None, async_op=False", _all_reduce,
           "all_reduce across ranks and across the entries of ``tensor_list``; every entry gets "
           "the result."),
    _entry("broadcast_multigpu", "tensor_list, src, group=None, async_op=False, src_tensor=0",
           _broadcast,
           "Broadcast ``tensor_list[src_tensor]`` of rank ``src`` into every entry on every rank."),
    _entry("reduce_multigpu", "tensor_list, dst, op=_SUM, group=None, async_op=False, dst_tensor=0",
           _reduce, "Reduce across ranks and entries into ``tensor_list[dst_tensor]`` of rank ``dst``."),
    _entry("all_gather_multigpu", "output_tensor_lists, input_tensor_list, group=None, async_op=False",
           _all_gather, "``output_tensor_lists[i][r * k + j]`` gets rank r's ``input_tensor_list[j]`` "
           "(k entries per rank)."),
    _entry("reduce_scatter_multigpu", "output_tensor_list, input_tensor_lists, op=_SUM, group=None, "
           "async_op=False", _reduce_scatter,
           """``output_tensor_list[i]`` on rank r gets the reduction, over every rank and
    entry, of ``input_tensor_lists[.][r * k + i]`` (k entries per rank)."""))
