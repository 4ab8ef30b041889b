"""The same-host shared-memory backend: every rank of the group maps one segment.

One POSIX shared-memory segment per group, created by rank 0 at init, named to
the others through the store, and unlinked as soon as every rank has mapped it
(so nothing is left in /dev/shm, even after a crash). Collectives run in C with
the GIL released (``collectives.engines._shm``; barrier and small broadcasts and all_reduces
release it only where they must wait longer than a short spin); point-to-point
messages travel through a byte ring per ordered pair of ranks, driven by two helper
threads per rank (one sends queued messages, one drains incoming rings into posted
receives or an unexpected-message list), so ``isend``/``irecv`` never block and two
ranks that both send large messages first cannot deadlock.

Tunables (environment): COLLECTIVES_SHM_HALF_BYTES (bytes per half data slot),
COLLECTIVES_SHM_ONESHOT_MAX (largest all_reduce done one-shot),
COLLECTIVES_SHM_CHUNK_BYTES (all_reduce/reduce two-shot chunk), COLLECTIVES_SHM_SPIN (polls before a
waiting rank yields; none by default when the ranks outnumber the cores),
COLLECTIVES_SHM_YIELD_US (how long it yields before it
sleeps on a futex) and COLLECTIVES_SHM_LLC_BYTES (the last-level cache size, read
from sysfs by default: an all_gather whose outputs, all ranks' together, fill it gets
the local block with streaming stores), COLLECTIVES_SHM_STREAM (0, 1 or 2: plain, streaming, or
measured stores for the segment) and COLLECTIVES_SHM_FAR_NS (the
probe's cache-line round trip from which a peer counts as far, 250 by default).
COLLECTIVES_SHM_THP=0 stops a rank from collapsing the buffers its peers copy by
process_vm_readv/writev into huge pages (MADV_COLLAPSE, the second time it sees a
buffer: they copy twice as fast from it; see thp_prepare in engines/shm/shm_copy.c).
"""
import collections
import os
import secrets
import struct
import threading
import time

import numpy as np

from .. import config
from ..core import dtypes as D
from ..core.errors import DistBackendError, DistError
from ..core.fingerprint import COLLECTIVES
from .base import Backend, DoneRequest, FutureRequest

# a message's header: tag, payload bytes, dtype code (a receive must match both: one of
# another size or dtype raises on the receiver instead of truncating or reinterpreting)
_HDR = struct.Struct("<qqi4x")

# The thresholds' defaults are the settings registry's (collectives.config: one source);
# the figures behind them are in docs/design-shm.md ("Measured figures behind the engine's
# constants"). Two defaults depend on the group and the host, and are set here.
#
# Where more than two ranks run at once, one-shot all_reduce (every rank reads all the
# others' whole buffers) costs more than two-shot's second synchronisation from a few KiB:
CROWDED_ONESHOT_MAX = 4 * 1024
# With more than two ranks (where the probe allows the broadcast's single copy at all), the
# single copy pays off from 256 KiB (from COLLECTIVES_SHM_CMA_BCAST_MIN with two ranks);
# where more than two run at once, never: every reader pins and copies the root's pages at
# the same time, which serialises them.
MANY_CMA_BCAST_MIN = 256 * 1024

def crowded(size, ncpu=None):
    """Whether more than two of ``size`` ranks run at once on this host (more than two
    ranks and more than two cores)."""
    return size > 2 and (ncpu or os.cpu_count() or 1) > 2


def default_oneshot_max(size, ncpu=None):
    """COLLECTIVES_SHM_ONESHOT_MAX's default for a group of ``size`` ranks on this host."""
    if crowded(size, ncpu):
        return CROWDED_ONESHOT_MAX
    return config.declared("COLLECTIVES_SHM_ONESHOT_MAX").default


