"""collectives: the torch.distributed process-group API, Cython-accelerated.

``import collectives as dist`` in a program written for torch.distributed.
"""
from . import config  # noqa: F401  (first: COLLECTIVES_NO_EXTENSIONS acts before any extension loads)
from .core import dtypes
from .core.errors import DistBackendError, DistError, DistNetworkError, DistStoreError

# ---- stores and rendezvous ----------------------------------------------------------------
from .store import FileStore, HashStore, PrefixStore, QueueEmptyError, Store, TCPStore  # noqa: E402
# torch.distributed's names: dist.rendezvous is the function (the module: below)
from .store.rendezvous import register_rendezvous_handler, rendezvous  # noqa: E402

# ---- the torch.distributed front end ---------------------------------------------------------
from .backends import register_backend  # noqa: E402
from .diagnostics.debug import (  # noqa: E402
    DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env)
from .api.collective_ops import (
    _all_gather_base, _reduce_scatter_base, all_gather, all_gather_coalesced, all_gather_into_tensor,
    all_gather_single, all_reduce, all_reduce_coalesced, all_to_all, all_to_all_single, barrier,
    broadcast, gather, monitored_barrier, reduce, reduce_scatter, reduce_scatter_single,
    reduce_scatter_tensor, scatter)
from .api.group import (
    Backend, GroupMember, ProcessGroup, default_pg_timeout, destroy_process_group, get_backend,
    get_backend_config, get_default_backend_for_device, get_global_rank, get_group_rank,
    get_node_local_rank, get_pg_count, get_process_group_ranks, get_rank, get_world_size, group,
    init_process_group, is_available, is_backend_available, is_gloo_available, is_initialized,
    is_mpi_available, is_nccl_available, is_torchelastic_launched, is_ucc_available,
    is_xccl_available, new_group, new_subgroups, new_subgroups_by_enumeration, split_group)
from .api.shrink import shrink_group
from .api._generated import (  # the *_multigpu calls (their plans: api/multigpu.py)
    all_gather_multigpu, all_reduce_multigpu, broadcast_multigpu, reduce_multigpu,
    reduce_scatter_multigpu)
from .api.objects import (
    all_gather_object, broadcast_object_list, gather_object, recv_object_list, scatter_object_list,
    send_object_list)
from .api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .diagnostics.progress import dump_flight_recorder  # noqa: E402
from .core.profiling import record_comm
from .core.reduce_op import ReduceOp, reduce_op, supports_complex
from .core.work import Future, Work
from .api.breakpoint import breakpoint  # noqa: E402,A004  (torch's name)
from .torch_bridge.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from .torch_bridge.gloo import ProcessGroupGloo  # noqa: E402
from .core.options import (  # noqa: E402
    AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
    BroadcastOptions, GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions)

# torch.distributed's module paths for modules that live in folders here:
# collectives.rendezvous (torch.distributed.rendezvous; dist.rendezvous stays the function)
# is store/rendezvous.py, and collectives.device_mesh (also dist.device_mesh) is
# torch_bridge/device_mesh.py; ``from collectives.rendezvous import ...`` finds them in sys.modules
from .store import rendezvous as _rendezvous_module  # noqa: E402
from .torch_bridge import device_mesh  # noqa: E402
import sys as _sys  # noqa: E402
_sys.modules[__name__ + ".rendezvous"] = _rendezvous_module
_sys.modules[__name__ + ".device_mesh"] = device_mesh

