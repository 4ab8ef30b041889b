"""Sync points, collectives among workers, and registered-function calls, from the master."""
import time

import numpy as np

from ..core.reduce_op import ReduceOp
from ..core.work import Future
import collectives.master_worker.protocol as P
from .codec import Ref, encode
from .master import get_master
from .registry import name_of
from .tensor import RemoteTensor, current_node


def _nodes(node):
    m = get_master()
    if node is None:
        return m, list(m.nodes)
    if isinstance(node, (list, tuple)):
        return m, [m.node(k) for k in node]
    return m, [m.node(node)]


def _sync_entry(m, nd, token=None):
    return m.call(nd, P.C_SYNC, (token,), lambda ok, payload: payload, "synchronize")


def synchronize(node=None):
    """Wait until ``node`` (an int, a list, or None for every node) has run every command
    issued to it; raise the first failure any of them reported since the last sync point."""
    m, nds = _nodes(node)
    entries = [(nd, _sync_entry(m, nd)) for nd in nds]
    for nd, e in entries:
        m.resolve(nd, e)
    for nd in nds:
        m.check(nd)


class Event:
    """A marker in a node's stream: ``record()`` queues it, ``wait()`` blocks until the
    node has reached it (a sync point), ``query()`` says whether it has, without waiting."""

    def __init__(self):
        self._m = self._nd = self._entry = None
        self._t = None

    def record(self, node=None):
        m = get_master()
        nd = m.node(current_node() if node is None else node)
        self._m, self._nd = m, nd
        self._entry = _sync_entry(m, nd)
        self._t = None
        return self

    def query(self):
        if self._entry is None:
            return True
        self._m.progress(self._nd)
        return self._entry.done

    def wait(self):
        if self._entry is None:
            return
        self._m.resolve(self._nd, self._entry)
        if self._t is None:
            self._t = time.perf_counter()
        self._m.check(self._nd)

    synchronize = wait


def manual_seed(seed):
    """Seed every node's random generator (node k gets ``seed + k``)."""
    m = get_master()
    for nd in m.nodes:
        m.command(nd, P.C_SEED, (int(seed) + nd.index,))


def worker_stats(node):
    """``{'live', 'failed', 'rss', 'seq'}`` of a node: live handles, failed handles, resident
    memory (bytes) and commands run (a sync point)."""
    m = get_master()
    nd = m.node(node)
    e = m.call(nd, P.C_STATS, (), lambda ok, payload: payload, "stats")
    return m.resolve(nd, e)


# ---- collectives among workers ------------------------------------------------------------------
def _group_of(tensors, name):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{name} takes a non-empty list of remote tensors, one per node")
    for i, t in enumerate(tensors):
        if not isinstance(t, RemoteTensor):
            raise TypeError(f"tensors[{i}] must be a RemoteTensor, got {type(t).__name__}")
    ranks = [t._nd.rank for t in tensors]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{name}: tensors must be on different nodes, got nodes "
                         f"{[t.get_node() for t in tensors]}")
    order = sorted(range(len(tensors)), key=lambda i: ranks[i])
    refs = [t._ref() for t in tensors]
    return tensors[0]._m, order, tuple(sorted(ranks)), refs


def _opname(op):
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        if op == getattr(ReduceOp, name) or (isinstance(op, str) and op.upper() == name):
            return name
    raise ValueError(f"op must be a ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR), "
                     f"got {op!r}")


def all_reduce(tensors, op=ReduceOp.SUM):
    """Reduce the remote tensors (one per node) in place, among those workers directly."""
    name = _opname(op)
    m, order, ranks, refs = _group_of(tensors, "all_reduce")
    for i in order:
        m.command(tensors[i]._nd, P.C_COLL, ("all_reduce", refs[i].hid, ranks, name, 0, -1))
    return tensors


def broadcast(tensors, src):
    """Copy the tensor on node ``src`` into the others of ``tensors`` (one per node)."""
    m, order, ranks, refs = _group_of(tensors, "broadcast")
    root = m.node(src).rank
    if root not in ranks:
        raise ValueError(f"src={src}: none of the tensors is on node {src}")
    for i in order:
        m.command(tensors[i]._nd, P.C_COLL, ("broadcast", refs[i].hid, ranks, "SUM", root, -1))
    return tensors


