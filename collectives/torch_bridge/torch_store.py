"""Stores across the bridge (needs torch): torch's store as a collectives Store (the
rendezvous of a program that called ``torch.distributed.init_process_group("collectives")``),
and ours as torch's (the store of torch's default group when ``dist.init_process_group``
installs it)."""
from datetime import timedelta

import torch.distributed as td

from ..core.errors import DistStoreError
from ..store import Store


class FromTorchStore(Store):
    """A torch.distributed Store seen through collectives' Store API (the rendezvous of a
    program that called ``torch.distributed.init_process_group("collectives")``)."""

    def __init__(self, store, timeout):
        super().__init__(timeout)
        self._store = store

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except td.DistStoreError as e:
            raise DistStoreError(str(e)) from e

    def _set(self, key, value):
        self._call(self._store.set, key, value)

    def _get(self, key, secs):
        self._wait([key], secs)
        return self._call(self._store.get, key)

    def _add(self, key, amount):
        return self._call(self._store.add, key, amount)

    def _compare_set(self, key, expected, desired):
        return self._call(self._store.compare_set, key, expected, desired)

    def _wait(self, keys, secs):
        self._call(self._store.wait, keys, timedelta(seconds=secs))

    def _check(self, keys):
        return self._call(self._store.check, keys)

    def _delete(self, key):
        return self._call(self._store.delete_key, key)

    def _num_keys(self):
        return self._call(self._store.num_keys)

    def _append(self, key, value):
        self._call(self._store.append, key, value)

    def _multi_get(self, keys, secs):
        self._wait(keys, secs)
        return self._call(self._store.multi_get, keys)

    def _multi_set(self, keys, values):
        self._call(self._store.multi_set, keys, values)


class ToTorchStore(td.Store):
    """A collectives Store seen as a torch.distributed Store: what torch's default group
    holds when ``dist.init_process_group`` installs it, so that groups of torch's own
    backends (``torch.distributed.new_group(backend="gloo")``, which meet through the
    default group's store) meet through the job's rendezvous."""

    def __init__(self, store):
        super().__init__()
        self._store = store

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key):
        return self._store.get(key)

    def add(self, key, amount):
        return self._store.add(key, amount)

    def compare_set(self, key, expected_value, desired_value):
        return self._store.compare_set(key, expected_value, desired_value)

    def wait(self, keys, timeout=None):
        self._store.wait(keys, timeout)

    def check(self, keys):
        return self._store.check(keys)

    def delete_key(self, key):
        return self._store.delete_key(key)

    def num_keys(self):
        return self._store.num_keys()

    def append(self, key, value):
        self._store.append(key, value)

    def multi_get(self, keys):
        return self._store.multi_get(keys)

    def multi_set(self, keys, values):
        self._store.multi_set(keys, values)

    def clone(self):  # torch's C++ side calls these three by their C++ names
        return self  # (one object, kept alive by the group that holds it; ours is thread-safe)

    def getNumKeys(self):  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key):  # noqa: N802
        return self.delete_key(key)
