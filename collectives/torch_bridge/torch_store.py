"""torch's store as a collectives Store: the rendezvous of a program that called
``torch.distributed.init_process_group("collectives")`` (needs torch)."""
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

