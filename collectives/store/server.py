"""The TCPStore server: one thread, one selector, every client."""
import collections
import errno
import heapq
import ipaddress
import os
import selectors
import socket
import threading
import time

from ..security import auth
from ..core.errors import DistStoreError
from .base import _add, _compare_set
from .wire import (
    _HDR, _REQ, MAX_FRAME, OP_ADD, OP_APPEND, OP_CAS, OP_CHECK, OP_DELETE, OP_GET, OP_LEASE,
    OP_LIST_KEYS, OP_MULTI_GET, OP_MULTI_SET, OP_NUM_KEYS, OP_PING, OP_QUEUE_LEN, OP_QUEUE_POP, OP_QUEUE_PUSH,
    OP_SET, OP_WAIT, SERVER_LINGER, ST_ERROR, ST_OK, ST_REJECTED, ST_TIMEOUT, _decode_request,
    _encode_reply,
)


OUT_HIGH = 8 << 20  # replies buffered for one client beyond which it is not read from
MAX_PENDING = 256  # connections authenticating at once; a flood evicts the oldest
ACCEPT_PAUSE = 0.05  # seconds without accepting when the process is out of descriptors


def listen_socket(host, port):
    """A listening socket for ``host``: an address binds that address only (127.0.0.1
    listens on loopback, not on every interface), a name that resolves only to loopback
    addresses binds the first of them, and None, "", "0.0.0.0", "::" or any other name
    bind every interface (IPv4 and IPv6 where the host has both), as torch's TCPStore."""
    addr = _bind_address(host)
    if addr is None:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                        backlog=1024)
        return socket.create_server(("", port), backlog=1024)
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        return socket.create_server((str(addr), port), family=family, backlog=1024)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
    # not an address of this host (one that NAT or a published container port leads here):
    # torch's behaviour, every interface, and a line that says so
    auth.log.warning("TCPStore: %s is not an address of this host; listening on every "
                     "interface instead", addr)
    return listen_socket(None, port)


def _bind_address(host):
    if not host:
        return None
    try:
        addr = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return None
        addrs = [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]
        if addrs and all(a.is_loopback for a in addrs):
            return sorted(addrs, key=lambda a: a.version)[0]
        return None
    return None if addr.is_unspecified else addr


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "waiter", "closing", "events", "hs", "leases")

    def __init__(self, sock, hs=None):
        self.sock = sock
        self.hs = hs  # the authentication handshake still under way, or None
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter = None
        self.closing = False  # close once outbuf is flushed
        self.events = selectors.EVENT_READ  # what the selector watches for
        self.leases = None  # key -> (key set when this connection closes, its value)


class _Waiter:
    __slots__ = ("conn", "op", "keys", "deadline", "done", "secs")

    def __init__(self, conn, op, keys, deadline, secs):
        self.conn = conn
        self.op = op
        self.keys = keys
        self.deadline = deadline
        self.secs = secs
        self.done = False

    def __lt__(self, other):
        return id(self) < id(other)


