"""The default backend ('gloo', alias 'tcp'): picks the transport for a group.

At init every rank publishes its host identity through the group's store:
COLLECTIVES_HOST_ID if set (tests use it to fake several hosts on one machine),
else hostname + boot id (/proc/sys/kernel/random/boot_id) + IPC namespace, so
containers that share a hostname but not memory are told apart. Then:

* all ranks on one host: :class:`~collectives.backends.shm.ShmBackend`;
* ranks on several hosts: :class:`~collectives.backends.hierarchical.HierarchicalBackend`:
  all_reduce, broadcast, reduce and barrier (and all_gather and reduce_scatter where each host holds an equal
  run of consecutive ranks) run in shared memory within each host and over TCP among
  the host leaders; the rest use the TCP backend over the whole group;
* COLLECTIVES_TRANSPORT=tcp forces the TCP backend (=shm insists on shared
  memory, failing if the ranks span hosts); the default is auto.
"""
import os
import socket

from .. import config
from ..core.errors import DistBackendError
from .hierarchical import HierarchicalBackend, _prefixed, _tcp

TRANSPORT_ENV = "COLLECTIVES_TRANSPORT"
HOST_ID_ENV = "COLLECTIVES_HOST_ID"


def host_identity():
    """This process's host identity: ranks with equal identities can share memory."""
    forced = config.get(HOST_ID_ENV)
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
    """'auto', 'tcp' or 'shm' from COLLECTIVES_TRANSPORT (the registry's choice rule);
    ValueError for anything else."""
    return config.get(TRANSPORT_ENV)


def exchange_hosts(store, rank, size):
    """Every rank's host identity, by group rank (a collective over the store)."""
    store.set(f"select/host/{rank}", host_identity())
    keys = [f"select/host/{r}" for r in range(size)]
    vals = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return [v.decode() if isinstance(v, (bytes, bytearray)) else str(v) for v in vals]


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
