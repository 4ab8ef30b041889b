"""The flight recorder: each group's last calls, dumped per rank when something goes wrong.

Every process group keeps a :class:`Recorder`: a preallocated ring of its last N
collectives (sequence number, front-end name, element count, dtype, root, reduce op, the
time it was issued, and the Python stack where asked), a smaller ring of its
point-to-point calls, and three counters: the last collective issued, started and
completed. The groups' calls complete in issue order, so one counter says which entries
are done; recording a call is one tuple stored into the ring and a few integer stores.

A rank's recorders are written to one JSON file (:func:`dump`): when one of its calls
fails (a timeout, a lost peer, calls that do not match), when another rank's call failed
(through the store), on SIGUSR1, and on demand (``collectives.dump_flight_recorder``).
``collectives-trace`` (:mod:`collectives.trace`) reads a job's files and says where the
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
"""
import json
import logging
import os
import re
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta

from . import config
from . import dtypes as D
from .errors import DistError

_log = logging.getLogger("collectives")

FORMAT = "collectives-flight-recorder"
VERSION = 1

P2P_BUFFER_SIZE = 64  # point-to-point entries kept per group
TICK_S = 0.5  # the daemon's period: progress that changed is posted within it
HEARTBEAT_S = 2.0  # unchanged progress is posted again this often (a silent rank is dead or stuck)
POLL_S = 0.5  # how often the daemon looks for another rank's dump request
STALE_S = 2 * HEARTBEAT_S + 1.5  # a post older than this: the rank died or is stuck
STORE_TIMEOUT_S = 3.0  # any store call of the recorder's daemon
READ_WAIT_S = 1.0  # a failing rank waits at most this long for the other ranks' progress
ACK_WAIT_S = 1.5  # ... and at most this long for the others to write their dumps
KEEP_ENDED = 16  # recorders of destroyed groups kept for later dumps
KEY = "collectives_fr"  # the store keys' prefix


def _torch_int(name):
    """torch's name for a setting, where set (it comes before ours, as torch users expect)."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of entries, got {v!r}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0 (0 turns the flight recorder off), got {n}")
    return n


BUFFER_SIZE = _torch_int("TORCH_FR_BUFFER_SIZE")
if BUFFER_SIZE is None:
    BUFFER_SIZE = config.get("COLLECTIVES_FR_BUFFER_SIZE")
ENABLED = BUFFER_SIZE > 0
DUMP_PREFIX = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or config.get("COLLECTIVES_FR_DUMP") or None
STACKS = config.get("COLLECTIVES_FR_STACK")

now = time.monotonic_ns  # the entries' clock (the dump converts to wall time)

ISSUED, STARTED, COMPLETED, FAILED = "issued", "started", "completed", "failed"

_ROOT_ARG = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


def _stack():
    """The caller's Python stack above this package, innermost first (at most 16 frames)."""
    f = sys._getframe(2)
    pkg = os.path.dirname(__file__)
    out = []
    while f is not None and len(out) < 16:
        code = f.f_code
        if not code.co_filename.startswith(pkg):
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return out


class _StackRing(list):
    """A ring whose stores add the caller's stack to the entry (COLLECTIVES_FR_STACK=1)."""

    def __setitem__(self, i, entry):
        list.__setitem__(self, i, entry + (_stack(),))