# the public names
__all__ = [
    "FileStore", "HashStore", "PrefixStore", "QueueEmptyError", "Store", "TCPStore",
    "register_rendezvous_handler", "rendezvous", "dump_flight_recorder",
    "DistBackendError", "DistError", "DistNetworkError", "DistStoreError", "dtypes", "register_backend",
    "_all_gather_base", "_reduce_scatter_base", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single", "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "gather", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
    "Backend", "GroupMember", "ProcessGroup", "default_pg_timeout", "destroy_process_group",
    "get_backend", "get_backend_config", "get_default_backend_for_device", "get_global_rank",
    "get_group_rank", "get_node_local_rank", "get_pg_count", "get_process_group_ranks",
    "get_rank", "get_world_size", "group", "init_process_group", "is_available",
    "is_backend_available", "is_gloo_available", "is_initialized", "is_mpi_available",
    "is_nccl_available", "is_torchelastic_launched", "is_ucc_available", "is_xccl_available",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "shrink_group", "split_group",
    "all_gather_multigpu", "all_reduce_multigpu", "broadcast_multigpu", "reduce_multigpu",
    "reduce_scatter_multigpu",
    "all_gather_object", "broadcast_object_list", "gather_object", "recv_object_list",
    "scatter_object_list", "send_object_list",
    "P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send",
    "ReduceOp", "reduce_op", "supports_complex", "Future", "Work",
    "DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env",
    "breakpoint", "DeviceMesh", "init_device_mesh", "record_comm", "ProcessGroupGloo",
    "AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions", "AllToAllOptions",
    "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions",
    "ReduceScatterOptions", "ScatterOptions",
]

# ---- master-worker mode: names that do not clash with the process-group API;
# the rest (send, zeros, all_reduce over remote tensors...) live in collectives.master_worker
from .master_worker import (  # noqa: E402
    BoolTensor, ByteTensor, CharTensor, DoubleTensor, Event, FloatTensor, HalfTensor, IntTensor,
    LongTensor, RemoteError, RemoteTensor, ShortTensor, init_master_worker, node,
    register_function, remote, rpc_async, rpc_sync)
from .master_worker import send as dist_send  # noqa: E402
from . import master_worker  # noqa: E402
__all__ += [
    "BoolTensor", "ByteTensor", "CharTensor", "DoubleTensor", "Event", "FloatTensor",
    "HalfTensor", "IntTensor", "LongTensor", "RemoteError", "RemoteTensor", "ShortTensor",
    "dist_send", "init_master_worker", "master_worker", "node", "register_function", "remote",
    "rpc_async", "rpc_sync"]
# ---- end of master-worker mode -------------------------------------------------------------

set_debug_level_from_env()  # as torch.distributed does at import


def _version():
    # one source of truth: pyproject.toml's version, as installed (wheel, sdist or editable);
    # collectives-info (diagnostics/envreport.py, a layer below) reads it the same way
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("collectives")
    except PackageNotFoundError:  # a checkout on PYTHONPATH that was never installed
        return "0+unknown"


__version__ = _version()


from . import constants  # noqa: E402,F401


def _torch_findable():
    """Whether ``import torch`` would find a module, without importing it."""
    import importlib.util
    import sys
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def _lazy(name):
    """Submodule ``name`` as a module that runs at its first attribute access;
    ``import collectives.<name>`` gives the same module."""
    import importlib.util
    import sys
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# A module-level __getattr__ would cost every ``dist.all_reduce`` lookup: CPython does not
# specialise attribute loads on a module that has one (~250 instructions per call on 3.11).
# So dist.distributed_c10d (which imports this package) and dist.nn (which imports torch,
# as torch.distributed.nn needs its own import) are lazily run modules, the latter where
# torch can be found; __getattr__ exists only where it cannot, to say what dist.nn needs.
distributed_c10d = _lazy("distributed_c10d")
if _torch_findable():
    nn = _lazy("nn")
else:
    def __getattr__(name):
        if name == "nn":
            # AttributeError, so that hasattr() and getattr(..., default) work without torch
            raise AttributeError(
                f"module {__name__!r} has no attribute {name!r} without torch: "
                f"collectives.{name} needs torch (pip install 'collectives[torch]')")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_torch_backend():
    """torch.distributed's backend name "collectives": registered now where torch.distributed
    is imported, else when it is (an import hook; torch is not imported here). The bridge
    itself is imported at the first init_process_group("collectives")."""
    try:
        import _collectives_torch
    except ImportError:  # a copy of the package without its top-level module
        return
    _collectives_torch.install()


_register_torch_backend()
