"""The collectives, each described once: one :class:`OpSpec` per collective in ``SPECS``.

An OpSpec holds what the front end knows about a collective:

- ``params``: its torch.distributed signature;
- ``roles``: its buffers, in the order they are checked, and how each is checked
  (:class:`Role`: one tensor, or a list of them like another buffer), and its root
  argument (``root``: the global and the group spelling of it);
- ``fast``: the condition under which the call is one backend call on the buffers as
  given (``None``: always; absent: never), and ``plan``: the front end's work otherwise
  (counts, offsets, the AVG/PREMUL scaling, staging), a function of this module; an entry
  that is never one call names no roles nor root: its plan is handed the call's
  arguments and checks its buffers and root itself;
- ``method`` and ``args``: the backend method (``backends/base.py``'s contract) and its
  arguments;
- ``record``: what the flight recorder and the fingerprint take (the kind, the buffer
  whose count and dtype are recorded, the root, the op); ``fingerprint``: the kind code
  the backend's fingerprint carries for the call (:mod:`collectives.core.fingerprint`).

From each OpSpec one function is written out, by :mod:`collectives.api.gen`, into
:mod:`collectives.api._generated` (checked in; a test fails when it is not what the table
makes): the free function (``collectives.all_reduce``: resolve the group, then the body,
written in place rather than called, so its common call ``dist.all_reduce(t)`` has one
Python frame and goes straight to the group's dispatcher, ``pg.dispatch.call``:
:mod:`collectives.api.group_dispatcher`; an entry with no one-call path is one call,
``_in_group(group, plan, args...)``). The ProcessGroup methods call it with ``group=``
the group they run on. ``fast``, ``args``, ``record`` and ``plan_args`` are Python
expressions over the generated function's parameters and the buffers the roles name
(``plan_args`` by default: the call's arguments but ``group``, :func:`call_args`);
``doc`` is the function's docstring (the long ones are :mod:`collectives.api.opdocs`' texts,
which the generated module sets rather than copies).

Point-to-point calls (``isend``, ``irecv``, ``send``, ``recv``) are entries too: a buffer,
a peer argument (``peer``), the backend's isend or irecv, posted through the group's
dispatcher (``pg.dispatch.post``), which records and profiles it; the ``*_multigpu``
calls are entries whose plans (:mod:`collectives.api.multigpu`) are handed the
single-tensor entry's free function (``all_reduce``...) to call on their group.

Lists of tensors reach the backend as one Buffer (a staging buffer, or the tensors' own
memory when they already lie back to back).
"""
import numpy as np

from ..core import cuda as _cuda
from ..core.fingerprint import KIND_NAMES
from ..core.convert import buffer, buffers, check_devices, check_like
from ..core.queued import Steps, settle
from ..core.reduction import reduce_plan, scale
from ..core.staging import (contiguous_span, copy_into, copy_of, needs_own_copy, separate_blocks,
                            stage, unstage)
from ..core.tensors import overlaps
from ..core.args import TAG_LIMIT, check_tag
from ..core.work import Work
from ..core.world import NOT_INITIALIZED, current, world
from ..core.reduce_op import ReduceOp
from ..core.tensors import Buffer
from .opdocs import (DOC_ALL_GATHER_COALESCED, DOC_ALL_GATHER_SINGLE, DOC_ALL_REDUCE,
                     DOC_ALL_TO_ALL_SINGLE, DOC_BARRIER, DOC_BROADCAST, DOC_RECV, DOC_SEND)

_SUM = ReduceOp.SUM


def _absent(group, value=None):
    """What a call returns on a rank outside ``group`` (``value``: None, recv's -1);
    ValueError before init."""
    if group is None:
        raise ValueError(NOT_INITIALIZED)
    return value


def _in_group(group, plan, *args):
    """``plan(pg, *args)`` on the group ``group`` names (None: the default group), as the
    entries without a one-call path run (their free function is this one call); what
    :func:`_absent` says on a rank outside it. The entries with one (all_reduce, the
    point-to-point calls...) resolve the group in their own body, by the same rule."""
    if (pg := world.default if group is None else current(group)) is None:
        return _absent(group)
    return plan(pg, *args)


# ---- point to point: the peer's rules -----------------------------------------------------------

def send_peer(pg, dst, group_dst):
    """The group rank of a send's peer (``dst`` global, or ``group_dst``), not this rank's."""
    peer = pg.peer(dst, group_dst, "dst")
    if peer == pg._rank:
        raise ValueError("Invalid destination rank: destination rank should not be the same as "
                         "the rank of the current process.")
    return peer


