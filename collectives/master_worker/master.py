"""The master side: init_master_worker, the per-node command streams and their replies.

Commands go to a node as they are issued (asynchronous, in order); a command that needs
an answer posts its receive first and joins the node's queue of pending replies, which
is drained in order at a sync point (a copy back, ``synchronize``, ``Event.wait``, an
rpc result). Errors a worker hit since its last reply travel with every reply and are
raised at the sync point, naming the node and the command.
"""
import atexit
import collections
import datetime
import itertools
import os
import sys
import threading
import zlib

import numpy as np

from ..api import collective_ops as coll
from ..api.group import destroy_process_group, init_process_group, new_group, world
from ..core.convert import buffer
from ..core.errors import DistBackendError, DistError
import collectives.master_worker.protocol as P
from .codec import frame, unframe
from .worker import pid_alive, run_worker, wait_request

DEFAULT_TIMEOUT = 300.0


class RemoteError(DistError):
    """A command failed on a worker. ``node``, ``seq`` (the node's command number),
    ``command`` and ``errors`` (every failure reported with it) name what failed."""

    def __init__(self, node, errors):
        self.node = node
        self.errors = errors
        seq, what, msg, _ = errors[0]
        self.seq = seq
        self.command = what
        more = f" (and {len(errors) - 1} later failures)" if len(errors) > 1 else ""
        super().__init__(f"node {node}: {what} failed: {msg}{more}")


class Entry:
    """A reply the master is owed, in its node's queue."""

    __slots__ = ("req", "buf", "handler", "done", "value", "exc", "what")

    def __init__(self, req, buf, handler, what):
        self.req, self.buf, self.handler, self.what = req, buf, handler, what
        self.done = False
        self.value = self.exc = None


class Node:
    """The master's view of one worker: its rank, liveness, handle ids and reply queue."""

    def __init__(self, index, rank, pid, same_host, ncuda):
        self.index, self.rank, self.pid, self.same_host, self.ncuda = index, rank, pid, same_host, ncuda
        self.hids = itertools.count(1)  # handle ids on this node (next() is atomic)
        self.frees = collections.deque()  # ids of collected handles (appended by __del__)
        self.failed = {}          # hid -> message
        self.pending = collections.deque()
        self.errors = []          # reported failures not yet raised
        self.lost = None          # the error that ended this node
        self.sends = []           # (request, buffer) in flight
        self.unacked = 0          # commands since the last credit
        self.credits = collections.deque()  # credit entries not yet waited for
        self.pair = None          # the group {master, this node}, for bulk copies
        self.grad = True          # the grad mode the node runs calls under (torch mode)

    def __repr__(self):
        return f"node {self.index} (rank {self.rank})"


