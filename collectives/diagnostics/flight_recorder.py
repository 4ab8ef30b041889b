"""The flight recorder: each group's last calls, dumped per rank when something goes wrong.

Every process group keeps a :class:`Recorder`: a preallocated ring of its last N
collectives (sequence number, front-end name, element count, dtype, root, reduce op, the
time it was issued, and the Python stack where asked), a smaller ring of its
point-to-point calls, and three counters: the last collective issued, started and
completed. The groups' calls complete in issue order, so one counter says which entries
are done; recording a call is one method call that stores it into the ring (C arrays,
collectives.engines._core.CallRing) and a few integer stores.

A rank's recorders are written to one JSON file (:func:`dump`): when one of its calls
fails (a timeout, a lost peer, calls that do not match), when another rank's call failed
(through the store), on SIGUSR1, and on demand (``collectives.dump_flight_recorder``).
``collectives-trace`` (:mod:`collectives.diagnostics.trace`) reads a job's files and says where the
ranks parted.

A daemon thread per process posts each group's progress (last collective issued and
completed, and what they were) to the job's store when it changes, and a heartbeat every
few seconds; a rank whose collective times out reads the others' posts, so its error
names the ranks that never joined the call and where each one is.

Settings (read once, at import): ``TORCH_FR_BUFFER_SIZE`` else
``COLLECTIVES_FR_BUFFER_SIZE`` (entries per group, default 256; 0 turns the recorder,
its dumps and the progress posts off), ``TORCH_FR_DUMP_TEMP_FILE`` else
``COLLECTIVES_FR_DUMP`` (the dump path prefix; the global rank is appended) and
``COLLECTIVES_FR_STACK`` (1: record the Python stack of every call; costly).

This module holds the recorders (:class:`Recorder`, :func:`new_recorder`) and the ends of
an async entry (:class:`CollectiveEnd`, :class:`P2PEnd`); :mod:`collectives.api.tracked` runs the front
end's calls as their entries; :mod:`collectives.diagnostics.progress` has the dumps and the
progress daemon, :mod:`collectives.diagnostics.fr_registry` the settings and the process's
recorders, :mod:`collectives.diagnostics.sigusr1` the SIGUSR1 handler.
"""
import logging
import os
import sys
import time
import warnings

from ..backends import base as _backend_base
from ..core import dtypes as D
from . import sigusr1
from .fr_registry import BUFFER_SIZE, ENABLED, STACKS, describe, register
from .progress import _progress, _trace_arg, dump

_log = logging.getLogger("collectives")

P2P_BUFFER_SIZE = 64  # point-to-point entries kept per group

now = time.monotonic_ns  # the entries' clock (the dump converts to wall time)

ISSUED, STARTED, COMPLETED, FAILED = "issued", "started", "completed", "failed"


#: where the package's own code comes from: its files, and the functions the op table
#: compiles (file names ``<opspec NAME>``: collectives.api.opspec.build)
_OWN_CODE = (os.path.dirname(__file__), "<opspec ")


def _stack():
    """The caller's Python stack above this package, innermost first (at most 16 frames)."""
    f = sys._getframe(1)
    out = []
    while f is not None and len(out) < 16:
        code = f.f_code
        if not code.co_filename.startswith(_OWN_CODE):
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return out


class _PyCallRing:
    """``collectives.engines._core.CallRing`` in Python (the package without its extensions): a
    group's last ``size`` collectives as tuples ``(seq, kind, count, dtype, root, op,
    time_ns[, stack])``, and ``seq``, the last issued."""

    __slots__ = ("seq", "size", "_ring", "_stack_fn", "started", "done")

    def __init__(self, size, stack=None):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._ring = [None] * size
        self._stack_fn = stack
        self.seq = self.started = self.done = 0

    def issue(self, kind, count=0, dtype=-1, root=-1, op=-1):
        """Record collective ``kind`` issued now; its sequence number. ``root``: a group
        rank (-1: none); ``op``: a reduce-op code (-1 or None: none)."""
        s = self.seq + 1
        e = (s, kind, count, dtype, root, -1 if op is None else int(op), now())
        if self._stack_fn is not None:
            e += (self._stack_fn(),)
        self._ring[s % self.size] = e
        self.seq = s
        return s

    def issue_buffer(self, kind, buf, root=-1, op=-1):
        """``issue(kind, buf.count, buf.dtype, root, op)``: the front end's hot paths."""
        return self.issue(kind, buf.count, buf.dtype, root, op)

    def entry(self, s):
        """Collective ``s``'s entry, or None when it left the ring (or never was)."""
        if s <= 0:
            return None
        e = self._ring[s % self.size]
        return e if e is not None and e[0] == s else None

    def entries(self):
        """The entries in the ring, oldest first."""
        return sorted((e for e in self._ring if e is not None), key=lambda e: e[0])