def default_cma_bcast_min(size, ncpu=None):
    """COLLECTIVES_SHM_CMA_BCAST_MIN's default for a group of ``size`` ranks on this host
    (0: never)."""
    if crowded(size, ncpu):
        return 0
    return config.declared("COLLECTIVES_SHM_CMA_BCAST_MIN").default if size <= 2 \
        else MANY_CMA_BCAST_MIN


#: the settings whose default depends on the group: name -> default for ``size`` ranks
_SIZED_DEFAULTS = {"COLLECTIVES_SHM_ONESHOT_MAX": default_oneshot_max,
                   "COLLECTIVES_SHM_CMA_BCAST_MIN": default_cma_bcast_min}


def tuning_value(var, size):
    """Rank 0's value of ``var`` for a group of ``size`` ranks: the environment's, else its
    default for such a group."""
    sized = _SIZED_DEFAULTS.get(var)
    return sized(size) if sized is not None and var not in os.environ else config.get(var)


#: the thresholds rank 0 chooses for the group (its environment's, or the defaults), in the
#: order they travel with the segment's name
_TUNING = ("COLLECTIVES_SHM_ONESHOT_MAX", "COLLECTIVES_SHM_CHUNK_BYTES", "COLLECTIVES_SHM_CMA_MIN",
           "COLLECTIVES_SHM_CMA_BCAST_MIN", "COLLECTIVES_SHM_CMA_AR_MIN", "COLLECTIVES_SHM_STREAM",
           "COLLECTIVES_SHM_AR_ALGO", "COLLECTIVES_SHM_MAP_MIN")


# a segment younger than this is never swept: its creator may not have locked it yet
SWEEP_MIN_AGE_S = 5.0


def sweep_stale_segments(min_age=SWEEP_MIN_AGE_S, shm_dir="/dev/shm"):
    """Unlink this user's segments whose creator died before unlinking the name.

    The creating rank holds a shared flock on its segment while it lives (shm_segment.c)
    and unlinks the name once every rank has mapped it; a name still linked that no
    process locks was left by a creator killed in between. Rank 0 sweeps before it
    creates a segment, so such a leak lasts until the next group on this host.
    Returns the names removed.
    """
    import fcntl
    import time
    prefix = f"collectives-{os.getuid()}-"
    removed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except OSError:
        return removed
    now = time.time()
    for n in names:
        path = os.path.join(shm_dir, n)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it: creator gone
            os.unlink(path)
            removed.append(n)
        except OSError:
            pass  # locked (its creator lives), or gone already
        finally:
            os.close(fd)
    return removed


def shm_available():
    """True when the _shm extension is built and /dev/shm is usable."""
    try:
        from ..engines import _shm  # noqa: F401
    except ImportError:
        return False
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)


# ShmBackend's collectives, every one of the contract's: ShmComm's own methods, which take
# the contract's arguments (Buffers, ranks, op codes) and ``fp``; bound in ShmBackend.__init__
_FORWARDED = tuple(COLLECTIVES)