class Master:
    def __init__(self, pg, nodes, lib, timeout):
        self.pg = pg
        self.backend = pg.backend
        self.nodes = nodes
        self.lib = lib
        self.timeout = timeout
        self.closed = False
        self.lock = threading.RLock()  # one thread at a time drives a stream
        # the call path's caches (remote_call.py): allow-list, methods and operators by name
        self.names = None
        self.methods = {}
        self.operators = {}
        self.return_types = None
        self.consts = None
        self.torch = None
        if lib == "torch":
            import torch
            self.torch = torch

    # ---- sending ---------------------------------------------------------------------------
    def node(self, k):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"node must be an int, got {type(k).__name__}")
        if not 0 <= k < len(self.nodes):
            raise ValueError(f"node must be in [0, {len(self.nodes)}) (the workers), got {k}")
        return self.nodes[int(k)]

    def usable(self, node):
        if self.closed:
            raise RuntimeError("master-worker mode has been shut down")
        if node.lost is not None:
            raise DistBackendError(f"{node} is lost: {node.lost}")

    def _isend(self, node, arr, tag):
        try:
            req = self.backend.isend(buffer(arr), node.rank, tag)
        except DistError as e:
            self._lose(node, e)
            raise DistBackendError(f"{node}: sending failed: {e}") from e
        if not req.test():
            node.sends.append((req, arr))
            if len(node.sends) > 64:
                node.sends = [(r, a) for r, a in node.sends if not r.test()]

    def command(self, node, opcode, args):
        """Queue one command on ``node``'s stream (returns at once)."""
        with self.lock:
            self.usable(node)
            if len(node.frees) >= P.FREE_BATCH:
                self._flush_frees(node)
            self._send_frame(node, frame(opcode, args))
            self._credit(node)

    def _credit(self, node):
        """Flow control: every CREDIT commands ask the node to answer; more than two such
        answers outstanding and the master waits for the oldest. The master stays at most
        ~3 * CREDIT commands ahead, so transport memory stays bounded and every wait covers
        a bounded amount of queued work."""
        node.unacked += 1
        if node.unacked < P.CREDIT:
            return
        node.unacked = 0
        node.credits.append(self.expect(node, lambda ok, payload: None, "flow control"))
        self._send_frame(node, frame(P.C_SYNC, (None,)))
        while len(node.credits) > 2:
            e = node.credits.popleft()
            if not e.done:
                self.resolve(node, e)

    def _send_frame(self, node, msg):
        if len(msg) > P.CMD_MAX:
            self._isend(node, np.frombuffer(frame(P.C_BIG, (len(msg),)), np.uint8), P.T_CMD)
            self._isend(node, np.frombuffer(msg, np.uint8), P.T_BIG)
        else:
            self._isend(node, np.frombuffer(msg, np.uint8), P.T_CMD)

    def _flush_frees(self, node):
        ids, frees = [], node.frees
        while frees:  # popleft is atomic: a handle collected meanwhile waits for the next batch
            h = frees.popleft()
            node.failed.pop(h, None)
            ids.append(h)
        self._send_frame(node, frame(P.C_FREE, (ids,)))

    def send_data(self, node, arr):
        """Send a tensor's bytes; returns when the caller may reuse ``arr`` (small ones
        are copied into the transport at once, large ones once the worker has them)."""
        with self.lock:
            try:
                req = self.backend.isend(buffer(arr), node.rank, P.T_DATA)
            except DistError as e:
                self._lose(node, e)
                raise DistBackendError(f"{node}: sending a tensor failed: {e}") from e
            if not req.test():
                self._wait(node, req, "sending a tensor")

    def pair(self, node):
        """The 2-rank group {master, node} (made on first use, on both sides)."""
        if node.pair is None:
            self.command(node, P.C_PAIR, ())
            node.pair = new_group([0, node.rank], use_local_synchronization=True)
        return node.pair

    def bulk(self, node, arr, src):
        """Move ``arr`` between the master and ``node`` by a broadcast from ``src`` (a rank)
        in their pair group: the shared-memory collective path, not the p2p rings."""
        try:
            coll.broadcast(arr, src=src, group=node.pair)
        except DistError as e:
            self._lose(node, e)
            raise DistBackendError(f"{node}: bulk copy failed: {e}") from e

    def new_hid(self, node):
        return next(node.hids)

    # ---- replies -----------------------------------------------------------------------------
    def expect(self, node, handler, what, data=None):
        """Post the receive of a reply (and of ``data``, a host array for a tensor's bytes)
        before the command that produces it. ``handler(ok, payload)`` makes the value."""
        buf = np.empty(P.REPLY_MAX, np.uint8)
        dbuf = None if data is None else buffer(data)  # a dtype it cannot carry raises here,
        try:                                           # before any receive is posted
            req = self.backend.irecv(buffer(buf), node.rank, P.T_REPLY)
            dreq = None if dbuf is None else self.backend.irecv(dbuf, node.rank, P.T_DATA)
        except DistError as e:
            self._lose(node, e)
            raise DistBackendError(f"{node}: {e}") from e
        if dreq is not None:
            inner = handler

            def handler(ok, payload):
                self._wait(node, dreq, what)
                return inner(ok, payload)
        e = Entry(req, buf, handler, what)
        node.pending.append(e)
        return e

    def call(self, node, opcode, args, handler, what, data=None):
        """A command with a reply: ``(entry)``; ``resolve`` it for the value."""
        with self.lock:
            self.usable(node)
            if node.frees:
                self._flush_frees(node)
            e = self.expect(node, handler, what, data)
            self._send_frame(node, frame(opcode, args))
            self._credit(node)
            return e

    def resolve(self, node, entry):
        """Drain ``node``'s replies up to ``entry``; its value (or its exception raised)."""
        with self.lock:
            while not entry.done:
                if node.lost is not None and not node.pending:
                    break
                self._complete(node, node.pending[0], block=True)
        if entry.exc is not None:
            # handed over once: the entry (whose handler may hold a remote tensor) and this
            # frame must not stay in a cycle with the exception's traceback, or the tensor
            # lives, failed, on its node until the cyclic garbage collector runs
            exc, entry.exc, entry.handler = entry.exc, None, None
            try:
                raise exc
            finally:
                del exc
        if not entry.done:
            raise DistBackendError(f"{node} is lost: {node.lost}")
        return entry.value

    def progress(self, node):
        """Complete the replies that have arrived, without waiting."""
        with self.lock:
            while node.pending and node.pending[0].req.test():
                try:
                    self._complete(node, node.pending[0], block=False)
                except DistError:
                    return

    def _wait(self, node, req, what):
        def alive():
            if node.same_host and not pid_alive(node.pid):
                raise DistBackendError(f"{node} (pid {node.pid}) died")
        try:
            wait_request(req, self.timeout, alive, f"{node}: {what}")
        except DistError as e:
            self._lose(node, e)
            raise DistBackendError(f"{node}: {what}: {e}") from e

    def _complete(self, node, e, block):
        try:
            self._wait(node, e.req, e.what)
            op, (payload, errs) = unframe(e.buf)
            if op == P.R_BIG:
                big = np.empty(payload, np.uint8)
                self._wait(node, self.backend.irecv(buffer(big), node.rank, P.T_REPLY_BIG), e.what)
                op, (payload, errs) = unframe(big)
        except DistError as exc:
            e.exc, e.done = exc, True
            if node.pending and node.pending[0] is e:
                node.pending.popleft()
            raise
        node.pending.popleft()
        self._record(node, errs)
        try:
            e.value = e.handler(op == P.R_OK, payload)
        except Exception as exc:
            e.exc = exc
        e.done = True

    def _record(self, node, errs):
        for seq, what, msg, hids in errs:
            for h in hids:
                node.failed[h] = f"{what} failed on node {node.index}: {msg}"
            node.errors.append((seq, what, msg, hids))

    def check(self, node):
        """Raise the failures ``node`` reported since the last check (a sync point)."""
        if node.errors:
            errs, node.errors = node.errors, []
            raise RemoteError(node.index, errs)

    def _lose(self, node, exc):
        if node.lost is None:
            node.lost = exc
        pend, node.pending = node.pending, collections.deque()
        for e in pend:
            if not e.done:
                e.exc, e.done = DistBackendError(f"{node} is lost: {exc}"), True

    # ---- the end -----------------------------------------------------------------------------
    def shutdown(self):
        with self.lock:
            if self.closed:
                return
            for node in self.nodes:
                if node.lost is None:
                    try:
                        self._send_frame(node, frame(P.C_SHUTDOWN, ()))
                    except DistError:
                        pass
            for node in self.nodes:  # let the shutdown frames leave before the transport ends
                for req, _ in node.sends:
                    try:
                        req.wait(min(self.timeout, 5.0))
                    except DistError:
                        pass
            self.closed = True
        try:
            destroy_process_group()
        except Exception:  # a lost worker may make the transport's end noisy
            pass
        world.master_worker = False