def recv_peer(pg, src, group_src):
    """The group rank of a receive's peer (``src`` global, or ``group_src``; neither: None,
    any source), not this rank's."""
    if src is None and group_src is None:
        return None  # any source
    peer = pg.peer(src, group_src, "src")
    if peer == pg._rank:
        raise ValueError("Invalid source rank: source rank should not be the same as "
                         "the rank of the current process.")
    return peer


def _post(group, kind, tensor, arg, group_arg, tag, rule, wait):
    """Point-to-point call ``kind`` of ``tensor`` on the group ``group`` names (resolved as
    the collectives' prologue does), the peer named by ``arg`` (a global rank: one dict
    lookup) or ``group_arg`` (resolved in full by ``rule``: :func:`send_peer` or
    :func:`recv_peer`), the tag and the tensor checked, then the backend's isend or irecv
    posted through the dispatcher: a Work; waited for (``wait``): None for a send, the
    sender's global rank for a receive (-1 on a rank outside the group, torch's recv).
    Every generated point-to-point call is one call of it, its one Python frame."""
    if (pg := world.default if group is None else current(group)) is None:
        return _absent(group, -1 if wait and rule is recv_peer else None)
    peer = pg.group_of_global.get(arg) if type(arg) is int and group_arg is None else None
    if peer is None or peer == pg._rank:
        peer = rule(pg, arg, group_arg)
    if type(tag) is not int or not 0 <= tag < TAG_LIMIT:
        check_tag(tag)  # (the rule; the test above only spares the call)
    buf = buffer(tensor)
    if buf.device != -1:
        check_devices(pg, (buf,), 'tensor')
    fn = pg.backend.isend if rule is send_peer else pg.backend.irecv
    req = pg.dispatch.post(kind, fn, buf, peer, tag)
    if not wait:
        return Work(req, [tensor], pg)
    req.wait()
    if rule is send_peer:
        return None
    return pg.ranks[any_sender(pg, req) if peer is None else peer]


def any_sender(pg, req):
    """The group rank that sent what an any-source receive ``req`` (done) received."""
    got = req.source
    if got < 0:
        raise RuntimeError(f"{pg.backend_name} backend did not report the sender of an any-source recv")
    return got


def _launch(pg, async_op, outputs, name, steps, buf, root=-1, op=-1, timeout=None):
    """Run ``steps`` as collective ``name``, recorded with ``buf``'s count and dtype, ``root``
    and ``op`` (a ReduceOp or code; -1: none)."""
    if _cuda.cuda_seen:  # a CUDA tensor must not reach a host backend, nor host memory nccl
        for _, args in steps:
            check_devices(pg, [a for a in args if isinstance(a, Buffer)], name)
    fn, args = (Steps(name, steps), ()) if len(steps) > 1 else steps[0]
    return pg.dispatch.call(name, buf, root, int(op), fn, args, async_op, outputs, timeout)


# ---- the plans: what the front end computes when the call is more than one backend call ------

def _reduction(pg, op, dtype, inp, out, call, own_input, avg_here=True):
    """The steps of a reduction with ``op`` (AVG: SUM, then ``out`` scaled by 1/size where
    ``avg_here``; PREMUL_SUM(f): ``inp`` scaled by f, then SUM; a copy of it unless
    ``own_input``), ``call(code, inp)`` the backend's step; and the input it reads."""
    code, pre, avg = reduce_plan(op, dtype)
    steps = []
    if pre is not None:
        if not own_input:  # the caller's input must not change
            settle(pg)
            inp = copy_of(inp)
        steps.append((scale, (inp, pre)))
    steps.append(call(code, inp))
    if avg and avg_here:
        steps.append((scale, (out, 1.0 / pg._size)))
    return steps, inp


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


def _flat_apart(pg, bufs, dtype, other):
    """One Buffer over ``bufs`` (inputs) that does not overlap ``other``: their own memory
    when back to back and apart from it, else a copy made now."""
    flat = contiguous_span(bufs)
    if flat is None or overlaps(flat, other):
        settle(pg)
        flat = stage(bufs, dtype, copy_in=True)
    return flat


