"""The world registry's state: the default group, the groups made since init, and how a
user's ``group`` argument resolves to a group.

This module sits below the front end (collective_ops, p2p, objects, multigpu) and the
group methods (api/pg_methods.py): they resolve groups here, and never import
:mod:`collectives.api.group`, which creates and destroys groups (init_process_group,
new_group, split, shrink, destroy) and imports them. What must reach back up, the
destruction of a group from its own ``shutdown()``, goes through :func:`destroy`, which
collectives.api.group installs.
"""
from . import heap as _heap
from . import profiling as _profiling

NOT_INITIALIZED = ("Default process group has not been initialized, "
                   "please make sure to call init_process_group.")


class GroupBase:
    """A group of ranks sharing one backend instance (its collective methods are added by
    :class:`collectives.api.group.ProcessGroup`).

    ``rank()``/``size()``, ``name()`` (the backend's), ``group_name`` and the collective
    methods (``allreduce``, ``broadcast``, ... with torch's ``*Options``) as in torch;
    ``ranks`` lists the members' global ranks in group-rank order.
    """

    def __init__(self, backend, ranks, rank, name, backend_name, timeout, store):
        self.backend = backend
        self.ranks = list(ranks)
        self._rank = rank
        self._size = len(self.ranks)
        #: this rank's block where the backend takes torch's in-place forms (an all_gather's
        #: input that is this rank's block of its output; a reduce_scatter's output that is
        #: this rank's block of its input) straight from the front end's checks, else -1
        self._own_block = rank if getattr(backend, "own_block_in_place", False) else -1
        self.group_name = name
        self.backend_name = backend_name
        self.timeout = timeout
        self.store = store
        self.group_of_global = {g: i for i, g in enumerate(self.ranks)}
        # bound once: the general path calls these directly
        self.run = backend.run
        self.submit = backend.submit
        self.destroyed = False
        _profiling.refresh()  # torch may have been imported since the last group was made
        _heap.keep_freed_memory()  # once a process (the first group)

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def group_rank(self, global_rank, name):
        """The group rank of ``global_rank``; ValueError naming ``name`` if not a member."""
        r = self.group_of_global.get(global_rank)
        if r is None:
            raise ValueError(f"{name}={global_rank!r} is not a rank of group {self.group_name!r} "
                             f"(its global ranks are {self.ranks})")
        return r

    def check_group_rank(self, group_rank, name):
        if not isinstance(group_rank, int) or not 0 <= group_rank < self._size:
            raise ValueError(f"{name} must be a group rank in [0, {self._size}), got {group_rank!r}")
        return group_rank

    def peer(self, global_rank, group_rank, name, default=None):
        """Resolve a (global, group) pair of peer arguments to a group rank; one may be given."""
        if group_rank is not None:
            if global_rank is not None:
                raise ValueError(f"give either {name} or group_{name}, not both")
            return self.check_group_rank(group_rank, f"group_{name}")
        if global_rank is None:
            if default is None:
                raise ValueError(f"{name} must be given (a global rank)")
            global_rank = default
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{name} must be an int rank, got {type(global_rank).__name__}")
        return self.group_rank(global_rank, name)

    def __repr__(self):
        return (f"ProcessGroup(name={self.group_name!r}, backend={self.backend_name!r}, "
                f"ranks={self.ranks}, rank={self._rank})")


class GroupMember:
    """``GroupMember.WORLD`` (the default group, None before init) and ``NON_GROUP_MEMBER``."""

    WORLD = None
    NON_GROUP_MEMBER = -100


class group:  # noqa: N801  (torch spells it dist.group.WORLD)
    WORLD = None


class _World:
    """The default group and everything new_group needs (one instance: ``world``)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.default = None
        self.store = None
        self.owned_store = False
        self.groups = []
        self.group_count = 0
        self.local_counts = {}
        # whether this world's groups are torch ProcessGroups too: decided once, at init
        self.bridge = False


world = _World()


def _set_world(pg):
    world.default = pg
    GroupMember.WORLD = pg
    group.WORLD = pg


def default_group():
    pg = world.default
    if pg is None:
        raise ValueError(NOT_INITIALIZED)
    return pg


def resolve(grp):
    """The ProcessGroup for a user's ``group`` argument; None if this rank is not a member."""
    if grp is None:
        pg = world.default
        if pg is None:
            raise ValueError(NOT_INITIALIZED)
        return pg
    if isinstance(grp, GroupBase):
        if grp.destroyed:
            raise ValueError(f"group {grp.group_name!r} has been destroyed")
        return grp
    if grp is GroupMember.NON_GROUP_MEMBER or grp == GroupMember.NON_GROUP_MEMBER:
        return None
    inner = getattr(grp, "collectives_group", None)  # torch's group over one of ours (torch_pg)
    if isinstance(inner, GroupBase):
        return resolve(inner)
    raise TypeError(f"group must be a ProcessGroup, None or GroupMember.WORLD, got {type(grp).__name__}")


def current(grp):
    """``resolve(grp)`` with the default group's case first: the entry of every operation."""
    pg = world.default if grp is None else resolve(grp)
    if pg is None and grp is None:
        raise ValueError(NOT_INITIALIZED)
    return pg


_destroy_hook = None


def set_destroy_hook(fn):
    """Install ``fn(group)``, which :func:`destroy` calls (collectives.api.group's
    destroy_process_group)."""
    global _destroy_hook
    _destroy_hook = fn


def destroy(pg):
    """Destroy ``pg`` (``pg.shutdown()``, torch's spelling), through the installed hook."""
    _destroy_hook(pg)
