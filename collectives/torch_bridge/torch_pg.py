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
- the backend ``"collectives"`` is registered with torch by ``import collectives``, by
  torch's ``torch.backends`` entry point at ``import torch`` (both lazily: see
  ``_collectives_torch.py``; this module is imported at the first init), and by importing
  this module: ``torch.distributed.init_process_group("collectives")`` then runs a program written for
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
import os
import sys
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as td
from torch.distributed import distributed_c10d as _c10d

from .. import config
from ..api import group as _groups
from ..api.monitored_barrier import monitored_barrier as _monitored_barrier
from ..api.pg_methods import CollectiveMethods
from .mapped import maybe_map
from .torch_store import FromTorchStore as _FromTorchStore
from .torch_store import ToTorchStore as _ToTorchStore
from .torch_work import TorchWork, _Completer, _timeout  # noqa: F401  (_Completer: tests)
from ..core.work import timeout_seconds

BACKEND_NAME = "collectives"


def _torch_work(call, work, outputs, group):
    """torch's Work over our call's (None when a collective blocked; ``call`` None: a
    point-to-point one), whose future is torch's and holds ``outputs``."""
    return TorchWork(work if call is None or call.async_op else None, outputs, group)


class _TorchSide:
    """What a torch ``ProcessGroup`` over a collectives group (``self._group``) answers
    beyond the collective methods: the name and description torch gives it, its backend's
    name, ``collectives_group``, torch's ``monitored_barrier``. Shared by the two torch
    classes below; it is no ProcessGroup itself."""

    # torch's C++ ProcessGroup keeps its name and description in its backends, and these
    # have none: they live here, for torch's Python code (destroy_process_group...)
    def _set_group_name(self, name):
        self._name = name

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

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        _monitored_barrier(group=self._group, timeout=_timeout(timeout),
                           wait_all_ranks=wait_all_ranks)


