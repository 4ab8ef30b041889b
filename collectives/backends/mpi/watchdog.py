"""The 'mpi' backend's watchdog: ends the job when a blocking MPI call outlives its group's
timeout (MPI cannot time one out, and this MPICH cannot revoke a communicator)."""
import sys
import threading
import time
import traceback
import weakref

from ... import config
from ..base import dump_recorder  # the flight recorder's dump (it registers it)


def _blocking_frame(frame, codes):
    """``frame`` or one of its two callers whose code is in ``codes`` (a blocking call's
    method, which may be in the call log's comparison); None if none is."""
    for _ in range(3):
        if frame is None or frame.f_code in codes:
            return frame
        frame = frame.f_back
    return None


class Watchdog:
    """Ends the MPI job when a blocking collective has run past its group's timeout.

    A daemon thread samples every thread's innermost Python frames
    (``sys._current_frames``, and up to two callers). A blocking collective of
    :class:`MpiBackend` is a method frame that calls one MPI function (itself, or through
    the call log's comparison), which releases the GIL while it waits.
    While a call runs its frame object stays the same object, and a later call gets a
    new one as long as this thread holds the old one, which it does from one sample to
    the next; so a frame seen again is the same call, still running. Once one has run
    longer than its backend's timeout (or, for the hot calls the C call log makes with no
    Python frame of their own, once its ``busy`` has named the same call that long), the
    watchdog prints which call on which rank,
    and the stack that made it, to stderr and calls MPI_Abort: mpiexec then ends every
    process of the job. The calls themselves pay nothing for this.

    ``COLLECTIVES_MPI_WATCHDOG=0`` turns it off (a stuck call then waits forever, as
    in MPI).
    """

    MAX_PERIOD_S = 1.0
    MIN_PERIOD_S = 0.02

    def __init__(self):
        self.period = self.MAX_PERIOD_S
        self._lock = threading.Lock()
        self._thread = None
        self._codes = frozenset()
        self._logged = weakref.WeakSet()  # backends whose C call log says which call is busy

    def watch(self, backend):
        """Bound ``backend``'s blocking collectives by its timeout (starts the thread)."""
        if not config.get("COLLECTIVES_MPI_WATCHDOG"):
            return
        tmo = backend.timeout
        with self._lock:
            if hasattr(backend._fp_log, "busy"):
                self._logged.add(backend)
            if tmo:  # sample often enough to act within a quarter timeout of the deadline
                self.period = max(self.MIN_PERIOD_S, min(self.period, tmo / 4))
            if self._thread is None:
                # the method that makes MPI's call: name, or _name behind the fingerprint
                # check (functions of the class or a base: the hot calls' names are slots)
                cls = type(backend)  # MpiBackend
                self._codes = frozenset(
                    fn.__code__ for name in cls.BLOCKING for m in (name, "_" + name)
                    for fn in (vars(k).get(m) for k in cls.__mro__) if hasattr(fn, "__code__"))
                self._thread = threading.Thread(target=self._loop, name="collectives-mpi-watchdog",
                                                daemon=True)
                self._thread.start()

    def _loop(self):
        # thread id -> (frame, first seen): held, so a later call's frame differs; and
        # (id of a C log, number of its busy call) -> first seen
        seen = {}
        codes = self._codes
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            frames = sys._current_frames()
            running = {}
            for tid, frame in frames.items():
                frame = _blocking_frame(frame, codes)
                if frame is None:
                    continue
                prev = seen.get(tid)
                since = prev[1] if prev is not None and prev[0] is frame else now
                running[tid] = (frame, since)
                backend = frame.f_locals.get("self")
                tmo = getattr(backend, "timeout", None)
                if tmo and now - since > tmo and getattr(backend, "comm", None) is not None:
                    self._abort(backend, frame, now - since)
            with self._lock:  # watch() may add one meanwhile
                logged = list(self._logged)
            for backend in logged:  # the C log's calls, by the call's number
                log = backend._fp_log
                busy, tid = log.busy, log.thread
                if not busy:
                    continue
                key = (id(log), busy)
                since = seen.get(key, now)
                running[key] = since
                tmo = backend.timeout
                if tmo and now - since > tmo and backend.comm is not None:
                    # the innermost Python frame of that thread: the front end's call
                    self._abort(backend, frames.get(tid) or sys._getframe(), now - since)
            seen = running
            frames = frame = logged = backend = None  # hold only the frames in seen

    @staticmethod
    def _abort(backend, frame, took):
        from mpi4py import MPI  # loaded: the backend's communicator exists
        rank = MPI.COMM_WORLD.Get_rank()
        name = frame.f_code.co_name.lstrip("_")  # the collective (its inner _name method too)
        try:  # the job ends here: leave this rank's recent calls behind (never raises)
            path = dump_recorder(f"mpi watchdog: {name} ran {took:.1f} s, past "
                                 f"the group timeout")
        except Exception:  # noqa: BLE001
            path = None
        sys.stderr.write(
            (f"collectives: rank {rank}: flight recorder dump: {path}\n" if path else "") +
            f"collectives: rank {rank}: the mpi {name} (group rank {backend.rank} "
            f"of {backend.size}) has not finished after {took:.1f} s, past the group timeout "
            f"({backend.timeout} s): "
            + "a peer never called it, or called another collective. "
            + "MPI cannot time out a blocking call, so this rank calls MPI_Abort, which ends "
            "every process of the job. The call was made at:\n"
            + "".join(traceback.format_stack(frame)))
        sys.stderr.flush()
        backend.comm.Abort(1)



watchdog = Watchdog()  # one per process: it watches every group's backend
