"""torch.distributed's own process group, run by collectives (needs torch).

``DistributedDataParallel``, ``FSDP``, ``torch.distributed.nn`` and libraries that call
``torch.distributed`` directly reach their process group through torch, never through
``collectives``. This module gives them one: :class:`TorchProcessGroup` is a
``torch.distributed.ProcessGroup`` whose methods (the ones torch's C++ reducer calls
and the ones torch's Python front end calls) run on a collectives group.

Three ways in:

- ``import collectives as dist`` in a program that has imported torch: collectives'
  groups are BridgedGroups, torch's ProcessGroups too; ``dist.init_process_group``
  makes the new default group torch's default group, and ``dist.new_group`` (and its kin)
  enter the new group in torch's table, so ``DistributedDataParallel(model)``,
  ``DistributedDataParallel(model, process_group=dist.new_group(...))`` and
  ``torch.distributed.get_rank()`` work unchanged (``COLLECTIVES_TORCH_BRIDGE=0`` turns
  this off; torch's default group is left alone when it already exists).
  ``dist.destroy_process_group`` takes them out again.
- ``import collectives.torch_pg`` registers the backend ``"collectives"`` with torch:
  ``torch.distributed.init_process_group("collectives")`` then runs a program written for
  torch.distributed on collectives without touching its calls (the transport: the
  ``COLLECTIVES_TORCH_BACKEND`` environment variable, default ``gloo``; rendezvous:
  torch's own store). ``torch.distributed.new_group`` makes collectives groups too.
- :func:`to_torch` wraps any collectives group (a plain one: made before torch was
  imported, or with the bridge off), for ``DistributedDataParallel(model,
  process_group=to_torch(group))``.

A call torch makes asynchronously (``async_op=True``, and every call of DDP's reducer)
runs on the group's progress thread; when it finishes, one long-lived thread completes its
torch future (so callbacks may issue collectives of their own), and DDP's reducer overlaps
communication with the backward pass.
"""
import importlib
import os
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as td
from torch.distributed import distributed_c10d as _c10d

from . import collective_ops as _ops
from . import multigpu as _mgpu
from . import _pg_methods, config
from . import options as _our_options
from . import p2p as _p2p
from ._pg_methods import _opts as _options
from .reduce_op import PremulSum, RedOpType, ReduceOp, _PremulSumMember
from .torch_store import FromTorchStore as _FromTorchStore
from .torch_work import TorchWork, _Completer, _timeout  # noqa: F401  (_Completer: tests)
from .work import option_timeout, per_call_timeout, timeout_seconds

_groups = importlib.import_module(f"{__package__}.group")  # (the package's `group` is dist.group)

BACKEND_NAME = "collectives"

_RedOpType = td.ReduceOp.RedOpType


def _op(rop):
    """Our ReduceOp for torch's (a ReduceOp, or a RedOpType member)."""
    code = getattr(rop, "op", rop)
    if code == _RedOpType.PREMUL_SUM:
        factor = rop.factor
        return ReduceOp.PREMUL_SUM(float(factor.item() if isinstance(factor, torch.Tensor) else factor))
    return getattr(ReduceOp, code.name)


