"""A store client with successors: ``host0:port0,host1:port1,...``.

The job's store runs outside the training processes (in each host's collectives-run, or
``python -m collectives.elastic.store``). Its first address is the primary; when the
primary's process dies (its connections close, it refuses new ones) every client moves to
the next address that answers, never back, and tells its owner (``on_switch``), which
writes again what the job needs there: its lease, the current generation's decision.
Every client walks the same list in the same order, so they meet on the same successor.

Not a consensus protocol: a network partition that leaves the primary alive but
unreachable to some clients only would split them (docs/elastic.md says so).
"""
import datetime
import threading
import time

from ..core.errors import DistNetworkError, DistStoreError
from ..security import auth
from .base import Store
from .tcp import TCPStore

CONNECT_S = 3.0  # seconds to reach one address before the next is tried
ADOPTED = "_failover/adopted"  # set on a successor once a client moved to it


def parse_addresses(text):
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"the elastic store address must be host:port[,host:port...], "
                             f"got {text!r}")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("the elastic store address is empty")
    return out


class FailoverStore(Store):
    """The TCPStore API over a list of servers, moving to the next when one dies."""

    def __init__(self, addresses, timeout=30.0, auth_key=None, start=0):
        super().__init__(datetime.timedelta(seconds=timeout))
        self._addrs = parse_addresses(addresses) if isinstance(addresses, str) else list(addresses)
        self._auth_key = auth.resolve_key(auth_key)
        self._lock = threading.RLock()
        self.on_switch = []  # callables run (in the switching thread) after a move
        self.switches = 0
        self._i = start
        self._client = None
        self._client, self._i = self._reach(start, first=True)

    @property
    def address(self):
        host, port = self._addrs[self._i]
        return f"{host}:{port}"

    def _open(self, i):
        host, port = self._addrs[i]
        return TCPStore(host, port, None, False, datetime.timedelta(seconds=CONNECT_S),
                        wait_for_workers=False, auth_key=self._auth_key)

    def _reach(self, i, first=False):
        """The first server from index ``i`` on that answers. A process that starts
        (``first``) waits up to the store's timeout for the primary, and takes a successor
        only once a client has moved there (ADOPTED is set): one that merely started
        sooner than the primary must not split the job."""
        deadline = time.monotonic() + (self._timeout if first else 0.0)
        last = None
        while True:
            for j in range(i, len(self._addrs)):
                try:
                    client = self._open(j)
                except DistNetworkError as e:
                    last = e
                    continue
                if first and j > i and not client.check([ADOPTED]):
                    client.close()
                    continue
                return client, j
            if time.monotonic() >= deadline:
                raise DistNetworkError(f"no elastic store answers at {self._addrs[i:]} (the "
                                       f"last error: {last})")
            time.sleep(0.2)

    def _failover(self, client):
        with self._lock:
            if self._client is not client:  # another thread has moved already
                return
            if self._i + 1 >= len(self._addrs):
                raise DistNetworkError(f"the elastic store at {self.address} is lost and no "
                                       f"successor is configured")
            new, i = self._reach(self._i + 1)
            old, self._client, self._i = self._client, new, i
            self.switches += 1
            new.set(ADOPTED, self.address)  # newcomers may come here now
            try:
                old.close()
            except Exception:  # noqa: BLE001
                pass
            for cb in list(self.on_switch):
                cb()

    def _call(self, name, *args):
        for _ in range(len(self._addrs)):
            client = self._client
            try:
                return getattr(client, name)(*args)
            except DistNetworkError:
                if self._still_there(client):
                    raise  # the server answers: not a lost store
                self._failover(client)
        return getattr(self._client, name)(*args)

    def _still_there(self, client):
        """Whether the server answers a request on a new connection (the one that failed
        may have been cut alone). A connection the kernel accepts is not enough: a dying
        server's listening socket still takes them for a moment after its other connections
        closed. Refused, cut, or unanswered within CONNECT_S: it is gone."""
        import socket
        try:
            with socket.create_connection((client.host, client.port), timeout=CONNECT_S):
                pass
        except OSError:
            return False  # refused: no retry, unlike a store client's connect
        probe = None
        try:
            probe = TCPStore(client.host, client.port, None, False,
                             datetime.timedelta(seconds=CONNECT_S), wait_for_workers=False,
                             auth_key=self._auth_key)
            probe.check([ADOPTED])
            return True
        except (DistNetworkError, DistStoreError):
            return False
        finally:
            if probe is not None:
                probe.close()

    # (the Store API's primitives: _ON_CLIENT below)

    def lease(self, key, value, close_key="", close_value=b""):
        return self._call("lease", key, value, close_key, close_value)

    def clone(self):
        """Another client of the same list, at the same server (one per thread)."""
        return FailoverStore(self._addrs, self._timeout, self._auth_key, start=self._i)

    def close(self):
        with self._lock:
            self._client.close()


# The Store primitives that FailoverStore runs on the current server's client through _call,
# moving to the next server when it dies: class attributes, set once here.
_ON_CLIENT = ("_set", "_get", "_add", "_compare_set", "_wait", "_check", "_delete", "_num_keys",
              "_append", "_multi_get", "_multi_set", "_list_keys")


def _on_client(name):
    def method(self, *args):
        return self._call(name, *args)
    method.__name__ = name
    method.__qualname__ = f"FailoverStore.{name}"
    method.__doc__ = f"The current server's ``{name}`` (see FailoverStore._call)."
    return method


for _name in _ON_CLIENT:
    setattr(FailoverStore, _name, _on_client(_name))
del _name