try:
    from ..engines._core import CallRing
except ImportError:  # extensions not built (or hidden)
    CallRing = _PyCallRing


class Recorder(CallRing):
    """One group's flight recorder. The front end records a call with
    ``s = fr.issue_buffer(kind, buf, root, op)`` (or ``fr.issue(kind, count, dtype, root,
    op)``), then ``fr.started = s`` when the call runs and ``fr.done = s`` when it
    returns; :meth:`fail` when it raises. ``root`` is a group rank (-1: none), ``op`` a
    reduce-op code (-1: none). The ring and ``seq`` are :class:`collectives.engines._core.CallRing`'s
    (in C; ``_PyCallRing`` without the extensions); ``started`` and ``done`` are plain
    slots (the cheapest stores from Python, two per call).
    """

    __slots__ = ("name", "ranks", "rank", "backend", "failures", "p2p",
                 "p2p_n", "ended", "__weakref__")

    def __init__(self, name, ranks, rank, backend):
        # off: one slot, overwritten (the counters still count)
        super().__init__(max(BUFFER_SIZE, 1), _stack if STACKS and ENABLED else None)
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.backend = backend
        self.failures = {}  # seq -> (error text, time) of the calls that raised
        self.p2p = [None] * P2P_BUFFER_SIZE
        self.p2p_n = 0
        self.ended = False

    # ---- recording (issue, issue_buffer: CallRing's) -----------------------------------
    def issue_p2p(self, kind, peer, tag, buf):
        """Record a point-to-point call; the entry (a list: its state is updated in place)."""
        self.p2p_n = n = self.p2p_n + 1
        entry = [n, kind, -1 if peer is None else peer, tag, buf.count, buf.dtype, now(), ISSUED,
                 0, None]
        self.p2p[n % P2P_BUFFER_SIZE] = entry
        return entry

    def fail(self, s, exc):
        """Collective ``s`` raised ``exc`` (a DistError): record it, dump, and say in the
        error where the other ranks are. Never raises; acts once per exception."""
        if getattr(exc, "_fr_seen", False):
            return
        try:
            exc._fr_seen = True
        except AttributeError:
            return
        try:
            text = str(exc)
            # a call after the group's first failure ("group unusable ...") asks nobody for
            # a dump: the first failure's request did
            again = any(k < s for k in list(self.failures))
            self.failures[s] = (text, time.time())
            if len(self.failures) > 32:
                self.failures.pop(next(iter(self.failures)))
            if not ENABLED:
                return
            if "Timed out" in text:
                text = _progress.explain(self, s, text) + text
                self.failures[s] = (text, time.time())
            path = dump(reason=f"{self.describe_seq(s)} in group {self.name} failed")
            if not again:
                _progress.request_dumps(self, s)
            note = f" [flight recorder: {path}; run collectives-trace {_trace_arg(path)}]" if path else ""
            exc.args = (f"{text}{note}",) + tuple(exc.args[1:])
        except Exception as e:  # noqa: BLE001  (the user's error matters more than ours)
            warnings.warn(f"collectives flight recorder: could not record the failure: {e!r}",
                          RuntimeWarning, stacklevel=2)

    # ---- reading (entry, entries: CallRing's) -------------------------------------------
    def describe_seq(self, s):
        e = self.entry(s)
        return f"{describe(e, self.ranks)} #{s}" if e is not None else f"collective #{s}"

    def state(self, s):
        if s in self.failures:  # (a lookup is safe while another thread adds)
            return FAILED
        if s <= self.done:
            return COMPLETED
        if s <= self.started:
            return STARTED
        return ISSUED

    def progress(self):
        """[issued, completed, what was issued last, what completed last, failed seq]."""
        seq, done = self.seq, self.done
        last = self.entry(seq)
        fin = self.entry(done)
        failed = max(dict(self.failures), default=0)  # (a copy: another thread may add one)
        return [seq, done, describe(last, self.ranks) if last else None,
                describe(fin, self.ranks) if fin else None, failed]

    def snapshot(self, offset_ns):
        """This group's part of a dump (``offset_ns`` turns entry times into wall time)."""
        failures = dict(self.failures)  # a copy: the group's thread may add one meanwhile
        entries = []
        for e in self.entries():
            s, kind, count, dtype, root, op, t = e[:7]
            item = {"seq": s, "kind": kind, "call": describe(e, self.ranks), "count": count,
                    "dtype": D.DTYPE_NAMES.get(dtype), "root": self.ranks[root] if 0 <= root < len(
                        self.ranks) else None, "op": D.OP_NAMES.get(op) if op >= 0 else None,
                    "state": self.state(s), "time_issued": (t + offset_ns) / 1e9}
            if s in failures:
                item["error"] = failures[s][0]
            if len(e) > 7:
                item["stack"] = [{"file": f, "line": ln, "function": fn} for f, ln, fn in e[7]]
            entries.append(item)
        p2p = []
        for e in sorted((e for e in self.p2p if e is not None), key=lambda e: e[0]):
            n, kind, peer, tag, count, dtype, t, st, tdone, err = e
            item = {"id": n, "kind": kind, "peer": self.ranks[peer] if 0 <= peer < len(self.ranks)
                    else None, "tag": tag, "count": count, "dtype": D.DTYPE_NAMES.get(dtype),
                    "state": st, "time_issued": (t + offset_ns) / 1e9}
            if tdone:
                item["time_finished"] = (tdone + offset_ns) / 1e9
            if err:
                item["error"] = err
            p2p.append(item)
        return {"ranks": self.ranks, "rank": self.rank, "backend": self.backend,
                "destroyed": self.ended, "issued": self.seq, "started": self.started,
                "completed": self.done, "buffer_size": self.size,
                "failed": {str(s): err for s, (err, _) in failures.items()},
                "entries": entries, "p2p": p2p}


