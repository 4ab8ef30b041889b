"""Key-value stores for rendezvous, with torch.distributed's Store API.

``TCPStore`` (a server thread on rank 0, clients everywhere), ``FileStore`` (an
append-only log in a shared file), ``HashStore`` (one process) and
``PrefixStore`` (a namespace inside another store). Keys are str, values bytes
(str is accepted and UTF-8 encoded). ``get`` and ``wait`` block until the keys
exist or the timeout passes, then raise :class:`~collectives.errors.DistStoreError`
naming the keys. Timeouts are ``datetime.timedelta`` (as torch) or float seconds;
zero means no timeout, as torch's ``kNoTimeout``.

Example:
    >>> server = TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    >>> server.set("k", "v"); server.get("k")
    b'v'
"""
import collections
import errno
import fcntl
import heapq
import os
import selectors
import socket
import struct
import threading
import time
import weakref
from datetime import timedelta

from .errors import DistNetworkError, DistStoreError

DEFAULT_TIMEOUT = timedelta(seconds=300)
_INIT_KEY = "init/"  # the key torch's TCPStore counts arriving workers on


# ---- argument checks ------------------------------------------------------------------

def to_seconds(timeout, name="timeout"):
    """A timeout (timedelta or seconds) as float seconds; 0 means none."""
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        secs = float(timeout)
    else:
        raise TypeError(f"{name} must be a datetime.timedelta or seconds (int/float), "
                        f"got {type(timeout).__name__}")
    if secs < 0 or secs != secs:
        raise ValueError(f"{name} must be >= 0 seconds, got {secs}")
    if secs > 1e8:  # beyond what sockets and condition variables take: no timeout
        secs = 0.0
    return secs


def _check_key(key, name="key"):
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__}")
    return key


def _check_keys(keys, name="keys"):
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise TypeError(f"{name} must be a list of str, got {type(keys).__name__}")
    keys = list(keys)
    for k in keys:
        _check_key(k, f"every element of {name}")
    return keys


