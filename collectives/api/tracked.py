"""A group's calls run as entries of its flight recorder: the general dispatch path's runners.

:func:`run` (a blocking call that may queue behind the group's work) and :func:`submit`
(async) run a backend call as collective ``s`` of the group's recorder (:class:`Tracked`:
started, then completed or failed); :class:`TrackedRequest` is a backend's request with the
recorder's end and the profiler's span on it; :func:`p2p` records a posted isend or irecv.
The recorder itself is :mod:`collectives.diagnostics.flight_recorder`.
"""
from ..core import timeline as _timeline
from ..core.errors import DistError
from ..diagnostics import flight_recorder as _fr


class Tracked:
    """``fn`` run as collective ``s`` of ``fr``: started, then completed or failed."""

    __slots__ = ("fr", "s", "fn", "__name__")

    def __init__(self, fr, s, fn):
        self.fr, self.s, self.fn = fr, s, fn
        self.__name__ = getattr(fn, "__name__", "operation")

    def __call__(self, *args):
        fr, s = self.fr, self.s
        fr.started = s
        if _timeline.ON:
            return self._timed(args)
        try:
            self.fn(*args)
        except DistError as e:
            fr.fail(s, e)
            raise
        fr.done = s

    def _timed(self, args):
        fr, s = self.fr, self.s
        name = getattr(fr, "name", None)
        _timeline.mark("start", name, s)
        try:
            self.fn(*args)
        except DistError as e:
            fr.fail(s, e)
            raise
        finally:
            _timeline.mark("end", name, s)
        fr.done = s


def run(pg, s, fn, *args):
    """``pg.run(fn, *args)`` as collective ``s`` (a blocking call that may queue)."""
    fr = pg.fr
    try:
        pg.run(Tracked(fr, s, fn), *args)
    except DistError as e:
        fr.fail(s, e)  # a wait that ran out before the call ran (once: fail acts once)
        raise


def submit(pg, s, fn, *args):
    """``pg.submit(fn, *args)`` as collective ``s`` (async). On the base progress thread
    ``fn`` runs tracked; a backend with a submit of its own (mpi posts its non-blocking
    collectives at once, nccl enqueues on its stream) gets ``fn`` itself, and the request
    says when it is done."""
    if getattr(type(pg.backend), "submit", None) is _base_submit():
        return pg.submit(Tracked(pg.fr, s, fn), *args)
    fr = pg.fr
    if fr.started < s:
        fr.started = s
    return TrackedRequest(pg.submit(fn, *args), _fr.CollectiveEnd(fr, s))


def _base_submit():
    from ..backends.base import Backend
    return Backend.submit


class TrackedRequest:
    """A backend's request with the front end's hooks on its end: the flight recorder's
    (``end``: a collective's ``flight_recorder.CollectiveEnd`` or a point-to-point entry's
    ``flight_recorder.P2PEnd``) and the profiler's span (``span``, closed on the thread whose
    wait or test first finds the request done, before it goes on to its next op). A Work
    holds one of these over the backend's own request; nothing else wraps it."""

    __slots__ = ("_req", "_end", "_span")

    def __init__(self, req, end=None, span=None):
        self._req, self._end, self._span = req, end, span

    def _close_span(self):
        span, self._span = self._span, None
        if span is not None:
            span.close()

    def wait(self, timeout=None):
        req, end = self._req, self._end
        try:
            req.wait(timeout)
        except DistError as e:
            if end is not None:
                end.failed(req, e)
            raise
        finally:
            if self._span is not None and req.test():
                self._close_span()
        if end is not None:
            end.completed()

    def test(self):
        done = self._req.test()
        if done:
            if self._end is not None:
                self._end.tested(self._req)
            self._close_span()
        return done

    def __getattr__(self, name):  # exception, source and the backend's extras (nbytes, ...)
        return getattr(self._req, name)


def p2p(pg, kind, req, peer, tag, buf, span=None):
    """``req`` (a posted isend/irecv) recorded on ``pg``'s recorder (and ``span``, the
    profiler's, closed when it is found done)."""
    fr = pg.fr
    return TrackedRequest(req, _fr.P2PEnd(fr.issue_p2p(kind, peer, tag, buf), fr), span)


__all__ = ["Tracked", "TrackedRequest", "run", "submit", "p2p"]
