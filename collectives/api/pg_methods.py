"""ProcessGroup's own methods, as torch's C++ ProcessGroup exposes them:
``pg.allreduce([t], opts)``, ``pg.broadcast(t, root)``, ``pg.send([t], dst, tag)``...

One table (:class:`CollectiveMethods`) serves our groups, torch's wrapper over one of
them and the groups that are both (collectives.torch_bridge.torch_pg). In torch's order: each method
normalises its options (:func:`normalise`: torch's ``*Options`` struct or ours, or the
legacy positional form) into one :class:`Call`, calls the collective's free function
(:mod:`collectives.api._generated`) with ``group=`` its group, and hands the result to the
class's result adapter (``_result``): our groups return our Work, torch's groups torch's.

Each returns a Work (the call is asynchronous, as torch's, unless the options say
``asyncOp=False``: it then blocks and its Work is completed). Ranks given to them
(opts.rootRank, ``root``, ``dstRank``, ``srcRank``) are ranks of this group, not global
ones, as in torch. A list of several tensors per rank takes the ``*_multigpu`` meaning
(every entry takes part), as torch's gloo does. An options struct's ``timeout``, where
set, bounds that call instead of the group's timeout (torch's gloo does the same). They
call the free functions, so they take what those take (torch tensors, NumPy
arrays) and check it the same way.
"""
from ..core.options import (
    AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
    BroadcastOptions, GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions)
from ..core import world as _world
from . import _generated as _api  # the free functions, which the methods call
from .monitored_barrier import monitored_barrier as _monitored_barrier
from ..backends.base import DoneRequest
from ..core.reduce_op import PremulSum, RedOpType, ReduceOp, _PremulSumMember, as_op
from ..core.work import Work, option_timeout, per_call_timeout, timeout_seconds

_OUR_OPS = (RedOpType, PremulSum, _PremulSumMember)
_SUM = ReduceOp.SUM


def _tensors(x, name):
    """A list of tensors from a tensor or a list/tuple of them."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name} must hold at least one tensor")
        return list(x)
    return [x]


def _seq(x):
    """A list from a list/tuple (empty allowed), or a one-entry list from a tensor."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _only(x, name, what="tensor"):
    if len(x) != 1:
        raise ValueError(f"{name} must hold one {what}, got {len(x)}")
    return x[0]


def _root(pg, rank, name):
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < pg._size:
        raise ValueError(f"{name} must be a rank of this group, in [0, {pg._size}), got {rank!r}")
    return rank


class Call:
    """One method call, normalised: the group it runs on, its reduce op (ours), root rank
    and root tensor, its own timeout (seconds, or None: the group's), whether it is
    asynchronous, whether its options were torch's (True), ours (False) or not given
    (None), and its first tensor argument (which torch's groups look at when no options
    say whose call it is)."""

    __slots__ = ("group", "op", "root", "root_tensor", "secs", "async_op", "theirs", "first")


_accepted = {}  # (options type, our class) -> whether the type is torch's struct of that name


def _torchs(value, cls):
    """Whether ``value`` is torch's options struct of ``cls``'s name (``torch.distributed``'s
    AllreduceOptions for ours...): they have the same fields, and need no torch here."""
    key = (type(value), cls)
    ok = _accepted.get(key)
    if ok is None:
        t = type(value)
        ok = _accepted[key] = t.__name__ == cls.__name__ and t.__module__.startswith("torch")
    return ok


