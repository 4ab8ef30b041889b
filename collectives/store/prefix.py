"""PrefixStore: a namespace inside another store."""
from .base import Store


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