class ShmBackend(Backend):
    """Collectives among ranks of one host through shared memory.

    Args:
        store: the group's store (already prefixed for this group).
        rank, size: this rank and the group size; every rank must be on this host.
        timeout: seconds a single wait may take before DistBackendError.
        options: unused (accepted for the Backend interface).
        label: names the group in error messages.
        rank_names: the rank each rank of this group is called by in error messages
            (default: itself), for a group inside another one (a hierarchical group's
            ranks on one host).
    """

    name = "shm"
    own_block_in_place = True
    gathers_into_list = True
    # the forwarded collectives live in slots: a slot shadows Backend's method of the same
    # name, so the front end's ``pg.backend.broadcast`` is a specialised slot load (an
    # instance attribute over a class method is looked up the generic way every call)
    __slots__ = _FORWARDED

    def __init__(self, store, rank, size, timeout, options=None, label=None, *, rank_names=None):
        super().__init__(store, rank, size, timeout, options)
        from ..engines._shm import ShmComm, unlink
        half = config.get("COLLECTIVES_SHM_HALF_BYTES")
        half = max(half, 4096, 64 + 128 * size)
        ring = 256 * 1024 if size <= 8 else 64 * 1024
        self.label = label or f"shm group (size {size})"
        tmo = float(timeout) if timeout else 0.0
        # a store reused by a later group of the same prefix gets a fresh key
        key = f"shm/segment/{(store.add('shm/init', 1) - 1) // size}"
        if rank == 0:
            # every rank must pick the same algorithm for a call: rank 0's thresholds
            # travel with the segment's name, whatever the others' environments say
            tuning = ",".join(str(tuning_value(var, size)) for var in _TUNING)
            sweep_stale_segments()
            name = f"/collectives-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
            self._comm = ShmComm(name, True, rank, size, half, ring, tmo, self.label)
            try:
                store.set(key, f"{name};{tuning}")
            except BaseException:
                unlink(name)
                raise
        else:
            value = store.get(key)
            value = value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
            name, _, tuning = value.partition(";")
            self._comm = ShmComm(name, False, rank, size, half, ring, tmo, self.label)
        self._comm.rank_names = list(rank_names) if rank_names is not None else None
        try:
            self._comm.barrier()  # every rank has mapped the segment
        finally:
            if rank == 0:
                unlink(name)
        self._comm.coll_base = self._comm.coll  # error messages count the user's collectives
        #: the group's settings as every rank applied them (rank 0's), by setting name
        self.tuning = dict(zip(_TUNING, tuning.split(",")))
        (oneshot_max, chunk_bytes, cma_min, cma_bcast_min, cma_ar_min, stream,
         ar_algo, map_min) = self.tuning.values()
        #: DDP's buckets from this size are mapped by every rank (torch_bridge/mapped.py)
        self.map_min = int(map_min)
        (oneshot_max, chunk_bytes, cma_min, cma_bcast_min, cma_ar_min,
         stream) = map(int, (oneshot_max, chunk_bytes, cma_min, cma_bcast_min, cma_ar_min,
                             stream))
        if stream not in (0, 1, 2):  # every rank sees rank 0's value: all raise alike
            raise ValueError(f"COLLECTIVES_SHM_STREAM (rank 0's environment) must be 0 (plain), "
                             f"1 (streaming) or 2 (measured), got {stream}")
        self._comm.set_thresholds(oneshot_max, chunk_bytes)
        self._comm.set_stream(stream)
        self._comm.set_ar_algo(ar_algo)
        self.single_copy = self._comm.cma_probe()  # collective: every rank gets the same answer
        # unconditionally: the gathers' single copy needs only the ranks' memory readable,
        # the broadcast's also at most two ranks a core, the all_reduce's a core per rank
        # (the C gates check what the probe found)
        self._comm.set_cma_min(cma_min, cma_bcast_min, cma_ar_min)
        self.single_copy = self.single_copy and bool(cma_min or cma_bcast_min or cma_ar_min)
        self.segment_name = name
        # The collectives are ShmComm's methods, which take the contract's arguments
        # (Buffers, ranks, op codes, fp): bound here, in the slots of their names, the
        # front end's call reaches C without a forwarding Python frame.
        comm = self._comm
        self.broadcast = comm.broadcast
        self.all_reduce = comm.all_reduce
        self.reduce = comm.reduce
        self.all_gather = comm.all_gather
        self.all_gather_list = comm.all_gather_list
        self.gather = comm.gather
        self.scatter = comm.scatter
        self.reduce_scatter = comm.reduce_scatter
        self.all_to_all = comm.all_to_all
        self.barrier = comm.barrier
        # buffers every rank maps (collectives/torch_bridge/mapped.py: DDP's buckets)
        self.map_register = comm.map_register
        self.map_unregister = comm.map_unregister
        self._p2p = None
        self._p2p_lock = threading.Lock()

    # ---- collectives ---------------------------------------------------------------
    # broadcast, all_reduce, reduce, all_gather, all_gather_list, gather, scatter,
    # reduce_scatter, all_to_all and barrier are ShmComm's own methods, bound in the slots
    # of those names in __init__ (_FORWARDED): they take the contract's arguments (Buffers,
    # ranks, op codes) and ``fp``. Each call carries its fingerprint (kind, dtype, element count, root, op;
    # computed in _shm from these arguments, or ``fp``, a collectives.core.fingerprint.pack
    # word, where a caller such as the hierarchical backend passes the original call's): a
    # rank whose peer called something else raises DistBackendError naming both calls, on
    # every rank. all_to_all's per-rank counts differ legally: the word holds kind and
    # dtype, and every rank checks that what each peer sends it is what it expects from it.

    @property
    def mapped_calls(self):
        """all_reduces that took the mapped path (both ranks' buffers mapped) so far."""
        return self._comm.mapped_calls

    def number_next(self, seq):
        """Error messages call this backend's next collective, and those after it until the
        next call of this, the caller's collective #seq (a hierarchical group's local parts
        number their calls as the whole group does; one of its calls may make several)."""
        self._comm.number_next(seq)

    def failure(self):
        """The group's recorded failure (the same text on every rank), or None."""
        return self._comm.failure()

    def fail_group(self, message):
        """Record ``message`` as this group's failure (unless one is recorded already) and
        make every rank's current and later calls on it raise it: for a caller whose own
        part of a collective failed elsewhere (the hierarchical backend's leaders)."""
        self._comm.poison(message)

    # ---- point to point --------------------------------------------------------------
    def _engine(self):
        with self._p2p_lock:
            if self._closed:
                raise DistBackendError(f"{self.label}: backend is shut down")
            if self._p2p is None:
                self._p2p = _P2PEngine(self._comm, self.label, self.timeout)
            return self._p2p

    def isend(self, buf, dst, tag=0):
        return self._engine().isend(buf, dst, tag)

    def irecv(self, buf, src, tag=0):
        return self._engine().irecv(buf, src, tag)

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        self._comm.set_timeout(float(timeout))
        with self._p2p_lock:
            if self._p2p is not None:
                self._p2p.timeout = timeout

    # ---- lifetime -----------------------------------------------------------------------
    def interrupt(self):
        """Mark the segment aborted: running and queued work fails at once (the segment
        stays mapped until shutdown, which waits for the threads inside C)."""
        self._comm.abort()

    def shutdown(self):
        super().shutdown()
        with self._p2p_lock:
            p2p, self._p2p = self._p2p, None
        self._comm.abort()  # helper threads blocked in C return now
        stuck = ((p2p is not None and not p2p.close())
                 or (self._thread is not None and self._thread.is_alive()))
        if not stuck:  # never unmap under a thread still inside C
            self._comm.close()


