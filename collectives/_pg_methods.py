"""ProcessGroup's own collective methods, as torch's C++ ProcessGroup exposes them:
``pg.allreduce([t], opts)``, ``pg.broadcast(t, root)``, ``pg.send([t], dst, tag)``...

Each returns a Work (the call is asynchronous, as torch's). Ranks given to them (opts.rootRank,
``root``, ``dstRank``, ``srcRank``) are ranks of this group, not global ones, as in torch.
A list of several tensors per rank takes the ``*_multigpu`` meaning (every entry takes
part), as torch's gloo does. An options struct's ``timeout``, where set, bounds that call
instead of the group's timeout (torch's gloo does the same). They run through the
front-end functions, so they take what those take (torch tensors, NumPy arrays) and check
it the same way.
"""
import functools
import inspect

from .options import (
    AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
    BroadcastOptions, GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions, _Options)
from . import _world
from . import collective_ops as _c
from . import multigpu as _mg
from . import p2p as _pp
from .backends.base import DoneRequest
from .work import Work, option_timeout, per_call_timeout, timeout_seconds


def _tensors(x, name):
    """A list of tensors from a tensor or a list/tuple of them."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name} must hold at least one tensor")
        return list(x)
    return [x]


def _opts(value, cls, name, **fields):
    """``value`` if it is a ``cls``; else a ``cls`` with ``fields`` filled from the legacy
    positional form, where the method has one (``fields`` values of None are left at their
    defaults); else TypeError."""
    if isinstance(value, cls):
        return value
    if value is not None and not fields:
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    opts = cls()
    for k, v in fields.items():
        if v is not None:
            setattr(opts, k, v)
    return opts


def _timed(method):
    """``method`` (which takes ``opts``) run with ``opts.timeout`` as its call's own timeout
    when ``opts`` is an options struct whose timeout is set."""
    at = list(inspect.signature(method).parameters).index("opts") - 1  # after self

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        opts = kwargs["opts"] if "opts" in kwargs else args[at] if len(args) > at else None
        if isinstance(opts, _Options):
            secs = option_timeout(opts.timeout, "opts.timeout")
            if secs is not None:
                with per_call_timeout(secs):
                    return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return timed


def _root(pg, rank, name):
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < pg._size:
        raise ValueError(f"{name} must be a rank of this group, in [0, {pg._size}), got {rank!r}")
    return rank


class ProcessGroupMethods:
    """Mixed into ProcessGroup."""

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

    # ---- collectives -----------------------------------------------------------------------

    @_timed
    def allreduce(self, tensors, opts=None):
        """``allreduce(tensors, AllreduceOptions())``, ``allreduce(tensors, op)`` or
        ``allreduce(tensor, op)``."""
        ts = _tensors(tensors, "tensors")
        o = _opts(opts, AllreduceOptions, "opts", reduceOp=opts)
        if len(ts) > 1:
            return _mg.all_reduce_multigpu(ts, o.reduceOp, group=self, async_op=True)
        return _c.all_reduce(ts[0], o.reduceOp, group=self, async_op=True)

    @_timed
    def allreduce_coalesced(self, tensors, opts=None):
        o = _opts(opts, AllreduceCoalescedOptions, "opts")
        return _c.all_reduce_coalesced(_tensors(tensors, "tensors"), o.reduceOp, group=self,
                                           async_op=True)

    @_timed
    def broadcast(self, tensors, opts=None):
        """``broadcast(tensors, BroadcastOptions())`` or ``broadcast(tensor, root)``."""
        ts = _tensors(tensors, "tensors")
        o = _opts(opts, BroadcastOptions, "opts", rootRank=opts)
        root = _root(self, o.rootRank, "rootRank")
        if len(ts) > 1:
            return _mg.broadcast_multigpu(ts, self.ranks[root], group=self, async_op=True,
                                              src_tensor=o.rootTensor)
        return _c.broadcast(ts[0], group=self, async_op=True, group_src=root)

    @_timed
    def reduce(self, tensors, opts=None, op=None):
        """``reduce(tensors, ReduceOptions())`` or ``reduce(tensor, root, op)``."""
        ts = _tensors(tensors, "tensors")
        o = _opts(opts, ReduceOptions, "opts", rootRank=opts, reduceOp=op)
        root = _root(self, o.rootRank, "rootRank")
        if len(ts) > 1:
            return _mg.reduce_multigpu(ts, self.ranks[root], o.reduceOp, group=self,
                                           async_op=True, dst_tensor=o.rootTensor)
        return _c.reduce(ts[0], op=o.reduceOp, group=self, async_op=True, group_dst=root)

    @_timed
    def allgather(self, output_tensors, input_tensors, opts=None):
        """``allgather([[out per rank]], [inp], AllgatherOptions())`` or
        ``allgather([out per rank], inp)``."""
        _opts(opts, AllgatherOptions, "opts")
        if isinstance(input_tensors, (list, tuple)):
            ins = _tensors(input_tensors, "input_tensors")
            outs = list(output_tensors)
            if len(ins) > 1:
                return _mg.all_gather_multigpu(outs, ins, group=self, async_op=True)
            if len(outs) != 1 or not isinstance(outs[0], (list, tuple)):
                raise ValueError("output_tensors must be a list holding one list of tensors "
                                 "(one per rank) for each input tensor")
            return _c.all_gather(list(outs[0]), ins[0], group=self, async_op=True)
        return _c.all_gather(list(output_tensors), input_tensors, group=self, async_op=True)

    @_timed
    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        _opts(opts, AllgatherOptions, "opts")
        return _c.all_gather_into_tensor(output, input, group=self, async_op=True)

    all_gather_single = _allgather_base

    def _issue_coalesced(self, fn, outputs, inputs, *args):
        """``fn(output, input, *args)`` for each pair, all issued before any is waited for;
        one Work for them all (the group runs them in order: the last done means all are)."""
        outputs, inputs = list(outputs), list(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"outputs and inputs must have the same length, got {len(outputs)} "
                             f"and {len(inputs)}")
        works = [fn(o, i, *args, group=self, async_op=True) for o, i in zip(outputs, inputs)]
        if not works or works[-1] is None:
            return Work(DoneRequest(), outputs, self)
        return Work(works[-1]._req, outputs, self)

    @_timed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """``_allgather_base`` for each (output, input) pair, as one Work."""
        _opts(opts, AllgatherOptions, "opts")
        return self._issue_coalesced(_c.all_gather_into_tensor, outputs, inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_timed
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        _opts(opts, AllgatherOptions, "opts")
        return _c.all_gather_coalesced(output_lists, input_list, group=self, async_op=True)

    def _rooted(self, single, many, opts, cls, single_name):
        """(root, the one tensor, the root's list or None) from gather's and scatter's two
        forms: ``([t], [[one per rank]] or [], opts)`` and ``(t, [one per rank] or [], root)``."""
        o = _opts(opts, cls, "opts", rootRank=opts)
        root = _root(self, o.rootRank, "rootRank")
        if isinstance(single, (list, tuple)):
            ts = _tensors(single, single_name)
            if len(ts) != 1:
                raise ValueError(f"{single_name} must hold one tensor, got {len(ts)}")
            return root, ts[0], list(many[0]) if self._rank == root else None
        return root, single, list(many) if self._rank == root else None

    @_timed
    def gather(self, output_tensors, input_tensors, opts=None):
        """``gather([[out per rank]] or [], [inp], GatherOptions())`` or
        ``gather([out per rank] or [], inp, root)``."""
        root, inp, outs = self._rooted(input_tensors, output_tensors, opts, GatherOptions,
                                       "input_tensors")
        return _c.gather(inp, outs, group=self, async_op=True, group_dst=root)

    @_timed
    def scatter(self, output_tensors, input_tensors, opts=None):
        """``scatter([out], [[in per rank]] or [], ScatterOptions())`` or
        ``scatter(out, [in per rank] or [], root)``."""
        root, out, ins = self._rooted(output_tensors, input_tensors, opts, ScatterOptions,
                                      "output_tensors")
        return _c.scatter(out, ins, group=self, async_op=True, group_src=root)

    @_timed
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``reduce_scatter([out], [[in per rank]], ReduceScatterOptions())`` or
        ``reduce_scatter(out, [in per rank], op)``."""
        o = _opts(opts, ReduceScatterOptions, "opts", reduceOp=opts)
        if isinstance(output_tensors, (list, tuple)):
            outs = _tensors(output_tensors, "output_tensors")
            if len(outs) > 1:
                return _mg.reduce_scatter_multigpu(outs, list(input_tensors), o.reduceOp,
                                                       group=self, async_op=True)
            return _c.reduce_scatter(outs[0], list(input_tensors[0]), o.reduceOp, group=self,
                                         async_op=True)
        return _c.reduce_scatter(output_tensors, list(input_tensors), o.reduceOp, group=self,
                                     async_op=True)

    @_timed
    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        o = _opts(opts, ReduceScatterOptions, "opts")
        return _c.reduce_scatter_tensor(output, input, o.reduceOp, group=self, async_op=True)

    reduce_scatter_single = _reduce_scatter_base

    @_timed
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """``_reduce_scatter_base`` for each (output, input) pair, as one Work."""
        o = _opts(opts, ReduceScatterOptions, "opts")
        return self._issue_coalesced(_c.reduce_scatter_tensor, outputs, inputs, o.reduceOp)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_timed
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                      opts=None):
        _opts(opts, AllToAllOptions, "opts")
        return _c.all_to_all_single(output, input, list(output_split_sizes) or None,
                                        list(input_split_sizes) or None, group=self, async_op=True)

    all_to_all_single = alltoall_base

    @_timed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        _opts(opts, AllToAllOptions, "opts")
        return _c.all_to_all(list(output_tensors), list(input_tensors), group=self,
                                 async_op=True)

    @_timed
    def barrier(self, opts=None):
        _opts(opts, BarrierOptions, "opts")
        return _c.barrier(group=self, async_op=True)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier in which group rank 0 names the ranks that did not arrive within
        ``timeout`` (a timedelta or seconds; default: the group's), all of them with
        ``wait_all_ranks``; blocking, as torch's ``pg.monitored_barrier``."""
        return _c.monitored_barrier(group=self, timeout=timeout,
                                        wait_all_ranks=wait_all_ranks)

    # ---- point to point --------------------------------------------------------------------

    def _one(self, tensors):
        ts = _tensors(tensors, "tensors")
        if len(ts) != 1:
            raise ValueError(f"tensors must hold one tensor, got {len(ts)}")
        return ts[0]

    def send(self, tensors, dstRank, tag=0):  # noqa: N803  (torch's names)
        return _pp.isend(self._one(tensors), group=self, tag=tag,
                            group_dst=_root(self, dstRank, "dstRank"))

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        return _pp.irecv(self._one(tensors), group=self, tag=tag,
                            group_src=_root(self, srcRank, "srcRank"))

    def recv_anysource(self, tensors, tag=0):
        """A receive from any rank of the group; ``work.source_rank()`` names the sender."""
        return _pp.irecv(self._one(tensors), group=self, tag=tag)
