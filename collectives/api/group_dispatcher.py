"""Each group's dispatcher: the one path from a collective's plan to its backend.

A front-end function checks its arguments and plans the call (the buffers, the backend
method, the steps around it); then ``pg.dispatch.call(kind, buf, root, op, fn, args,
async_op, outputs, timeout)`` runs ``fn(*args)`` as collective ``kind`` of group ``pg``
(``buf``, the call's Buffer, gives the recorder its dtype and count). This is the only
place where a call is recorded by the flight recorder, timed by the profiler, bounded by
its own timeout, queued behind the group's async work or submitted to it:

- the cheap path (blocking, nothing queued, a backend whose ``run`` is the base one, no
  profiler, no per-call timeout) is :class:`collectives.engines._core.Dispatcher`, in C: record,
  run in the calling thread, complete (``_PyDispatcher`` without the extensions);
- :func:`general` everything else, with the recorder's and the profiler's hooks around the
  one callable.

Point to point takes the same path: ``pg.dispatch.post(kind, fn, buf, peer, tag)`` posts
the backend's isend or irecv and records it (:func:`collectives.api.tracked.p2p`), in
the profiler's span while it runs (:func:`general_post`); :func:`post_batch` posts
``batch_isend_irecv``'s ops as one where the backend can.

Whether a group can take the cheap path at all (``inline``) is fixed when the group is
made (:func:`for_group`); the profiler's and the per-call timeouts' switches are one test
each per call, as torch's own "fast python check" of its profiler flag.
"""
from ..diagnostics import flight_recorder as _flight
from . import tracked as _tracked
from ..core import profiling as _profiling
from ..core import timeline as _timeline
from ..backends.base import Backend
from ..core.errors import DistError
from ..core.work import Counter, Work, call_timeout, timed

try:
    from ..engines._core import Counter as _CCounter, Dispatcher as _Dispatcher, ProfilerTap
except ImportError:  # extensions not built (or hidden)
    _CCounter = _Dispatcher = None
    _tap = None
else:
    _tap = ProfilerTap(_profiling._Off)  # the C dispatchers' view of the flag
    _profiling.bind(_tap)
_state = {}  # "_prof": torch's profiler module once torch is imported (profiling.bind)
_profiling.bind(_state)


class _WithTimeout:
    """``fn(*args)`` with the backend's timeout set to ``secs`` while it runs (and back after):
    a call's own timeout, as torch's ``barrier(timeout=...)`` and options' ``timeout``. It
    runs in issue order with the group's other calls, so none of them sees ``secs``;
    point-to-point waits that begin meanwhile do."""

    __slots__ = ("be", "secs", "fn", "__name__")

    def __init__(self, be, secs, fn):
        self.be, self.secs, self.fn = be, secs, fn
        self.__name__ = getattr(fn, "__name__", "operation")

    def __call__(self, *args):
        be = self.be
        old = be.timeout
        be.set_timeout(self.secs)
        try:
            return self.fn(*args)
        finally:
            try:
                be.set_timeout(old)
            except DistError:  # shut down meanwhile: no later call to bound
                pass


def _issue(fr, kind, buf, root, op):
    """Record collective ``kind`` in ``fr`` (``buf``: its count and dtype; None: none)."""
    if buf is None:
        return fr.issue(kind, 0, -1, root, op)
    return fr.issue_buffer(kind, buf, root, op)


def general(pg, kind, buf, root, op, fn, args, async_op, outputs, timeout):
    """``fn(*args)`` as collective ``kind`` of ``pg`` by the general path: under the call's
    own timeout (``timeout`` seconds, or the calling thread's per-call one), in the
    profiler's span while it runs, queued behind the group's work or submitted to it for
    ``async_op`` (then a Work over ``outputs``)."""
    if timeout is None and timed.n:  # some thread issues calls with their own timeout
        timeout = call_timeout()
    if timeout is not None:
        fn = _WithTimeout(pg.backend, timeout, fn)
    s = _issue(pg.fr, kind, buf, root, op)
    if _state["_prof"]._is_profiler_enabled:
        if not async_op:
            return _profiling.run(pg, kind, _tracked.Tracked(pg.fr, s, fn), args)
        fn, args = _profiling.Recorded(pg, kind, fn, args), ()
    if async_op:
        if _timeline.ON:
            _timeline.mark("post", pg.fr.name, s, 0 if buf is None else buf.nbytes)
            req = _tracked.submit(pg, s, fn, *args)
            _timeline.KEYS[id(req)] = (pg.fr.name, s)
            return Work(req, list(outputs), pg)
        return Work(_tracked.submit(pg, s, fn, *args), list(outputs), pg)
    _tracked.run(pg, s, fn, *args)
    return None


