"""What a program asks of the world's groups without changing them (torch's ``get_rank``,
``get_world_size``, ``get_backend``, ``get_process_group_ranks``...)."""
import os

from ..core.world import resolve, world


def get_rank(group=None):
    """This process's rank in ``group`` (-1 if not a member)."""
    pg = resolve(group)
    return -1 if pg is None else pg._rank


def get_world_size(group=None):
    """The number of ranks in ``group`` (-1 if this rank is not a member)."""
    pg = resolve(group)
    return -1 if pg is None else pg._size


def get_backend(group=None):
    """The backend name of ``group``, e.g. 'gloo'."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg.backend_name


def get_backend_config(group=None):
    """``'device:backend'`` for ``group`` as torch prints it, e.g. 'cpu:gloo' or 'cuda:nccl'
    (a group here has one backend, for the device its backend takes)."""
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return f"{'cuda' if getattr(pg.backend, 'takes_cuda', False) else 'cpu'}:{pg.backend_name}"


_DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


def get_default_backend_for_device(device):
    """The backend ``init_process_group`` would pick for ``device`` ('cpu', 'cuda:0' or a
    torch.device): 'gloo' or 'nccl'."""
    kind = getattr(device, "type", None)
    if kind is None:
        if not isinstance(device, str):
            raise TypeError(f"device must be a string such as 'cpu' or a torch.device, "
                            f"got {type(device).__name__}")
        kind = device.partition(":")[0].strip().lower()
    backend = _DEVICE_BACKEND.get(kind)
    if backend is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return backend


def get_pg_count():
    """The number of process groups made since init, the default one included (as torch:
    destroying a subgroup does not lower it; ``use_local_synchronization`` groups do not count)."""
    return world.group_count + (world.default is not None)


def get_node_local_rank(fallback_rank=None):
    """This process's rank on its node: ``LOCAL_RANK`` (set by collectives-run and torchrun),
    else ``fallback_rank``; RuntimeError if neither is there."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not in the environment. Consider passing fallback_rank to "
                       "allow `get_node_local_rank` to work, assuming you are not running in a "
                       "multi-device context and want the code to run locally instead.")


def get_global_rank(group, group_rank):
    pg = resolve(group)
    if pg is None:
        raise ValueError("Group is not registered, please create group with new_group")
    return pg.ranks[pg.check_group_rank(group_rank, "group_rank")]


def get_group_rank(group, global_rank):
    pg = resolve(group)
    if pg is None:
        raise ValueError("Group is not registered, please create group with new_group")
    return pg.group_rank(global_rank, "global_rank")


def get_process_group_ranks(group):
    pg = resolve(group)
    if pg is None:
        raise ValueError("Group is not registered, please create group with new_group")
    return list(pg.ranks)

