"""The flight recorder's output (see :mod:`collectives.diagnostics.flight_recorder`): dumps (a rank's
recorders as a JSON file), and the daemon thread that posts this process's progress to
the job's store, answers the other ranks' dump requests, and the error path's reading of
the other ranks' posts (the job's name, in default dump paths, is agreed through it)."""
import json
import logging
import os
import re
import select
import signal
import socket
import tempfile
import threading
import time
import warnings
import weakref
from datetime import timedelta

from .. import config
from .fr_registry import (BUFFER_SIZE, DUMP_PREFIX, describe, global_rank, live_recorders,
                          recorders, world_size)

_log = logging.getLogger("collectives")

FORMAT = "collectives-flight-recorder"
VERSION = 1

TICK_S = 0.5  # the daemon's period: progress that changed is posted within it
HEARTBEAT_S = 2.0  # unchanged progress is posted again this often (a silent rank is dead or stuck)
POLL_S = 0.5  # how often the daemon looks for another rank's dump request
STALE_S = 2 * HEARTBEAT_S + 1.5  # a post older than this: the rank died or is stuck
STORE_TIMEOUT_S = 3.0  # any store call of the recorder's daemon
READ_WAIT_S = 1.0  # a failing rank waits at most this long for the other ranks' progress
ACK_WAIT_S = 1.5  # ... and at most this long for the others to write their dumps
KEY = "collectives_fr"  # the store keys' prefix
WAIT_WARN_S = config.get("COLLECTIVES_WAIT_WARN_S")  # a collective waiting this long is logged
now = time.monotonic_ns  # the flight recorder's clock (its entries' issue times)


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
    return {"format": FORMAT, "version": VERSION, "rank": global_rank(), "world_size": world_size(),
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

def set_ack_wait(seconds):
    """How long a failing call waits for the other ranks' dumps (ACK_WAIT_S): collectives.
    elastic sets 0, as a failure there is followed at once by a new group, and the dead
    rank's dump never comes (the others still write theirs, in their daemons)."""
    global ACK_WAIT_S
    ACK_WAIT_S = float(seconds)


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
        self.req_lock = threading.Lock()  # the daemon and a failing call both answer requests
        self.mine = set()  # the numbers of this process's own dump requests
        self.sig_daemon = self.sig_main = 0  # SIGUSR1s the daemon, the main thread has seen
        self.down = float("-inf")  # when the error path last found the store unreachable
        self.warned = weakref.WeakKeyDictionary()  # recorder -> (seq warned of, next level in s)

    # -- the store --------------------------------------------------------------------
    def _store(self):
        from ..core.world import world
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
                self.mine = set()
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
                    from ..core.world import world
                    if world.default is None and not live_recorders():
                        self.thread = None  # a later group starts another
                        self._forget_store()
                        return
                continue
            try:  # (before the posts: a job without a store, or whose store is gone, warns too)
                self.watch(frs)
            except Exception as e:  # noqa: BLE001
                _log.debug("collectives flight recorder: wait check failed: %r", e)
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
        with self.req_lock:
            self._answer_requests(st)

    def _answer_requests(self, st):
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
                if k not in self.mine:  # this rank's own request counts its ack once
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
        self.mine.add(n)
        st.set(f"{KEY}/dump/{n}", why)
        acks = int(st.add(f"{KEY}/ack/{n}", 1))
        deadline = time.monotonic() + ACK_WAIT_S
        want = world_size() or len(fr.ranks)
        while acks < want and time.monotonic() < deadline:
            time.sleep(0.01)
            # answer the requests of the ranks failing beside this one (this rank's dump is
            # fresh): else each waits for the others' daemons, whose poll comes every POLL_S
            # (a mismatch, which fails every rank at once, raised 0.5 s late)
            if self.seen_requests is not None:
                self._poll_requests(st)
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

    def whereabouts(self, fr, s, mark_down):
        """``(missing ranks, notes)`` of collective ``s`` from the other ranks' progress
        posts, or why they could not be read (a str). ``mark_down``: a store that failed
        takes no dump requests either."""
        try:
            done, posts = _within(READ_WAIT_S, self.read, fr)
        except Exception as e:  # noqa: BLE001
            if mark_down:
                self.down = time.monotonic()
            return f"the other ranks' progress could not be read: {e}"
        if not done:
            if mark_down:
                self.down = time.monotonic()
            return (f"the other ranks' progress could not be read: the store did not answer "
                    f"within {READ_WAIT_S:g} s")
        if posts is None:
            return "no store to read the other ranks' progress from"
        return _whereabouts(fr, s, posts)

    def explain(self, fr, s, text):
        """The lead of a timeout's message: which ranks never joined collective ``s``."""
        m = re.search(r"Timed out waiting (\d+)ms", text)
        after = f" after {int(m.group(1)) / 1000:g} s" if m else ""
        head = f"{fr.describe_seq(s)} in group {fr.name} timed out{after}"
        return self._who(fr, s, head, True, "did not join it", "joined it") + ". "

    # -- a collective that waits long -------------------------------------------------
    def watch(self, frs):
        """Warn (once, then at doubling intervals) for each group whose oldest unfinished
        collective has waited longer than COLLECTIVES_WAIT_WARN_S: its number and call, and
        the ranks that have not joined it (from their progress posts)."""
        if WAIT_WARN_S <= 0:
            return
        t = now()
        for fr in frs:
            s = fr.done + 1
            if s > fr.seq or any(k >= s for k in list(fr.failures)):  # idle, or failed
                continue
            e = fr.entry(s)
            if e is None:
                continue
            waited = (t - e[6]) / 1e9
            seen, level = self.warned.get(fr, (None, WAIT_WARN_S))
            if seen != s:
                level = WAIT_WARN_S
            if waited < level:
                continue
            self.warned[fr] = (s, 2 * level)
            _log.warning("collectives: %s", self.waiting(fr, s, waited))

    def waiting(self, fr, s, waited):
        """The warning's text: rank R has waited N s in collective #s, and who is missing."""
        head = (f"rank {global_rank()} has waited {waited:.0f} s in {fr.describe_seq(s)} "
                f"in group {fr.name}")
        return self._who(fr, s, head, False, "have not arrived", "has arrived",
                         tail="; still waiting, up to the group's timeout")

    def _who(self, fr, s, head, mark_down, missing_did, every_did, tail=""):
        """``head``, then the ranks missing from collective ``s`` ("ranks {..} <missing_did>",
        or "every rank <every_did>") and what each other rank is doing, then ``tail``; or
        ``head`` and why their progress could not be read."""
        found = self.whereabouts(fr, s, mark_down=mark_down)
        if isinstance(found, str):
            return f"{head} ({found})"
        missing, notes = found
        who = (f": ranks {{{', '.join(map(str, missing))}}} {missing_did}" if missing
               else f": every rank {every_did}")
        return f"{head}{who} ({'; '.join(notes)}){tail}"


def _whereabouts(fr, s, posts):
    """([ranks that have not issued collective ``s``], [what each other rank is doing]),
    from their progress posts."""
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
    return missing, notes


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