def _output_span(bufs, dtype, inp):
    """A Buffer the backend can write all of ``bufs`` into, and whether it must be copied out."""
    span = contiguous_span(bufs)
    if span is not None and (inp is None or not overlaps(span, inp)):
        return span, False
    return stage(bufs, dtype, copy_in=False), True


def _into(steps, out, copy_out, outs):
    """``steps`` followed by the copy of a staged ``out`` into ``outs`` when ``copy_out``."""
    if copy_out:
        steps.append((unstage, (out, outs)))
    return steps


def _all_reduce(pg, buf, tensor, op, async_op):
    be = pg.backend
    steps, _ = _reduction(pg, op, buf.dtype, buf, buf, lambda c, b: (be.all_reduce, (b, c)), True)
    return _launch(pg, async_op, [tensor], "all_reduce", steps, buf, -1, op)


def _all_reduce_coalesced(pg, tensors, op, async_op):
    bufs = _some_buffers(tensors, "tensors")
    flat = _flat_input(pg, bufs)
    be = pg.backend
    steps, _ = _reduction(pg, op, flat.dtype, flat, flat, lambda c, b: (be.all_reduce, (b, c)),
                          True)
    if flat.obj is not bufs:
        steps.append((unstage, (flat, bufs)))
    return _launch(pg, async_op, list(tensors), "all_reduce_coalesced", steps, flat, -1, op)


def _reduce(pg, buf, tensor, root, op, async_op):
    be = pg.backend
    mine = pg._rank == root
    steps, inp = _reduction(pg, op, buf.dtype, buf, buf,
                            lambda c, b: (be.reduce, (b, c, root)), False, mine)
    if inp is not buf and mine:  # a scaled copy was reduced: the root's result is in it
        steps.append((copy_into, (buf, inp)))
    return _launch(pg, async_op, [tensor], "reduce", steps, buf, root, op)


def _all_gather(pg, tensor_list, tensor, async_op):
    inp = buffer(tensor)
    outs = buffers(tensor_list, "tensor_list", inp.dtype, inp.count, pg._size)
    if pg.backend.gathers_into_list and separate_blocks(outs, inp, pg._rank):
        # separate tensors, as torch programs allocate them: the backend fills each one
        steps = [(pg.backend.all_gather_list, (outs, inp))]
    else:
        out, copy_out = _output_span(outs, inp.dtype, inp)
        steps = _into([(pg.backend.all_gather, (out, inp))], out, copy_out, outs)
    return _launch(pg, async_op, list(tensor_list), "all_gather", steps, inp)


def _all_gather_single(pg, out, inp, output_tensor, async_op):
    check_like(out, inp, "output_tensor", "input_tensor", inp.count * pg._size)
    if needs_own_copy(pg, out, inp):
        settle(pg)
        inp = copy_of(inp)
    return _launch(pg, async_op, [output_tensor], "all_gather",
                   [(pg.backend.all_gather, (out, inp))], inp)


def _all_gather_coalesced(pg, output_tensor_lists, input_tensor_list, async_op):
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
    steps = _into([(pg.backend.all_gather, (out, inp))], out, copy_out, outs)
    return _launch(pg, async_op, [t for tensors in output_tensor_lists for t in tensors],
                   "all_gather_coalesced", steps, inp)


def _root_list(pg, root, buf, tensors, list_name, where):
    """The Buffers of gather's and scatter's list ``tensors``: one per rank, like ``buf``, on
    the root; None elsewhere, where it must be empty."""
    if pg._rank != root:
        if tensors:
            raise ValueError(f"Argument ``{list_name}`` must NOT be specified on non-{where} ranks.")
        return None
    if tensors is None:
        raise ValueError(f"{list_name} must be given on the {where} rank")
    return buffers(tensors, list_name, buf.dtype, buf.count, pg._size)


def _gather(pg, tensor, gather_list, dst, async_op, group_dst):
    root = pg.dispatch.root(dst, group_dst, "dst")
    inp = buffer(tensor)
    outs = _root_list(pg, root, inp, gather_list, "gather_list", "destination")
    if outs is None:
        return _launch(pg, async_op, [], "gather", [(pg.backend.gather, (None, inp, root))], inp,
                       root)
    out, copy_out = _output_span(outs, inp.dtype, inp)
    steps = _into([(pg.backend.gather, (out, inp, root))], out, copy_out, outs)
    return _launch(pg, async_op, list(gather_list), "gather", steps, inp, root)


