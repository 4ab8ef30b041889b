"""The request of the 'mpi' backend's non-blocking calls (async collectives, isend, irecv)."""
import os
import time

from ...core.errors import DistBackendError
from ..base import Request, timed_out

_MPI = None  # mpi4py.MPI, given by collectives.backends.mpi once it has loaded MPI (bind)


def bind(mpi):
    """Give this module the loaded ``mpi4py.MPI`` (requests exist only after MPI is loaded)."""
    global _MPI
    _MPI = mpi


class MpiRequest(Request):
    """A non-blocking MPI operation. ``wait`` polls ``MPI_Test``: a short spin, then
    yields and short sleeps, bounded by the timeout. Keeps its buffers alive."""

    __slots__ = ("_req", "_status", "_keep", "_describe", "_timeout", "_done", "_source", "_exc")

    SPIN_S = 50e-6
    YIELD_S = 0.1  # MPI progresses only inside MPI calls: sleeping would stall big transfers

    def __init__(self, req, keep, describe, timeout, want_source=False):
        self._req = req
        self._status = _MPI.Status() if want_source else None
        self._keep = keep
        self._describe = describe
        self._timeout = timeout
        self._done = False
        self._source = -1
        self._exc = None

    def _finish(self):
        self._done = True
        self._keep = None
        if self._status is not None:
            self._source = self._status.Get_source()

    def test(self):
        if not self._done:
            try:
                if self._req.Test(self._status):
                    self._finish()
            except _MPI.Exception as e:
                self._done = True
                self._exc = DistBackendError(f"{self._describe} failed: {e}")
        return self._done

    def wait(self, timeout=None):
        if not self._done:
            if timeout is None:
                timeout = self._timeout
            self._poll(timeout)
        if self._exc is not None:
            raise self._exc

    def _poll(self, timeout):
        test = self.test
        now = time.monotonic
        start = now()
        deadline = None if timeout is None else start + timeout
        pause = 20e-6
        while not test():
            elapsed = now() - start
            if elapsed < self.SPIN_S:
                continue
            if deadline is not None and now() > deadline:
                raise timed_out(self._describe, timeout)
            if elapsed < self.YIELD_S:
                os.sched_yield()
            else:  # a long wait: give the cores to the other ranks
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
