"""Process groups: the class, init/destroy, new_group and split (the world's state is in
collectives.core.world; shrink_group, which builds on this module, is in api/shrink.py; the
rank queries, in api/group_queries.py, and the availability probes, in
api/availability.py, are re-exported here).

Every rank of the world calls ``new_group`` in the same order (as torch requires);
group state (ranks, this rank's group rank, the backend's bound methods) is
computed once here so the per-call path in collective_ops does no lookups.
"""
import datetime
import hashlib
import sys
import warnings
import zlib

from .. import backends as _backends
from ..diagnostics import debug as _debug
from . import group_dispatcher as _dispatcher
from ..diagnostics import flight_recorder as _flight
from .pg_methods import CollectiveMethods, ProcessGroupMethods
from ..core import world as _world
from .. import config
from ..core.world import (NOT_INITIALIZED, GroupBase, GroupMember, _set_world, current,  # noqa: F401
                          default_group, resolve, set_destroy_hook, world)
from ..core.work import timeout_seconds
from .availability import (is_available, is_backend_available, is_gloo_available,  # noqa: F401
                           is_mpi_available, is_nccl_available, is_torchelastic_launched,
                           is_ucc_available, is_xccl_available)
from .group_queries import (_DEVICE_BACKEND, get_backend, get_backend_config,  # noqa: F401
                            get_default_backend_for_device, get_global_rank, get_group_rank,
                            get_node_local_rank, get_pg_count, get_process_group_ranks, get_rank,
                            get_world_size)

DEFAULT_TIMEOUT = 1800.0  # torch's default for CPU backends (30 minutes)
default_pg_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT)  # dist.default_pg_timeout


