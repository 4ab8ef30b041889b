"""The 'mpi' backend's always-on check that the ranks called the same collectives.

Every blocking collective appends its fingerprint (collectives.core.fingerprint.pack's
fields: kind, dtype, count, root, op) to the group's log; every 64th blocking call first
compares a hash of the ranks' logs (one MIN all_reduce of (hash, ~hash), two 32-bit words,
on a duplicate of the group's communicator; a barrier is that comparison, made at once)
and, where they differ, every rank raises DistBackendError naming the first pair of calls
that differed and its collective number (an allgather of the logs, on mismatch only); the
group then stays unusable. So every mismatch among calls MPI completes (another dtype or
op of equal bytes, such as an int32 broadcast received as float32) raises within 64 calls
(or at the next barrier), at the same call on every rank, though MPI has moved the mismatched data. A count
difference MPICH reports as a fatal truncation error, which ends the job; a call that
hangs inside MPI (another root or kind) is ended by the watchdog. Async calls
(``async_op=True``) are not checked: MPI may post them natively, and every rank must count
the same calls (every rank agrees on async_op). A check at every call, before the data
moves, is the DETAIL debug mode. Comparing at every call (an overlapped persistent
MPI_Allreduce_init) measured 2-7x MPICH's time for 4 B-1 KiB all_reduce/broadcast at world
2 and up to 200x at world 4 (2 loaded cores).
"""
import numpy as np

from ...core import fingerprint as F
from ...core.errors import DistBackendError

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def fold(h):
    """The 32-bit word the ranks compare of a 64-bit digest (CallLog's ``_fold``): 8 bytes,
    (word, ~word), are MPICH's quickest all_reduce, 16 took ~1.6x as long. Two logs that
    differ then compare equal with probability 2**-32."""
    return (h ^ (h >> 32)) & _MASK32


class PyCallLog(list):
    """``collectives.engines._mpilog.CallLog`` in Python (where the extension is not built): the
    fingerprints of a group's blocking calls since the last comparison, as tuples."""

    def __init__(self, compare, error):
        super().__init__()
        self._compare = compare
        self._error = error
        self.failed = None  # the message once the ranks' calls differed
        self.async_mode = False  # the backend's (see MpiBackend._async_mode)
        self.compared = 0  # calls compared so far (the numbering in messages)

    def _put(self, entry):
        if type(entry) is not tuple:
            raise TypeError(f"Argument 'entry' has incorrect type (expected tuple, got "
                            f"{type(entry).__name__})")
        kind, dtype, count, root, op = entry  # five words, as CallLog takes them
        if self.failed is not None:
            raise self._error(f"group unusable after an earlier failure: {self.failed}")
        if len(self) >= FingerprintCheck.CHECK_EVERY:  # a comparison raised before clearing
            self.failed = "the comparison of the ranks' calls failed"
            raise self._error(f"group unusable after an earlier failure: {self.failed}")
        list.append(self, entry)

    def append(self, entry):
        """Log one call's (kind, dtype, count, root, op); compare when the log is full."""
        self._put(entry)
        if len(self) >= FingerprintCheck.CHECK_EVERY:
            self._compare()

    def append_and_compare(self, entry):
        """Log one call, then compare the ranks' logs: the comparison is that call (a
        barrier: an all_reduce synchronises as one does)."""
        self._put(entry)
        self._compare()

    def entries(self):
        return list(self)

    def digest(self):
        """CallLog.digest's hash (FNV-1a over the entries' words, then a final mix)."""
        h = 14695981039346656037
        for entry in self:
            for word in entry:
                h = ((h ^ (word & _MASK64)) * 1099511628211) & _MASK64
        h ^= h >> 33
        h = (h * 0xff51afd7ed558ccd) & _MASK64
        return h ^ (h >> 33)

    def clear(self):
        del self[:]


try:
    from ...engines._mpilog import CallLog
except ImportError:  # extensions not built
    CallLog = None


class FingerprintCheck:
    """The always-on check of a group's blocking collective calls (see the module
    docstring). Each call appends (kind, dtype, count, root, op), fingerprint.pack's
    arguments, to ``log`` (machine words in ``collectives.engines._mpilog.CallLog``: no
    allocation; tuples in :class:`PyCallLog` without the extension); every
    CHECK_EVERY-th call the ranks compare a hash of their logs (one MIN all_reduce of
    (hash, ~hash) on a duplicate communicator) and, where they differ, the logs
    themselves (an allgather, on mismatch only), to name the first pair of calls that
    differed."""

    CHECK_EVERY = 64

    def __init__(self, comm, label, mpi, c_log=True):
        self.mpi = mpi  # the loaded mpi4py.MPI
        self.comm = comm.Dup()
        self.label = label
        make = CallLog if c_log and CallLog is not None else PyCallLog
        self.log = make(self.compare, DistBackendError)
        self.buf = np.zeros(2, np.uint32)

    def bind_direct(self, handle):
        """Have the C log compare by address (after its ``bind_direct``); ``handle(obj)``
        gives an mpi4py object's handle."""
        mpi = self.mpi
        self.log.bind_check(handle(self.comm), handle(mpi.UINT32_T), handle(mpi.MIN),
                            self.mismatch)

    def compare(self):
        """Compare the ranks' logs (every rank is here: the log is full, or a barrier);
        raise DistBackendError naming the first pair of calls that differed, if any.
        The C log compares by address once bound (``bind_direct``), calling
        :meth:`mismatch` where the ranks differed; this is its form through mpi4py."""
        log = self.log
        h = fold(log.digest())
        buf = self.buf
        buf[0] = h
        buf[1] = h ^ _MASK32
        mpi = self.mpi
        self.comm.Allreduce(mpi.IN_PLACE, [buf, mpi.UINT32_T], mpi.MIN)
        if buf[0] == h and buf[1] == h ^ _MASK32:
            log.compared += len(log)
            log.clear()
            return
        self.mismatch()

    def mismatch(self):
        """The ranks' hashes differed (every rank is here): gather the logs and raise
        DistBackendError naming the first pair of calls that differed."""
        log = self.log
        first = log.compared
        entries = log.entries()
        log.clear()
        logs = self.comm.allgather(entries)  # every rank is here: all saw MIN != MAX
        message = f"ranks called different collectives in {self.label}"
        for i, calls in enumerate(zip(*logs)):
            q = next((r for r, e in enumerate(calls) if e != calls[0]), None)
            if q is not None:
                message = F.mismatch_message(first + i + 1, 0, F.pack(*calls[0]), q,
                                             F.pack(*calls[q]), self.label)
                break
        log.failed = message  # every later call on the group raises
        raise DistBackendError(message)

    def free(self):
        try:
            self.comm.Free()
        except self.mpi.Exception:
            pass

