"""The launchers' own rendezvous (``collectives-run --rdzv-backend c10d``), as torchrun's
c10d rendezvous: the launchers of a job find each other through a store at
``--rdzv-endpoint`` and number their nodes themselves, so no ``--node-rank`` is needed.

The launcher that can serve the store there (the endpoint's host; the first to bind it,
where several launchers share that host) is node 0, and its rank 0 serves the ranks'
store (MASTER_ADDR is the endpoint's host, MASTER_PORT a free port it posts). The others
number themselves 1, 2... in the order they join. Launchers meet in rounds:

* a round closes when ``--nnodes`` MAX nodes have joined, or MIN have and
  ``last_call_timeout`` seconds (``--rdzv-conf``, default 30) have passed since the MIN-th;
  fewer than MIN within ``join_timeout`` (default 600) fails the launch;
* a node that arrives after its round closed waits for the next one; node 0 then starts
  that next round (every node restarts its ranks with the new world) while the job has
  fewer than MAX nodes, as torchrun's elastic agent does: not counted in ``--max-restarts``;
* a rank that fails makes every node restart its ranks in a new round while
  ``--max-restarts`` allows (TORCHELASTIC_RESTART_COUNT counts these), and end with the
  failure otherwise; a launcher that is stopped by a signal ends the job everywhere;
* a node whose ranks all succeeded waits for the others; the job ends when every node's
  have. Node 0 keeps the store until the others have left (or ``close_timeout``).

A store that stops answering (its node crashed, or the network between is cut: nothing
resets the connection) ends the launcher's part of the job ``read_timeout`` seconds
(default 60) after its last answer; its ranks then have ``read_timeout`` seconds more to
end on their own (a rank whose peers are across the cut fails its collective at the
group's timeout, with a message that says more than the launcher can) before it stops
them. Each request waits at most OP_TIMEOUT seconds and is tried again meanwhile, so a
launcher stays responsive: it keeps relaying its ranks' output, notices their failures
and obeys a signal while the store is silent.

Keys live under ``collectives-run/<rdzv-id>/``.
"""
import socket
import time
from datetime import timedelta

POLL_S = 0.05
OP_TIMEOUT = 5.0  # seconds one request to the rendezvous store may wait for its answer

# torchrun's --rdzv-conf keys this rendezvous reads, with torchrun's defaults
CONF_DEFAULTS = {"join_timeout": 600.0, "last_call_timeout": 30.0, "close_timeout": 30.0,
                 "read_timeout": 60.0}


def parse_conf(text):
    """``--rdzv-conf key=value,key=value``: the known keys as floats (the others torchrun
    reads, such as ``is_host``, are accepted and left alone)."""
    conf = dict(CONF_DEFAULTS)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--rdzv-conf entries must be key=value, got {item!r}")
        key = key.strip()
        if key in CONF_DEFAULTS:
            try:
                conf[key] = float(value)
            except ValueError:
                raise ValueError(f"--rdzv-conf {key} must be a number of seconds, "
                                 f"got {value!r}") from None
            if not conf[key] >= 0:
                raise ValueError(f"--rdzv-conf {key} must be >= 0, got {value!r}")
    return conf