def _list(x):
    """A list of tensors from a tensor or a sequence of them (torch's overloads take both)."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _opts(value, cls, **legacy):
    """``value`` if it is a torch ``cls`` (options); else a ``cls`` (asynchronous, as
    torch's defaults) with the legacy positional form's ``legacy`` fields set."""
    return _options(value, cls, "opts", **legacy)


def _one(tensors, name):
    if len(tensors) != 1:
        raise ValueError(f"{name} must hold one tensor per rank for the {BACKEND_NAME} "
                         f"backend, got {len(tensors)}")
    return tensors[0]


class TorchProcessGroup(td.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` over the collectives group ``group``.

    Ranks in options (``rootRank``, ``dstRank``, ``srcRank``) are ranks of the group, as
    torch's front end passes them.
    """

    def __init__(self, group, owned=False):
        super().__init__(group.rank(), group.size())
        self._group = group
        self._owned = owned  # made for torch (its init or new_group): torch's shutdown ends it

    # torch's C++ ProcessGroup keeps its name and description in its backends, and this
    # one has none: they live here, for torch's Python code (destroy_process_group...)
    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return getattr(self, "_name", None) or self._group.group_name

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_desc(self):
        return getattr(self, "_desc", None) or self.group_name

    @property
    def collectives_group(self):
        """The collectives group this one runs on."""
        return self._group

    def getBackendName(self):  # noqa: N802  (torch's name)
        return BACKEND_NAME

    def _global(self, group_rank):
        if not isinstance(group_rank, int) or not 0 <= group_rank < self.size():
            raise ValueError(f"rootRank must be a rank of this group, in [0, {self.size()}), "
                             f"got {group_rank!r}")
        return self._group.ranks[group_rank]

    def _run(self, opts, fn, outputs, *args, **kwargs):
        async_op = bool(opts.asyncOp)
        secs = option_timeout(opts.timeout, "opts.timeout")
        if secs is None:
            work = fn(*args, group=self._group, async_op=async_op, **kwargs)
        else:  # this call's own timeout (torch's barrier(timeout=...) sets it)
            with per_call_timeout(secs):
                work = fn(*args, group=self._group, async_op=async_op, **kwargs)
        return TorchWork(work if async_op else None, outputs, self._group)

    # ---- collectives -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        """``(tensors, AllreduceOptions)``, ``(tensors, op)`` or ``(tensor, op)``."""
        ts = _list(tensors)
        o = _opts(opts, _c10d.AllreduceOptions, reduceOp=opts)
        if len(ts) > 1:
            return self._run(o, _mgpu.all_reduce_multigpu, ts, ts, _op(o.reduceOp))
        return self._run(o, _ops.all_reduce, ts, ts[0], _op(o.reduceOp))

    def allreduce_coalesced(self, tensors, opts=None):
        o = _opts(opts, _c10d.AllreduceCoalescedOptions)
        ts = _list(tensors)
        return self._run(o, _ops.all_reduce_coalesced, ts, ts, _op(o.reduceOp))

    def broadcast(self, tensors, opts=None):
        """``(tensors, BroadcastOptions)`` or ``(tensor, root)``."""
        ts = _list(tensors)
        o = _opts(opts, _c10d.BroadcastOptions, rootRank=opts)
        if len(ts) > 1:
            return self._run(o, _mgpu.broadcast_multigpu, ts, ts, self._global(o.rootRank),
                             src_tensor=o.rootTensor)
        return self._run(o, _ops.broadcast, ts, ts[0], group_src=o.rootRank)

    def reduce(self, tensors, opts=None, op=None):
        """``(tensors, ReduceOptions)`` or ``(tensor, root, op)``."""
        ts = _list(tensors)
        o = _opts(opts, _c10d.ReduceOptions, rootRank=opts, reduceOp=op)
        if len(ts) > 1:
            return self._run(o, _mgpu.reduce_multigpu, ts, ts, self._global(o.rootRank),
                             _op(o.reduceOp), dst_tensor=o.rootTensor)
        return self._run(o, _ops.reduce, ts, ts[0], op=_op(o.reduceOp), group_dst=o.rootRank)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``([[out per rank]], [inp], AllgatherOptions)`` or ``([out per rank], inp)``."""
        o = _opts(opts, _c10d.AllgatherOptions)
        if isinstance(input_tensors, torch.Tensor):
            outs = list(output_tensors)
            return self._run(o, _ops.all_gather, outs, outs, input_tensors)
        ins = _list(input_tensors)
        if len(ins) > 1:
            outs = [list(x) for x in output_tensors]
            return self._run(o, _mgpu.all_gather_multigpu, outs, outs, ins)
        outs = list(_one(output_tensors, "output_tensors"))
        return self._run(o, _ops.all_gather, [outs], outs, ins[0])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        o = _opts(opts, _c10d.AllgatherOptions)
        outs = [list(x) for x in output_lists]
        return self._run(o, _ops.all_gather_coalesced, outs, outs, _list(input_list))

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        o = _opts(opts, _c10d.AllgatherOptions)
        return self._run(o, _ops.all_gather_into_tensor, [output], output, input)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        o = _opts(opts, _c10d.AllgatherOptions)
        return self._coalesced(o, _ops.all_gather_into_tensor, _list(outputs), _list(inputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        """``([[out per rank]] or [], [inp], GatherOptions)`` or ``([out per rank] or [], inp, root)``."""
        o = _opts(opts, _c10d.GatherOptions, rootRank=opts)
        root = self.rank() == o.rootRank
        if isinstance(input_tensors, torch.Tensor):
            inp, outs = input_tensors, list(output_tensors) if root else None
        else:
            inp = _one(_list(input_tensors), "input_tensors")
            outs = list(_one(output_tensors, "output_tensors")) if root else None
        return self._run(o, _ops.gather, outs or [], inp, outs, group_dst=o.rootRank)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``([out], [[in per rank]] or [], ScatterOptions)`` or ``(out, [in per rank] or [], root)``."""
        o = _opts(opts, _c10d.ScatterOptions, rootRank=opts)
        root = self.rank() == o.rootRank
        if isinstance(output_tensors, torch.Tensor):
            out, ins = output_tensors, list(input_tensors) if root else None
        else:
            out = _one(_list(output_tensors), "output_tensors")
            ins = list(_one(input_tensors, "input_tensors")) if root else None
        return self._run(o, _ops.scatter, [out], out, ins, group_src=o.rootRank)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """``([out], [[in per rank]], ReduceScatterOptions)`` or ``(out, [in per rank], op)``."""
        o = _opts(opts, _c10d.ReduceScatterOptions, reduceOp=opts)
        if isinstance(output_tensors, torch.Tensor):
            return self._run(o, _ops.reduce_scatter, [output_tensors], output_tensors,
                             list(input_tensors), _op(o.reduceOp))
        outs = _list(output_tensors)
        if len(outs) > 1:
            return self._run(o, _mgpu.reduce_scatter_multigpu, outs, outs,
                             [list(x) for x in input_tensors], _op(o.reduceOp))
        return self._run(o, _ops.reduce_scatter, outs, outs[0],
                         list(_one(input_tensors, "input_tensors")), _op(o.reduceOp))

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        o = _opts(opts, _c10d.ReduceScatterOptions)
        return self._run(o, _ops.reduce_scatter_tensor, [output], output, input, _op(o.reduceOp))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        o = _opts(opts, _c10d.ReduceScatterOptions)
        return self._coalesced(o, _ops.reduce_scatter_tensor, _list(outputs), _list(inputs),
                               _op(o.reduceOp))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _coalesced(self, opts, fn, outputs, inputs, *args):
        """One call per pair, all issued before any is waited for."""
        if len(outputs) != len(inputs):
            raise ValueError(f"outputs and inputs must have the same length, got {len(outputs)} "
                             f"and {len(inputs)}")
        async_op = bool(opts.asyncOp)
        secs = option_timeout(opts.timeout, "opts.timeout")
        with per_call_timeout(secs):
            works = [fn(o, i, *args, group=self._group, async_op=async_op)
                     for o, i in zip(outputs, inputs)]
        if not async_op or not works:
            return TorchWork(None, outputs, self._group)
        for w in works[:-1]:  # the group runs them in order: the last one done means all are
            w.wait()
        return TorchWork(works[-1], outputs, self._group)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        o = _opts(opts, _c10d.AllToAllOptions)
        return self._run(o, _ops.all_to_all_single, [output], output, input,
                         list(output_split_sizes) or None, list(input_split_sizes) or None)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        o = _opts(opts, _c10d.AllToAllOptions)
        outs = list(output_tensors)
        return self._run(o, _ops.all_to_all, outs, outs, list(input_tensors))

    def barrier(self, opts=None):
        return self._run(_opts(opts, _c10d.BarrierOptions), _ops.barrier, [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        _ops.monitored_barrier(group=self._group, timeout=_timeout(timeout),
                               wait_all_ranks=wait_all_ranks)

    def set_timeout(self, timeout):
        _pg_methods.ProcessGroupMethods.set_timeout(self._group, timeout)

    # ---- point to point ----------------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):  # noqa: N803  (torch's names)
        t = _one(tensors, "tensors")
        return TorchWork(_p2p.isend(t, group=self._group, tag=tag, group_dst=dstRank), [t], self._group)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        t = _one(tensors, "tensors")
        return TorchWork(_p2p.irecv(t, group=self._group, tag=tag, group_src=srcRank), [t], self._group)

    def recv_anysource(self, tensors, tag=0):
        t = _one(tensors, "tensors")
        return TorchWork(_p2p.irecv(t, group=self._group, tag=tag), [t], self._group)

    # ---- life ----------------------------------------------------------------------------------

    def shutdown(self):
        if self._owned:
            _end(self._group)

    abort = shutdown

    def __repr__(self):
        return f"TorchProcessGroup({self._group!r})"


def _end(pg):
    """Destroy collectives' group ``pg`` for torch (its destroy_process_group calls
    ``shutdown``), unless it is over or our own destroy is what got torch here."""
    if pg.destroyed or getattr(_state, "tearing_down", False):
        return
    _state.tearing_down = True  # torch's destroy is under way: ours must not call it
    try:
        if pg is _groups.world.default:
            _groups.destroy_process_group()
        else:
            _groups.destroy_process_group(pg)
    finally:
        _state.tearing_down = False


# ---- collectives groups that are torch's process groups too ------------------------------------

_TORCH_ARGS = (_c10d.AllreduceOptions, _c10d.AllreduceCoalescedOptions, _c10d.BroadcastOptions,
               _c10d.ReduceOptions, _c10d.AllgatherOptions, _c10d.GatherOptions,
               _c10d.ScatterOptions, _c10d.ReduceScatterOptions, _c10d.AllToAllOptions,
               _c10d.BarrierOptions)


def _holds_torch_tensor(x):
    """Whether ``x`` is a torch tensor, or a list (of lists) whose first entry is one."""
    for _ in range(3):
        if isinstance(x, torch.Tensor):
            return True
        if not isinstance(x, (list, tuple)) or not x:
            return False
        x = x[0]
    return False


_OUR_ARGS = (_our_options._Options, ReduceOp, RedOpType, PremulSum, _PremulSumMember)


def _either(name):
    """A method that runs as TorchProcessGroup's (returning torch's Work, whose future is
    torch's) when given torch's options, as torch's front end and its C++ callers (DDP's
    reducer among them) always pass them, or torch tensors and no options of ours, as a
    comm hook's ``group.allreduce([bucket.buffer()])`` does; as collectives' own
    otherwise (NumPy arrays, or our options or ReduceOp)."""
    theirs = getattr(TorchProcessGroup, name)
    ours = getattr(_pg_methods.ProcessGroupMethods, name, None) or theirs

    def method(self, *args, **kwargs):
        values = args + tuple(kwargs.values())
        for a in values:
            if isinstance(a, _TORCH_ARGS):
                return theirs(self, *args, **kwargs)
        for a in values:
            if isinstance(a, _OUR_ARGS):
                return ours(self, *args, **kwargs)
        if values and _holds_torch_tensor(values[0]):
            return theirs(self, *args, **kwargs)
        return ours(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = theirs.__doc__ or ours.__doc__
    return method


class BridgedGroup(TorchProcessGroup, _groups.ProcessGroup):
    """A collectives group that is also a ``torch.distributed.ProcessGroup``: what
    collectives makes its groups when the program has imported torch (unless
    ``COLLECTIVES_TORCH_BRIDGE=0``). ``DistributedDataParallel(model,
    process_group=dist.new_group(...))``, FSDP and ``torch.distributed``'s functions take
    it as it is; collectives' functions and methods work on it as on any of its groups.

    The collective methods (``allreduce``, ``broadcast``...) run as torch's when called
    with torch's options (as torch calls them) and as collectives' otherwise; the
    point-to-point ones are collectives' (their Work answers torch's ``_source_rank``).
    ``name()`` is the transport's ('gloo', 'mpi'...), ``group_name`` torch's name for it
    once torch has named it.
    """

    # in slots, the attributes the front end reads on every call: an instance attribute of
    # a subclass of torch's (pybind) class takes ~38 ns to read from its __dict__, ~13 ns
    # from a slot (a plain object's: ~10 ns)
    __slots__ = ("backend", "ranks", "_rank", "_size", "_our_name", "backend_name", "timeout",
                 "store", "group_of_global", "run", "submit", "inline", "destroyed", "_group")

    def __init__(self, backend, ranks, rank, name, backend_name, timeout, store):
        td.ProcessGroup.__init__(self, rank, len(ranks))
        self._group = self
        _groups.ProcessGroup.__init__(self, backend, ranks, rank, name, backend_name, timeout, store)

    @property
    def group_name(self):
        return self.__dict__.get("_name") or self._our_name

    @group_name.setter
    def group_name(self, name):
        self._our_name = name

    def shutdown(self):
        _end(self)

    abort = shutdown
    name = _pg_methods.ProcessGroupMethods.name
    get_group_store = _pg_methods.ProcessGroupMethods.get_group_store
    monitored_barrier = TorchProcessGroup.monitored_barrier
    set_timeout = _pg_methods.ProcessGroupMethods.set_timeout
    send = _pg_methods.ProcessGroupMethods.send
    recv = _pg_methods.ProcessGroupMethods.recv
    recv_anysource = _pg_methods.ProcessGroupMethods.recv_anysource
    __repr__ = _groups.ProcessGroup.__repr__


for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
              "allgather_coalesced", "_allgather_base", "all_gather_single",
              "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
              "alltoall_base", "all_to_all_single", "alltoall", "barrier"):
    setattr(BridgedGroup, _name, _either(_name))
del _name


def register_group(pg):
    """Enter our new group ``pg`` in torch's table of groups, so that torch's functions
    take it, when torch's default group runs on collectives' (the bridge)."""
    if getattr(_state, "for_torch", False) or not isinstance(pg, td.ProcessGroup) \
            or not td.is_initialized():
        return
    default = _c10d._get_default_group()
    if getattr(default, "collectives_group", None) is not _groups.world.default:
        return
    world = _c10d._world
    name = pg.group_name
    store = td.PrefixStore(f"{name}/", world.pg_map[default][1])
    config = world.pg_backend_config.get(default, BACKEND_NAME)
    ranks = {g: i for i, g in enumerate(pg.ranks)}
    helper = getattr(_c10d, "_register_pg_in_world", None)
    if helper is not None:
        helper(pg, backend_name=BACKEND_NAME, store=store, group_name=name, backend_config=config,
               rank_mapping=ranks)
        return
    world.pg_map[pg] = (BACKEND_NAME, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = config
    world.pg_group_ranks[pg] = ranks
    _c10d._register_process_group(name, pg)
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag


def forget_group(pg):
    """Take our group ``pg`` out of torch's table (collectives' destroy_process_group of one
    group), unless torch's own destroy is what got us here."""
    if getattr(_state, "tearing_down", False) or not td.is_initialized() \
            or pg not in _c10d._world.pg_map:
        return
    _state.tearing_down = True
    try:
        td.destroy_process_group(pg)
    finally:
        _state.tearing_down = False


_wrappers = weakref.WeakKeyDictionary()
_wrappers_lock = threading.Lock()


def to_torch(group=None):
    """The ``torch.distributed.ProcessGroup`` over a collectives group (default: the
    default group), one per group: ``DistributedDataParallel(model,
    process_group=to_torch(g))``. None for a rank outside ``group`` (torch's
    ``GroupMember.NON_GROUP_MEMBER`` then)."""
    pg = _groups.current(group)
    if pg is None:
        return td.GroupMember.NON_GROUP_MEMBER
    if isinstance(pg, td.ProcessGroup):  # a BridgedGroup: torch's already
        return pg
    with _wrappers_lock:
        tpg = _wrappers.get(pg)
        if tpg is None:
            tpg = _wrappers[pg] = TorchProcessGroup(pg)
        return tpg


# ---- the "collectives" backend of torch.distributed --------------------------------------------

_state = threading.local()
_register_lock = threading.Lock()
_registered = False


def _create(opts, _options=None):
    """torch's backend creator (extended API): the default group, or a new subgroup."""
    pg = _create_group(opts)
    pg._set_group_name(opts.group_id)  # torch names only the groups of its own backends
    return pg


def _create_group(opts):
    installing = getattr(_state, "installing", None)
    if isinstance(installing, _groups.ProcessGroup):  # dist.init_process_group installing it
        return installing if isinstance(installing, td.ProcessGroup) else TorchProcessGroup(installing)
    ranks = list(opts.global_ranks_in_group)
    timeout = opts.timeout
    if not _groups.is_initialized():  # torch.distributed.init_process_group("collectives")
        _state.installing = False  # our init must not install torch's group in turn
        try:
            _groups.init_process_group(
                config.get("COLLECTIVES_TORCH_BACKEND"),
                store=_FromTorchStore(opts.store, timeout), rank=opts.group_rank,
                world_size=opts.group_size, timeout=timeout)
        finally:
            _state.installing = None
        return _owned(_groups.world.default)
    world = _groups.world.default
    if (not ranks or ranks == world.ranks) and (
            timeout is None or timeout_seconds(timeout) == world.timeout):
        return TorchProcessGroup(world, owned=False)  # a second name for it: another object
    ranks = ranks or list(world.ranks)  # (all ranks with a timeout of their own: a group)
    # torch.distributed.new_group: only members get here, so only they meet; torch enters
    # the group in its table itself
    _state.for_torch = True
    try:
        sub = _groups.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    finally:
        _state.for_torch = False
    return _owned(sub)


def _owned(pg):
    """torch's group over our ``pg``, which torch made and whose shutdown ends it (a
    BridgedGroup's shutdown always does)."""
    return pg if isinstance(pg, td.ProcessGroup) else TorchProcessGroup(pg, owned=True)


def register():
    """Register ``"collectives"`` as a torch.distributed backend (once; done on import)."""
    global _registered
    with _register_lock:
        if not _registered and BACKEND_NAME.upper() not in td.Backend._plugins:
            td.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                        devices=["cpu", "cuda"])
        _registered = True


def install_default(pg, ranks=None):
    """Make torch's default group a TorchProcessGroup over ``pg`` (collectives' default
    group), unless torch's already exists; called by ``init_process_group`` (``ranks``: its
    ``_ranks``, which torch names the group by). Returns whether it did."""
    if getattr(_state, "installing", None) is not None or td.is_initialized():
        return False
    register()
    barrier_env = os.environ.pop("TORCH_DIST_INIT_BARRIER", None)  # its barrier uses the store:
    _state.installing = pg                                         # ours met already
    try:
        td.init_process_group(BACKEND_NAME, store=td.HashStore(), rank=pg.rank(),
                              world_size=pg.size(), timeout=timedelta(seconds=pg.timeout),
                              **({"_ranks": list(ranks)} if ranks else {}))
    finally:
        _state.installing = None
        if barrier_env is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier_env
    if pg is _groups.world.default and config.get("COLLECTIVES_TORCH_BRIDGE"):
        _groups.world.bridge = True  # torch now runs on this world: its later groups bridge too
    return True


def uninstall_default():
    """Destroy torch's default group if it is a TorchProcessGroup (collectives'
    ``destroy_process_group`` calls it), unless torch's destroy is what got us here."""
    if getattr(_state, "tearing_down", False) or not td.is_initialized():
        return
    if isinstance(td.distributed_c10d._get_default_group(), TorchProcessGroup):
        _state.tearing_down = True
        try:
            td.destroy_process_group()
        finally:
            _state.tearing_down = False


register()

__all__ = ["BACKEND_NAME", "BridgedGroup", "TorchProcessGroup", "TorchWork", "forget_group",
           "install_default", "register", "register_group", "to_torch", "uninstall_default"]
