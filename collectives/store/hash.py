"""HashStore: a store in one process's memory."""
import collections
import threading
import time

from .base import QueueEmptyError, Store, _add, _compare_set, _deadline, _timeout_error


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
