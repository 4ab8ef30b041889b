"""``torch.distributed.distributed_c10d``'s names, for programs that import from it.

``from collectives.distributed_c10d import _get_default_group`` (or
``dist.distributed_c10d._get_default_group()``) where a program wrote it for torch.
Every public name of :mod:`collectives` is here too, as torch's module holds its
package's, plus the private helpers programs and libraries reach for:
``_get_default_group``, ``_rank_not_in_group``, ``_get_global_rank``,
``_get_group_size``, ``_get_pg_default_device``, ``_get_process_group_name``,
``_resolve_process_group``, ``_get_default_store``, ``_get_default_timeout``, and the
``_pg_group_ranks`` / ``_pg_names`` maps (read on each access: changing them changes
nothing, as the groups are kept elsewhere).
"""
import sys
import warnings

from . import *  # noqa: F401,F403  (the package's __all__)
from . import __all__ as _public
from .constants import default_pg_nccl_timeout, default_pg_timeout
from .api.group import GroupMember, default_group, get_global_rank, get_world_size, world
from .api.shrink import SHRINK_ABORT, SHRINK_DEFAULT

__all__ = list(_public) + ["SHRINK_ABORT", "SHRINK_DEFAULT"]


def _get_default_group():
    """The default group (ValueError before ``init_process_group``)."""
    return default_group()


def _rank_not_in_group(group):
    """Whether this rank is outside ``group``: ``new_group`` gave it NON_GROUP_MEMBER
    (None, the default group, holds every rank)."""
    return isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER


def _get_global_rank(group, rank):
    """Deprecated in torch: ``get_global_rank``."""
    warnings.warn("torch.distributed.distributed_c10d._get_global_rank is deprecated, please "
                  "use torch.distributed.distributed_c10d.get_global_rank instead",
                  FutureWarning, stacklevel=2)
    return get_global_rank(group, rank)


def _get_group_size(group):
    """The size of ``group`` (None: the default group)."""
    return get_world_size(group)


def _get_pg_default_device(group=None):
    """The device a group's collectives take tensors on: cuda for nccl, else cpu (a
    ``torch.device`` where torch is imported, else the string)."""
    pg = default_group() if group is None else group
    dev = "cuda" if getattr(pg, "backend_name", None) == "nccl" else "cpu"
    torch = sys.modules.get("torch")
    return torch.device(dev) if torch is not None else dev


def _get_process_group_name(pg):
    return pg.group_name


def _resolve_process_group(group_name):
    """The group named ``group_name`` that this rank belongs to."""
    for pg in world.groups:
        if pg.group_name == group_name:
            return pg
    raise ValueError(f"group_name={group_name!r} names no group of this rank "
                     f"(its groups: {[pg.group_name for pg in world.groups]})")


def _get_default_store():
    """The store the default group met on (ValueError before ``init_process_group``)."""
    default_group()
    return world.store


def _set_pg_timeout(timeout, group=None):
    """torch's: the timeout of ``group``'s (default: the default group's) later calls."""
    from .api.group import resolve
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    pg.set_timeout(timeout)


def _get_default_timeout(backend):
    """torch's defaults: 10 minutes for nccl, 30 for the others (a timedelta)."""
    return default_pg_nccl_timeout if str(backend).lower() == "nccl" else default_pg_timeout


def __getattr__(name):
    if name == "_pg_group_ranks":  # group -> {global rank: group rank}
        return {pg: dict(pg.group_of_global) for pg in world.groups}
    if name == "_pg_names":
        return {pg: pg.group_name for pg in world.groups}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
