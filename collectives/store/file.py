"""FileStore: an append-only log of records in a file every rank can open."""
import contextlib
import fcntl
import os
import struct
import threading
import time
import weakref

from ..core.errors import DistStoreError
from .base import QueueEmptyError, Store, _add, _compare_set, _deadline, _timeout_error
from .wire import _HDR

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

    @contextlib.contextmanager
    def _locked(self, exclusive):
        """This store's thread lock, then the file's (flock: exclusive or shared)."""
        with self._lock:
            if self._closed:
                raise DistStoreError(f"FileStore {self.path!r} is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

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