class CollectiveEnd:
    """An async collective posted by the backend itself: done (or failed) once a wait or
    a test sees it so."""

    __slots__ = ("fr", "s")

    def __init__(self, fr, s):
        self.fr, self.s = fr, s

    def failed(self, req, exc):
        self.fr.fail(self.s, exc)

    def completed(self):
        if self.fr.done < self.s:
            self.fr.done = self.s

    def tested(self, req):
        if req.exception() is None:
            self.completed()


class P2PEnd:
    """A point-to-point call's entry, given its completion (or failure) once."""

    __slots__ = ("entry", "fr")

    def __init__(self, entry, fr):
        self.entry, self.fr = entry, fr

    def _finished(self, exc):
        e = self.entry
        if e[7] in (COMPLETED, FAILED):
            return
        e[8] = now()
        if exc is None:
            e[7] = COMPLETED
        else:
            e[7], e[9] = FAILED, str(exc)
            if ENABLED and not getattr(exc, "_fr_seen", False):
                exc._fr_seen = True
                path = dump(reason=f"{e[1]} (peer {e[2]}, tag {e[3]}) in group {self.fr.name} "
                                   f"failed: {exc}")
                if path:
                    exc.args = (f"{exc} [flight recorder: {path}]",) + tuple(exc.args[1:])

    def failed(self, req, exc):
        # the operation failed, or a blocking send/recv gave up on it
        if self.entry[1] in ("send", "recv") or req.test():
            self._finished(exc)

    def completed(self):
        self._finished(None)

    def tested(self, req):
        if self.entry[7] not in (COMPLETED, FAILED):
            self._finished(req.exception())


def new_recorder(pg):
    """The recorder of a new group ``pg`` (registered for dumps and progress posts)."""
    fr = Recorder(pg.group_name, pg.ranks, pg._rank, str(pg.backend_name))
    register(pg, fr)
    if ENABLED:
        _progress.agree_job(pg.store)
        _progress.ensure_started()
        sigusr1.install()
    return fr


_backend_base.set_dump_hook(dump)  # a backend about to end the job dumps first (mpi watchdog)

__all__ = ["Recorder", "CallRing", "CollectiveEnd", "P2PEnd", "new_recorder"]