def _to_bytes(value, name="value"):
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)):  # torch also takes a list of byte values
        try:
            return bytes(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{name} must be str or bytes, got {type(value).__name__}")


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's QueueEmptyError)."""


def _deadline(secs):
    return None if secs == 0 else time.monotonic() + secs


def _timeout_error(what, keys, secs):
    return DistStoreError(f"{what} timed out after {secs:g} s waiting for keys {list(keys)!r}")


def _parse_int(value, key):
    try:
        return int(value)
    except ValueError:
        if isinstance(key, bytes):
            key = key.decode(errors="replace")
        raise DistStoreError(f"add: the value of key {key!r} is not an integer: {value[:40]!r}") from None


# ---- the in-memory semantics, shared by HashStore, FileStore and the TCP server ----------

def _compare_set(data, key, expected, desired):
    """torch's compare_set: returns the value now stored (or ``expected`` if the key is
    absent and ``expected`` is not empty)."""
    cur = data.get(key)
    if cur is None:
        if expected == b"":
            data[key] = desired
            return desired
        return expected
    if cur == expected:
        data[key] = desired
        return desired
    return cur


def _add(data, key, amount):
    cur = data.get(key)
    n = (0 if cur is None else _parse_int(cur, key)) + amount
    data[key] = str(n).encode()
    return n


# ---- the Store base ----------------------------------------------------------------

class Store:
    """Base class of every store: the torch.distributed.Store API.

    Subclasses implement ``_set, _get, _add, _compare_set, _wait, _check, _delete,
    _num_keys`` (and may override the multi-key and append operations).
    Keys reach the ``_`` methods already checked; values already bytes; timeouts in seconds.
    """

    def __init__(self, timeout=DEFAULT_TIMEOUT):
        self._timeout = to_seconds(timeout)

    # -- public API ---------------------------------------------------------------
    @property
    def timeout(self):
        """The default timeout of blocking operations, as a timedelta."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout):
        self._timeout = to_seconds(timeout)

    def set(self, key, value):
        self._set(_check_key(key), _to_bytes(value))

    def get(self, key):
        """The value of ``key`` (bytes), waiting up to the store's timeout for it to be set."""
        return self._get(_check_key(key), self._timeout)

    def add(self, key, amount):
        """Add ``amount`` to the integer stored at ``key`` (0 if absent); returns the new value."""
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"amount must be an int, got {type(amount).__name__}")
        return self._add(_check_key(key), amount)

    def compare_set(self, key, expected_value, desired_value):
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is absent and
        ``expected_value`` is empty); returns the value now stored, as torch does."""
        return self._compare_set(_check_key(key), _to_bytes(expected_value, "expected_value"),
                                 _to_bytes(desired_value, "desired_value"))

    def wait(self, keys, timeout=None):
        """Block until every key in ``keys`` exists; DistStoreError naming them on timeout."""
        secs = self._timeout if timeout is None else to_seconds(timeout)
        self._wait(_check_keys(keys), secs)

    def check(self, keys):
        """True if every key in ``keys`` exists (does not wait)."""
        return self._check(_check_keys(keys))

    def delete_key(self, key):
        """Delete ``key``; True if it existed."""
        return self._delete(_check_key(key))

    def num_keys(self):
        return self._num_keys()

    def append(self, key, value):
        """Append ``value`` to the bytes at ``key`` (creating it)."""
        self._append(_check_key(key), _to_bytes(value))

    def multi_get(self, keys):
        """The values of ``keys``, waiting for all of them (one round trip where possible)."""
        return self._multi_get(_check_keys(keys), self._timeout)

    def multi_set(self, keys, values):
        keys = _check_keys(keys)
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"values must be a list of str or bytes, got {type(values).__name__}")
        values = [_to_bytes(v, "every element of values") for v in values]
        if len(keys) != len(values):
            raise ValueError(f"keys and values must have the same length, got {len(keys)} and {len(values)}")
        self._multi_set(keys, values)

    def list_keys(self):
        return self._list_keys()

    def has_extended_api(self):
        return True

    def queue_push(self, key, value):
        """Append ``value`` to the queue ``key`` (queues are a namespace apart from keys)."""
        self._queue_push(_check_key(key), _to_bytes(value))

    def queue_pop(self, key, block=True):
        """Pop the oldest value of queue ``key``; waits up to the timeout if it is empty,
        or raises QueueEmptyError at once with ``block=False``."""
        return self._queue_pop(_check_key(key), self._timeout if block else -1.0)

    def queue_len(self, key):
        return self._queue_len(_check_key(key))

    def _queue_push(self, key, value):
        raise NotImplementedError(f"{type(self).__name__} does not implement queues")

    _queue_pop = _queue_len = _queue_push

    # -- defaults built on the primitives -----------------------------------------------------
    def _append(self, key, value):
        while True:
            cur = self._get(key, self._timeout) if self._check([key]) else b""
            if self._compare_set(key, cur, cur + value) == cur + value:
                return

    def _multi_get(self, keys, secs):
        return [self._get(k, secs) for k in keys]

    def _multi_set(self, keys, values):
        for k, v in zip(keys, values):
            self._set(k, v)

    def _list_keys(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement list_keys")


# ---- HashStore ----------------------------------------------------------------------

class HashStore(Store):
    """A store in this process's memory, shared by its threads."""

    def __init__(self):
        super().__init__()
        self._data = {}
        self._queues = {}
        self._cv = threading.Condition()

    def _set(self, key, value):
        with self._cv:
            self._data[key] = value
            self._cv.notify_all()

    def _wait_locked(self, keys, secs, what):
        deadline = _deadline(secs)
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _timeout_error(what, missing, secs)
            self._cv.wait(left)

    def _get(self, key, secs):
        with self._cv:
            self._wait_locked([key], secs, "get")
            return self._data[key]

    def _multi_get(self, keys, secs):
        with self._cv:
            self._wait_locked(keys, secs, "multi_get")
            return [self._data[k] for k in keys]

    def _wait(self, keys, secs):
        with self._cv:
            self._wait_locked(keys, secs, "wait")

    def _add(self, key, amount):
        with self._cv:
            n = _add(self._data, key, amount)
            self._cv.notify_all()
            return n

    def _compare_set(self, key, expected, desired):
        with self._cv:
            out = _compare_set(self._data, key, expected, desired)
            self._cv.notify_all()
            return out

    def _append(self, key, value):
        with self._cv:
            self._data[key] = self._data.get(key, b"") + value
            self._cv.notify_all()

    def _multi_set(self, keys, values):
        with self._cv:
            self._data.update(zip(keys, values))
            self._cv.notify_all()

    def _check(self, keys):
        with self._cv:
            return all(k in self._data for k in keys)

    def _delete(self, key):
        with self._cv:
            return self._data.pop(key, None) is not None

    def _num_keys(self):
        with self._cv:
            return len(self._data)

    def _list_keys(self):
        with self._cv:
            return list(self._data)

    def _queue_push(self, key, value):
        with self._cv:
            self._queues.setdefault(key, collections.deque()).append(value)
            self._cv.notify_all()

    def _queue_pop(self, key, secs):
        with self._cv:
            deadline = None if secs == 0 else time.monotonic() + secs
            while not self._queues.get(key):
                left = None if deadline is None else deadline - time.monotonic()
                if secs < 0:
                    raise QueueEmptyError(f"queue {key!r} is empty")
                if left is not None and left <= 0:
                    raise _timeout_error("queue_pop", [key], secs)
                self._cv.wait(left)
            return self._queues[key].popleft()

    def _queue_len(self, key):
        with self._cv:
            return len(self._queues.get(key, ()))

    def clone(self):
        return self