class StoreServer:
    """The TCPStore server: one thread, one selector, every client.

    Blocking requests (get, wait, multi_get) park the connection on a waiter until
    the keys are set or the request's own deadline passes; nothing else blocks.
    A malformed frame gets an error reply and its connection is closed.
    """

    def __init__(self, port=0, listen_fd=None, host=None, auth_key=None):
        if listen_fd is not None:
            self._lsock = socket.socket(fileno=os.dup(listen_fd))
        else:
            self._lsock = listen_socket(host, port)
        self._lsock.setblocking(False)
        self._key = auth_key
        self._pending = {}  # connections still authenticating, oldest first
        self._refusals = auth.RefusalLog(f"store server on port {self._lsock.getsockname()[1]}")
        self._accept_paused = None  # out of fds: accept again at this time
        self.port = self._lsock.getsockname()[1]
        self._data = {}
        self._queues = {}  # key -> deque of values
        self._waiters = {}  # key (or ("q", key) for a queue) -> set of _Waiter
        self._deadlines = []  # heap of (deadline, _Waiter); answered waiters leave lazily
        self._compact_at = 1024  # rebuild the heap without answered waiters at this length
        self._conns = set()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._linger_until = None
        self._unlistened = threading.Event()
        self.refs = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"collectives-store-server-{self.port}")
        self._thread.start()

    def stop(self, linger=0.0):
        """Stop serving. With ``linger`` > 0 the port is released at once, but clients
        still connected are served until they hang up or ``linger`` seconds pass, so a
        rank that is a little behind can finish its last requests after the master's
        store is closed."""
        self._linger_until = time.monotonic() + linger if linger > 0 else None
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            if linger <= 0:
                self._thread.join(5)
            else:  # the port is free when stop returns
                self._unlistened.wait(5)

    # -- loop ---------------------------------------------------------------------------
    def _loop(self):
        listening = True
        try:
            while True:
                timeout = None
                if self._stopping:
                    if listening:  # free the port for a new master right away
                        listening = False
                        if self._accept_paused is None:
                            self._sel.unregister(self._lsock)
                        self._lsock.close()
                        self._unlistened.set()
                    until = self._linger_until
                    if not self._conns or until is None or time.monotonic() >= until:
                        break
                    timeout = until - time.monotonic()
                if self._deadlines:
                    left = max(0.0, self._deadlines[0][0] - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
                for until in self._handshake_deadline(), self._accept_paused:
                    if until is not None and listening:
                        left = max(0.0, until - time.monotonic())
                        timeout = left if timeout is None else min(timeout, left)
                for key, mask in self._sel.select(timeout):
                    if key.data == "listen":
                        if listening:
                            self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and conn.sock is not None:
                            self._read(conn)
                self._expire()
                if listening:
                    self._expire_handshakes()
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._sel.close()
            self._lsock.close()
            self._unlistened.set()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self):
        for _ in range(64):
            try:
                sock, _addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: stop accepting a moment (the listening socket stays
                    # readable, and polling it would spin), and shed the oldest handshakes
                    self._sel.unregister(self._lsock)
                    self._accept_paused = time.monotonic() + ACCEPT_PAUSE
                    for conn in list(self._pending)[:len(self._pending) // 2 + 1]:
                        self._refuse(conn, "too many connections authenticating at once")
                    return
                if e.errno == errno.ECONNABORTED:
                    continue
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, None if self._key is None else auth.ServerHandshake(self._key))
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            if conn.hs is not None:
                if len(self._pending) >= MAX_PENDING:  # a flood: the oldest one goes
                    self._refuse(next(iter(self._pending)), "too many connections authenticating at once")
                self._pending[conn] = None

    # -- authentication -------------------------------------------------------------------
    def _handshake_deadline(self):
        for conn in self._pending:  # the oldest: every handshake gets the same time
            return conn.hs.deadline
        return None

    def _expire_handshakes(self):
        if self._accept_paused is not None and time.monotonic() >= self._accept_paused:
            self._accept_paused = None
            self._sel.register(self._lsock, selectors.EVENT_READ, "listen")
        now = time.monotonic()
        while self._pending:
            conn = next(iter(self._pending))
            if conn.hs.deadline > now:
                break
            self._refuse(conn, f"no authentication within {auth.HANDSHAKE_TIMEOUT:g} s")

    def _refuse(self, conn, why, reply=b""):
        self._pending.pop(conn, None)
        self._refusals.refused(auth.peer_name(conn.sock), why)
        conn.hs = None
        conn.inbuf.clear()
        conn.closing = True
        if reply:
            conn.outbuf += reply
            self._flush(conn)
        else:
            self._close(conn)

    def _authenticate(self, conn, data):
        """Feed the handshake; returns the bytes that follow it once it succeeded, else None."""
        hs = conn.hs
        plain_frame = hs.nc is None and data[:1] != auth.MAGIC[:1]
        out, done, rest = hs.feed(data)
        if done is None or done is True:
            if out:
                conn.outbuf += out
                self._flush(conn)
            if done is None:
                return None
            self._pending.pop(conn, None)
            conn.hs = None
            return rest
        if plain_frame:  # a client without a key: tell it in the store's own words
            out = _encode_reply(ST_REJECTED, [f"{auth.REFUSED_MARK}: this store server has a key "
                                              f"and the client sent none".encode()])
        self._refuse(conn, done, out)
        return None

    def _close(self, conn):
        if conn.sock is None:
            return
        w = conn.waiter
        if w is not None:
            self._drop_waiter(w)
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.sock = None
        if conn.leases:  # the holder is gone (its process died or let go): say so
            leases, conn.leases = conn.leases, None
            woken = []
            for key, (close_key, close_value) in leases.items():
                self._data.pop(key, None)
                if close_key:
                    self._data[close_key] = close_value
                    woken.append(close_key)
            self._wake(woken)

    def _read(self, conn):
        if conn.closing:
            return
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        if conn.hs is not None:
            data = self._authenticate(conn, data)
            if not data:
                return
        conn.inbuf += data
        self._process(conn)

    def _process(self, conn):
        buf = conn.inbuf
        while conn.waiter is None and not conn.closing and conn.sock is not None:
            if len(conn.outbuf) >= OUT_HIGH:  # a client that does not read its replies: wait
                return
            if len(buf) < 4:
                return
            n, = _HDR.unpack_from(buf)
            if n > MAX_FRAME or n < _REQ.size:
                self._reject(conn, f"frame length {n} outside [{_REQ.size}, {MAX_FRAME}]")
                return
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            try:
                op, args = _decode_request(body)
            except ValueError as e:
                self._reject(conn, f"malformed frame: {e}")
                return
            try:
                self._dispatch(conn, op, args)
            except _Malformed as e:
                self._reject(conn, f"malformed request: {e}")
                return
            except DistStoreError as e:  # a well-formed request that failed (add to a non-number)
                self._reply(conn, ST_ERROR, [str(e).encode()])

    def _reject(self, conn, why):
        conn.inbuf.clear()
        self._reply(conn, ST_REJECTED, [why.encode()])
        conn.closing = True
        if not conn.outbuf:
            self._close(conn)

    def _reply(self, conn, status, args):
        if conn.sock is None:
            return
        conn.outbuf += _encode_reply(status, args)
        self._flush(conn)

    def _flush(self, conn):
        if conn.sock is None:
            return
        while conn.outbuf:
            try:
                n = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbuf[:n]
        want = bool(conn.outbuf)
        # a client that does not read its replies is not read from either (its requests
        # would only pile up more replies): memory stays bounded per connection
        events = (selectors.EVENT_READ if len(conn.outbuf) < OUT_HIGH else 0) | \
            (selectors.EVENT_WRITE if want else 0)
        if events != conn.events:
            resumed = not conn.events & selectors.EVENT_READ and events & selectors.EVENT_READ
            conn.events = events
            self._sel.modify(conn.sock, events, conn)
            if resumed:
                self._process(conn)  # requests it sent before it stopped reading
        if not want and conn.closing:
            self._close(conn)

    # -- requests ---------------------------------------------------------------------
    def _dispatch(self, conn, op, args):
        data = self._data
        if op == OP_SET:
            k, v = _nargs(args, 2)
            data[k] = v
            self._reply(conn, ST_OK, [])
            self._wake([k])
        elif op in (OP_GET, OP_WAIT, OP_MULTI_GET, OP_QUEUE_POP):
            if not args or (op == OP_QUEUE_POP and len(args) != 2):
                raise _Malformed("expected keys and a timeout")
            ms = _int_arg(args[-1])
            keys = args[:-1]
            w = _Waiter(conn, op, keys, None if ms <= 0 else time.monotonic() + ms / 1000.0, ms)
            missing = self._missing(w)
            if not missing:
                self._answer(conn, op, keys)
            elif ms < 0:  # a non-blocking queue_pop
                self._reply(conn, ST_TIMEOUT, missing)
            else:
                conn.waiter = w
                for k in missing:
                    self._waiters.setdefault(self._watch(w, k), set()).add(w)
                if w.deadline is not None:
                    self._push_deadline(w)
        elif op == OP_QUEUE_PUSH:
            k, v = _nargs(args, 2)
            self._queues.setdefault(k, collections.deque()).append(v)
            self._reply(conn, ST_OK, [])
            self._wake([("q", k)])
        elif op == OP_QUEUE_LEN:
            k, = _nargs(args, 1)
            self._reply(conn, ST_OK, [str(len(self._queues.get(k, ()))).encode()])
        elif op == OP_ADD:
            k, n = _nargs(args, 2)
            out = _add(data, k, _int_arg(n))
            self._reply(conn, ST_OK, [str(out).encode()])
            self._wake([k])
        elif op == OP_CAS:
            k, exp, des = _nargs(args, 3)
            self._reply(conn, ST_OK, [_compare_set(data, k, exp, des)])
            self._wake([k])
        elif op == OP_APPEND:
            k, v = _nargs(args, 2)
            data[k] = data.get(k, b"") + v
            self._reply(conn, ST_OK, [])
            self._wake([k])
        elif op == OP_MULTI_SET:
            if len(args) % 2:
                raise _Malformed("multi_set needs key/value pairs")
            keys = args[0::2]
            data.update(zip(keys, args[1::2]))
            self._reply(conn, ST_OK, [])
            self._wake(keys)
        elif op == OP_CHECK:
            self._reply(conn, ST_OK, [b"1" if all(k in data for k in args) else b"0"])
        elif op == OP_DELETE:
            k, = _nargs(args, 1)
            self._reply(conn, ST_OK, [b"1" if data.pop(k, None) is not None else b"0"])
        elif op == OP_NUM_KEYS:
            self._reply(conn, ST_OK, [str(len(data)).encode()])
        elif op == OP_LIST_KEYS:
            self._reply(conn, ST_OK, list(data))
        elif op == OP_LEASE:
            k, v, ck, cv = _nargs(args, 4)
            data[k] = v
            if conn.leases is None:
                conn.leases = {}
            conn.leases[k] = (ck, cv)
            self._reply(conn, ST_OK, [])
            self._wake([k])
        elif op == OP_PING:
            self._reply(conn, ST_OK, [b"pong"])
        else:
            raise _Malformed(f"unknown op {op}")

    def _missing(self, w):
        if w.op == OP_QUEUE_POP:
            return [k for k in w.keys if not self._queues.get(k)]
        return [k for k in w.keys if k not in self._data]

    @staticmethod
    def _watch(w, key):
        return ("q", key) if w.op == OP_QUEUE_POP else key

    def _answer(self, conn, op, keys):
        if op == OP_WAIT:
            self._reply(conn, ST_OK, [])
        elif op == OP_QUEUE_POP:
            self._reply(conn, ST_OK, [self._queues[keys[0]].popleft()])
        else:
            self._reply(conn, ST_OK, [self._data[k] for k in keys])

    def _wake(self, keys):
        for k in keys:
            ws = self._waiters.pop(k, None)
            if not ws:
                continue
            for w in ws:
                if w.done:
                    continue
                missing = self._missing(w)
                if missing:
                    self._waiters.setdefault(self._watch(w, missing[0]), set()).add(w)
                    continue
                self._drop_waiter(w)
                conn = w.conn
                self._answer(conn, w.op, w.keys)
                self._process(conn)  # requests that arrived behind the blocked one

    def _drop_waiter(self, w):
        w.done = True
        w.conn.waiter = None
        for k in w.keys:
            k = self._watch(w, k)
            ws = self._waiters.get(k)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._waiters[k]

    def _push_deadline(self, w):
        dl = self._deadlines
        if len(dl) >= self._compact_at:
            # waits answered long before their deadline would otherwise pile up here
            # (a client that waits often with a long timeout)
            dl[:] = [e for e in dl if not e[1].done]
            heapq.heapify(dl)
            self._compact_at = max(1024, 2 * len(dl))
        heapq.heappush(dl, (w.deadline, w))

    def _expire(self):
        now = time.monotonic()
        dl = self._deadlines
        while dl and (dl[0][1].done or dl[0][0] <= now):
            _, w = heapq.heappop(dl)
            if w.done:
                continue
            self._drop_waiter(w)
            self._reply(w.conn, ST_TIMEOUT, self._missing(w))
            self._process(w.conn)


class _Malformed(Exception):
    pass


def _nargs(args, n):
    if len(args) != n:
        raise _Malformed(f"expected {n} arguments, got {len(args)}")
    return args


def _int_arg(b):
    try:
        return int(b)
    except ValueError:
        raise _Malformed(f"expected a decimal integer, got {b[:20]!r}") from None


_SERVERS = {}  # port -> StoreServer, for multi_tenant
_SERVERS_LOCK = threading.RLock()  # a finalizer may release a server in any thread


def _release_server(server, multi_tenant):
    with _SERVERS_LOCK:
        server.refs -= 1
        if server.refs > 0:
            return
        if multi_tenant and _SERVERS.get(server.port) is server:
            del _SERVERS[server.port]
    server.stop(SERVER_LINGER)


def _close_socks(idle):
    while idle:
        idle.pop().close()