class TorchProcessGroup(_TorchSide, CollectiveMethods, td.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` over the collectives group ``group``, for a
    group made before torch was imported or with the bridge off (:func:`to_torch`), and
    for the second name torch gives the world (see ``_create_group``).

    Its collective and point-to-point methods are collectives' one table
    (``api.pg_methods.CollectiveMethods``), run on ``group``, returning torch's Work; they
    take torch's ``*Options`` structs (as torch's front end and DDP's reducer pass them),
    ours, or the legacy positional forms.

    Ranks in options (``rootRank``, ``dstRank``, ``srcRank``) are ranks of the group, as
    torch's front end passes them.
    """

    def __init__(self, group, owned=False):
        super().__init__(group.rank(), group.size())
        self._group = group
        self._owned = owned  # made for torch (its init or new_group): torch's shutdown ends it

    @property
    def group_name(self):
        return getattr(self, "_name", None) or self._group.group_name

    def _result(self, call, work, outputs):
        return _torch_work(call, work, outputs, self._group)

    def set_timeout(self, timeout):
        self._group.set_timeout(timeout)  # (a plain group's: a BridgedGroup is never wrapped)

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

#: the autograd graph task this thread runs, -1 outside a backward pass
_graph_task = torch._C._current_graph_task_id


def _holds_torch_tensor(x):
    """Whether ``x`` is a torch tensor, or a list (of lists) whose first entry is one."""
    for _ in range(3):
        if isinstance(x, torch.Tensor):
            return True
        if not isinstance(x, (list, tuple)) or not x:
            return False
        x = x[0]
    return False


class BridgedGroup(_TorchSide, _groups.ProcessGroup, td.ProcessGroup):
    """A collectives group that is also a ``torch.distributed.ProcessGroup``: what
    collectives makes its groups when the program has imported torch (unless
    ``COLLECTIVES_TORCH_BRIDGE=0``). ``DistributedDataParallel(model,
    process_group=dist.new_group(...))``, FSDP and ``torch.distributed``'s functions take
    it as it is; collectives' functions and methods work on it as on any of its groups.

    Our ProcessGroup comes before torch's base, so its methods (``rank``, ``name``,
    ``allreduce``...) are the ones called; torch's C++ base holds only what torch's own
    code needs of a ProcessGroup object. The collective methods return torch's Work when
    called torch's way: with torch's options (as torch's front end and its C++ callers,
    DDP's reducer among them, always pass them), or with torch tensors and no options of
    ours (as a comm hook's ``group.allreduce([bucket.buffer()])``); collectives' Work
    otherwise (NumPy arrays, or our options or ReduceOp). The point-to-point ones return
    collectives' Work (it answers torch's ``_source_rank``).
    ``name()`` is the transport's ('gloo', 'mpi'...), ``group_name`` torch's name for it
    once torch has named it.
    """

    # in slots, the attributes the front end reads on every call: an instance attribute of
    # a subclass of torch's (pybind) class takes ~38 ns to read from its __dict__, ~13 ns
    # from a slot (a plain object's: ~10 ns)
    __slots__ = ("backend", "ranks", "_rank", "_size", "_our_name", "backend_name", "timeout",
                 "store", "group_of_global", "run", "submit", "fr", "dispatch", "destroyed")

    def __init__(self, backend, ranks, rank, name, backend_name, timeout, store):
        td.ProcessGroup.__init__(self, rank, len(ranks))
        _groups.ProcessGroup.__init__(self, backend, ranks, rank, name, backend_name, timeout, store)

    @property
    def group_name(self):
        return self.__dict__.get("_name") or self._our_name

    @group_name.setter
    def group_name(self, name):
        self._our_name = name

    def _result(self, call, work, outputs):
        if call is not None and (call.theirs or (call.theirs is None
                                                 and _holds_torch_tensor(call.first))):
            return _torch_work(call, work, outputs, self)
        return super()._result(call, work, outputs)

    def allreduce(self, tensors, opts=None):
        # in a backward pass on shared memory: DDP's buckets mapped (one C call otherwise)
        if _graph_task() != -1 and getattr(self.backend, "map_min", 0):
            maybe_map(self, tensors)
        return CollectiveMethods.allreduce(self, tensors, opts)

    def shutdown(self):
        _end(self)

    abort = shutdown


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


def _fsdp_first_forward(module, args):
    """torch.nn's global forward pre-hook (installed at import unless
    ``COLLECTIVES_FSDP_SHARED=0``): an FSDP2 module's calls on our groups go through shared
    memory from its first forward (``fsdp.share_by_default``). It costs a lookup a
    module call until FSDP2 is imported, and never imports it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ())):
        from .fsdp import share_by_default
        share_by_default(module, _TorchSide)


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
        td.init_process_group(BACKEND_NAME, store=_store_for_torch(pg), rank=pg.rank(),
                              world_size=pg.size(), timeout=timedelta(seconds=pg.timeout),
                              **({"_ranks": list(ranks)} if ranks else {}))
    finally:
        _state.installing = None
        if barrier_env is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier_env
    if pg is _groups.world.default and config.get("COLLECTIVES_TORCH_BRIDGE"):
        _groups.world.bridge = True  # torch now runs on this world: its later groups bridge too
    return True


def _store_for_torch(pg):
    """The store torch's default group over ``pg`` holds: the job's rendezvous store under
    a prefix of its own, where ``pg`` is the world that met through one (groups of torch's
    own backends, ``new_group(backend="gloo")``, meet through it); else a HashStore (they
    would wait for peers they cannot reach: a job without a store, as mpiexec's)."""
    store = getattr(_groups.world, "store", None)
    if pg is not _groups.world.default or store is None:
        return td.HashStore()
    from ..store import PrefixStore
    # the Python object must outlive torch's C++ references to it (they find its methods
    # through it): our group holds it
    pg._torch_store = _ToTorchStore(PrefixStore("torch", store))
    return pg._torch_store


def uninstall_default():
    """Destroy torch's default group if it runs on collectives (a TorchProcessGroup or a
    BridgedGroup; collectives' ``destroy_process_group`` calls it), unless torch's destroy
    is what got us here."""
    if getattr(_state, "tearing_down", False) or not td.is_initialized():
        return
    if isinstance(td.distributed_c10d._get_default_group(), _TorchSide):
        _state.tearing_down = True
        try:
            td.destroy_process_group()
        finally:
            _state.tearing_down = False


register()
_groups.set_torch_bridge(loaded=sys.modules[__name__])  # api/group reaches the bridge here
if config.get("COLLECTIVES_FSDP_SHARED"):
    torch.nn.modules.module.register_module_forward_pre_hook(_fsdp_first_forward)

__all__ = ["BACKEND_NAME", "BridgedGroup", "TorchProcessGroup", "TorchWork", "forget_group",
           "install_default", "register", "register_group", "to_torch", "uninstall_default"]