def _scatter(pg, tensor, scatter_list, src, async_op, group_src):
    root = pg.dispatch.root(src, group_src, "src")
    out = buffer(tensor)
    ins = _root_list(pg, root, out, scatter_list, "scatter_list", "source")
    inp = None if ins is None else _flat_apart(pg, ins, out.dtype, out)
    return _launch(pg, async_op, [tensor], "scatter", [(pg.backend.scatter, (out, inp, root))],
                   out, root)


def _reduce_scatter_steps(pg, out, inp, op, async_op, outputs, staged):
    be = pg.backend
    steps, _ = _reduction(pg, op, out.dtype, inp, out,
                          lambda c, b: (be.reduce_scatter, (out, b, c)), staged)
    return _launch(pg, async_op, outputs, "reduce_scatter", steps, out, -1, op)


def _reduce_scatter(pg, output, input_list, op, async_op):
    out = buffer(output, "output")
    ins = buffers(input_list, "input_list", out.dtype, out.count, pg._size)
    inp = contiguous_span(ins)
    staged = inp is None or overlaps(inp, out)
    if staged:
        settle(pg)
        inp = stage(ins, out.dtype, copy_in=True)
    return _reduce_scatter_steps(pg, out, inp, op, async_op, [output], staged)


def _reduce_scatter_single(pg, out, inp, output, op, async_op):
    check_like(inp, out, "input", "output", out.count * pg._size)
    staged = needs_own_copy(pg, inp, out)
    if staged:
        settle(pg)
        inp = copy_of(inp)
    return _reduce_scatter_steps(pg, out, inp, op, async_op, [output], staged)


def _self_part(pg, out_counts, in_counts, out_name, in_name):
    """An all_to_all's part from this rank to itself: the sizes the rank sends and receives
    are both its own, so they must agree (the other parts' sizes are the peers' to match)."""
    me = pg._rank
    if out_counts[me] != in_counts[me]:
        raise ValueError(f"{out_name.format(me)} has {out_counts[me]} elements, but this rank "
                         f"(group rank {me}) sends itself {in_name.format(me)}, which has "
                         f"{in_counts[me]}")


def _all_to_all(pg, output_tensor_list, input_tensor_list, async_op):
    n = pg._size
    ins = buffers(input_tensor_list, "input_tensor_list", length=n)
    outs = buffers(output_tensor_list, "output_tensor_list", ins[0].dtype if ins else None, length=n)
    in_counts = [b.count for b in ins]
    out_counts = [b.count for b in outs]
    _self_part(pg, out_counts, in_counts, "output_tensor_list[{}]", "input_tensor_list[{}]")
    out = contiguous_span(outs)
    copy_out = out is None
    if copy_out:
        out = stage(outs, ins[0].dtype, copy_in=False)
    inp = _flat_apart(pg, ins, ins[0].dtype, out)
    steps = _into([(pg.backend.all_to_all, (out, inp, out_counts, in_counts))], out, copy_out,
                  outs)
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


def _split(t, buf, sizes, n, name):
    """The element counts of ``t``'s parts along dim 0 (``sizes`` rows each, or even)."""
    rows, shape = _rows(t)
    row = buf.count // rows if rows else int(np.prod(shape[1:], dtype=np.int64))
    return _split_counts(sizes, rows, row, n, name)


def _all_to_all_single(pg, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                       async_op):
    inp = buffer(input, "input")
    out = buffer(output, "output")
    check_like(out, inp, "output", "input")
    in_counts = _split(input, inp, input_split_sizes, pg._size, "input_split_sizes")
    out_counts = _split(output, out, output_split_sizes, pg._size, "output_split_sizes")
    _self_part(pg, out_counts, in_counts, "the output's part {}", "the input's part {}")
    if overlaps(inp, out):
        settle(pg)
        inp = copy_of(inp)
    return _launch(pg, async_op, [output], "all_to_all",
                   [(pg.backend.all_to_all, (out, inp, out_counts, in_counts))], inp)


# ---- the table ----------------------------------------------------------------------------------

class Role:
    """A buffer argument: ``var = buffer(param, label)`` for one tensor, or for a list
    (``like``: the buffer whose dtype and count each entry must have, one per rank;
    :func:`collectives.api.gen.body` writes the line)."""

    __slots__ = ("var", "param", "label", "like")

    def __init__(self, var, param, label=None, like=None):
        self.var, self.param, self.label, self.like = var, param, label, like


