"""Work: the handle of an asynchronous operation (``async_op=True``, isend, irecv)."""
import concurrent.futures
import datetime
import threading

from .args import timeout_seconds
from .errors import DistError


_UNSET = datetime.timedelta(milliseconds=-1)  # torch's "unset" timeout of an options struct


def option_timeout(timeout, name):
    """Seconds from an options struct's ``timeout``, or None where it is torch's "unset"
    value (-1 ms: the group's timeout applies). ValueError/TypeError naming ``name``
    for anything else that is not a positive duration."""
    if timeout == _UNSET:
        return None
    return timeout_seconds(timeout, name, positive=True)


class _PerCall(threading.local):
    secs = None


_per_call = _PerCall()


class _PyCounter:
    """``collectives.engines._core.Counter`` in Python: one count (``n``)."""

    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


try:
    from ..engines._core import Counter
except ImportError:  # extensions not built (or hidden)
    Counter = _PyCounter

#: ``timed.n``: how many threads are issuing calls with their own timeout now. The groups'
#: dispatchers take their cheap path (which skips the per-call check) only while it is 0.
timed = Counter()
_timed_lock = threading.Lock()


def call_timeout():
    """The timeout (seconds) of the call the calling thread is issuing, or None."""
    return _per_call.secs


class per_call_timeout:  # noqa: N801  (a context manager, used like a function)
    """``with per_call_timeout(secs):`` the collectives this thread issues inside take
    ``secs`` as their own timeout instead of their group's (torch's per-call timeouts:
    ``opts.timeout`` of a process group's methods). ``secs`` None changes nothing."""

    __slots__ = ("secs", "prev")

    def __init__(self, secs):
        self.secs = secs

    def __enter__(self):
        if self.secs is not None:
            self.prev = _per_call.secs
            _per_call.secs = self.secs
            with _timed_lock:
                timed.n += 1

    def __exit__(self, *exc):
        if self.secs is not None:
            _per_call.secs = self.prev
            with _timed_lock:
                timed.n -= 1


class Future(concurrent.futures.Future):
    """A concurrent.futures.Future that torch-style code can also ``wait()``/``then()``/``value()``."""

    def wait(self, timeout=None):
        """The result (blocks until done)."""
        return self.result(timeout)

    def value(self):
        return self.result()

    def then(self, callback):
        """A Future holding ``callback(self)``, run once this one is done."""
        nxt = Future()

        def chain(_):
            try:
                nxt.set_result(callback(self))
            except BaseException as e:  # handed to whoever waits on nxt
                nxt.set_exception(e)

        self.add_done_callback(chain)
        return nxt


class _WorkFuture(Future):
    """Settled from its Work when someone looks (or a watcher thread, for callbacks)."""

    def __init__(self, work):
        super().__init__()
        self._work = work
        self._lock = threading.Lock()
        self._watching = False

    def _settle(self, timeout=None):
        if super().done():
            return
        try:
            self._work.wait(timeout)
        except DistError as e:
            if not self._work.is_completed():  # only our wait ran out: leave it pending
                raise concurrent.futures.TimeoutError(str(e)) from None
            self._set(exc=e)
        else:
            self._set(value=self._work.result())

    def _set(self, value=None, exc=None):
        with self._lock:
            if super().done():
                return
            if exc is not None:
                self.set_exception(exc)
            else:
                self.set_result(value)

    def done(self):
        if not super().done() and self._work.is_completed():
            self._settle()
        return super().done()

    def result(self, timeout=None):
        self._settle(timeout)
        return super().result(0)

    def exception(self, timeout=None):
        self._settle(timeout)
        return super().exception(0)

    def add_done_callback(self, fn):
        if not self.done():
            with self._lock:
                start = not self._watching
                self._watching = True
            if start:
                threading.Thread(target=self._watch, daemon=True, name="collectives-future").start()
        super().add_done_callback(fn)

    def _watch(self):
        try:
            self._settle()
        except concurrent.futures.TimeoutError as e:
            self._set(exc=DistError(str(e)))


class Work:
    """An operation in flight, as torch's ``Work``.

    ``wait()`` raises the operation's DistError, if any; ``result()`` is the list of
    output tensors; ``source_rank()`` is the sender's global rank for a receive.
    """

    __slots__ = ("_req", "_outputs", "_group", "_future")

    def __init__(self, req, outputs, group=None):
        self._req = req
        self._outputs = outputs
        self._group = group
        self._future = None

    def wait(self, timeout=None):
        """Block until done (at most ``timeout``: timedelta or seconds). Returns True."""
        self._req.wait(timeout_seconds(timeout))
        return True

    def synchronize(self):
        self._req.wait()

    def is_completed(self):
        return self._req.test()

    def is_success(self):
        """True when finished without an error."""
        return self._req.test() and self._req.exception() is None

    def exception(self):
        return self._req.exception()

    def result(self):
        """The output tensors (a list)."""
        return list(self._outputs)

    def source_rank(self):
        """The global rank of the sender of a finished receive."""
        src = self._req.source
        if src < 0:
            raise ValueError("source_rank() is only defined for a finished receive")
        return self._group.ranks[src] if self._group is not None else src

    def _source_rank(self):
        """The sender's rank in the group (torch's ``recv`` from any source asks this)."""
        src = self._req.source
        if src < 0:
            raise ValueError("_source_rank() is only defined for a finished receive")
        return src

    def get_future(self):
        """A Future whose result is the output tensors (``.wait()``, ``.then()`` work too)."""
        if self._future is None:
            self._future = _WorkFuture(self)
        return self._future

    def __repr__(self):
        state = "done" if self._req.test() else "pending"
        return f"<collectives.Work {state}>"


__all__ = ["Work", "Future", "timeout_seconds"]