class Recorder:
    """One group's flight recorder. The front end writes it inline:

    ``s = fr.seq + 1; fr.ring[s % fr.size] = (s, kind, count, dtype, root, op, now());
    fr.seq = s``, then ``fr.started = s`` when the call runs and ``fr.done = s`` when it
    returns; :meth:`fail` when it raises. ``root`` is a group rank (-1: none), ``op`` a
    reduce-op code (-1: none).
    """

    __slots__ = ("seq", "started", "done", "ring", "size", "name", "ranks", "rank", "backend",
                 "failures", "p2p", "p2p_n", "ended", "__weakref__")

    def __init__(self, name, ranks, rank, backend):
        self.size = max(BUFFER_SIZE, 1)  # off: one slot, overwritten (the counters still count)
        self.ring = (_StackRing if STACKS and ENABLED else list)([None] * self.size)
        self.seq = self.started = self.done = 0
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.backend = backend
        self.failures = {}  # seq -> (error text, time) of the calls that raised
        self.p2p = [None] * P2P_BUFFER_SIZE
        self.p2p_n = 0
        self.ended = False

    # ---- recording (the slow paths; the hot ones inline this) --------------------------
    def issue(self, kind, count=0, dtype=-1, root=-1, op=-1):
        """Record a collective issued now; its sequence number."""
        s = self.seq + 1
        self.ring[s % self.size] = (s, kind, count, dtype, root, -1 if op is None else int(op), now())
        self.seq = s
        return s

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
            self.failures[s] = (text, time.time())
            if len(self.failures) > 32:
                self.failures.pop(next(iter(self.failures)))
            if not ENABLED:
                return
            if "Timed out" in text:
                text = _progress.explain(self, s, text) + text
                self.failures[s] = (text, time.time())
            path = dump(reason=f"{self.describe_seq(s)} in group {self.name} failed")
            _progress.request_dumps(self, s)
            note = f" [flight recorder: {path}; run collectives-trace {_trace_arg(path)}]" if path else ""
            exc.args = (f"{text}{note}",) + tuple(exc.args[1:])
        except Exception as e:  # noqa: BLE001  (the user's error matters more than ours)
            warnings.warn(f"collectives flight recorder: could not record the failure: {e!r}",
                          RuntimeWarning, stacklevel=2)

    # ---- reading ------------------------------------------------------------------------
    def entry(self, s):
        """Collective ``s``'s entry, or None when it left the ring (or never was)."""
        if s <= 0:
            return None
        e = self.ring[s % self.size]
        return e if e is not None and e[0] == s else None

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
        for e in sorted((e for e in self.ring if e is not None), key=lambda e: e[0]):
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


def describe(e, ranks=None):
    """``broadcast(src=1, float32, 100)``: a ring entry as a user would have written the call."""
    _, kind, count, dtype, root, op = e[:6]
    parts = []
    if root >= 0:
        shown = ranks[root] if ranks is not None and root < len(ranks) else root
        parts.append(f"{_ROOT_ARG.get(kind.split('_')[0], 'root')}={shown}")
    if dtype >= 0:
        parts.append(D.DTYPE_NAMES.get(dtype, f"dtype {dtype}"))
    if kind not in ("barrier", "monitored_barrier"):
        parts.append(str(count))
    if op >= 0:
        parts.append(f"op={D.OP_NAMES.get(op, op)}")
    return f"{kind}({', '.join(parts)})"


class Tracked:
    """``fn`` run as collective ``s`` of ``fr``: started, then completed or failed."""

    __slots__ = ("fr", "s", "fn", "__name__")

    def __init__(self, fr, s, fn):
        self.fr, self.s, self.fn = fr, s, fn
        self.__name__ = getattr(fn, "__name__", "operation")

    def __call__(self, *args):
        fr, s = self.fr, self.s
        fr.started = s
        try:
            self.fn(*args)
        except DistError as e:
            fr.fail(s, e)
            raise
        fr.done = s


def run(pg, s, fn, *args):
    """``pg.run(fn, *args)`` as collective ``s`` (a blocking call that may queue)."""
    try:
        pg.run(Tracked(pg.fr, s, fn), *args)
    except DistError as e:
        pg.fr.fail(s, e)  # a wait that ran out before the call ran
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
    return CollectiveRequest(pg.submit(fn, *args), fr, s)


def _base_submit():
    from .backends.base import Backend
    return Backend.submit


