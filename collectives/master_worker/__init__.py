"""Master-worker mode: one process (rank 0) drives tensors that live on worker ranks.

``collectives.init_master_worker()`` on every rank; rank 0 continues as the master,
the others serve it. See docs/master-worker.md.
"""
from .master import RemoteError, init_master_worker, is_master_worker_initialized, shutdown
from .remote_call import call
from .modules import RemoteModule, RemoteOptimizer, optim, to_node
from .registry import register_function, register_module
from .commands import (
    Event, all_gather, all_reduce, broadcast, enable_dist_send, manual_seed, remote, rpc_async,
    rpc_sync, synchronize, worker_stats)
from .tensor import (
    BFloat16Tensor, BoolTensor, ByteTensor, CharTensor, DoubleTensor, FloatTensor, HalfTensor,
    IntTensor, LongTensor, RemoteTensor, ShortTensor, current_node, empty, full, node,
    num_nodes, ones, rand, randn, send, set_node, tensor, zeros)

__all__ = [
    "RemoteError", "init_master_worker", "is_master_worker_initialized", "shutdown",
    "register_function", "register_module", "call", "to_node", "optim", "RemoteModule",
    "RemoteOptimizer", "Event", "all_gather", "all_reduce", "broadcast", "enable_dist_send",
    "manual_seed", "remote", "rpc_async", "rpc_sync", "synchronize", "worker_stats",
    "BFloat16Tensor", "BoolTensor", "ByteTensor", "CharTensor", "DoubleTensor", "FloatTensor",
    "HalfTensor", "IntTensor", "LongTensor", "RemoteTensor", "ShortTensor", "current_node",
    "empty", "full", "node", "num_nodes", "ones", "rand", "randn", "send", "set_node", "tensor",
    "zeros",
]
