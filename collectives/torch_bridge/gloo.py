"""``ProcessGroupGloo``: torch's direct constructor of a gloo group, over our default
backend.

Code written for torch builds gloo groups by hand, without ``init_process_group``::

    store = dist.FileStore(path, world_size)
    pg = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=60))
    pg.allreduce([t]).wait()

or with options naming the address to use::

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(interface="eth0")]
    pg = dist.ProcessGroupGloo(store, rank, world_size, opts)

Here the group runs on the backend ``init_process_group('gloo')`` would pick (shared
memory among ranks of one host, TCP between hosts); a device sets the address its TCP
connections listen on and publish. As in torch, the group is not registered with the
front end's world: it is used through its own methods (``allreduce``, ``broadcast``,
...), or passed as ``group=`` to the front-end functions, where its ranks are taken as
global ranks.
"""
import datetime
import itertools
import socket

from ..api.group import ProcessGroup
from ..store.rendezvous import _check_int
from ..store import PrefixStore, Store
from ..core.work import timeout_seconds

_instances = itertools.count()  # every rank makes its groups in the same order


class Device:
    """A gloo transport device: the IPv4 address a rank listens on and publishes."""

    def __init__(self, host):
        self.host = host

    def __repr__(self):
        return f"ProcessGroupGloo.Device(host={self.host!r})"


class Options:
    """torch's ``ProcessGroupGloo._Options``: ``_devices`` (the first one is used: we do
    not stripe a group across devices), ``_timeout``, ``_threads`` (accepted; our
    backend runs blocking calls in the caller's thread and async ones on one progress
    thread), ``global_ranks_in_group``, ``group_name`` and ``backend``."""

    def __init__(self):
        self._devices = []
        self._threads = 2
        self._timeout = datetime.timedelta(minutes=30)
        self.global_ranks_in_group = []
        self.group_name = ""
        self.backend = "gloo"

    def __repr__(self):
        return (f"ProcessGroupGloo._Options(_devices={self._devices!r}, "
                f"_timeout={self._timeout!r}, group_name={self.group_name!r})")


def _local_address(host, what):
    """``host`` resolved to an IPv4 address this machine can listen on; ValueError naming
    ``what`` otherwise."""
    try:
        addr = socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"{what}={host!r} cannot be resolved to an address: {e}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            raise ValueError(f"{what}={host!r} ({addr}) is not an address of this machine: "
                             f"{e}") from None
    return addr


class ProcessGroupGloo(ProcessGroup):
    """``ProcessGroupGloo(store, rank, size, timeout=timedelta(minutes=30))`` or
    ``ProcessGroupGloo(store, rank, size, options)``, as torch's.

    Args:
        store: a collectives Store every rank of the group reaches (its keys are put
            under a prefix per group made in this process, so one store serves several).
        rank, size: this rank and the group's size.
        timeout: a timedelta or seconds, > 0; or an ``Options`` (its ``_timeout``,
            ``_devices`` and ``group_name`` are used).
    """

    Device = Device
    Options = Options
    _Options = Options

    def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
        if not isinstance(store, Store):
            raise TypeError(f"store must be a collectives Store, got {type(store).__name__}")
        _check_int(rank, "rank")
        _check_int(size, "size")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size={size}), got {rank}")
        if isinstance(timeout, Options):
            options = timeout
            if not isinstance(options._devices, (list, tuple)) or not all(
                    isinstance(d, Device) for d in options._devices):
                raise TypeError("options._devices must be a list of ProcessGroupGloo.Device "
                                f"(from create_device), got {options._devices!r}")
            secs = timeout_seconds(options._timeout, "options._timeout", positive=True)
        else:
            options = Options()
            secs = timeout_seconds(timeout, "timeout", positive=True)
            options._timeout = datetime.timedelta(seconds=secs)
        from ..backends.select import create_default_backend
        n = next(_instances)
        pg_store = PrefixStore(f"ProcessGroupGloo/{n}", store)
        backend = create_default_backend(pg_store, rank, size, secs, options)
        super().__init__(backend, range(size), rank, options.group_name or f"gloo_pg_{n}",
                         "gloo", secs, pg_store)
        self._options = options

    @property
    def options(self):
        return self._options

    def _get_backend_name(self):
        return "gloo"

    @staticmethod
    def create_device(hostname="", interface="", lazy_init=None):
        """A device on ``hostname`` (a name or address of this machine) or, when it is
        empty, on ``interface``'s IPv4 address; ValueError if neither is given or the one
        given is not usable here. ``lazy_init`` is accepted (connections are made when the
        group is)."""
        for name, value in (("hostname", hostname), ("interface", interface)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if hostname:
            return Device(_local_address(hostname, "hostname"))
        if interface:
            from ..backends.tcp import _interface_ipv4
            return Device(_interface_ipv4(interface, "interface"))
        raise ValueError("Specify either `hostname` or `interface` argument.")

    @staticmethod
    def create_default_device(lazy_init=None):
        """The device a group uses by default: COLLECTIVES_IFNAME's or GLOO_SOCKET_IFNAME's
        interface, else the one that routes to MASTER_ADDR, else this host name's address
        (loopback when that one cannot be listened on)."""
        from ..backends.tcp import advertised_host
        host = advertised_host()
        try:
            return Device(_local_address(host, "hostname"))
        except ValueError:
            return Device("127.0.0.1")

    def __repr__(self):
        return f"ProcessGroupGloo(size={self._size}, rank={self._rank}, name={self.group_name!r})"


__all__ = ["ProcessGroupGloo"]