class CollectiveRequest:
    """An async collective's request, posted by the backend itself: done (or failed) once
    a wait or test sees it so."""

    __slots__ = ("_req", "_fr", "_s")

    def __init__(self, req, fr, s):
        self._req, self._fr, self._s = req, fr, s

    def _completed(self):
        if self._fr.done < self._s:
            self._fr.done = self._s

    def wait(self, timeout=None):
        try:
            self._req.wait(timeout)
        except DistError as e:
            self._fr.fail(self._s, e)
            raise
        self._completed()

    def test(self):
        done = self._req.test()
        if done and self._req.exception() is None:
            self._completed()
        return done

    def exception(self):
        return self._req.exception()

    @property
    def source(self):
        return self._req.source

    def __getattr__(self, name):
        return getattr(self._req, name)


def record(pg, kind, buf=None, root=-1, op=-1):
    """Record a collective on ``pg`` (``buf`` gives the count and dtype); its number."""
    if buf is None:
        return pg.fr.issue(kind)
    return pg.fr.issue(kind, buf.count, buf.dtype, root, op)


class P2PRequest:
    """A point-to-point request whose completion (or failure) is written to its entry."""

    __slots__ = ("_req", "_entry", "_fr")

    def __init__(self, req, entry, fr):
        self._req, self._entry, self._fr = req, entry, fr

    def _finished(self, exc):
        e = self._entry
        if e[7] in (COMPLETED, FAILED):
            return
        e[8] = now()
        if exc is None:
            e[7] = COMPLETED
        else:
            e[7], e[9] = FAILED, str(exc)
            if ENABLED and not getattr(exc, "_fr_seen", False):
                exc._fr_seen = True
                path = dump(reason=f"{e[1]} (peer {e[2]}, tag {e[3]}) in group {self._fr.name} "
                                   f"failed: {exc}")
                if path:
                    exc.args = (f"{exc} [flight recorder: {path}]",) + tuple(exc.args[1:])

    def wait(self, timeout=None):
        try:
            self._req.wait(timeout)
        except DistError as exc:
            # the operation failed, or a blocking send/recv gave up on it
            if self._entry[1] in ("send", "recv") or self._req.test():
                self._finished(exc)
            raise
        self._finished(None)

    def test(self):
        done = self._req.test()
        if done and self._entry[7] not in (COMPLETED, FAILED):
            self._finished(self._req.exception())
        return done

    def exception(self):
        return self._req.exception()

    @property
    def source(self):
        return self._req.source

    def __getattr__(self, name):  # backend extras (nbytes, add_done_callback, ...)
        return getattr(self._req, name)


def p2p(pg, kind, req, peer, tag, buf):
    """``req`` (a posted isend/irecv) recorded on ``pg``'s recorder."""
    fr = pg.fr
    return P2PRequest(req, fr.issue_p2p(kind, peer, tag, buf), fr)


# ---- the process's recorders --------------------------------------------------------------

_lock = threading.Lock()
_live = []  # (weakref to the group, recorder)
_ended = []  # recorders of destroyed groups, newest last
_global_rank = None
_world_size = None


def new_recorder(pg):
    """The recorder of a new group ``pg`` (registered for dumps and progress posts)."""
    import weakref
    fr = Recorder(pg.group_name, pg.ranks, pg._rank, str(pg.backend_name))
    with _lock:
        _prune()
        _live.append((weakref.ref(pg), fr))
    if ENABLED:
        _progress.agree_job(pg.store)
        _progress.ensure_started()
        _signals.install()
    return fr


def _prune():
    """Move recorders of destroyed groups to ``_ended`` (caller holds ``_lock``)."""
    keep = []
    for ref, fr in _live:
        pg = ref()
        if pg is None or getattr(pg, "destroyed", False):
            fr.ended = True
            _ended.append(fr)
        else:
            keep.append((ref, fr))
    _live[:] = keep
    del _ended[:-KEEP_ENDED]