def call_args(params):
    """The names of the parameters ``params`` (a signature's text) but ``group``, as the
    arguments of a call: what an entry without a one-call path hands its plan."""
    names = (p.split("=")[0].strip() for p in params.split(","))
    return ", ".join(n for n in names if n != "group")


_FINGERPRINT_KIND = {name: code for code, name in KIND_NAMES.items()}  # backend method -> kind


class OpSpec:
    """One collective, or one point-to-point call: see the module's docstring. ``doc`` is
    the public function's docstring.

    A point-to-point call names its ``peer`` argument ("dst": a send's, "src": a
    receive's, which may be any rank) and posts the backend's ``method`` (isend, irecv)
    through the group's dispatcher (``pg.dispatch.post``), which records it under
    ``kind`` with the buffer, the peer and the tag (:func:`_post`); a ``blocking`` one waits for
    it and returns None (a send) or the sender's global rank (a receive; -1 on a rank
    outside the group), the others a Work. ``fingerprint`` names the backend's kind where
    it differs from ``method``."""

    __slots__ = ("name", "params", "kind", "roles", "root", "root_first", "fast", "devices",
                 "method", "args", "record", "outputs", "timeout", "plan", "plan_args",
                 "peer", "blocking", "fingerprint", "doc")

    def __init__(self, name, params, kind, roles=(), root=None, root_first=False, fast=False,
                 devices=(), method=None, args="()", record=("None", "-1", "-1"), outputs="()",
                 timeout=False, plan=None, plan_args=None, peer=None, blocking=False,
                 fingerprint=None, doc=None):
        self.name, self.params, self.kind, self.roles = name, params, kind, roles
        self.root, self.root_first, self.fast, self.devices = root, root_first, fast, devices
        self.method, self.args, self.record, self.outputs = method, args, record, outputs
        self.timeout, self.plan = timeout, plan
        self.plan_args = call_args(params) if plan_args is None else plan_args
        self.peer, self.blocking = peer, blocking
        self.fingerprint = _FINGERPRINT_KIND[fingerprint or method]
        self.doc = doc

    def __repr__(self):
        return f"OpSpec({self.name!r}, kind={self.kind!r}, method={self.method!r})"


def _p2p(name, kind, method, peer, doc, *, blocking=False):
    """A point-to-point call's entry: one buffer, its peer, the backend's isend or irecv.
    It names no roles, fast path, record or outputs: :func:`_post` checks the buffer and
    has the dispatcher record it with the peer and the tag, the same for all four."""
    return OpSpec(name, f"tensor, {peer}=None, group=None, tag=0, group_{peer}=None", kind,
                  method=method, peer=peer, blocking=blocking,
                  fingerprint="send" if method == "isend" else "recv", doc=doc)


