"""The Backend interface (the seed design's DataChannel) and the request objects.

A backend works on :class:`collectives.core.tensors.Buffer` objects and group ranks
(0..size-1); it never sees a torch tensor or a global rank. The front end
validates every argument before calling it, so a backend may assume:

* all buffers of one call share a dtype and are host memory (or CUDA memory
  for a CUDA backend);
* ``op`` is one of SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR and is valid for the
  dtype (the front end turns AVG and PREMUL_SUM into SUM plus a scale);
* ranks, roots and counts are in range and consistent on this rank.

Collectives are blocking and are called in issue order. ``submit`` runs one on
the backend's progress thread (``async_op=True``); the base class provides a
progress thread that runs submitted calls in issue order, and a backend with
native non-blocking operations may override ``submit``. Point-to-point
``isend``/``irecv`` return a :class:`Request` and must not deadlock against a
matching operation issued later on this rank (post them, don't run them).

Every wait is bounded by ``timeout``; a failure raises a DistError naming the
operation and the peer.

A factory that finds its own rank and size (mpi under mpiexec) carries a
``world_rank_size()`` attribute returning ``(rank, size)``; the front end then
needs no init_method and passes ``store=None`` for the world group.
"""
import collections
import threading
from _thread import allocate_lock as _allocate_lock

from .. import config
from ..core.errors import DistBackendError, DistError
from ..core.sched import short_slice
from ..core.work import Counter


# ---- a hook the diagnostics layer (above the backends) fills in --------------------------
_dump_hook = None


def set_dump_hook(fn):
    """Register ``fn(reason)``, which writes this rank's flight recorder out and returns the
    path written (None where it failed): collectives.diagnostics.flight_recorder registers its ``dump`` at
    import, so that a backend reaches it without importing a layer above its own."""
    global _dump_hook
    _dump_hook = fn


def dump_recorder(reason):
    """This rank's flight recorder written out, for a backend about to end the job (the mpi
    watchdog): the path, or None where nothing is registered or the dump failed."""
    return None if _dump_hook is None else _dump_hook(reason=reason)


def timed_out(describe, timeout):
    """The DistBackendError of a wait on ``describe`` that ran past ``timeout`` seconds
    (in torch gloo's words, "Timed out waiting <n>ms", which torch's own tests match)."""
    return DistBackendError(f"{describe} did not finish: Timed out waiting "
                            f"{float(timeout) * 1000:.0f}ms")


class Request:
    """An operation in flight. ``wait`` raises the operation's DistError, if any.

    A subclass keeps its failure in ``_exc`` and a receive's sender in ``_source``; the
    two accessors below read them."""

    _exc = None
    _source = -1

    def wait(self, timeout=None):
        raise NotImplementedError

    def test(self):
        """True when the operation has finished (successfully or not)."""
        raise NotImplementedError

    def exception(self):
        """The exception the operation failed with, or None."""
        return self._exc

    @property
    def source(self):
        """For a receive: the group rank of the sender; -1 otherwise."""
        return self._source


class DoneRequest(Request):
    """A request that finished at creation."""

    def __init__(self, source=-1, exc=None):
        self._source = source
        self._exc = exc

    def wait(self, timeout=None):
        if self._exc is not None:
            raise self._exc

    def test(self):
        return True


_CALLBACKS_LOCK = threading.Lock()