def recorders():
    """This process's recorders: live groups first, then recently destroyed ones."""
    with _lock:
        _prune()
        return [fr for _, fr in _live] + list(reversed(_ended))


def live_recorders():
    with _lock:
        _prune()
        return [fr for _, fr in _live]


def global_rank():
    """This process's rank in the default group (the last one known after it is gone)."""
    global _global_rank, _world_size
    from ._world import world
    pg = world.default
    if pg is not None:
        _global_rank, _world_size = pg._rank, pg._size
    if _global_rank is not None:
        return _global_rank
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


# ---- dumps ------------------------------------------------------------------------------

def job_id():
    """The job's name in default dump paths: the launcher's run id, else one the ranks
    agreed on through the store (the first rank's start time, host and pid), else the
    store's address."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        v = os.environ.get(var, "").strip()
        if v and v != "none":
            return _safe(v)
    if _progress.job:
        return _progress.job
    if os.environ.get("MASTER_PORT"):
        return _safe(f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ['MASTER_PORT']}")
    # no store (mpi under mpiexec): the ranks of one host share their launcher's proxy
    return _safe(f"{socket.gethostname()}-{os.getppid()}")


def _safe(name):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def dump_prefix():
    """The path every rank's dump starts with (the global rank is appended)."""
    if DUMP_PREFIX:
        return DUMP_PREFIX
    return os.path.join(tempfile.gettempdir(), f"collectives-fr-{job_id()}-rank")


def _trace_arg(path):
    """What to pass collectives-trace for the job of dump ``path``."""
    prefix = dump_prefix()
    return prefix if path.startswith(prefix) else path


def snapshot(reason="on demand"):
    """This rank's flight recorder as a JSON-ready dict (the dump's content)."""
    offset = time.time_ns() - time.monotonic_ns()
    groups = {}
    for fr in recorders():
        name = fr.name if fr.name not in groups else f"{fr.name} (destroyed)"
        groups[name] = fr.snapshot(offset)
    return {"format": FORMAT, "version": VERSION, "rank": global_rank(), "world_size": _world_size,
            "pid": os.getpid(), "host": socket.gethostname(), "job": job_id(),
            "time": time.time(), "reason": reason, "buffer_size": BUFFER_SIZE, "groups": groups}


_dump_lock = threading.Lock()
_last_dump = [float("-inf")]  # monotonic time of this process's last dump


def dump(path=None, reason="on demand"):
    """Write this rank's flight recorder to ``path`` (default: the dump prefix followed by
    the global rank) as JSON; the path written, or None where writing failed (a warning
    says why: a dump never raises into the program)."""
    try:
        if path is None:
            path = f"{dump_prefix()}{global_rank()}"
        path = os.fspath(path)
        data = json.dumps(snapshot(reason), indent=1)
        d = os.path.dirname(os.path.abspath(path))
        with _dump_lock:
            os.makedirs(d, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, path)
            _last_dump[0] = time.monotonic()
        return path
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"collectives flight recorder: could not write a dump to {path}: {e!r}",
                      RuntimeWarning, stacklevel=2)
        return None


def dump_flight_recorder(path=None):
    """Write this rank's flight recorder (every group's last calls) to ``path`` as JSON.

    ``path`` defaults to the dump prefix (``TORCH_FR_DUMP_TEMP_FILE`` or
    ``COLLECTIVES_FR_DUMP``, else a file in the temp directory named after the job)
    followed by this rank's global rank. Returns the path written, or None if writing
    failed (a warning says why). Read a job's dumps with ``collectives-trace PREFIX``.

    Example:
        >>> path = dist.dump_flight_recorder()
    """
    return dump(path, "on demand (dump_flight_recorder)")


# ---- progress posts and dump requests through the store -----------------------------------