def all_gather(tensors):
    """Every node's tensor gathered on every node: a list of new remote tensors (in the
    order given), each of shape ``(len(tensors), *shape)`` stacked in node order."""
    m, order, ranks, refs = _group_of(tensors, "all_gather")
    outs = [None] * len(tensors)
    for i in order:
        nd = tensors[i]._nd
        out = m.new_hid(nd)
        m.command(nd, P.C_COLL, ("all_gather", refs[i].hid, ranks, "SUM", 0, out))
        outs[i] = RemoteTensor(m, nd, out)
    return outs


# ---- registered functions -----------------------------------------------------------------------
def _rpc_args(m, nd, args, kwargs):
    def conv(v):
        if isinstance(v, RemoteTensor):
            if v._nd is not nd:
                raise ValueError(f"an argument is on node {v.get_node()}, the call goes to node "
                                 f"{nd.index}: move it with .to_node({nd.index})")
            return v._ref()
        if hasattr(v, "detach") and hasattr(v, "numpy"):  # a local torch tensor: its data
            return v.detach().cpu().numpy()
        if isinstance(v, (list, tuple)):
            return type(v)(conv(x) for x in v)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    a, k = conv(tuple(args)), conv(dict(kwargs))
    encode((a, k))  # refuse what is not plain data now, before anything is sent
    return a, k


def _local(m, v):
    if m.lib == "torch" and isinstance(v, np.ndarray):
        import torch
        return torch.from_numpy(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_local(m, x) for x in v)
    if isinstance(v, dict):
        return {k: _local(m, x) for k, x in v.items()}
    return v


class RpcFuture(Future):
    """The result of :func:`rpc_async`; ``wait()``/``result()`` drive the node's replies."""

    def __init__(self, m, nd, entry):
        super().__init__()
        self._m, self._nd, self._entry = m, nd, entry

    def _settle(self, block):
        if super().done():
            return
        if block:
            try:
                v = self._m.resolve(self._nd, self._entry)
            except BaseException as e:
                self.set_exception(e)
                return
            self.set_result(v)
        else:
            self._m.progress(self._nd)
            if self._entry.done:
                self._settle(True)

    def done(self):
        self._settle(False)
        return super().done()

    def result(self, timeout=None):
        self._settle(True)
        return super().result(0)

    def wait(self, timeout=None):
        return self.result(timeout)


def rpc_async(node, fn, *args, **kwargs):
    """Call the function registered as ``fn`` (its name, or the function) on ``node`` with
    plain-data, local-tensor or remote-tensor (on that node) arguments: a Future of its
    result (tensors come back as local copies)."""
    m = get_master()
    nd = m.node(node)
    name = name_of(fn)
    a, k = _rpc_args(m, nd, args, kwargs)

    def handler(ok, payload):
        if not ok:
            from .master import RemoteError
            raise RemoteError(nd.index, [(0, f"rpc {name!r}", payload, [])])
        return _local(m, payload)
    e = m.call(nd, P.C_RPC, (name, -1, a, k, True), handler, f"rpc {name!r}")
    return RpcFuture(m, nd, e)


def rpc_sync(node, fn, *args, **kwargs):
    """``rpc_async(...).wait()``."""
    return rpc_async(node, fn, *args, **kwargs).wait()


def remote(node, fn, *args, **kwargs):
    """Call a registered function on ``node`` and keep its result there: a RemoteTensor
    handle (``get()`` copies it back; a non-tensor result comes back as its value)."""
    m = get_master()
    nd = m.node(node)
    name = name_of(fn)
    a, k = _rpc_args(m, nd, args, kwargs)
    out = m.new_hid(nd)
    m.command(nd, P.C_RPC, (name, out, a, k, False))
    return RemoteTensor(m, nd, out)


def enable_dist_send():
    """Opt in to the seed's method spelling: ``torch_tensor.dist_send(node=None)``
    (torch only; NumPy arrays use ``collectives.send``)."""
    import torch

    from .tensor import send

    def dist_send(self, node=None, device=None):
        return send(self, node=node, device=device)
    torch.Tensor.dist_send = dist_send


__all__ = ["Event", "all_gather", "all_reduce", "broadcast", "enable_dist_send", "manual_seed",
           "remote", "rpc_async", "rpc_sync", "synchronize", "worker_stats", "Ref"]