# ---- PrefixStore ----------------------------------------------------------------------

class PrefixStore(Store):
    """Every key of ``store`` seen through ``prefix + "/"``, as torch's PrefixStore."""

    def __init__(self, prefix, store):
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"store must be a collectives Store, got {type(store).__name__}")
        self._store = store
        self._prefix = prefix + "/"

    @property
    def underlying_store(self):
        return self._store

    @property
    def _timeout(self):  # shares the underlying store's timeout, as torch's does
        return self._store._timeout

    @_timeout.setter
    def _timeout(self, secs):
        self._store._timeout = secs

    def _k(self, key):
        return self._prefix + key

    def _set(self, key, value):
        self._store._set(self._k(key), value)

    def _get(self, key, secs):
        return self._store._get(self._k(key), secs)

    def _add(self, key, amount):
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys, secs):
        self._store._wait([self._k(k) for k in keys], secs)

    def _check(self, keys):
        return self._store._check([self._k(k) for k in keys])

    def _delete(self, key):
        return self._store._delete(self._k(key))

    def _num_keys(self):
        return self._store._num_keys()

    def _append(self, key, value):
        self._store._append(self._k(key), value)

    def _multi_get(self, keys, secs):
        return self._store._multi_get([self._k(k) for k in keys], secs)

    def _multi_set(self, keys, values):
        self._store._multi_set([self._k(k) for k in keys], values)

    def _queue_push(self, key, value):
        self._store._queue_push(self._k(key), value)

    def _queue_pop(self, key, secs):
        return self._store._queue_pop(self._k(key), secs)

    def _queue_len(self, key):
        return self._store._queue_len(self._k(key))

    def _list_keys(self):
        n = len(self._prefix)
        return [k[n:] for k in self._store._list_keys() if k.startswith(self._prefix)]

    def clone(self):
        return PrefixStore(self._prefix[:-1], self._store.clone())


# ---- FileStore ----------------------------------------------------------------------

_REC_SET = b"S"
_REC_DEL = b"D"
_REFCOUNT_KEY = "\0refcount"  # hidden from num_keys/list_keys