def _within(seconds, fn, *args):
    """fn(*args) in a daemon thread, waited for at most ``seconds``: (True, its result), or
    (False, None) if it is still running (a store across a cut link answers nothing until
    its own timeout; the user's error must not wait for it). Its exception is raised."""
    box = {}

    def target():
        try:
            box["ok"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            box["exc"] = e
    t = threading.Thread(target=target, daemon=True, name="collectives-flight-recorder-read")
    t.start()
    t.join(seconds)
    if "exc" in box:
        raise box["exc"]
    return ("ok" in box), box.get("ok")


class _Progress:
    """The daemon thread that posts this process's progress to the job's store, and the
    error path's reading of the other ranks' posts."""

    def __init__(self):
        self.thread = None
        self.pid = None
        self.lock = threading.Lock()
        self.store_lock = threading.RLock()
        self.store = None  # a clone of the world's store, with a short timeout
        self.store_of = None  # the world store it was cloned from
        self.job = None
        self.job_root = None  # the store the job's name was agreed through
        self.wake_r = None  # the signal wakeup pipe's read end (see _Signals)
        self.seen_requests = None
        self.sig_daemon = self.sig_main = 0  # SIGUSR1s the daemon, the main thread has seen
        self.down = float("-inf")  # when the error path last found the store unreachable

    # -- the store --------------------------------------------------------------------
    def _store(self):
        from ._world import world
        with self.store_lock:  # the daemon and a failing call may both ask first
            root = world.store
            if root is None:
                return None
            if root is not self.store_of:
                self._forget_store()
                st = root.clone()
                if st is not root:
                    st.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
                self.store, self.store_of = st, root
                self.seen_requests = None
            return self.store

    def _forget_store(self):
        with self.store_lock:
            st, root, self.store, self.store_of = self.store, self.store_of, None, None
        if st is not None and st is not root:
            try:
                st.close()  # its connection would keep a closed master serving (linger)
            except Exception:  # noqa: BLE001
                pass

    def ensure_started(self):
        with self.lock:
            if self.thread is not None and self.thread.is_alive() and self.pid == os.getpid():
                return
            self.pid = os.getpid()
            self.thread = threading.Thread(target=self._loop, daemon=True,
                                           name="collectives-flight-recorder")
            self.thread.start()

    def _loop(self):
        posted, last_post, last_poll = None, 0.0, 0.0
        first = True
        while True:
            r = self.wake_r
            if first:  # agree on the job's name and post at once
                first = False
                time.sleep(0.05)  # (init_process_group sets the world's store just after the group)
            elif r is not None:
                try:
                    ready, _, _ = select.select([r], [], [], TICK_S)
                except (OSError, ValueError):
                    ready = []
                if ready:
                    self._drain(r)
            else:
                time.sleep(TICK_S)
            frs = live_recorders()
            if not frs:
                with self.lock:
                    from ._world import world
                    if world.default is None and not live_recorders():
                        self.thread = None  # a later group starts another
                        self._forget_store()
                        return
                continue
            try:
                st = self._store()
                if st is None:
                    continue
                t = time.monotonic()
                state = {fr.name: fr.progress() for fr in frs}
                if state != posted or t - last_post >= HEARTBEAT_S:
                    self.post(st, state)
                    posted, last_post = state, t
                if t - last_poll >= POLL_S - 0.1:  # (ticks come a little early or late)
                    last_poll = t
                    self._poll_requests(st)
            except Exception as e:  # noqa: BLE001  (store gone: the job is ending)
                _log.debug("collectives flight recorder: progress post failed: %r", e)
                time.sleep(HEARTBEAT_S)

    def _drain(self, r):
        """Read the signal wakeup pipe; dump if SIGUSR1 came."""
        try:
            got = os.read(r, 512)
        except OSError:
            return
        n = got.count(int(signal.SIGUSR1))
        if n:
            # each signal dumps once: here (at once), or in the main thread's handler if that
            # ran first (it runs when the main thread is back in Python, which may be late)
            self.sig_daemon += n
            if self.sig_daemon > self.sig_main:
                dump(reason="SIGUSR1")

    def agree_job(self, st):
        """Agree with the other ranks on the job's name, through a new group's store ``st``
        (at init: the first group is the default one, the same on every rank; again only
        once the world's store is another one, after a new init)."""
        if st is None:
            return
        root = getattr(st, "underlying_store", st)
        if self.job is not None and self.job_root is root:
            return
        mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{os.getpid()}"
        try:
            got = st.compare_set(f"{KEY}/job", "", mine)
        except Exception as e:  # noqa: BLE001  (then the job's name comes from its address)
            _log.debug("collectives flight recorder: no job name from the store: %r", e)
            return
        got = got.decode() if isinstance(got, (bytes, bytearray)) else str(got)
        self.job, self.job_root = _safe(got or mine), root

    def post(self, st, state):
        st.set(f"{KEY}/progress/{global_rank()}",
               json.dumps({"t": time.time(), "pid": os.getpid(), "host": _HOST, "groups": state}))

    def _poll_requests(self, st):
        n = int(st.add(f"{KEY}/dump", 0))
        if self.seen_requests is None:
            self.seen_requests = n  # requests before this process came are not for it
            return
        if n > self.seen_requests:
            first, self.seen_requests = self.seen_requests + 1, n
            try:
                why = st.get(f"{KEY}/dump/{n}")
                why = why.decode() if isinstance(why, (bytes, bytearray)) else str(why)
            except Exception:  # noqa: BLE001
                why = "another rank's call failed"
            if time.monotonic() - _last_dump[0] > POLL_S + TICK_S:  # else this rank's is fresh
                dump(reason=f"requested by another rank: {why}")
            for k in range(first, n + 1):
                st.add(f"{KEY}/ack/{k}", 1)

    # -- the error path ---------------------------------------------------------------
    def request_dumps(self, fr, s):
        """Ask every rank's daemon for a dump and wait (at most ACK_WAIT_S) until they wrote
        one."""
        try:
            _within(ACK_WAIT_S, self._request_dumps, fr, s)
        except Exception as e:  # noqa: BLE001
            _log.debug("collectives flight recorder: dump request failed: %r", e)

    def _request_dumps(self, fr, s):
        st = self._store()
        if st is None or time.monotonic() - self.down < 2 * STORE_TIMEOUT_S:
            return
        why = f"rank {global_rank()}: {fr.describe_seq(s)} in group {fr.name} failed"
        n = int(st.add(f"{KEY}/dump", 1))
        st.set(f"{KEY}/dump/{n}", why)
        acks = int(st.add(f"{KEY}/ack/{n}", 1))
        deadline = time.monotonic() + ACK_WAIT_S
        want = _world_size or len(fr.ranks)
        while acks < want and time.monotonic() < deadline:
            time.sleep(0.05)
            acks = int(st.add(f"{KEY}/ack/{n}", 0))

    def read(self, fr):
        """{global rank: (age in s, [issued, completed, last issued, last completed, failed])
        or None} for the other ranks of ``fr``'s group, from their posts."""
        st = self._store()
        if st is None:
            return None
        self.post(st, {f.name: f.progress() for f in live_recorders()})
        out = {}
        deadline = time.monotonic() + STORE_TIMEOUT_S
        for g in fr.ranks:
            if g == fr.ranks[fr.rank] or time.monotonic() > deadline:
                continue
            key = f"{KEY}/progress/{g}"
            if not st.check([key]):
                out[g] = None
                continue
            raw = st.get(key)
            post = json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)
            out[g] = (max(0.0, time.time() - post["t"]), post["groups"].get(fr.name),
                      _gone(post.get("host"), post.get("pid")))
        return out

    def explain(self, fr, s, text):
        """The lead of a timeout's message: which ranks never joined collective ``s``."""
        m = re.search(r"Timed out waiting (\d+)ms", text)
        after = f" after {int(m.group(1)) / 1000:g} s" if m else ""
        head = f"{fr.describe_seq(s)} in group {fr.name} timed out{after}"
        try:
            done, posts = _within(READ_WAIT_S, self.read, fr)
        except Exception as e:  # noqa: BLE001
            self.down = time.monotonic()  # no dump requests through it either
            return f"{head} (the other ranks' progress could not be read: {e}). "
        if not done:
            self.down = time.monotonic()
            return (f"{head} (the other ranks' progress could not be read: the store did not "
                    f"answer within {READ_WAIT_S:g} s). ")
        if posts is None:
            return f"{head} (no store to read the other ranks' progress from). "
        mine = fr.entry(s)
        missing, notes = [], []
        for g, post in sorted(posts.items()):
            if post is None or post[1] is None:
                notes.append(f"rank {g} posted no progress")
                missing.append(g)
                continue
            age, (issued, done, last, fin, failed), gone = post
            stale = f" (posted {age:.0f} s ago: dead or stuck?)" if age > STALE_S else ""
            if gone:
                stale = f" (its process {gone} is gone: it died)"
            if issued < s:
                missing.append(g)
                where = f"last completed #{done} {fin}" if done else "completed no collective"
                if issued > done:
                    where += f", is still in #{issued} {last}"
                notes.append(f"rank {g} {where}{stale}")
            elif done >= s:
                notes.append(f"rank {g} completed #{s}{stale}")
            elif issued == s and mine is not None and last != describe(mine, fr.ranks):
                notes.append(f"rank {g} called {last} as #{s}{stale}")
            else:
                notes.append(f"rank {g} is in #{s}{stale}")
        who = (f": ranks {{{', '.join(map(str, missing))}}} did not join it" if missing
               else ": every rank joined it")
        return f"{head}{who} ({'; '.join(notes)}). "