class _Flag:
    """``threading.Event``'s ``is_set``/``set``/``wait`` on one raw lock, held until the
    flag is set: a request makes and sets one for every message, and this costs a fifth
    of an Event (measured 0.5-0.9 us against 4.4 us to make, set and test one). ``set``
    must not run twice at once: FutureRequest calls it under ``_CALLBACKS_LOCK``."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = _allocate_lock()
        self._lock.acquire()
        self._set = False

    def is_set(self):
        return self._set

    def set(self):
        if not self._set:
            self._set = True
            self._lock.release()

    def wait(self, timeout=None):
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(timeout, 0)):
            self._lock.release()  # (the next waiter, if any, takes it in turn)
            return True
        return self._set


class FutureRequest(Request):
    """A request completed by another thread with ``set_result``/``set_exception``."""

    def __init__(self, describe="operation", default_timeout=None):
        self._event = _Flag()
        self._exc = None
        self._source = -1
        self._describe = describe
        self._default_timeout = default_timeout
        self._callbacks = None

    def set_result(self, source=-1):
        self._source = source
        self._finish()

    def set_exception(self, exc):
        self._exc = exc
        self._finish()

    def _finish(self):
        with _CALLBACKS_LOCK:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def add_done_callback(self, fn):
        """Call ``fn(self)`` once done: in the completing thread, or now if done already."""
        with _CALLBACKS_LOCK:
            if not self._event.is_set():
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn(self)

    def wait(self, timeout=None):
        if timeout is None:
            timeout = self._default_timeout
        left = timeout if self._event.is_set() else self._progress(timeout)
        if not self._event.wait(left):
            raise timed_out(self.describe(), timeout)
        if self._exc is not None:
            raise self._exc

    def _progress(self, timeout):
        """Work toward this request's completion in the waiting thread before it blocks;
        returns what is left of ``timeout`` (None: no limit). Here: nothing to do."""
        return timeout

    def describe(self):
        """What this request is, for its errors ("... irecv from rank 1 (tag 0)")."""
        return self._describe

    def test(self):
        return self._event.is_set()


class Backend:
    """Base class of every backend. Subclasses implement the collectives below.

    Args:
        store: a Store shared by the group's ranks (already prefixed for this group).
        rank: this process's rank in the group.
        size: the group's size.
        timeout: seconds any single wait may take before raising DistBackendError.
        options: backend-specific options (``pg_options``), or None.

    Example:
        >>> class MyBackend(Backend):
        ...     def all_reduce(self, buf, op): ...
        >>> collectives.backends.register_backend("mine", MyBackend)
    """

    name = "base"
    #: whether buffers may live in CUDA memory (only such backends are given CUDA tensors)
    takes_cuda = False
    #: whether all_gather takes an input that is this rank's own block of its output, and
    #: reduce_scatter an output that is this rank's block of its input (torch's in-place
    #: forms, e.g. ``all_gather_into_tensor(out, out.chunk(size)[rank])``); where not, the
    #: front end hands the backend a copy of the input
    own_block_in_place = False
    #: whether the backend has ``all_gather_list(outs, inp)``: all_gather into one Buffer per
    #: rank (torch's list form) without a staging copy; where not, the front end stages
    gathers_into_list = False
    #: the largest tag isend/irecv take (the front end's internal messages stay within it)
    max_tag = 2**31 - 1

    def __init__(self, store, rank, size, timeout, options=None):
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.options = options
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._thread = None
        self._closed = False
        #: ``pending.n``: calls submitted to the base progress thread and not yet finished.
        #: While it is 0 a blocking call may run in the caller's thread: the front end's
        #: cheap path reads it (in C) on every call of a backend whose ``run`` is this class's
        self.pending = Counter()

    # ---- collectives (blocking) --------------------------------------------
    def broadcast(self, buf, root):
        raise NotImplementedError(f"{self.name} does not implement broadcast")

    def all_reduce(self, buf, op):
        raise NotImplementedError(f"{self.name} does not implement all_reduce")

    def reduce(self, buf, op, root):
        """Reduce into ``buf`` on ``root``; the other ranks' ``buf`` stays unchanged."""
        raise NotImplementedError(f"{self.name} does not implement reduce")

    def all_gather(self, out, inp):
        """``out`` holds size * inp.count elements, rank r's at [r*n, (r+1)*n)."""
        raise NotImplementedError(f"{self.name} does not implement all_gather")

    def gather(self, out, inp, root):
        """Like all_gather, into ``out`` on root only (``out`` is None elsewhere)."""
        raise NotImplementedError(f"{self.name} does not implement gather")

    def scatter(self, out, inp, root):
        """Root's ``inp`` holds size * out.count elements; rank r gets slice r (``inp`` None elsewhere)."""
        raise NotImplementedError(f"{self.name} does not implement scatter")

    def reduce_scatter(self, out, inp, op):
        """``inp`` holds size * out.count elements; rank r gets the reduction of slice r."""
        raise NotImplementedError(f"{self.name} does not implement reduce_scatter")

    def all_to_all(self, out, inp, out_counts, in_counts):
        """Send inp's consecutive slices of in_counts[r] elements to rank r; receive
        out_counts[r] elements from rank r into out's consecutive slices."""
        raise NotImplementedError(f"{self.name} does not implement all_to_all")

    def barrier(self):
        raise NotImplementedError(f"{self.name} does not implement barrier")

    # ---- point to point (non-blocking, return a Request) ----------------------
    def isend(self, buf, dst, tag=0):
        raise NotImplementedError(f"{self.name} does not implement isend")

    def irecv(self, buf, src, tag=0):
        """``src`` None receives from any rank; the Request's ``source`` names the sender."""
        raise NotImplementedError(f"{self.name} does not implement irecv")

    # ---- groups ---------------------------------------------------------------------
    def set_timeout(self, timeout):
        """Bound this backend's later calls by ``timeout`` seconds (calls already issued
        keep theirs). Subclasses whose transports hold a timeout of their own pass it on."""
        self.timeout = timeout

    def split(self, ranks, timeout, options=None):
        """Make the backend of a subgroup from this (parent) backend.

        Called on *every* rank of this group, members of ``ranks`` or not, in the same
        order, when the front end's ``new_group`` asks for this backend's kind.
        ``ranks`` are ranks of this group, sorted. Returns the subgroup's Backend on
        members and None elsewhere, or NotImplemented to let the front end call the
        factory with a prefixed store instead (the default).
        """
        return NotImplemented

    # ---- ordering and async ------------------------------------------------------
    def submit(self, fn, *args):
        """Run ``fn(*args)`` on the progress thread after every earlier submission."""
        req = FutureRequest(f"{self.name} {getattr(fn, '__name__', 'operation')}", self.timeout)
        # the progress thread's slice, read here so that a bad value raises in the caller
        slice_us = config.get("COLLECTIVES_PROGRESS_SLICE_US") if self._thread is None else None
        with self._cv:
            if self._closed:
                raise DistBackendError(f"{self.name} backend is shut down")
            self._queue.append((fn, args, req))
            self.pending.n += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._progress, args=(slice_us,),
                                                daemon=True,
                                                name=f"collectives-{self.name}-progress")
                self._thread.start()
            self._cv.notify()
        return req

    def run(self, fn, *args):
        """Run a blocking collective in issue order: in this thread when nothing is
        queued (the fast path), else behind the queued work on the progress thread."""
        if self.pending.n:
            # the base queue, even where a subclass overrides submit: pending counts only its items
            req = Backend.submit(self, fn, *args)
            try:
                req.wait()
            except DistError:
                self._withdraw(req)
                raise
            return None
        return fn(*args)

    def _withdraw(self, req):
        """A blocking call that gave up while still queued must not run later behind the caller."""
        with self._cv:
            for item in self._queue:
                if item[2] is req:
                    self._queue.remove(item)
                    self.pending.n -= 1
                    return

    def _take_queued(self):
        """The next submitted call, (fn, args, req), or None once shut down and drained."""
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            return self._queue.popleft() if self._queue else None

    def _progress(self, slice_us=None):
        short_slice(slice_us or 0)  # woken by a post or a peer, run at once (core/sched.py)
        while True:
            item = self._take_queued()
            if item is None:
                return
            fn, args, req = item
            try:
                fn(*args)
            except DistError as e:
                req.set_exception(e)
            except BaseException as e:  # a bug inside a backend: report it on wait, keep the thread
                what = getattr(fn, "__name__", "operation")
                req.set_exception(DistBackendError(f"{self.name} {what} failed: {e!r}"))
            else:
                req.set_result()
            finally:
                with self._cv:
                    self.pending.n -= 1

    def interrupt(self):
        """Make running and queued work fail now, talking to no peer; ``shutdown`` still
        follows. Backends that cannot interrupt their work leave this empty."""

    def abort(self):
        """Fail queued and running work now, then shut down (``shrink_group``'s
        ``SHRINK_ABORT``)."""
        self.interrupt()
        self.shutdown()

    def shutdown(self):
        """Finish queued work, stop the progress thread and release resources."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(self.timeout)