_POLL_SLICE = 0.2  # seconds a poll sleeps before it looks at the engine's state again


class _DirectRequest(FutureRequest):
    """A receive whose waiter reads the rings itself (:meth:`_P2PEngine.drive`) while the
    engine's receiver thread stays out of the way, so that the message wakes the waiting
    thread at once. Completed by the receiver thread instead, it would cost two wake-ups:
    the receiver's, then the waiter's through the Event (in a request-reply round trip such
    as a master-worker command, four in all)."""

    def __init__(self, engine, src, tag, default_timeout):
        super().__init__(None, default_timeout)
        self._engine = engine
        self._src_tag = src, tag
        self._waiter = 0  # the thread reading the rings for it, while one does

    def describe(self):  # (made only for an error: formatting costs as much as a message)
        src, tag = self._src_tag
        who = "any rank" if src is None else f"rank {src}"
        return f"{self._engine.label} irecv from {who} (tag {tag})"

    def _progress(self, timeout):
        # read the rings in this thread; what is left of the timeout covers an engine that
        # closed under the wait (whatever closes it ends the request)
        return self._engine.drive(self, timeout)


class _P2PEngine:
    """Non-blocking isend/irecv over the segment's rings: a sender and a receiver thread.
    A thread that waits for one of its receives reads the rings itself meanwhile (see
    :class:`_DirectRequest`); one thread at a time reads them (``reading``)."""

    def __init__(self, comm, label, timeout):
        self.comm = comm
        self.label = label
        self.timeout = timeout
        self.reading = threading.Lock()  # held while a thread takes a message off a ring
        self.lock = threading.Lock()
        self.send_cv = threading.Condition(self.lock)
        self.driving = 0  # threads inside drive (close waits for them to leave the C code)
        self.drive_cv = threading.Condition(self.lock)
        self.sends = collections.deque()  # (dst, hdr, buf, req), issue order
        self.sending = 0                  # queued or in flight on the sender thread
        self.posted = []                  # [src or None, tag, buf, req], post order
        self.unexpected = []              # (src, tag, (dtype, np.uint8 array)), arrival order
        self.error = None
        self.closed = False
        self.sender = threading.Thread(target=self._send_loop, daemon=True,
                                       name="collectives-shm-send")
        self.receiver = threading.Thread(target=self._recv_loop, daemon=True,
                                         name="collectives-shm-recv")
        self.sender.start()
        self.receiver.start()

    def isend(self, buf, dst, tag):
        hdr = _HDR.pack(tag, buf.nbytes, buf.dtype)
        with self.lock:
            if self.error is not None:
                raise self.error
            # fast path: nothing queued ahead and the message fits in the ring now
            if not self.sending and self.comm.p2p_try_send(dst, hdr, buf.ptr, buf.nbytes):
                return DoneRequest()
            req = FutureRequest(f"{self.label} isend to rank {dst} (tag {tag})", self.timeout)
            self.sends.append((dst, hdr, buf, req))
            self.sending += 1
            self.send_cv.notify()
        return req

    def _send_loop(self):
        while True:
            with self.lock:
                while not self.sends and not self.closed:
                    self.send_cv.wait()
                if not self.sends:
                    return
                dst, hdr, buf, req = self.sends.popleft()
            try:
                self.comm.p2p_send(dst, hdr, buf.ptr, buf.nbytes)
            except DistError as e:
                req.set_exception(e)
            else:
                req.set_result()
            finally:
                with self.lock:
                    self.sending -= 1

    def irecv(self, buf, src, tag):
        with self.lock:
            for i, (s, t, data) in enumerate(self.unexpected):
                if (src is None or s == src) and t == tag:
                    del self.unexpected[i]
                    return DoneRequest(s, self._deliver(buf, data, s, tag))
            if self.error is not None:
                raise self.error
            req = _DirectRequest(self, src, tag, self.timeout)
            self.posted.append([src, tag, buf, req])
        return req

    def _mismatch(self, buf, nbytes, dtype, src, tag):
        """The error of a receive into ``buf`` of a message longer than it or of another dtype,
        or None (a receive's size is an upper bound, as in MPI and torch's gloo)."""
        if nbytes <= buf.nbytes and dtype == buf.dtype:
            return None

        def what(nb, dt):
            isz = D.ITEMSIZE.get(dt)
            name = D.DTYPE_NAMES.get(dt, f"dtype {dt}")
            return f"{nb // isz} {name} ({nb} bytes)" if isz else f"{nb} bytes of {name}"
        names = self.comm.rank_names
        return DistBackendError(
            f"{self.label} irecv from rank {names[src] if names else src} (tag {tag}): the "
            f"message holds {what(nbytes, dtype)} but the receive takes {what(buf.nbytes, buf.dtype)}")

    def _deliver(self, buf, msg, src, tag):
        """Copy an unexpected message (dtype, data) into buf; the exception to report, or None."""
        dtype, data = msg
        exc = self._mismatch(buf, data.nbytes, dtype, src, tag)
        if exc is not None:
            return exc
        if data.nbytes:
            buf.bytes_view()[:data.nbytes] = data
        return None

    def _match(self, src, tag):
        for i, p in enumerate(self.posted):
            if (p[0] is None or p[0] == src) and p[1] == tag:
                del self.posted[i]
                return p
        return None

    def _take(self, src):
        """Take the message at the head of ``src``'s ring (``reading`` held) to its posted
        receive, or to the unexpected list."""
        comm = self.comm
        tag, nbytes, dtype = _HDR.unpack(comm.p2p_read_bytes(src, _HDR.size))
        with self.lock:
            match = self._match(src, tag)
        if match is not None:
            exc = self._mismatch(match[2], nbytes, dtype, src, tag)
            if exc is None:
                comm.p2p_read(src, match[2].ptr, nbytes)
            else:  # the message is consumed, the buffer left as it was
                comm.p2p_read(src, 0, nbytes)
        else:
            data = np.empty(nbytes, np.uint8)
            if nbytes:
                comm.p2p_read(src, data.ctypes.data, nbytes)
            with self.lock:  # a receive may have been posted while we read
                match = self._match(src, tag)
                if match is None:
                    self.unexpected.append((src, tag, (dtype, data)))
                    return
            exc = self._deliver(match[2], (dtype, data), src, tag)
        req = match[3]
        if exc is None:
            req.set_result(src)
        else:
            req.set_exception(exc)
        if req._waiter and req._waiter != threading.get_ident():
            comm.p2p_kick()  # its waiter may be asleep in its poll: wake it

    def _take_next(self):
        """Take one waiting message, if there is one (the caller has seen one arrive)."""
        with self.reading:
            src = self.comm.p2p_poll(_HDR.size, 0.0)  # (another thread may have taken it)
            if src >= 0:
                self._take(src)

    def _fail(self, e):
        """The rings broke (DistError ``e``): every posted receive and later call fails."""
        with self.lock:
            if self.closed:
                return
            self.error = e
            posted, self.posted = self.posted, []
        for p in posted:
            p[3].set_exception(e)

    def drive(self, req, timeout):
        """Read the rings for ``req`` on the calling thread until it completes or
        ``timeout`` seconds pass; the seconds left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        comm = self.comm
        with self.lock:
            if self.closed:  # (the communicator may be unmapped)
                req.set_exception(DistBackendError(f"{req.describe()}: backend is shut down"))
                return 0.0
            self.driving += 1
        req._waiter = threading.get_ident()
        comm.p2p_direct(1)
        try:
            while True:
                kicks = comm.p2p_kicks()  # before the look: a completion after it kicks
                if req.test() or self.closed:
                    break
                left = _POLL_SLICE if deadline is None else min(deadline - time.monotonic(),
                                                                _POLL_SLICE)
                if left <= 0:
                    break
                if comm.p2p_poll(_HDR.size, left, False, kicks) >= 0:
                    self._take_next()
        except DistError as e:
            self._fail(e)
        finally:
            req._waiter = 0
            # the receiver thread resumes at once only where receives are posted (which
            # it may have to complete); otherwise within 10 ms, or at the next waiter
            comm.p2p_direct(-1, bool(self.posted))
            with self.lock:
                self.driving -= 1
                if self.closed:  # close() waits for the last one
                    self.drive_cv.notify_all()
        if self.closed and not req.test():
            req.set_exception(DistBackendError(f"{req.describe()}: backend is shut down"))
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    def _recv_loop(self):
        try:
            while not self.closed:
                if self.comm.p2p_poll(_HDR.size, _POLL_SLICE, True) >= 0:
                    self._take_next()
        except DistError as e:
            self._fail(e)

    def close(self):
        with self.lock:
            self.closed = True
            self.send_cv.notify_all()
        self.comm.p2p_kick()
        self.receiver.join(5)
        self.sender.join(5)
        with self.lock:  # threads waiting on their receives leave at the kick or the abort
            self.drive_cv.wait_for(lambda: not self.driving, 5)
            driving = self.driving
        return not (driving or self.receiver.is_alive() or self.sender.is_alive())