_progress = _Progress()


def _host():
    """This host and pid namespace: where a peer's pid can be looked up."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{socket.gethostname()}|{ns}"


_HOST = _host()


def _gone(host, pid):
    """``pid`` where that process of this host no longer exists, else None."""
    if host != _HOST or "?" in _HOST or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except OSError:  # exists (another user's, say)
        return None
    return None


# ---- SIGUSR1 ----------------------------------------------------------------------------

class _Signals:
    """SIGUSR1 dumps. The handler is installed only where the program has none (else it
    is chained: ours dumps, then calls the program's). Python runs handlers in the main
    thread only, which may be waiting inside a collective with the GIL released; so where
    the program has set no wakeup fd, the daemon thread also hears the signal through one
    and dumps at once."""

    def __init__(self):
        self.installed = False
        self.previous = None

    def install(self):
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        if not hasattr(signal, "SIGUSR1"):
            return
        self.installed = True
        try:
            prev = signal.getsignal(signal.SIGUSR1)
            if prev is not signal.SIG_DFL and not callable(prev):
                return  # ignored on purpose (SIG_IGN), or handled outside Python: left alone
            self.previous = prev if callable(prev) else None
            signal.signal(signal.SIGUSR1, self._handler)
            r, w = os.pipe()
            os.set_blocking(w, False)
            os.set_blocking(r, False)
            try:
                old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except (ValueError, OSError):
                old = -2
            if old != -1:  # the program uses its own wakeup fd: leave it
                if old >= 0:
                    signal.set_wakeup_fd(old)
                os.close(r)
                os.close(w)
            else:
                _progress.wake_r = r
        except Exception as e:  # noqa: BLE001
            _log.debug("collectives flight recorder: no SIGUSR1 handler: %r", e)

    def _handler(self, signum, frame):
        _progress.sig_main += 1
        if _progress.sig_main > _progress.sig_daemon:  # the daemon did not dump for this one
            dump(reason="SIGUSR1")
        if self.previous is not None:
            self.previous(signum, frame)


_signals = _Signals()

__all__ = ["dump_flight_recorder"]
