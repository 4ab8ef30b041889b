"""The Store base class (torch.distributed.Store's API), argument checks, and the
in-memory semantics that HashStore, FileStore and the TCP server share."""
import time
from datetime import timedelta

from ..core.args import wait_seconds
from ..core.errors import DistStoreError

DEFAULT_TIMEOUT = timedelta(seconds=300)
_INIT_KEY = "init/"  # the key torch's TCPStore counts arriving workers on


# ---- argument checks ------------------------------------------------------------------

to_seconds = wait_seconds  # a timeout (timedelta or seconds) as float seconds; 0: none


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

    _auth_key = None  # the job's key (bytes) where the store carries one: see collectives.security.auth

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