class FileStore(Store):
    """A store in a file that every rank can open (a shared filesystem for many hosts).

    The file is an append-only log of set/delete records, read and written under
    ``flock``; the last FileStore object on the file to close removes it, as torch's does.

    Args:
        file_name: path of the file (created if absent).
        world_size: accepted for torch compatibility (-1: unknown).
    """

    def __init__(self, file_name, world_size=-1):
        super().__init__()
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"file_name must be a path, got {type(file_name).__name__}")
        if not isinstance(world_size, int) or (world_size < 1 and world_size != -1):
            raise ValueError(f"world_size must be a positive int or -1, got {world_size!r}")
        self.path = os.fspath(file_name)
        self.world_size = world_size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._data = {}
        self._offset = 0
        self._lock = threading.Lock()
        self._closed = False
        self._add(_REFCOUNT_KEY, 1)
        self._finalizer = weakref.finalize(self, FileStore._release, self.path, self._fd)

    # -- log ----------------------------------------------------------------------------
    def _refresh(self):
        size = os.fstat(self._fd).st_size
        if size < self._offset:  # the file was truncated: start over
            self._data.clear()
            self._offset = 0
        if size == self._offset:
            return
        buf = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while True:
            if pos + 5 > len(buf):
                break
            kind = buf[pos:pos + 1]
            klen, = struct.unpack_from("!I", buf, pos + 1)
            if kind == _REC_SET:
                if pos + 9 > len(buf):
                    break
                vlen, = struct.unpack_from("!I", buf, pos + 5)
                end = pos + 9 + klen + vlen
                if end > len(buf):
                    break
                key = buf[pos + 9:pos + 9 + klen].decode()
                self._data[key] = buf[pos + 9 + klen:end]
            elif kind == _REC_DEL:
                end = pos + 5 + klen
                if end > len(buf):
                    break
                self._data.pop(buf[pos + 5:end].decode(), None)
            else:
                raise DistStoreError(f"FileStore {self.path!r} is corrupt at byte {self._offset + pos}")
            pos = end
        self._offset += pos

    def _locked(self, exclusive):
        return _FileLock(self, exclusive)

    def _write(self, records):
        # called under the exclusive lock, after _refresh: self._offset is the end of the
        # last whole record; a torn tail (a writer killed mid-write) is cut off
        if os.fstat(self._fd).st_size != self._offset:
            os.ftruncate(self._fd, self._offset)
        blob = b"".join(records)
        os.pwrite(self._fd, blob, self._offset)
        self._offset += len(blob)

    @staticmethod
    def _set_rec(key, value):
        k = key.encode()
        return _REC_SET + struct.pack("!II", len(k), len(value)) + k + value

    @staticmethod
    def _del_rec(key):
        k = key.encode()
        return _REC_DEL + struct.pack("!I", len(k)) + k

    def _mutate(self, fn):
        with self._locked(True):
            self._refresh()
            before = dict(self._data)
            out = fn(self._data)
            recs = [self._set_rec(k, v) for k, v in self._data.items() if before.get(k) is not v]
            recs += [self._del_rec(k) for k in before if k not in self._data]
            if recs:
                self._write(recs)
            return out

    def _poll(self, keys, secs, what):
        deadline = _deadline(secs)
        pause = 0.0005
        while True:
            with self._locked(False):
                self._refresh()
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return [self._data[k] for k in keys]
            if deadline is not None and time.monotonic() >= deadline:
                raise _timeout_error(what, missing, secs)
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, 0.02)

    # -- operations ---------------------------------------------------------------------
    def _set(self, key, value):
        self._mutate(lambda d: d.__setitem__(key, value))

    def _get(self, key, secs):
        return self._poll([key], secs, "get")[0]

    def _multi_get(self, keys, secs):
        return self._poll(keys, secs, "multi_get")

    def _wait(self, keys, secs):
        self._poll(keys, secs, "wait")

    def _add(self, key, amount):
        return self._mutate(lambda d: _add(d, key, amount))

    def _compare_set(self, key, expected, desired):
        return self._mutate(lambda d: _compare_set(d, key, expected, desired))

    def _append(self, key, value):
        self._mutate(lambda d: d.__setitem__(key, d.get(key, b"") + value))

    def _multi_set(self, keys, values):
        self._mutate(lambda d: d.update(zip(keys, values)))

    def _delete(self, key):
        return self._mutate(lambda d: d.pop(key, None) is not None)

    def _check(self, keys):
        with self._locked(False):
            self._refresh()
            return all(k in self._data for k in keys)

    def _user_keys(self):
        with self._locked(False):
            self._refresh()
            return [k for k in self._data if not k.startswith("\0")]

    def _queue_push(self, key, value):
        qk = "\0queue/" + key
        self._mutate(lambda d: d.__setitem__(qk, d.get(qk, b"") + _HDR.pack(len(value)) + value))

    def _queue_pop(self, key, secs):
        qk = "\0queue/" + key

        def pop(d):
            blob = d.get(qk)
            if not blob:
                return None
            n, = _HDR.unpack_from(blob)
            d[qk] = blob[4 + n:]
            return blob[4:4 + n]

        deadline = _deadline(secs) if secs >= 0 else None
        pause = 0.0005
        while True:
            item = self._mutate(pop)
            if item is not None:
                return item
            if secs < 0:
                raise QueueEmptyError(f"queue {key!r} is empty")
            if deadline is not None and time.monotonic() >= deadline:
                raise _timeout_error("queue_pop", [key], secs)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _queue_len(self, key):
        with self._locked(False):
            self._refresh()
            blob = self._data.get("\0queue/" + key, b"")
        n = pos = 0
        while pos < len(blob):
            pos += 4 + _HDR.unpack_from(blob, pos)[0]
            n += 1
        return n

    def _num_keys(self):
        return len(self._user_keys())

    def _list_keys(self):
        return self._user_keys()

    def clone(self):
        store = FileStore(self.path, self.world_size)
        store._timeout = self._timeout
        return store

    def close(self):
        """Release the file; the last FileStore on it removes it."""
        with self._lock:  # no get/set in another thread may use the fd while it closes
            if not self._closed:
                self._closed = True
                self._finalizer()

    @staticmethod
    def _release(path, fd):
        try:
            # bounded: a finalizer run by the GC may interrupt this very thread holding the lock
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.002)
            st = os.fstat(fd)
            alive = st.st_nlink > 0
            store = _RawLog(fd)
            n = store.add(_REFCOUNT_KEY, -1)
            if n <= 0 and alive:
                try:
                    if os.stat(path).st_ino == st.st_ino:
                        os.unlink(path)
                except OSError:
                    pass
        except (OSError, DistStoreError):
            pass
        finally:
            os.close(fd)