# the public functions' docstrings too long for the table
SPECS = {s.name: s for s in (
    OpSpec("all_reduce", "tensor, op=_SUM, group=None, async_op=False", "all_reduce",
           roles=(Role("buf", "tensor"),), fast="op is _SUM", devices=(("buf",), "tensor"),
           method="all_reduce", args="(buf, _SUM_CODE)", record=("buf", "-1", "_SUM_CODE"),
           outputs="(tensor,)", plan=_all_reduce, plan_args="buf, tensor, op, async_op",
           doc=DOC_ALL_REDUCE),
    OpSpec("all_reduce_coalesced", "tensors, op=_SUM, group=None, async_op=False",
           "all_reduce_coalesced", method="all_reduce", plan=_all_reduce_coalesced,
           doc="all_reduce of several tensors of one dtype in one backend call."),
    OpSpec("reduce", "tensor, dst=None, op=_SUM, group=None, async_op=False, group_dst=None",
           "reduce", roles=(Role("buf", "tensor"),), root="dst", root_first=True,
           fast="op is _SUM", devices=(("buf",), "tensor"), method="reduce",
           args="(buf, _SUM_CODE, root)", record=("buf", "root", "_SUM_CODE"),
           outputs="(tensor,)", plan=_reduce, plan_args="buf, tensor, root, op, async_op",
           doc="Reduce ``tensor`` across the group into ``dst``'s tensor; the others keep theirs."),
    OpSpec("broadcast", "tensor, src=None, group=None, async_op=False, group_src=None",
           "broadcast", roles=(Role("buf", "tensor"),), root="src", fast=None,
           devices=(("buf",), "tensor"), method="broadcast", args="(buf, root)",
           record=("buf", "root", "-1"), outputs="(tensor,)",
           doc=DOC_BROADCAST),
    OpSpec("all_gather", "tensor_list, tensor, group=None, async_op=False", "all_gather",
           method="all_gather", plan=_all_gather,
           doc="Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank) on every rank."),
    OpSpec("all_gather_single", "output_tensor, input_tensor, group=None, async_op=False",
           "all_gather",
           roles=(Role("inp", "input_tensor", "input_tensor"),
                  Role("out", "output_tensor", "output_tensor")),
           fast="disjoint_gather(out, inp, pg._size, pg._own_block)",
           devices=(("out", "inp"), "output_tensor and input_tensor"), method="all_gather",
           args="(out, inp)", record=("inp", "-1", "-1"), outputs="(output_tensor,)",
           plan=_all_gather_single, plan_args="out, inp, output_tensor, async_op",
           doc=DOC_ALL_GATHER_SINGLE),
    OpSpec("all_gather_coalesced", "output_tensor_lists, input_tensor_list, group=None, "
           "async_op=False", "all_gather_coalesced", method="all_gather",
           plan=_all_gather_coalesced, doc=DOC_ALL_GATHER_COALESCED),
    OpSpec("gather", "tensor, gather_list=None, dst=None, group=None, async_op=False, "
           "group_dst=None", "gather", method="gather", plan=_gather,
           doc="Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (None elsewhere)."),
    OpSpec("scatter", "tensor, scatter_list=None, src=None, group=None, async_op=False, "
           "group_src=None", "scatter", method="scatter", plan=_scatter,
           doc="Rank r receives ``scatter_list[r]`` of ``src`` into ``tensor``."),
    OpSpec("reduce_scatter", "output, input_list, op=_SUM, group=None, async_op=False",
           "reduce_scatter", method="reduce_scatter", plan=_reduce_scatter,
           doc="Rank r's ``output`` gets the reduction over ranks of their ``input_list[r]``."),
    OpSpec("reduce_scatter_single", "output, input, op=_SUM, group=None, async_op=False",
           "reduce_scatter",
           roles=(Role("out", "output", "output"), Role("inp", "input", "input")),
           fast="op is _SUM and disjoint_gather(inp, out, pg._size, pg._own_block)",
           devices=(("out", "inp"), "output and input"), method="reduce_scatter",
           args="(out, inp, _SUM_CODE)", record=("out", "-1", "_SUM_CODE"),
           outputs="(output,)", plan=_reduce_scatter_single,
           plan_args="out, inp, output, op, async_op",
           doc="Rank r's ``output`` gets the reduction of slice r of every rank's ``input``."),
    OpSpec("all_to_all", "output_tensor_list, input_tensor_list, group=None, async_op=False",
           "all_to_all", method="all_to_all", plan=_all_to_all,
           doc="Rank r sends ``input_tensor_list[q]`` to rank q, which receives it in "
               "``output_tensor_list[r]``."),
    OpSpec("all_to_all_single", "output, input, output_split_sizes=None, input_split_sizes=None, "
           "group=None, async_op=False", "all_to_all", method="all_to_all",
           plan=_all_to_all_single, doc=DOC_ALL_TO_ALL_SINGLE),
    OpSpec("barrier", "group=None, async_op=False, device_ids=None, timeout=None", "barrier",
           fast=None, method="barrier", timeout=True,
           doc=DOC_BARRIER),
    # point to point: a Work for isend/irecv; send/recv wait, recv names the sender
    _p2p("isend", "isend", "isend", "dst", "Start sending ``tensor`` to ``dst``; returns a Work "
         "(don't modify the tensor until it's done)."),
    _p2p("irecv", "irecv", "irecv", "src", "Start receiving into ``tensor`` from ``src`` (None: "
         "any rank; ``Work.source_rank()`` names it)."),
    _p2p("send", "send", "isend", "dst", DOC_SEND, blocking=True),
    _p2p("recv", "recv", "irecv", "src", DOC_RECV, blocking=True),
)}


def add(*specs):
    """Enter ``specs`` in the table (the ``*_multigpu`` entries, whose plans live in
    :mod:`collectives.api.multigpu`); ValueError for a name already there."""
    for spec in specs:
        if spec.name in SPECS:
            raise ValueError(f"{spec.name!r} is in the op table already")
        SPECS[spec.name] = spec


__all__ = ["OpSpec", "Role", "SPECS", "add", "any_sender", "call_args", "recv_peer", "send_peer"]