def normalise(group, first, value, cls, legacy):
    """The :class:`Call` for a method of ``group`` given ``value`` as its options: a ``cls``
    (ours), torch's struct of that name, or, where the method has a legacy positional form,
    the values in ``legacy`` (reduceOp, rootRank; None: the default). TypeError for
    anything else; ValueError for a timeout that is not a positive duration."""
    c = Call()
    c.group, c.first = group, first
    ours = isinstance(value, cls)
    if ours or (value is not None and _torchs(value, cls)):
        c.theirs = not ours
        c.op = as_op(getattr(value, "reduceOp", _SUM))
        c.root = getattr(value, "rootRank", 0)
        c.root_tensor = getattr(value, "rootTensor", 0)
        c.secs = option_timeout(value.timeout, "opts.timeout")
        c.async_op = bool(value.asyncOp)
        return c
    if value is not None and not legacy:
        raise TypeError(f"opts must be a {cls.__name__}, got {type(value).__name__}")
    op, root = legacy.get("reduceOp"), legacy.get("rootRank")
    c.theirs = False if isinstance(op, _OUR_OPS) else None
    c.op = _SUM if op is None else as_op(op)
    c.root = 0 if root is None else root
    c.root_tensor, c.secs, c.async_op = 0, None, True
    return c


class CollectiveMethods:
    """The collective and point-to-point methods, for our groups (mixed into ProcessGroup)
    and torch's (collectives.torch_bridge.torch_pg), in torch's order: a method resolves its arguments
    (:func:`normalise`) and calls the collective's free function (``fn``, of
    :mod:`collectives.api._generated`) with ``group=self._group``, the collectives group it
    runs on (the group itself, or the one a torch group wraps). ``_result`` is what a
    class returns for a call (``call`` None: a point-to-point one)."""

    def _result(self, call, work, outputs):
        """What a method returns: our Work (a completed one for a blocking call)."""
        if call is None:
            return work
        if work is None or not call.async_op:
            return Work(DoneRequest(), outputs, call.group)
        return work

    def _call(self, first, opts, cls, **legacy):
        """The :class:`Call` of a method, on the group it runs on."""
        return normalise(self._group, first, opts, cls, legacy)

    def _run(self, c, fn, outputs, *args, **kwargs):
        """The free function ``fn(*args, group=, async_op=, **kwargs)`` on the call's group
        (a destroyed one raises there), under the call's own timeout; its Work through the
        result adapter (``outputs``: what torch's Work's result() holds). ``args`` stop
        before ``fn``'s ``group`` parameter."""
        if c.secs is None:
            work = fn(*args, group=c.group, async_op=c.async_op, **kwargs)
        else:
            with per_call_timeout(c.secs):
                work = fn(*args, group=c.group, async_op=c.async_op, **kwargs)
        return self._result(c, work, outputs)

    def _coalesced(self, c, fn, outputs, inputs, *args):
        """The free function ``fn(output, input, *args)`` on the call's group for each pair,
        all issued before any is waited for; one Work for them all (the group runs them in
        order: the last done means all are)."""
        outputs, inputs = _seq(outputs), _seq(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"outputs and inputs must have the same length, got {len(outputs)} "
                             f"and {len(inputs)}")
        _world.current(c.group)  # (a destroyed group raises, with no pairs too)
        with per_call_timeout(c.secs):
            works = [fn(o, i, *args, group=c.group, async_op=c.async_op)
                     for o, i in zip(outputs, inputs)]
        last = works[-1] if works else None
        return self._result(c, None if last is None else Work(last._req, outputs, c.group),
                            outputs)

    # ---- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        """``allreduce(tensors, AllreduceOptions())``, ``allreduce(tensors, op)`` or
        ``allreduce(tensor, op)``."""
        ts = _tensors(tensors, "tensors")
        c = self._call(tensors, opts, AllreduceOptions, reduceOp=opts)
        if len(ts) > 1:
            return self._run(c, _api.all_reduce_multigpu, ts, ts, c.op)
        return self._run(c, _api.all_reduce, ts, ts[0], c.op)

    def allreduce_coalesced(self, tensors, opts=None):
        ts = _tensors(tensors, "tensors")
        c = self._call(tensors, opts, AllreduceCoalescedOptions)
        return self._run(c, _api.all_reduce_coalesced, ts, ts, c.op)

    def broadcast(self, tensors, opts=None):
        """``broadcast(tensors, BroadcastOptions())`` or ``broadcast(tensor, root)``."""
        ts = _tensors(tensors, "tensors")
        c = self._call(tensors, opts, BroadcastOptions, rootRank=opts)
        root = _root(c.group, c.root, "rootRank")
        if len(ts) > 1:
            return self._run(c, _api.broadcast_multigpu, ts, ts, c.group.ranks[root],
                             src_tensor=c.root_tensor)
        return self._run(c, _api.broadcast, ts, ts[0], group_src=root)

    def reduce(self, tensors, opts=None, op=None):
        """``reduce(tensors, ReduceOptions())`` or ``reduce(tensor, root, op)``."""
        ts = _tensors(tensors, "tensors")
        c = self._call(tensors, opts, ReduceOptions, rootRank=opts, reduceOp=op)
        root = _root(c.group, c.root, "rootRank")
        if len(ts) > 1:
            return self._run(c, _api.reduce_multigpu, ts, ts, c.group.ranks[root], c.op,
                             dst_tensor=c.root_tensor)
        return self._run(c, _api.reduce, ts, ts[0], op=c.op, group_dst=root)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``allgather([[out per rank]], [inp], AllgatherOptions())`` or
        ``allgather([out per rank], inp)``."""
        c = self._call(output_tensors, opts, AllgatherOptions)
        if not isinstance(input_tensors, (list, tuple)):
            outs = list(output_tensors)
            return self._run(c, _api.all_gather, outs, outs, input_tensors)
        ins = _tensors(input_tensors, "input_tensors")
        if len(ins) > 1:
            outs = [list(x) for x in output_tensors]
            return self._run(c, _api.all_gather_multigpu, outs, outs, ins)
        if len(output_tensors) != 1 or not isinstance(output_tensors[0], (list, tuple)):
            raise ValueError("output_tensors must be a list holding one list of tensors "
                             "(one per rank) for each input tensor")
        outs = list(output_tensors[0])
        return self._run(c, _api.all_gather, [outs], outs, ins[0])

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        c = self._call(output, opts, AllgatherOptions)
        return self._run(c, _api.all_gather_single, [output], output, input)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """``_allgather_base`` for each (output, input) pair, as one Work."""
        c = self._call(outputs, opts, AllgatherOptions)
        return self._coalesced(c, _api.all_gather_single, outputs, inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        c = self._call(output_lists, opts, AllgatherOptions)
        outs = [list(x) for x in output_lists]
        return self._run(c, _api.all_gather_coalesced, outs, outs, _seq(input_list))

    def _rooted(self, c, single, many, single_name, many_name):
        """(root, the one tensor, the root's list or None) from gather's and scatter's two
        forms: ``([t], [[one per rank]] or [], opts)`` and ``(t, [one per rank] or [], root)``."""
        root = _root(c.group, c.root, "rootRank")
        mine = c.group._rank == root
        if isinstance(single, (list, tuple)):
            one = _only(_tensors(single, single_name), single_name)
            return root, one, list(_only(many, many_name, "list of tensors")) if mine else None
        return root, single, list(many) if mine else None

    def gather(self, output_tensors, input_tensors, opts=None):
        """``gather([[out per rank]] or [], [inp], GatherOptions())`` or
        ``gather([out per rank] or [], inp, root)``."""
        c = self._call(input_tensors, opts, GatherOptions, rootRank=opts)
        root, inp, outs = self._rooted(c, input_tensors, output_tensors, "input_tensors",
                                       "output_tensors")
        return self._run(c, _api.gather, outs or [], inp, outs, group_dst=root)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``scatter([out], [[in per rank]] or [], ScatterOptions())`` or
        ``scatter(out, [in per rank] or [], root)``."""
        c = self._call(output_tensors, opts, ScatterOptions, rootRank=opts)
        root, out, ins = self._rooted(c, output_tensors, input_tensors, "output_tensors",
                                      "input_tensors")
        return self._run(c, _api.scatter, [out], out, ins, group_src=root)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``reduce_scatter([out], [[in per rank]], ReduceScatterOptions())`` or
        ``reduce_scatter(out, [in per rank], op)``."""
        c = self._call(output_tensors, opts, ReduceScatterOptions, reduceOp=opts)
        if not isinstance(output_tensors, (list, tuple)):
            return self._run(c, _api.reduce_scatter, [output_tensors], output_tensors,
                             list(input_tensors), c.op)
        outs = _tensors(output_tensors, "output_tensors")
        if len(outs) > 1:
            return self._run(c, _api.reduce_scatter_multigpu, outs, outs,
                             [list(x) for x in input_tensors], c.op)
        return self._run(c, _api.reduce_scatter, outs, outs[0],
                         list(_only(input_tensors, "input_tensors", "list of tensors")), c.op)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        c = self._call(output, opts, ReduceScatterOptions)
        return self._run(c, _api.reduce_scatter_single, [output], output, input, c.op)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """``_reduce_scatter_base`` for each (output, input) pair, as one Work."""
        c = self._call(outputs, opts, ReduceScatterOptions)
        return self._coalesced(c, _api.reduce_scatter_single, outputs, inputs, c.op)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                      opts=None):
        c = self._call(output, opts, AllToAllOptions)
        return self._run(c, _api.all_to_all_single, [output], output, input,
                         list(output_split_sizes) or None, list(input_split_sizes) or None)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        c = self._call(output_tensors, opts, AllToAllOptions)
        outs = list(output_tensors)
        return self._run(c, _api.all_to_all, outs, outs, list(input_tensors))

    def barrier(self, opts=None):
        return self._run(self._call(None, opts, BarrierOptions), _api.barrier, [])

    # ---- point to point --------------------------------------------------------------------

    def _p2p(self, fn, t, **kwargs):
        """The point-to-point free function ``fn`` (isend, irecv) for tensor ``t`` on this
        group; its Work through the result adapter."""
        return self._result(None, fn(t, group=self._group, **kwargs), [t])

    def send(self, tensors, dstRank, tag=0):  # noqa: N803  (torch's names)
        t = _only(_tensors(tensors, "tensors"), "tensors")
        return self._p2p(_api.isend, t, tag=tag, group_dst=_root(self._group, dstRank, "dstRank"))

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        t = _only(_tensors(tensors, "tensors"), "tensors")
        return self._p2p(_api.irecv, t, tag=tag, group_src=_root(self._group, srcRank, "srcRank"))

    def recv_anysource(self, tensors, tag=0):
        """A receive from any rank of the group; ``work.source_rank()`` names the sender."""
        return self._p2p(_api.irecv, _only(_tensors(tensors, "tensors"), "tensors"), tag=tag)