def is_local(host):
    """Whether ``host`` names an address of this machine (one a socket can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


class Stop(Exception):
    """The job is over for this launcher: the message says why (a rank failed elsewhere
    and no restart is left, a launcher was stopped, the store was lost)."""


class Silent(Exception):
    """The rendezvous store did not answer one request in time (not yet for long)."""


class NodeRendezvous:
    """One launcher's side of the rendezvous (see the module's docstring)."""

    def __init__(self, host, port, run_id, min_nodes, max_nodes, conf, free_port,
                 stopped=lambda: False, auth_key=None):
        from ..security.auth import AuthError
        from ..core.errors import DistError
        from ..store import TCPStore
        self._DistError = DistError
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.conf = conf
        self.free_port = free_port
        self.stopped = stopped  # true once the launcher got a signal: waits end
        self.host = host
        self.prefix = f"collectives-run/{run_id}/"
        self.read_timeout = max(conf["read_timeout"], 0.1)
        self.op_timeout = min(OP_TIMEOUT, self.read_timeout)
        self.lost = None  # why the store is lost, once it is: no more requests then
        self.silent = False  # the last request got no answer
        self._last_answer = time.monotonic()
        tmo = timedelta(seconds=max(conf["join_timeout"], 1.0))
        self.is_host = False
        self.store = None
        if is_local(host):
            try:
                self.store = TCPStore(host, port, None, True, tmo, wait_for_workers=False,
                                      multi_tenant=False, auth_key=auth_key)
                self.is_host = True
            except DistError:  # another launcher on this host serves it
                pass
        deadline = time.monotonic() + conf["join_timeout"]
        while self.store is None:  # in short tries, so that a signal ends the wait
            try:
                self.store = TCPStore(host, port, None, False, timedelta(seconds=1),
                                      wait_for_workers=False, auth_key=auth_key)
            except AuthError as e:  # (security) trying again will not help
                raise Stop(f"the rendezvous store at {host}:{port} refused this launcher: {e}") from e
            except DistError as e:
                if stopped() or time.monotonic() > deadline:
                    why = "stopped by a signal" if stopped() else \
                        f"join_timeout={conf['join_timeout']:g} s passed"
                    raise Stop(f"cannot reach the rendezvous store at {host}:{port} ({why}): "
                               f"{e}") from e
        self.round = None
        self.node_rank = None
        self.nnodes = None
        self.nprocs = None
        self.master_port = None
        self._next_poll = 0.0

    def _k(self, *parts):
        return self.prefix + "/".join(str(p) for p in parts)

    def _call(self, fn, *args, once=False, wait=True, timeout=None):
        """``fn(*args)`` on the store. A request that gets no answer within OP_TIMEOUT is
        made again until ``read_timeout`` has passed (or a signal came); ``once``: a
        request that must not be made twice (an add of 1) waits ``read_timeout`` once, or
        ``timeout``. ``wait=False``: one try, then Silent, unless the store has not
        answered for ``read_timeout``. Raises Stop when the store is lost."""
        from ..core.errors import DistNetworkError, DistStoreError
        if self.lost:
            raise Stop(self.lost)
        deadline = (time.monotonic() if wait else self._last_answer) + self.read_timeout
        if timeout is None:
            timeout = self.read_timeout if once else self.op_timeout
        while True:
            self.store.set_timeout(timedelta(seconds=timeout))
            try:
                out = fn(*args)
                self._last_answer = time.monotonic()
                self.silent = False
                return out
            except (DistStoreError, DistNetworkError) as e:
                silent = isinstance(e.__cause__, (socket.timeout, TimeoutError)) \
                    or "could not connect" in str(e)
                self.silent = silent
                if not silent or once or time.monotonic() >= deadline:
                    self.lost = f"lost the rendezvous store at {self.host}: " + (
                        f"no answer within read_timeout={self.conf['read_timeout']:g} s"
                        if silent else str(e))
                    raise Stop(self.lost) from e
                if not wait:
                    raise Silent() from e
                if self.stopped():
                    raise Stop("stopped by a signal while the rendezvous store did not "
                               "answer") from e
            except self._DistError as e:
                self.lost = f"lost the rendezvous store at {self.host}: {e}"
                raise Stop(self.lost) from e

    def _get(self, key):
        """The value at ``key`` once some launcher has set it; Stop when this launcher gets
        a signal meanwhile, or after join_timeout."""
        deadline = time.monotonic() + self.conf["join_timeout"]
        while not self._call(self.store.check, [key]):
            if self.stopped():
                raise Stop("stopped by a signal while waiting for the other nodes")
            if time.monotonic() > deadline:
                raise Stop(f"the rendezvous did not go on within join_timeout="
                           f"{self.conf['join_timeout']:g} s (waiting for {key!r})")
            time.sleep(POLL_S)
        return self._call(self.store.get, key)

    # ---- joining a round ---------------------------------------------------------------

    def join(self, nproc):
        """Join the next round (the current one, on first joining) with ``nproc`` ranks;
        returns once it has closed with this node in it: sets ``round``, ``node_rank``,
        ``nnodes``, ``nprocs`` (every node's rank count, by node rank), ``master_port``."""
        s = self.store
        if self.is_host:
            rnd = 0 if self.round is None else self.round + 1
            self._call(s.set, self._k("round"), str(rnd))
            self._close(rnd)
            self.round, self.node_rank = rnd, 0
        else:
            rnd = int(self._get(self._k("round"))) if self.round is None else self.round + 1
            while True:
                idx = int(self._call(s.add, self._k(rnd, "clients"), 1, once=True))
                nnodes = int(self._get(self._k(rnd, "nnodes")))
                self._check_failed()
                if idx < nnodes:
                    break
                # too late for this round: wait in the next one (and ask for it)
                self._call(s.add, self._k(rnd, "late"), 1, once=True)
                rnd += 1
            self.round, self.node_rank = rnd, idx
        self.nnodes = int(self._get(self._k(self.round, "nnodes")))
        self.master_port = int(self._get(self._k(self.round, "master_port")))
        self._call(s.set, self._k(self.round, "nproc", self.node_rank), str(nproc))
        self.nprocs = [int(self._get(self._k(self.round, "nproc", i))) for i in range(self.nnodes)]
        return self

    def _close(self, rnd):
        """Node 0: wait for the round's nodes, then fix its size and the ranks' port."""
        s = self.store
        start = time.monotonic()
        enough_at = None
        while True:
            self._check_failed()  # (a waiting launcher got a signal)
            if self.stopped():
                raise Stop("stopped by a signal while waiting for the other nodes")
            n = 1 + int(self._call(s.add, self._k(rnd, "clients"), 0))
            now = time.monotonic()
            if n >= self.max_nodes:
                break
            if n >= self.min_nodes:
                enough_at = enough_at or now
                if now - enough_at >= self.conf["last_call_timeout"]:
                    break
            elif now - start > self.conf["join_timeout"]:
                self._call(s.set, self._k("failed"),
                           f"only {n} of {self.min_nodes} nodes joined within "
                           f"{self.conf['join_timeout']:g} s")
                raise Stop(f"only {n} of at least {self.min_nodes} nodes joined the rendezvous "
                           f"within join_timeout={self.conf['join_timeout']:g} s")
            time.sleep(POLL_S)
        self._call(s.set, self._k(rnd, "master_port"), str(self.free_port()))
        self._call(s.set, self._k(rnd, "nnodes"), str(min(n, self.max_nodes)))

    def _check_failed(self, wait=True):
        """Stop if some launcher ended the job (``wait``: as ``_call``'s)."""
        if self._call(self.store.check, [self._k("failed")], wait=wait):
            raise Stop(self._call(self.store.get, self._k("failed"), wait=wait)
                       .decode(errors="replace"))

    # ---- while the ranks run -----------------------------------------------------------

    def poll(self, now):
        """Called often while this node's ranks run: why they must stop now, or None.
        Node 0 also starts the next round when a node waits and the job is below MAX."""
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_S * 2
        try:
            return self._poll()
        except Silent:  # no news this time; the ranks run on until read_timeout
            return None
        except Stop as e:  # "lost": the store; the ranks get a grace to fail on their own
            return ("lost" if self.lost else "failed", str(e))

    def _poll(self):
        s, rnd = self.store, self.round

        def call(fn, *args):  # one try each: the launcher's loop must not stall
            return self._call(fn, *args, wait=False)

        self._check_failed(wait=False)
        if call(s.check, [self._k(rnd, "restart")]):
            return ("restart", call(s.get, self._k(rnd, "restart")).decode(errors="replace"))
        if self.is_host and self.nnodes < self.max_nodes \
                and int(call(s.add, self._k(rnd, "late"), 0)):
            why = self.restart("S", "a node joined")
            return ("restart", why)
        return None

    def restart(self, kind, why):
        """Ask every node to restart its ranks in the next round; ``kind`` "F" for a failure
        (counted in --max-restarts), "S" for a new node. Returns the round's reason, which
        is an earlier node's where one asked first."""
        key = self._k(self.round, "restart")
        want = f"{kind}: {why}"
        got = self._call(self.store.compare_set, key, "", want)
        return got.decode(errors="replace") if isinstance(got, bytes) else str(got)

    def fail(self, why):
        """End the job on every node (no restart left, or this launcher was stopped); a
        store that is lost, or did not answer the last request, is left alone."""
        if self.silent:
            return
        try:
            self._call(self.store.compare_set, self._k("failed"), "", why, wait=False)
        except (Stop, Silent):
            pass

    def finish(self, stopped):
        """This node's ranks all succeeded: wait for the other nodes'. Returns None when the
        job is done everywhere, or ``poll``'s answer when a round restart or a failure comes
        first. ``stopped()`` is true once the launcher got a signal."""
        s = self.store
        self._call(s.add, self._k(self.round, "done"), 1, once=True)
        while True:
            if stopped():
                return ("signal", "")
            if int(self._call(s.add, self._k(self.round, "done"), 0)) >= self.nnodes:
                break
            ev = self.poll(time.monotonic())
            if ev is not None:
                return ev
            time.sleep(POLL_S)
        return None

    def close(self):
        """Leave: the other launchers say so; node 0 keeps the store up until those of the
        last round have (or ``close_timeout`` passed), so that they read how the job ended."""
        s = self.store
        try:
            if not self.is_host:
                if not self.silent:
                    self._call(s.add, self._k("left"), 1, once=True, timeout=self.op_timeout)
            else:
                deadline = time.monotonic() + self.conf["close_timeout"]
                while int(self._call(s.add, self._k("left"), 0)) < (self.nnodes or 1) - 1 \
                        and time.monotonic() < deadline:
                    time.sleep(POLL_S)
        except Stop:
            pass
        s.close()