def general_post(pg, kind, fn, buf, peer, tag):
    """``fn(buf, peer, tag)`` (the backend's isend or irecv) as point-to-point call
    ``kind`` of ``pg`` while torch's profiler runs: one span under torch gloo's name
    (send, recv, recvAnySource), opened first and closed by the request's wait or test
    (on the waiting thread for a blocking send/recv), and the flight recorder's entry."""
    name = kind[1:] if kind[0] == "i" else kind
    if name == "recv" and peer is None:
        name = "recvAnySource"
    req, span = _profiling.issue(pg, name, kind[0] == "i", fn, buf, peer, tag)
    return _tracked.p2p(pg, kind, req, peer, tag, buf, span)


def post_batch(pg, batch):
    """The requests of ``batch`` ([(send?, buf, peer, tag)]) posted as one by the backend
    (``batch_p2p``: one NCCL group, where a ring of isend/irecv cannot deadlock), each
    recorded as an isend or irecv; None where the backend has no batch or the profiler
    runs (then each is posted on its own, in its span)."""
    post = getattr(pg.backend, "batch_p2p", None)
    if post is None or _state["_prof"]._is_profiler_enabled:
        return None
    return [_tracked.p2p(pg, "isend" if send else "irecv", req, peer, tag, buf)
            for req, (send, buf, peer, tag) in zip(post(batch), batch)]


class _PyDispatcher:
    """``collectives.engines._core.Dispatcher`` in Python (the package without its extensions)."""

    __slots__ = ("pg", "fr", "backend", "inline", "_pending")

    def __init__(self, pg, fr, backend, inline, pending):
        self.pg, self.fr, self.backend, self.inline, self._pending = pg, fr, backend, inline, pending

    def call(self, kind, buf, root, op, fn, args, async_op=False, outputs=(), timeout=None):
        if (async_op or timeout is not None or not self.inline or self._pending.n or timed.n
                or _state["_prof"]._is_profiler_enabled):
            return general(self.pg, kind, buf, root, op, fn, args, async_op, outputs, timeout)
        fr = self.fr
        _tracked.Tracked(fr, _issue(fr, kind, buf, root, op), fn)(*args)
        return None

    def root(self, arg, group_arg, name):
        if type(arg) is int and group_arg is None:
            r = self.pg.group_of_global.get(arg)
            if r is not None:
                return r
        return self.pg.peer(arg, group_arg, name, default=0)

    def post(self, kind, fn, buf, peer, tag):
        if _state["_prof"]._is_profiler_enabled:
            return general_post(self.pg, kind, fn, buf, peer, tag)
        return _tracked.p2p(self.pg, kind, fn(buf, peer, tag), peer, tag, buf)


def for_group(pg):
    """The dispatcher of a new group ``pg`` (its recorder ``pg.fr`` made already). The
    cheap path is open to it when its backend runs blocking calls with the base
    ``Backend.run`` (in the caller's thread while nothing is queued)."""
    be = pg.backend
    pending = getattr(be, "pending", None)
    inline = getattr(type(be), "run", None) is Backend.run and pending is not None
    if pending is None:
        pending = Counter()  # never counts: such a backend runs every call through pg.run
    if _Dispatcher is not None and isinstance(pg.fr, _flight.CallRing) \
            and _flight.CallRing is not _flight._PyCallRing and isinstance(pending, _CCounter):
        return _Dispatcher(pg, pg.fr, be, inline, pending, general, timed, _tap, DistError,
                           _tracked.p2p, general_post)
    return _PyDispatcher(pg, pg.fr, be, inline, pending)


__all__ = ["for_group", "general", "general_post", "post_batch"]
