"""shrink_group: a group made of another's ranks less some, without them (torch 2.x's
``shrink_group``), and its flags. The groups it makes and ends are made and ended as
:mod:`collectives.api.group` makes and ends the others.
"""
import datetime
import zlib

from .. import backends as _backends
from ..core.errors import DistError
from ..core.world import GroupMember, _set_world, default_group, resolve, world
from . import group as _group

SHRINK_DEFAULT = 0x00  # torch.distributed.distributed_c10d's flags for shrink_group
SHRINK_ABORT = 0x01


def _shrink_args(ranks_to_exclude, group, shrink_flags):
    """shrink_group's checks, in torch's order: (parent group, excluded group ranks)."""
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(f"ranks_to_exclude must be a list of ranks of the group, e.g. [1, 3], "
                        f"got {type(ranks_to_exclude).__name__}")
    if not ranks_to_exclude:
        raise ValueError("ranks_to_exclude must name at least one rank of the group, e.g. "
                         "[failed_rank], got []")
    if type(shrink_flags) is not int or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(f"shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT "
                         f"({SHRINK_ABORT}), got {shrink_flags!r}")
    parent = default_group() if group is None or group is GroupMember.WORLD else resolve(group)
    if parent is None:
        raise ValueError("shrink_group: this rank is not a member of group")
    n = parent._size
    if n < 2:
        raise ValueError(f"shrink_group: group must have at least 2 ranks to shrink, it has {n}")
    excluded = set()
    for i, r in enumerate(ranks_to_exclude):
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"ranks_to_exclude must hold ints, got {r!r} at index {i}")
        if not 0 <= r < n:
            raise ValueError(f"ranks_to_exclude must hold ranks of the group, in [0, {n}), got {r} "
                             f"at index {i}")
        if r in excluded:
            raise ValueError(f"ranks_to_exclude must name each rank once, got {r} again at index {i}")
        excluded.add(r)
    if len(excluded) == n:
        raise ValueError(f"ranks_to_exclude must leave at least one of the group's {n} ranks")
    if parent._rank in excluded:
        raise ValueError(f"shrink_group: this rank ({parent._rank} of the group) is in "
                         f"ranks_to_exclude; only the ranks that stay call shrink_group")
    return parent, sorted(excluded)


def shrink_group(ranks_to_exclude, group=None, shrink_flags=SHRINK_DEFAULT, pg_options=None):
    """A new group of ``group``'s ranks less ``ranks_to_exclude`` (ranks of ``group``), made
    without them: only the ranks that stay call it, and the excluded ones may be dead
    (torch 2.x's ``shrink_group``). ``group`` is destroyed; the new group is returned.

    Shrinking the default group (``group=None``) makes the new group the default one,
    renumbers the world's ranks ``0..n-1`` in their old order, and destroys every other
    group (their ranks no longer mean the same). ``SHRINK_ABORT`` fails ``group``'s
    queued and running work first; ``SHRINK_DEFAULT`` lets it finish (each piece within
    the group's timeout) once the new group stands. The stayers meet through the
    rendezvous store, waiting up to twice the group's timeout for each other (they notice
    a lost peer up to a timeout apart), so that store must outlive the excluded ranks:
    with env:// and tcp:// rank 0 serves it, and a shrink that excludes a dead rank 0
    raises DistError (file:// or a store served elsewhere, passed as ``store=``, has no
    such limit).
    The mpi backend makes the group with ``MPI_Comm_create_group``, which needs the
    excluded processes alive (MPI ends the job when one dies).

    Example (a rank died; every rank left runs this)::

        try:
            dist.all_reduce(t)
        except dist.DistError:
            dist.shrink_group([dead_rank])   # the default group now holds the others
    """
    parent, excluded = _shrink_args(ranks_to_exclude, group, shrink_flags)
    keep = [r for r in range(parent._size) if r not in excluded]
    me = keep.index(parent._rank)
    key = ("shrink", parent.group_name, tuple(excluded))
    k = world.local_counts.get(key, 0)
    world.local_counts[key] = k + 1
    tag = f"shrink/{parent.group_name}/{'-'.join(map(str, excluded))}/{k}"
    is_default = parent is world.default
    if shrink_flags == SHRINK_ABORT:
        for pg in (list(world.groups) if is_default else [parent]):
            pg.backend.interrupt()  # their work fails now; they end below
    split_local = getattr(parent.backend, "split_local", None)  # mpi: from the parent itself
    store = None
    try:
        if split_local is not None:
            be = split_local(keep, parent.timeout, pg_options, zlib.crc32(tag.encode()) % 32768)
        elif world.store is not None:
            store = _group._prefix(f"group/{tag}", world.store)
            factory = _backends.get_backend_factory(parent.backend_name)
            # the stayers arrive up to a timeout apart: one that waited on the dead peer
            # raised at the timeout, one that saw its socket close at once
            was = world.store.timeout
            world.store.set_timeout(datetime.timedelta(seconds=2 * parent.timeout))
            try:
                be = factory(store, me, len(keep), parent.timeout, pg_options)
            finally:
                world.store.set_timeout(was)
        else:
            raise TypeError(f"shrink_group: the {parent.backend_name} group has no store to meet "
                            f"through and its backend cannot make a group of some of its ranks")
    except DistError as e:
        raise type(e)(f"shrink_group: ranks {[parent.ranks[r] for r in keep]} could not form "
                      f"the new group ({e}); the stayers meet through the rendezvous store, "
                      f"which rank 0 serves with env:// and tcp://") from e
    if not is_default:
        new = _group._add_group(be, [parent.ranks[r] for r in keep], parent.ranks[parent._rank],
                                tag, parent.backend_name, parent.timeout, store)
        _group._end_group(parent, abort=shrink_flags == SHRINK_ABORT)
        return new
    if _group._bridge is not None:  # torch's default group (and its table) over ours go first
        _group._bridge.uninstall_default()
    pgs, world.groups = world.groups, []
    for pg in reversed(pgs):
        pg.destroyed = True
        if pg is parent and shrink_flags == SHRINK_DEFAULT:
            pg.backend.shutdown()
        else:
            pg.backend.abort()
    new = _group._group_class()(be, range(len(keep)), me, f"group/{tag}", parent.backend_name,
                                parent.timeout, store)
    world.groups.append(new)
    _set_world(new)
    _group._torch_bridge(new)
    return new