class _FileLock:
    __slots__ = ("store", "exclusive")

    def __init__(self, store, exclusive):
        self.store = store
        self.exclusive = exclusive

    def __enter__(self):
        self.store._lock.acquire()
        if self.store._closed:
            self.store._lock.release()
            raise DistStoreError(f"FileStore {self.store.path!r} is closed")
        fcntl.flock(self.store._fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)

    def __exit__(self, *exc):
        fcntl.flock(self.store._fd, fcntl.LOCK_UN)
        self.store._lock.release()


class _RawLog:
    """The log of an fd already locked by the caller (for the finalizer)."""

    def __init__(self, fd):
        self._fd = fd
        self._data = {}
        self._offset = 0
        self.path = "<finalizer>"

    _refresh = FileStore._refresh
    _write = FileStore._write

    def add(self, key, amount):
        self._refresh()
        n = _add(self._data, key, amount)
        self._write([FileStore._set_rec(key, self._data[key])])
        return n


# ---- TCPStore: wire format --------------------------------------------------------------
#
# A frame is a u32 length then the body. Request body: u8 version, u8 op, u32 nargs,
# then nargs times (u32 length, bytes). Reply body: u8 status, u32 nargs, args.
# Numbers travel as ASCII decimal. No pickle: values are opaque bytes.

PROTOCOL_VERSION = 1
SERVER_LINGER = 30.0  # seconds a closed master keeps serving clients still connected
MAX_FRAME = 1 << 28
_HDR = struct.Struct("!I")
_REQ = struct.Struct("!BBI")
_REP = struct.Struct("!BI")

OP_SET, OP_GET, OP_ADD, OP_CAS, OP_WAIT, OP_CHECK, OP_DELETE, OP_NUM_KEYS, OP_APPEND, \
    OP_MULTI_GET, OP_MULTI_SET, OP_LIST_KEYS, OP_PING, OP_QUEUE_PUSH, OP_QUEUE_POP, \
    OP_QUEUE_LEN = range(1, 17)
ST_OK, ST_TIMEOUT, ST_ERROR, ST_REJECTED = range(4)


def _encode_args(args):
    parts = []
    for a in args:
        parts.append(_HDR.pack(len(a)))
        parts.append(a)
    return parts


def encode_request(op, args):
    body = [_REQ.pack(PROTOCOL_VERSION, op, len(args))] + _encode_args(args)
    n = sum(len(p) for p in body)
    return _HDR.pack(n) + b"".join(body)


def _encode_reply(status, args):
    body = [_REP.pack(status, len(args))] + _encode_args(args)
    n = sum(len(p) for p in body)
    return _HDR.pack(n) + b"".join(body)


def _decode_args(body, pos, nargs):
    args = []
    for _ in range(nargs):
        if pos + 4 > len(body):
            raise ValueError("argument header past the end of the frame")
        n, = _HDR.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ValueError("argument past the end of the frame")
        args.append(body[pos:pos + n])
        pos += n
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} stray bytes after the arguments")
    return args