class Backend(str):
    """Backend names (``dist.Backend.GLOO``...); ``Backend("GLOO") == "gloo"``."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    TCP = "tcp"

    def __new__(cls, name):
        if not isinstance(name, str):
            raise TypeError(f"Backend name must be a string, got {type(name).__name__}")
        return str.__new__(cls, name.lower())

    @staticmethod
    def register_backend(name, func, extended_api=False, devices=None):
        """Register a backend factory ``func(store, rank, size, timeout, options)``."""
        _backends.register_backend(name, func, extended_api, devices)
        setattr(Backend, name.upper(), name.lower())


group = _world.group  # dist.group.WORLD


class ProcessGroup(GroupBase, CollectiveMethods, ProcessGroupMethods):
    """A group of ranks sharing one backend instance.

    ``rank()``/``size()``, ``name()`` (the backend's), ``group_name`` and the collective
    methods (``allreduce``, ``broadcast``, ... with torch's ``*Options``) as in torch;
    ``ranks`` lists the members' global ranks in group-rank order.
    """

    def __init__(self, backend, ranks, rank, name, backend_name, timeout, store):
        backend = _debug.on_new_group(backend, name, ranks, rank, backend_name)
        super().__init__(backend, ranks, rank, name, backend_name, timeout, store)
        self.fr = _flight.new_recorder(self)  # the flight recorder: this group's last calls
        self.dispatch = _dispatcher.for_group(self)  # every collective call's one path

    @property
    def _group(self):
        """The collectives group the methods run on: this one (a torch group over one of
        ours, collectives.torch_bridge.torch_pg's, names that one)."""
        return self


# ---- initialisation ------------------------------------------------------------------

def _backend_name(backend):
    """'gloo' for None; the cpu entry of torch's 'cpu:gloo,cuda:nccl' form."""
    if backend is None:
        return Backend.GLOO
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'gloo', got {type(backend).__name__}")
    if ":" in backend:
        pairs = {}
        for entry in backend.split(","):
            dev, sep, name = entry.strip().partition(":")
            if not sep or not name:
                raise ValueError(f"backend {backend!r}: expected entries of the form 'device:name', "
                                 f"e.g. 'cpu:gloo,cuda:nccl'")
            pairs.setdefault(dev.strip().lower(), name.strip())
        backend = pairs.get("cpu") or next(iter(pairs.values()))
    return Backend(_backends.canonical_name(backend.strip()))


def _prefix(prefix, store):
    from ..store import PrefixStore
    return PrefixStore(prefix, store)


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None, _ranks=None,
                       *, auth_key=None):
    """Initialise the default process group (as torch.distributed).

    Args:
        backend: 'gloo' (default), 'mpi', 'nccl', a registered name, or torch's
            'cpu:gloo,cuda:nccl' form (the cpu entry is used).
        init_method: 'env://' (default), 'tcp://host:port', 'file:///path', or a URL of a
            scheme given to ``register_rendezvous_handler``.
        timeout: timedelta or seconds any single wait may take: the rendezvous, and
            every collective and point-to-point call of the group's, after which every
            waiting rank raises a DistError naming the ranks that did not arrive. Default
            1800 s (30 minutes, torch's for CPU backends; ``dist.default_pg_timeout``).
            A rank that waits longer than COLLECTIVES_WAIT_WARN_S (default 60 s) logs a
            warning naming the call and the missing ranks well before that.
        world_size, rank: required with ``store`` or a tcp:// / file:// init_method.
        store: a Store all ranks share (excludes init_method).
        _ranks: torch's private argument: the group is then named by the hash torch
            gives those ranks (``group_name`` otherwise, default "default_pg").
        auth_key: the job's shared key (str or bytes; keyword only, not torch's): the
            store and the TCP transport admit only processes that prove they hold it.
            Default: COLLECTIVES_AUTH_KEY (collectives-run sets it); with neither, no
            authentication (torch's behaviour). See docs/security.md.

    Example:
        >>> dist.init_process_group("gloo", rank=r, world_size=n)
    """
    if _ranks:  # torch's _hash_ranks_to_str, with no group named yet
        group_name = hashlib.sha1(f"{'_'.join(map(str, _ranks))}_0".encode(),
                                  usedforsecurity=False).hexdigest()
    if getattr(world, "master_worker", False):  # set by master_worker.init_master_worker
        raise RuntimeError("init_process_group: this process is in master-worker mode "
                           "(init_master_worker); the two modes exclude each other")
    if world.default is not None:
        raise ValueError("trying to initialize the default process group twice!")
    name = _backend_name(backend)
    factory = _backends.get_backend_factory(name)
    tmo = timeout_seconds(timeout, positive=True)
    tmo = DEFAULT_TIMEOUT if tmo is None else tmo
    if store is not None and init_method is not None:
        raise ValueError("Cannot specify both init_method and store.")
    for arg, val in (("world_size", world_size), ("rank", rank)):
        if not isinstance(val, int) or isinstance(val, bool):
            raise TypeError(f"{arg} must be an int, got {type(val).__name__}")
    if store is not None:
        if world_size <= 0:
            raise ValueError(f"world_size must be positive when store is given, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}) when store is given, got {rank}")
    world_rank_size = getattr(factory, "world_rank_size", None)
    owned = False
    if world_rank_size is not None and store is None and init_method is None:
        r, n = world_rank_size()
        if (rank >= 0 and rank != r) or (world_size > 0 and world_size != n):
            raise ValueError(f"rank={rank}, world_size={world_size} disagree with the {name} "
                             f"launcher's rank {r} of {n}")
        rank, world_size, store, pg_store = r, n, None, None
    else:
        from ..store.rendezvous import carry_key, custom_scheme, meet, rendezvous
        from ..store import Store
        if custom_scheme(init_method):  # torch's registry: the handler's first answer
            store, rank, world_size = next(rendezvous(
                init_method, rank, world_size, timeout=datetime.timedelta(seconds=tmo)))
            if not isinstance(store, Store):
                raise TypeError(f"the rendezvous handler for {init_method!r} must yield "
                                f"(Store, rank, world_size), got a {type(store).__name__}")
            if auth_key is not None:  # the transport's connections authenticate with it
                from ..security import auth
                carry_key(store, auth.check_key(auth_key))
        else:
            given = store
            store, rank, world_size = meet(init_method, rank, world_size, timeout=tmo, store=store,
                                           auth_key=auth_key)
            owned = given is None  # env://, tcp://, file://: ours to close at destroy
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        pg_store = _prefix("default_pg", store)
    be = factory(pg_store, rank, world_size, tmo, pg_options)
    world.bridge = _bridging()  # every group of this world follows (see _group_class)
    pg = _group_class()(be, range(world_size), rank, group_name or "default_pg", name, tmo, pg_store)
    world.store = store
    world.owned_store = owned
    world.groups.append(pg)
    _set_world(pg)
    _torch_bridge(pg, _ranks)


def _bridging():
    """Whether the program has imported torch and leaves the bridge on (see _torch_bridge).

    Asked once, by init_process_group: the world remembers the answer (``world.bridge``),
    and every group made until the world is destroyed (the default group, new_group,
    split_group, shrink_group) is of the class it implies, whether torch was imported
    before or after that group was made. A program that imports torch only after
    init_process_group gets plain groups, until it puts torch's default group over the
    world with ``collectives.torch_bridge.torch_pg.install_default``: the groups made from then on
    bridge (that call is the one other place the decision is made);
    ``collectives.torch_bridge.torch_pg.to_torch`` wraps a plain group for torch."""
    return "torch" in sys.modules and config.get("COLLECTIVES_TORCH_BRIDGE")


# ---- the torch bridge's hooks: collectives.torch_bridge, a layer above, fills them in -----------
_load_bridge = None  # imports torch_pg and returns it (None: no torch.distributed)
_bridge = None  # torch_pg once imported: BridgedGroup, install_default, uninstall_default, ...


def set_torch_bridge(load=None, loaded=None):
    """Register the torch bridge's hooks (this module never imports the bridge): ``load``,
    by the package torch_bridge when it is imported (with torch or without), and ``loaded``,
    by torch_pg when it is imported (by ``load`` or by the program)."""
    global _load_bridge, _bridge
    if load is not None:
        _load_bridge = load
    if loaded is not None:
        _bridge = loaded


def _active_bridge():
    """The bridge, imported now if need be (the world bridges); None where torch.distributed
    is unavailable."""
    if _bridge is None and _load_bridge is not None:
        return _load_bridge()
    return _bridge


def _group_class():
    """The class of a new group: one that is torch's ProcessGroup too when the world
    bridges (decided at init: see _bridging)."""
    if world.bridge:
        try:
            bridge = _active_bridge()
            if bridge is not None:
                return bridge.BridgedGroup
        except Exception as e:  # noqa: BLE001  (a plain group still works)
            warnings.warn(f"collectives: groups are not torch.distributed groups too "
                          f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3)
    return ProcessGroup


def _torch_bridge(pg, ranks=None):
    """Give torch.distributed a default group that runs on ``pg`` (see
    collectives.torch_bridge.torch_pg), when the program has imported torch: DistributedDataParallel
    and libraries calling torch.distributed then work unchanged."""
    if not world.bridge:
        return
    try:
        bridge = _active_bridge()
        if bridge is not None:
            bridge.install_default(pg, ranks)
    except Exception as e:  # noqa: BLE001  (collectives' own group is up and usable)
        warnings.warn(f"collectives: torch.distributed's default group was not set up over "
                      f"collectives ({type(e).__name__}: {e}); DistributedDataParallel and "
                      f"torch.distributed calls will not see this group", RuntimeWarning,
                      stacklevel=3)


class NoDefaultGroupError(ValueError, AssertionError):
    """``destroy_process_group()`` with no default group. torch raises AssertionError
    there ("Process group cannot be None"); this is one, and a ValueError as the
    package's other misuse errors are."""


def destroy_process_group(group=None):
    """Shut down ``group``'s backend, or every group (and the default one) when None.

    Raises:
        NoDefaultGroupError (an AssertionError, as torch's, and a ValueError): ``group``
            is None and there is no default group (destroyed already, or never made).
    """
    if group is None and world.default is None:
        raise NoDefaultGroupError(
            "Process group cannot be None: destroy_process_group() found no default group "
            "(destroyed already, or never initialised)")
    if group is None or group is GroupMember.WORLD:
        if _bridge is not None:  # torch's default group over ours goes first
            _bridge.uninstall_default()
        pgs, world.groups = world.groups, []
        for pg in reversed(pgs):
            pg.destroyed = True
            pg.backend.shutdown()
        if world.store is not None:
            from ..store.rendezvous import retire
            retire(world.store)  # a new init on the same port must not meet on its server
            if world.owned_store:  # and rank 0's server stops now, not when the
                world.store.close()  # collector finds a cycle (a BridgedGroup is one)
        world.reset()
        _set_world(None)
        return
    pg = resolve(group)
    if pg is None:
        return
    _end_group(pg, abort=False)


def _end_group(pg, abort):
    """Take ``pg`` (not the default group) out of torch's table and ours, and end its
    backend: ``abort`` fails its queued and running work at once; otherwise the backend
    finishes it (each piece within the group's timeout). Neither talks to the peers."""
    if _bridge is not None:  # out of torch's table of groups first
        _bridge.forget_group(pg)
    pg.destroyed = True
    if abort:
        pg.backend.abort()
    else:
        pg.backend.shutdown()
    if pg in world.groups:
        world.groups.remove(pg)


def is_initialized():
    return world.default is not None


# ---- subgroups --------------------------------------------------------------------------

def _check_ranks(ranks, size):
    try:
        ranks = list(ranks)
    except TypeError:
        raise TypeError(f"ranks must be a list of ints, got {type(ranks).__name__}") from None
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
            raise ValueError(f"ranks must hold global ranks in [0, {size}), got {r!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must not repeat a rank, got {ranks}")
    return ranks


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True):
    """A new group of ``ranks`` (global ranks; all ranks when None).

    Every rank of the world must call it, in the same order, unless
    ``use_local_synchronization`` is set (then members only). Non-members get
    ``GroupMember.NON_GROUP_MEMBER``.

    Example:
        >>> g = dist.new_group([0, 1]); dist.all_reduce(t, group=g)
    """
    wpg = default_group()
    ranks = _check_ranks(range(wpg._size) if ranks is None else ranks, wpg._size)
    if not ranks:
        raise ValueError("ranks must name at least one rank")
    if sort_ranks:
        ranks = sorted(ranks)
    tmo = timeout_seconds(timeout, positive=True)
    tmo = wpg.timeout if tmo is None else tmo
    name = wpg.backend_name if backend is None else _backend_name(backend)
    me = wpg._rank
    if use_local_synchronization:
        if me not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        key = tuple(ranks)
        k = world.local_counts.get(key, 0)
        world.local_counts[key] = k + 1
        tag = f"local/{'-'.join(map(str, ranks))}/{k}"
    else:
        tag = str(world.group_count)
        world.group_count += 1
        if name == wpg.backend_name and ranks == sorted(ranks):
            be = wpg.backend.split(ranks, tmo, pg_options)
            if be is not NotImplemented:
                if be is None:
                    return GroupMember.NON_GROUP_MEMBER
                return _add_group(be, ranks, me, tag, name, tmo, None)
        if me not in ranks:
            return GroupMember.NON_GROUP_MEMBER
    if world.store is None:
        split_local = getattr(wpg.backend, "split_local", None)
        if use_local_synchronization and split_local is not None and name == wpg.backend_name:
            # members only (mpi: MPI_Comm_create_group); the tag tells overlapping ones apart
            be = split_local(ranks, tmo, pg_options, zlib.crc32(tag.encode()) % 32768)
            return _add_group(be, ranks, me, tag, name, tmo, None)
        raise ValueError(f"new_group: the {wpg.backend_name} world group has no store and its "
                         f"backend cannot split; use backend={wpg.backend_name!r} ranks sorted")
    factory = _backends.get_backend_factory(name)
    store = _prefix(f"group/{tag}", world.store)
    be = factory(store, ranks.index(me), len(ranks), tmo, pg_options)
    return _add_group(be, ranks, me, tag, name, tmo, store)


def _add_group(be, ranks, me, tag, name, tmo, store):
    pg = _group_class()(be, ranks, ranks.index(me), f"group/{tag}", name, tmo, store)
    world.groups.append(pg)
    if _bridge is not None:  # torch's functions (and DDP) take it too
        _bridge.register_group(pg)
    return pg


def new_subgroups(group_size=None, group=None, timeout=None, backend=None, pg_options=None,
                  group_desc=None):
    """Split the world into consecutive groups of ``group_size`` ranks.

    Returns ``(this rank's subgroup, all subgroups)``. ``group_size`` defaults to
    the world size (there is no per-machine device count on CPU).
    """
    wpg = default_group()
    if group is not None and group is not GroupMember.WORLD:
        raise ValueError("new_subgroups splits the default group only; pass group=None")
    n = wpg._size
    if group_size is None:
        group_size = n
    if not isinstance(group_size, int) or not 0 < group_size <= n or n % group_size:
        raise ValueError(f"group_size must divide the world size {n} and be positive, got {group_size!r}")
    return new_subgroups_by_enumeration(
        [list(range(s, s + group_size)) for s in range(0, n, group_size)], timeout, backend, pg_options)


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None,
                                 pg_options=None, group_desc=None):
    """One new group per list of ranks; returns ``(this rank's subgroup or None, all subgroups)``."""
    wpg = default_group()
    seen = set()
    for ranks in ranks_per_subgroup_list:
        for r in _check_ranks(ranks, wpg._size):
            if r in seen:
                raise ValueError(f"rank {r} appears in more than one subgroup")
            seen.add(r)
    mine, groups = None, []
    for ranks in ranks_per_subgroup_list:
        g = new_group(ranks, timeout, backend, pg_options)
        groups.append(g)
        if wpg._rank in ranks:
            mine = g
    return mine, groups


