# A group's dispatcher (collectives.api.group_dispatcher makes one per group), included by _core.pyx
# beside the recorder's ring it writes. collectives.api.group_dispatcher._PyDispatcher is the same in
# Python (the package without its extensions), as work._PyCounter is Counter.


cdef class Counter:
    """One count that C code reads without a Python attribute lookup: a backend's calls
    queued and not yet finished (``Backend.pending``), the threads issuing calls with their
    own timeout (``work.timed``)."""

    cdef public Py_ssize_t n


cdef class ProfilerTap:
    """Where the dispatchers read torch's profiler flag: ``module`` is torch's profiler
    module once torch is imported, else None. ``collectives.core.profiling.bind`` keeps it
    current (``tap["_prof"] = module``, as it does a module's globals)."""

    cdef public object module
    cdef object _off

    def __init__(self, off):
        self._off = off

    def __setitem__(self, key, value):
        self.module = None if value is self._off else value


cdef class Dispatcher:
    """One group's path for every collective and point-to-point call: ``call(kind, buf,
    root, op, fn, args, async_op, outputs, timeout)`` runs ``fn(*args)`` as collective
    ``kind``, recorded in the group's flight recorder with ``buf``'s count and dtype (None:
    none), ``root`` (a group rank, -1: none) and ``op`` (a reduce-op code, -1: none).

    The cheap path is taken here, in C: a blocking call, on a backend that runs blocking
    calls in the caller's thread (``inline``, fixed when the group is made), with nothing
    queued (``backend.pending``), no per-call timeout and no profiler running. It issues the
    call in the ring, marks it started, runs it, and marks it done (or has the recorder
    record the DistError, then re-raises). Every other call goes to ``general``
    (Python: the queue, the profiler's span, the call's own timeout, async_op).
    """

    cdef readonly CallRing fr
    cdef readonly object pg
    cdef readonly object backend
    cdef readonly bint inline
    cdef Counter _pending
    cdef Counter _timed
    cdef ProfilerTap _prof
    cdef object _general
    cdef object _error
    cdef object _track
    cdef object _general_post
    cdef object _of_global  # the group's global -> group rank dict (fixed), or None

    def __init__(self, pg, CallRing fr not None, backend, bint inline, Counter pending not None,
                 general, Counter timed not None, ProfilerTap prof not None, error, track,
                 general_post):
        self.pg, self.fr, self.backend, self.inline = pg, fr, backend, inline
        self._pending, self._timed, self._prof = pending, timed, prof
        self._general, self._error = general, error
        self._track, self._general_post = track, general_post
        of_global = getattr(pg, "group_of_global", None)
        self._of_global = of_global if type(of_global) is dict else None

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def root(self, arg, group_arg, name):
        """The group rank a collective's root argument names: ``arg`` (a global rank) or
        ``group_arg`` (a group rank), rank 0 where neither is given. The common case, a
        global rank of the group, is one dict lookup here; every other is the group's
        ``peer(arg, group_arg, name, default=0)`` (which checks and raises)."""
        if type(arg) is int and group_arg is None:
            if self._of_global is not None:
                r = (<dict>self._of_global).get(arg)
            else:
                r = self.pg.group_of_global.get(arg)
            if r is not None:
                return r
        return self.pg.peer(arg, group_arg, name, default=0)

    def post(self, kind, fn, buf, peer, tag):
        """Post ``fn(buf, peer, tag)`` (the backend's isend or irecv) as point-to-point
        call ``kind``; its request, recorded by ``track`` (the flight recorder's), or by
        ``general_post`` while torch's profiler runs (then in a span too)."""
        tap = self._prof.module
        if tap is not None and tap._is_profiler_enabled:
            return self._general_post(self.pg, kind, fn, buf, peer, tag)
        return self._track(self.pg, kind, fn(buf, peer, tag), peer, tag, buf)

    @cython.binding(False)  # a method descriptor: the interpreter's specialised call
    def call(self, kind, _CBuffer buf, int root, int op, fn, tuple args, bint async_op=False,
             outputs=(), timeout=None):
        """Run ``fn(*args)`` as collective ``kind``; a Work when ``async_op``, else None."""
        cdef long long s
        cdef CallRing fr = self.fr
        tap = self._prof.module
        if (async_op or timeout is not None or not self.inline or self._pending.n
                or self._timed.n or (tap is not None and tap._is_profiler_enabled)):
            return self._general(self.pg, kind, buf, root, op, fn, args, async_op, outputs,
                                 timeout)
        if buf is None:
            s = fr._put(kind, 0, -1, root, op)
        else:
            s = fr._put(kind, buf.count, buf.dtype, root, op)
        fr.started = s
        try:
            fn(*args)
        except self._error as e:
            fr.fail(s, e)
            raise
        fr.done = s
        return None