class ProcessGroupMethods:
    """The rest of ProcessGroup's own methods (identity, timeout, life), mixed into it
    after :class:`CollectiveMethods`."""

    # ---- identity --------------------------------------------------------------------------

    def name(self):
        """The backend's name ('gloo', 'mpi', 'nccl', ...), as torch's ``pg.name()``."""
        return str(self.backend_name)

    @property
    def group_desc(self):
        return self.group_name

    @property
    def bound_device_id(self):
        return None

    def get_group_store(self):
        return self.store

    def set_timeout(self, timeout):
        """torch's ``pg.set_timeout(timeout)``: the timeout (a timedelta or seconds, > 0)
        of this group's later calls; calls already issued keep theirs."""
        secs = timeout_seconds(timeout, "timeout", positive=True)
        setter = getattr(self.backend, "set_timeout", None)
        if setter is not None:
            setter(secs)
        self.timeout = secs

    def shutdown(self):
        _world.destroy(self)

    abort = shutdown

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier in which group rank 0 names the ranks that did not arrive within
        ``timeout`` (a timedelta or seconds; default: the group's), all of them with
        ``wait_all_ranks``; blocking, as torch's ``pg.monitored_barrier``."""
        return _monitored_barrier(group=self, timeout=timeout, wait_all_ranks=wait_all_ranks)