def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None,
                backend=None):
    """Split ``parent_pg`` (default: the world) into disjoint groups and return this rank's,
    or None where it is in none of them (torch's ``split_group``).

    ``split_ranks`` lists the groups as lists of ranks of ``parent_pg`` (group ranks, not
    global ones), e.g. ``[[0, 1], [2, 3]]``; ranks may be left out. Every rank of
    ``parent_pg`` calls it with the same ``split_ranks``. A backend that splits itself
    (mpi: ``MPI_Comm_split``) is split once per group on every rank of the parent; other
    backends build each group from the store among its members only.
    """
    wpg = default_group()
    parent = wpg if parent_pg is None else resolve(parent_pg)
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise ValueError(f"split_ranks must be a non-empty list of lists of ranks of the parent "
                         f"group, got {split_ranks!r}")
    if parent is None:
        return None
    seen, splits, mine = set(), [], None
    for ranks in split_ranks:
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ValueError(f"split_ranks must hold non-empty lists of ranks, got {ranks!r}")
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < parent._size:
                raise ValueError(f"split_ranks must hold ranks of the parent group, in "
                                 f"[0, {parent._size}), got {r!r}")
            if r in seen:
                raise ValueError(f"split_ranks must name each rank once, got {r} twice")
            seen.add(r)
        splits.append(sorted(ranks))
        if parent._rank in ranks:
            mine = splits[-1]
    tmo = timeout_seconds(timeout, positive=True)
    tmo = parent.timeout if tmo is None else tmo
    name = parent.backend_name if backend is None else _backend_name(backend)
    if name == parent.backend_name:
        made = None
        for ranks in splits:  # every rank of the parent, in the same order
            be = parent.backend.split(ranks, tmo, pg_options)
            if be is NotImplemented:
                break
            if be is not None:
                made = be
        else:
            if made is None:
                return None
            glob = [parent.ranks[r] for r in mine]
            key = ("split",) + tuple(glob)
            k = world.local_counts.get(key, 0)
            world.local_counts[key] = k + 1
            return _add_group(made, glob, parent.ranks[parent._rank],
                              f"split/{'-'.join(map(str, glob))}/{k}", name, tmo, None)
    if mine is None:
        return None
    return new_group([parent.ranks[r] for r in mine], timeout, backend, pg_options,
                     use_local_synchronization=True, group_desc=group_desc)


set_destroy_hook(destroy_process_group)
