"""TCPStore: the client of a StoreServer (and, on the master, its owner)."""
import socket
import threading
import time
import weakref

from ..security import auth
from ..core.errors import DistNetworkError, DistStoreError
from .base import _INIT_KEY, DEFAULT_TIMEOUT, QueueEmptyError, Store, _deadline, _timeout_error
from .server import _SERVERS, _SERVERS_LOCK, StoreServer, _close_socks, _release_server
from .wire import (
    _HDR, _REP, MAX_FRAME, OP_ADD, OP_APPEND, OP_CAS, OP_CHECK, OP_DELETE, OP_GET, OP_LEASE,
    OP_LIST_KEYS, OP_MULTI_GET, OP_MULTI_SET, OP_NUM_KEYS, OP_QUEUE_LEN, OP_QUEUE_POP, OP_QUEUE_PUSH, OP_SET,
    OP_WAIT, ST_OK, ST_REJECTED, ST_TIMEOUT, _decode_args, encode_request,
)


class TCPStore(Store):
    """A store served over TCP by the master process, torch.distributed.TCPStore's API.

    Args:
        host_name: the master's host name or address.
        port: the master's port; 0 on the master picks a free one (see ``port``).
        world_size: number of processes that will connect, or None.
        is_master: run the server in this process (a background thread).
        timeout: default timeout of blocking operations and of connecting.
        wait_for_workers: with ``world_size``, the master's constructor waits until
            ``world_size`` stores have connected (every client counts itself in).
        multi_tenant: masters on the same port in one process share one server.
        master_listen_fd: an already listening socket for the server.
        use_libuv: accepted and ignored (torch compatibility).
        auth_key: the job's shared secret (str or bytes; keyword only, not in torch's
            signature). The server admits only clients that prove they hold it, and a
            client talks only to a server that proves the same (HMAC-SHA256
            challenge-response; the key never crosses the wire). None (the default) takes
            COLLECTIVES_AUTH_KEY (set by collectives-run); with neither, no authentication,
            as torch's TCPStore.

    Raises:
        DistNetworkError: the server could not be reached within the timeout, or the
            two ends do not hold the same key (:class:`collectives.security.auth.AuthError`).
        DistStoreError: a blocking operation timed out (naming the keys).
    """

    def __init__(self, host_name, port, world_size=None, is_master=False, timeout=DEFAULT_TIMEOUT,
                 wait_for_workers=True, multi_tenant=False, master_listen_fd=None, use_libuv=True,
                 *, auth_key=None):
        super().__init__(timeout)
        self._auth_key = auth.resolve_key(auth_key)
        if not isinstance(host_name, str) or not host_name:
            raise TypeError(f"host_name must be a non-empty str, got {host_name!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if world_size is not None and (not isinstance(world_size, int) or world_size < -1
                                       or world_size == 0):
            raise ValueError(f"world_size must be None or a positive int, got {world_size!r}")
        if world_size == -1:
            world_size = None
        if not is_master and port == 0 and master_listen_fd is None:
            raise ValueError("port must be the master's port (non-zero) when is_master=False")
        self.host = host_name
        self.world_size = world_size
        self.libuvBackend = False
        self._lock = threading.Lock()
        self._server = None
        self._multi_tenant = bool(multi_tenant)
        if is_master:
            self._server = self._start_server(port, master_listen_fd, self._multi_tenant,
                                              host_name, self._auth_key)
            port = self._server.port
            self._server_finalizer = weakref.finalize(self, _release_server, self._server,
                                                      self._multi_tenant)
        self._port = port
        # idle connections: a thread parked in get() must not block another thread's set()
        self._idle = []
        self._unconfirmed = weakref.WeakSet()  # sockets whose proof's verdict is still unread
        self._closed = False
        weakref.finalize(self, _close_socks, self._idle)
        try:
            self._idle.append(self._connect())
            if wait_for_workers and world_size is not None:
                self._wait_for_workers(is_master)
        except BaseException:
            self.close()  # a failed master must not keep its port bound (the traceback keeps self)
            raise

    @staticmethod
    def _start_server(port, listen_fd, multi_tenant, host, key):
        shared = multi_tenant and port
        server = _take_shared(port, key) if shared else None
        if server is not None:
            return server
        # Started outside the lock: Thread.start waits for the new thread, which may run
        # the cyclic GC on its first allocation, and so a finalizer of a dropped store,
        # _release_server, which takes the lock (a test once hung there for good).
        try:
            server = StoreServer(port, listen_fd, host, key)
        except OSError as e:
            # another thread of this process may have just started it
            other = _take_shared(port, key) if shared else None
            if other is not None:
                return other
            raise DistNetworkError(f"TCPStore master could not listen on port {port}: {e}") from e
        with _SERVERS_LOCK:
            if multi_tenant:
                _SERVERS[server.port] = server
            server.refs += 1
        return server

    @property
    def port(self):
        return self._port

    def _connect(self):
        deadline = _deadline(self._timeout)
        pause = 0.005
        last = None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DistNetworkError(
                    f"TCPStore client could not connect to {self.host}:{self._port} within "
                    f"{self._timeout:g} s (last error: {last})")
            try:
                sock = socket.create_connection((self.host, self._port),
                                                timeout=None if left is None else min(left, 10.0))
            except OSError as e:
                last = e
                time.sleep(pause if left is None else max(0.0, min(pause, left)))
                pause = min(pause * 2, 0.1)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._auth_key is None:
                return sock
            where = f"TCPStore {self.host}:{self._port}"
            hs_deadline = time.monotonic() + (auth.HANDSHAKE_TIMEOUT if left is None
                                              else min(left, auth.HANDSHAKE_TIMEOUT))
            try:
                auth.client_handshake(sock, self._auth_key, hs_deadline, where, wait_ok=False)
            except OSError as e:  # the server went away mid-handshake (a restart): try again
                sock.close()
                last = e
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            self._unconfirmed.add(sock)  # the first request follows the proof: see _request
            return sock

    def _wait_for_workers(self, is_master):
        n = self._add(_INIT_KEY, 1)
        if not is_master:
            return
        deadline = _deadline(self._timeout)
        pause = 0.0005
        while n < self.world_size:
            if deadline is not None and time.monotonic() >= deadline:
                raise DistStoreError(
                    f"TCPStore master timed out after {self._timeout:g} s waiting for workers: "
                    f"{n} of {self.world_size} arrived (key {_INIT_KEY!r})")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            n = self._add(_INIT_KEY, 0)

    def _request(self, op, args, wait_secs=None):
        """One round trip. ``wait_secs``: a server-side wait of that many seconds (0: none)."""
        frame = encode_request(op, args)
        with self._lock:
            if self._closed:
                raise DistStoreError(f"TCPStore {self.host}:{self._port} is closed")
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._connect()
        if wait_secs is None:
            sock_timeout = self._timeout or None
        else:  # the server answers the timeout itself; the slack covers the trip
            sock_timeout = None if wait_secs == 0 else wait_secs + max(10.0, self._timeout)
        try:
            sock.settimeout(sock_timeout)
            sock.sendall(frame)
            if sock in self._unconfirmed:
                self._unconfirmed.discard(sock)
                try:
                    auth.read_ok(sock, time.monotonic() + max(auth.HANDSHAKE_TIMEOUT, self._timeout),
                                 f"TCPStore {self.host}:{self._port}")
                except DistNetworkError:
                    sock.close()
                    raise
            status, out = self._read_reply(sock)
        except (OSError, EOFError) as e:
            sock.close()  # the stream may be out of step: the next request reconnects
            if isinstance(e, socket.timeout):
                raise DistStoreError(f"TCPStore {self.host}:{self._port}: no reply within "
                                     f"{sock_timeout:g} s") from e
            raise DistNetworkError(f"TCPStore {self.host}:{self._port}: connection lost: {e}") from e
        if status == ST_REJECTED:
            sock.close()
            if out and out[0].startswith(auth.REFUSED_MARK.encode()):
                raise auth.AuthError(
                    f"TCPStore {self.host}:{self._port} refused this client: authentication "
                    f"required (the server has a key and this process none: set "
                    f"{auth.ENV_KEY} or pass auth_key=)")
        else:
            with self._lock:
                if self._closed or len(self._idle) >= 4:
                    sock.close()
                else:
                    self._idle.append(sock)
        if status == ST_OK:
            return out
        if status == ST_TIMEOUT:
            return _TimedOut(out)
        raise DistStoreError(f"TCPStore {self.host}:{self._port}: "
                             f"{out[0].decode(errors='replace') if out else 'error'}")

    @staticmethod
    def _read_reply(sock):
        hdr = _recv_exact(sock, 4)
        n, = _HDR.unpack(hdr)
        if n < _REP.size or n > MAX_FRAME:
            raise EOFError(f"bad reply length {n}")
        body = _recv_exact(sock, n)
        status, nargs = _REP.unpack_from(body)
        try:
            return status, _decode_args(body, _REP.size, nargs)
        except ValueError as e:
            raise EOFError(f"bad reply: {e}") from None

    def _blocking(self, op, keys, secs, what):
        ms = 0 if secs == 0 else max(1, int(secs * 1000))
        out = self._request(op, [k.encode() for k in keys] + [str(ms).encode()], secs)
        if isinstance(out, _TimedOut):
            raise _timeout_error(what, [k.decode() for k in out.missing], secs)
        return out

    # -- operations ---------------------------------------------------------------------
    def _set(self, key, value):
        self._request(OP_SET, [key.encode(), value])

    def _get(self, key, secs):
        return self._blocking(OP_GET, [key], secs, "get")[0]

    def _multi_get(self, keys, secs):
        if not keys:
            return []
        return self._blocking(OP_MULTI_GET, keys, secs, "multi_get")

    def _wait(self, keys, secs):
        self._blocking(OP_WAIT, keys, secs, "wait")

    def _add(self, key, amount):
        return int(self._request(OP_ADD, [key.encode(), str(amount).encode()])[0])

    def _compare_set(self, key, expected, desired):
        return self._request(OP_CAS, [key.encode(), expected, desired])[0]

    def _append(self, key, value):
        self._request(OP_APPEND, [key.encode(), value])

    def _multi_set(self, keys, values):
        args = []
        for k, v in zip(keys, values):
            args += [k.encode(), v]
        self._request(OP_MULTI_SET, args)

    def _check(self, keys):
        return self._request(OP_CHECK, [k.encode() for k in keys])[0] == b"1"

    def _delete(self, key):
        return self._request(OP_DELETE, [key.encode()])[0] == b"1"

    def _num_keys(self):
        return int(self._request(OP_NUM_KEYS, [])[0])

    def _list_keys(self):
        return [k.decode() for k in self._request(OP_LIST_KEYS, [])]

    def _queue_push(self, key, value):
        self._request(OP_QUEUE_PUSH, [key.encode(), value])

    def _queue_pop(self, key, secs):
        if secs < 0:
            out = self._request(OP_QUEUE_POP, [key.encode(), b"-1"])
            if isinstance(out, _TimedOut):
                raise QueueEmptyError(f"queue {key!r} is empty")
            return out[0]
        return self._blocking(OP_QUEUE_POP, [key], secs, "queue_pop")[0]

    def _queue_len(self, key):
        return int(self._request(OP_QUEUE_LEN, [key.encode()])[0])

    def lease(self, key, value, close_key="", close_value=b""):
        """Set ``key`` to ``value`` for as long as this client's connection to the server
        lives: when it closes (this process exits or dies, even by SIGKILL, or ``close``
        is called), the server deletes ``key`` and, if ``close_key`` is given, sets it to
        ``close_value`` (waking whoever waits for it). Leasing the same key again on the
        same connection replaces its close action. Use a client of its own (``clone()``)
        from one thread only, so that every lease rides on the same connection."""
        from .base import _check_key, _to_bytes
        self._request(OP_LEASE, [_check_key(key).encode(), _to_bytes(value),
                                 close_key.encode() if close_key else b"",
                                 _to_bytes(close_value, "close_value")])

    def clone(self):
        """Another client of the same server (for use from another thread)."""
        return TCPStore(self.host, self._port, None, False, self._timeout, False,
                        auth_key=self._auth_key)

    def close(self):
        """Close this client's connection (and, on the master, stop serving once no
        master TCPStore on the server remains)."""
        with self._lock:
            self._closed = True
            _close_socks(self._idle)
        if self._server is not None:
            self._server = None
            self._server_finalizer()


def _same_key(server, key):
    if server._key != key:
        raise ValueError(f"multi_tenant TCPStore on port {server.port}: the server this process "
                         f"already runs there has a different auth_key")


class _TimedOut:
    __slots__ = ("missing",)

    def __init__(self, missing):
        self.missing = missing


def _take_shared(port, key):
    """The server this process runs on ``port``, with one more reference (its key checked
    against ``key``), or None."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(port)
        if server is not None:
            _same_key(server, key)
            server.refs += 1
        return server


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the store server closed the connection")
        buf += chunk
    return bytes(buf)