_state = threading.local()
_master = None
_ctx = threading.local()  # the current node of this thread (tensor.node, set_node)


def current_node():
    """The node new tensors go to (``with node(k):`` sets it; default 0)."""
    return getattr(_ctx, "node", 0)


def get_master():
    """The running Master; RuntimeError before init_master_worker (or after shutdown)."""
    m = _master
    if m is None or m.closed:
        raise RuntimeError("master-worker mode is not initialized: call "
                           "collectives.init_master_worker() first (on every rank)")
    return m


def is_master_worker_initialized():
    return _master is not None and not _master.closed


def init_master_worker(backend="tcp", init_method="env://", world_size=-1, rank=-1,
                       group_name="", *, timeout=None, library=None):
    """Start master-worker mode: rank 0 returns as the master; every other rank serves it.

    Every rank calls this. On ranks other than 0 it does not return: the process serves
    the master's commands and exits when the master shuts down (at its exit, by
    :func:`shutdown`), is interrupted, or dies. Excludes ``init_process_group``.

    Args:
        backend: 'tcp' or 'gloo' (the package's default transport: shared memory on one
            host, TCP between hosts), or 'mpi'.
        init_method, world_size, rank, group_name: as for ``init_process_group``.
        timeout: seconds (or timedelta) any single wait may take (default 300).
        library: 'numpy' or 'torch': what workers hold tensors as. Default: 'torch' if
            the master program has imported torch, else 'numpy'.

    Example:
        >>> import collectives as dist
        >>> dist.init_master_worker(backend="tcp")
        >>> x = dist.FloatTensor(20, 20).fill_(4)
    """
    global _master
    if not isinstance(backend, str) or backend.lower() not in ("tcp", "gloo", "mpi"):
        raise ValueError(f"backend must be 'tcp', 'gloo' or 'mpi', got {backend!r}")
    if library not in (None, "numpy", "torch"):
        raise ValueError(f"library must be 'numpy', 'torch' or None, got {library!r}")
    if _master is not None or world.default is not None:
        raise RuntimeError("trying to initialize collectives twice (init_master_worker and "
                           "init_process_group exclude each other)")
    if timeout is None:
        secs = DEFAULT_TIMEOUT
    elif isinstance(timeout, datetime.timedelta):
        secs = timeout.total_seconds()
    else:
        secs = float(timeout)
    if not secs > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    name = backend.lower()
    if name == "mpi" and init_method == "env://":
        init_method = None  # the MPI launcher gives rank and size
    init_process_group("gloo" if name in ("tcp", "gloo") else "mpi",
                              init_method=init_method, world_size=world_size, rank=rank,
                              group_name=group_name, timeout=secs)
    world.master_worker = True
    pg = world.default
    me, size = pg.rank(), pg.size()
    if size < 2:
        destroy_process_group()
        world.master_worker = False
        raise ValueError("master-worker mode needs at least 2 ranks (a master and a worker)")
    from ..backends.select import host_identity
    # rank 0 says how workers hold data and how to watch it; everyone says where it runs
    if library is None:
        library = "torch" if "torch" in sys.modules else "numpy"
    cfg = np.array([1 if library == "torch" else 0, os.getpid()], np.int64)
    coll.broadcast(cfg, src=0)
    lib = "torch" if cfg[0] == 1 else "numpy"
    ncuda = 0
    if me != 0 and lib == "torch":
        import torch
        ncuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mine = np.array([os.getpid(), zlib.crc32(host_identity().encode()), ncuda], np.int64)
    everyone = np.empty(3 * size, np.int64)
    coll.all_gather_into_tensor(everyone, mine)
    everyone = everyone.reshape(size, 3)
    if me != 0:
        run_worker(pg, lib, int(cfg[1]), bool(everyone[me, 1] == everyone[0, 1]), secs)
    nodes = [Node(r - 1, r, int(everyone[r, 0]), bool(everyone[r, 1] == everyone[0, 1]),
                  int(everyone[r, 2])) for r in range(1, size)]
    _master = Master(pg, nodes, lib, secs)
    atexit.register(shutdown)


def shutdown():
    """End master-worker mode: the workers exit, the process group is destroyed."""
    global _master
    m, _master = _master, None
    if m is not None:
        m.shutdown()
