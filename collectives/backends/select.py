"""The default backend ('gloo', alias 'tcp'): picks the transport for a group.

At init every rank publishes its host identity through the group's store:
COLLECTIVES_HOST_ID if set (tests use it to fake several hosts on one machine),
else hostname + boot id (/proc/sys/kernel/random/boot_id) + IPC namespace, so
containers that share a hostname but not memory are told apart. Then:

* all ranks on one host: :class:`~collectives.backends.shm.ShmBackend`;
* ranks on several hosts: :class:`HierarchicalBackend`: all_reduce is reduced
  within each host in shared memory, all-reduced across host leaders over TCP,
  and broadcast within each host; the other collectives and point-to-point use
  the TCP backend over the whole group;
* COLLECTIVES_TRANSPORT=tcp forces the TCP backend (=shm insists on shared
  memory, failing if the ranks span hosts); the default is auto.
"""
import os
import socket

from ..errors import DistBackendError
from .base import Backend

TRANSPORT_ENV = "COLLECTIVES_TRANSPORT"
HOST_ID_ENV = "COLLECTIVES_HOST_ID"


def host_identity():
    """This process's host identity: ranks with equal identities can share memory."""
    forced = os.environ.get(HOST_ID_ENV)
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = "?"
    return f"{socket.gethostname()}|{boot}|{ipc}"


def transport_choice():
    """'auto', 'tcp' or 'shm' from COLLECTIVES_TRANSPORT; ValueError for anything else."""
    v = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if v not in ("auto", "tcp", "shm"):
        raise ValueError(f"{TRANSPORT_ENV} must be 'auto', 'tcp' or 'shm', got {v!r}")
    return v


def exchange_hosts(store, rank, size):
    """Every rank's host identity, by group rank (a collective over the store)."""
    store.set(f"select/host/{rank}", host_identity())
    keys = [f"select/host/{r}" for r in range(size)]
    vals = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, (bytes, bytearray)) else str(v) for v in vals]


def _prefixed(store, prefix):
    from ..store import PrefixStore
    return PrefixStore(prefix, store)


def _tcp(store, rank, size, timeout, options):
    from .tcp import TcpBackend
    return TcpBackend(store, rank, size, timeout, options)


def create_default_backend(store, rank, size, timeout, options=None):
    """The backend for ``init_process_group('gloo')`` and ``new_group(backend='gloo')``."""
    choice = transport_choice()
    if choice == "tcp":
        return _tcp(store, rank, size, timeout, options)
    from .shm import ShmBackend, shm_available
    if not shm_available():
        if choice == "shm":
            raise DistBackendError(f"{TRANSPORT_ENV}=shm but the _shm extension is not built "
                                   "or /dev/shm is not writable")
        return _tcp(store, rank, size, timeout, options)
    hosts = exchange_hosts(store, rank, size)
    if len(set(hosts)) == 1:
        return ShmBackend(_prefixed(store, "shm"), rank, size, timeout, options,
                          label=f"shm group (size {size})")
    if choice == "shm":
        raise DistBackendError(f"{TRANSPORT_ENV}=shm but the group spans "
                               f"{len(set(hosts))} hosts")
    return HierarchicalBackend(store, rank, size, timeout, options, hosts)


class HierarchicalBackend(Backend):
    """A group spanning hosts: shared memory within a host, TCP between hosts.

    all_reduce is hierarchical (reduce to the host leader in shared memory,
    all_reduce among leaders over TCP, broadcast from the leader in shared
    memory); every other collective and point-to-point goes over a TCP backend
    spanning the whole group.
    """

    name = "gloo-hier"
    own_block_in_place = True

    def __init__(self, store, rank, size, timeout, options, hosts):
        super().__init__(store, rank, size, timeout, options)
        from .shm import ShmBackend
        order = sorted(set(hosts), key=hosts.index)  # hosts in order of their lowest rank
        mine = hosts[rank]
        local = [r for r in range(size) if hosts[r] == mine]
        leaders = [next(r for r in range(size) if hosts[r] == h) for h in order]
        self.host_index = order.index(mine)
        self.local_ranks = local
        self.is_leader = rank == local[0]
        self.world = _tcp(_prefixed(store, "hier/world"), rank, size, timeout, options)
        self.local = ShmBackend(_prefixed(store, f"hier/host{self.host_index}"), local.index(rank),
                                len(local), timeout, options,
                                label=f"shm host {self.host_index} of group (size {size})")
        self.leaders = None
        if self.is_leader:
            self.leaders = _tcp(_prefixed(store, "hier/leaders"), leaders.index(rank),
                                len(leaders), timeout, options)

    def all_reduce(self, buf, op):
        self.local.reduce(buf, op, 0)
        if self.leaders is not None:
            self.leaders.all_reduce(buf, op)
        self.local.broadcast(buf, 0)

    def broadcast(self, buf, root):
        self.world.broadcast(buf, root)

    def reduce(self, buf, op, root):
        self.world.reduce(buf, op, root)

    def all_gather(self, out, inp):
        self.world.all_gather(out, inp)

    def gather(self, out, inp, root):
        self.world.gather(out, inp, root)

    def scatter(self, out, inp, root):
        self.world.scatter(out, inp, root)

    def reduce_scatter(self, out, inp, op):
        self.world.reduce_scatter(out, inp, op)

    def all_to_all(self, out, inp, out_counts, in_counts):
        self.world.all_to_all(out, inp, out_counts, in_counts)

    def barrier(self):
        self.world.barrier()

    def isend(self, buf, dst, tag=0):
        return self.world.isend(buf, dst, tag)

    def irecv(self, buf, src, tag=0):
        return self.world.irecv(buf, src, tag)

    def shutdown(self):
        super().shutdown()
        for be in (self.leaders, self.local, self.world):
            if be is not None:
                be.shutdown()