def _decode_request(body):
    if len(body) < _REQ.size:
        raise ValueError("frame shorter than its header")
    version, op, nargs = _REQ.unpack_from(body)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if nargs > len(body):
        raise ValueError(f"{nargs} arguments cannot fit in {len(body)} bytes")
    return op, _decode_args(body, _REQ.size, nargs)


# ---- TCPStore: the server ---------------------------------------------------------------

class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "waiter", "closing", "writing")

    def __init__(self, sock):
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter = None
        self.closing = False  # close once outbuf is flushed
        self.writing = False


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

    def __init__(self, port=0, listen_fd=None):
        if listen_fd is not None:
            self._lsock = socket.socket(fileno=os.dup(listen_fd))
        elif socket.has_dualstack_ipv6():
            self._lsock = socket.create_server(("", port), family=socket.AF_INET6,
                                               dualstack_ipv6=True, backlog=1024)
        else:
            self._lsock = socket.create_server(("", port), backlog=1024)
        self._lsock.setblocking(False)
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
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                               errno.ECONNABORTED):
                    return
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn):
        if conn.sock is None:
            return
        w = conn.waiter
        if w is not None:
            self._drop_waiter(w)
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.sock = None

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
        conn.inbuf += data
        self._process(conn)

    def _process(self, conn):
        buf = conn.inbuf
        while conn.waiter is None and not conn.closing and conn.sock is not None:
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
        if want != conn.writing:
            conn.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(conn.sock, events, conn)
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


# ---- TCPStore: the client -----------------------------------------------------------------

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

    Raises:
        DistNetworkError: the server could not be reached within the timeout.
        DistStoreError: a blocking operation timed out (naming the keys).
    """

    def __init__(self, host_name, port, world_size=None, is_master=False, timeout=DEFAULT_TIMEOUT,
                 wait_for_workers=True, multi_tenant=False, master_listen_fd=None, use_libuv=True):
        super().__init__(timeout)
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
            self._server = self._start_server(port, master_listen_fd, self._multi_tenant)
            port = self._server.port
            self._server_finalizer = weakref.finalize(self, _release_server, self._server,
                                                      self._multi_tenant)
        self._port = port
        # idle connections: a thread parked in get() must not block another thread's set()
        self._idle = []
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
    def _start_server(port, listen_fd, multi_tenant):
        shared = multi_tenant and port
        if shared:
            with _SERVERS_LOCK:
                server = _SERVERS.get(port)
                if server is not None:
                    server.refs += 1
                    return server
        # Started outside the lock: Thread.start waits for the new thread, which may run
        # the cyclic GC on its first allocation, and so a finalizer of a dropped store,
        # _release_server, which takes the lock (a test once hung there for good).
        try:
            server = StoreServer(port, listen_fd)
        except OSError as e:
            if shared:  # another thread of this process may have just started it
                with _SERVERS_LOCK:
                    other = _SERVERS.get(port)
                    if other is not None:
                        other.refs += 1
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
            status, out = self._read_reply(sock)
        except (OSError, EOFError) as e:
            sock.close()  # the stream may be out of step: the next request reconnects
            if isinstance(e, socket.timeout):
                raise DistStoreError(f"TCPStore {self.host}:{self._port}: no reply within "
                                     f"{sock_timeout:g} s") from e
            raise DistNetworkError(f"TCPStore {self.host}:{self._port}: connection lost: {e}") from e
        if status == ST_REJECTED:
            sock.close()
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

    def clone(self):
        """Another client of the same server (for use from another thread)."""
        return TCPStore(self.host, self._port, None, False, self._timeout, False)

    def close(self):
        """Close this client's connection (and, on the master, stop serving once no
        master TCPStore on the server remains)."""
        with self._lock:
            self._closed = True
            _close_socks(self._idle)
        if self._server is not None:
            self._server = None
            self._server_finalizer()


class _TimedOut:
    __slots__ = ("missing",)

    def __init__(self, missing):
        self.missing = missing


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the store server closed the connection")
        buf += chunk
    return bytes(buf)


__all__ = ["Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "StoreServer", "QueueEmptyError",
           "DEFAULT_TIMEOUT", "to_seconds"]
