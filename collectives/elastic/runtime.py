"""Membership of an elastic job: generations agreed through a store outside the ranks.

A *generation* is one default process group: its members (process ids, in rank order)
are decided once, written to the store under ``gen/<g>`` by compare-and-set, so every
process reads the same list. The keys it uses on the store, under ``elastic/<job>/``,
are listed in :mod:`collectives.store.elastic_job`.

Deciding generation g (every process that came to it runs the same loop; the first
compare-and-set wins): ready when every member of g-1 whose lease is alive has come, or
after ``COLLECTIVES_ELASTIC_TIMEOUT`` (a live member that never comes is left out; it
rejoins as a newcomer). The members are those of g-1 that came, in their old rank order,
then the newcomers in arrival order, at most ``max_np``. Fewer than ``min_np``: wait for
newcomers up to the timeout, then :class:`ElasticError`. The first generation waits for
``np`` processes (or, after SETTLE seconds, at least ``min_np``).
"""
import datetime
import os
import secrets
import socket
import threading
import time

from .. import config
from ..core.errors import DistError
from ..store.elastic_job import (decide, decided, done_key, gen_key, here_entries, latest,
                                 members_of, prefix)

POLL = 0.05  # seconds between looks at a generation being decided
SETTLE = 30.0  # seconds the first generation waits for np processes before it starts with min_np
FORM_TIMEOUT = 15.0  # seconds a generation's members may take to meet in its new group
SWITCH_GRACE = 3.0  # seconds after a move to a successor store before an unleased member counts as dead


class ElasticError(RuntimeError):
    """The elastic job cannot go on (too few members for longer than the timeout, or this
    process was not admitted). Not a DistError: ``elastic.run`` does not retry it."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``State.commit()`` on every member when newcomers wait to be admitted:
    ``elastic.run`` forms the next generation with them (the state was just committed)."""


_runtime = None


def current():
    if _runtime is None:
        raise ValueError("collectives.elastic: call elastic.init() first (after it, "
                         "the default process group is the job's current generation)")
    return _runtime


def shutdown():
    """Leave the job: destroy the default group and close the store connections (the
    other members are not disturbed)."""
    global _runtime
    rt, _runtime = _runtime, None
    if rt is None:
        return
    rt.finish()
    rt._drop_groups()
    rt.close()


def _connect(address, timeout):
    from ..store.failover import FailoverStore, parse_addresses
    return FailoverStore(parse_addresses(address), timeout)


def init(store=None, *, job=None, np=None, min_np=None, max_np=None, backend=None,
         timeout=None, rendezvous_timeout=None):
    """Join the elastic job and make its current generation this process's default group.

    Args:
        store: the job's store: a TCPStore client, or "host:port" (default:
            COLLECTIVES_ELASTIC_STORE). It must be served outside the training
            processes (collectives-run's supervisor, ``python -m collectives.elastic.store``),
            so that any training process may die.
        job: the job's name (COLLECTIVES_ELASTIC_JOB, default "job").
        np: processes the first generation waits for (COLLECTIVES_ELASTIC_NP, else
            WORLD_SIZE, else min_np).
        min_np, max_np: the bounds on a generation's size.
        backend: the default group's backend ('gloo').
        timeout: seconds any collective wait may take (default 60).
        rendezvous_timeout: COLLECTIVES_ELASTIC_TIMEOUT's seconds.

    A process started after the job began is a newcomer: this call returns once the
    members admit it, at their next ``state.commit()``.
    """
    global _runtime
    if _runtime is not None:
        raise ValueError("collectives.elastic.init: already initialised in this process")
    import collectives as api
    if api.is_initialized():
        raise ValueError("collectives.elastic.init makes the default process group itself; "
                         "call it instead of init_process_group, not after it")
    min_np = config.get("COLLECTIVES_ELASTIC_MIN_NP") if min_np is None else min_np
    max_np = config.get("COLLECTIVES_ELASTIC_MAX_NP") if max_np is None else max_np
    for name, v in (("min_np", min_np), ("max_np", max_np), ("np", np)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if max_np is not None and max_np < min_np:
        raise ValueError(f"max_np ({max_np}) must be >= min_np ({min_np})")
    if np is None:
        np = config.get("COLLECTIVES_ELASTIC_NP")
    if np is None and os.environ.get("WORLD_SIZE", "").isdigit():
        np = int(os.environ["WORLD_SIZE"])
    np = max(np or min_np, min_np)
    if max_np is not None:
        np = min(np, max_np)
    timeout = 60.0 if timeout is None else float(timeout)
    rdzv = config.get("COLLECTIVES_ELASTIC_TIMEOUT") if rendezvous_timeout is None \
        else float(rendezvous_timeout)
    if store is None:
        store = config.get("COLLECTIVES_ELASTIC_STORE")
        if store is None:
            raise ValueError("collectives.elastic.init: no store: pass store= (a TCPStore or "
                             "'host:port') or set COLLECTIVES_ELASTIC_STORE (collectives-run "
                             "--min-np/--max-np does)")
    if isinstance(store, str):
        from ..store.failover import parse_addresses
        host, port = parse_addresses(store)[0]  # a bad one is a ValueError before anything is sent
        if not any(os.environ.get(v) for v in ("MASTER_ADDR", "COLLECTIVES_IFNAME",
                                               "GLOO_SOCKET_IFNAME")):
            # ranks publish the address of the interface that routes to the store
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
        store = _connect(store, max(timeout, 30.0))
    if not hasattr(store, "lease") or not hasattr(store, "clone"):
        raise TypeError(f"the elastic store must be a TCPStore (it leases each process's "
                        f"liveness on its connection), got {type(store).__name__}")
    from ..diagnostics import progress
    progress.set_ack_wait(0.0)  # a failure is followed by a new group, not by a wait for dumps
    rt = Runtime(store, job or config.get("COLLECTIVES_ELASTIC_JOB"), np, min_np, max_np,
                 backend, timeout, rdzv)
    _runtime = rt
    try:
        rt.join()
    except BaseException:
        _runtime = None
        rt.close()
        raise
    return rt


class Runtime:
    """This process's view of the job: its id, the current generation and its members."""

    def __init__(self, store, job, np, min_np, max_np, backend, timeout, rdzv_timeout):
        self.store = store
        self.job = job
        self.prefix = prefix(job)
        self.np, self.min_np, self.max_np = np, min_np, max_np
        self.backend = backend
        self.timeout = timeout
        self.rdzv_timeout = rdzv_timeout
        self.uid = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.gen = -1
        self.members = []
        self.resets = 0
        self.lock = threading.Lock()
        self._watch_stop = None
        self._leaser = store.clone()  # one connection, one thread: the lease lives on it
        self._lease(None)
        self.arrival = self._add("arrivals", 1)
        self.switched_at = None
        if hasattr(store, "on_switch"):  # a FailoverStore: its successor starts empty
            store.on_switch.append(self._reseed)

    def _reseed(self):
        """The store moved to a successor (the primary's process died): lease again there,
        and write the current generation's decision (every member writes the same)."""
        self.switched_at = time.monotonic()
        with self.lock:
            g, members = self.gen, list(self.members)
        try:
            self._lease(g if g >= 0 else None)
            if g >= 0:
                decide(self.store, self.job, g, members)
        except DistError:
            pass  # the next store call fails over again, or says why

    # -- store helpers (keys under the job's prefix) ------------------------------------------
    def _k(self, key):
        return self.prefix + key

    def _add(self, key, n):
        return self.store.add(self._k(key), n)

    def _check(self, key):
        return self.store.check([self._k(key)])

    def _lease(self, gen):
        """(Re)lease alive/<uid>; its close action breaks generation ``gen``."""
        close = "" if gen is None else self._k(f"g{gen}/abort")
        self._leaser.lease(self._k(f"alive/{self.uid}"), b"1", close, self.uid)

    def alive(self, uid):
        return self._check(f"alive/{uid}")

    def decision(self, g, wait=0.0):
        """Generation g's members, or None if not decided (within ``wait`` seconds)."""
        if wait > 0:
            try:
                self.store.wait([gen_key(self.job, g)], datetime.timedelta(seconds=wait))
            except DistError:
                return None
            return members_of(self.store, self.job, g)  # the wait saw it: no second check
        return decided(self.store, self.job, g)

    def _first_undecided(self):
        g = latest(self.store, self.job, 0)
        while self.store.check([gen_key(self.job, g)]):
            g += 1
        return g

    def _registrants(self, g):
        """Who came to generation g: [(arrival, uid)], first comer first, once each."""
        if not self._check(f"g{g}/here"):
            return []
        seen, out = set(), []
        for a, uid in here_entries(self.store.get(self._k(f"g{g}/here"))):
            if uid not in seen:
                seen.add(uid)
                out.append((a, uid))
        return out

    # -- deciding a generation ------------------------------------------------------------
    def _decide(self, g):
        """Come to generation g and return its members once decided (taking part in the
        decision while it is open)."""
        self.store.append(self._k(f"g{g}/here"), f"{self.arrival} {self.uid}\n".encode())
        old = self.decision(g - 1) if g > 0 else None
        t0 = time.monotonic()
        while True:
            members = self.decision(g, wait=POLL)
            if members is not None:
                return members
            regs = self._registrants(g)
            came = {u for _, u in regs}
            if self.uid not in came:  # the store moved to a successor meanwhile
                self.store.append(self._k(f"g{g}/here"), f"{self.arrival} {self.uid}\n".encode())
                continue
            waited = time.monotonic() - t0
            # just after a move, a live member may not have leased again on the successor yet
            settling = self.switched_at is not None and \
                time.monotonic() - self.switched_at < SWITCH_GRACE
            if old is None:
                fresh = [u for _, u in sorted(regs) if self.alive(u)]
                stay = []
                ready = len(fresh) >= self.np or (len(fresh) >= self.min_np and waited >= SETTLE)
            else:
                stay = [u for u in old if u in came]
                missing = [u for u in old if u not in came and (settling or self.alive(u))]
                fresh = [u for a, u in sorted(regs) if u not in old and self.alive(u)]
                ready = not missing or waited >= self.rdzv_timeout
            if old is not None and not stay and not settling and \
                    not any(self.alive(u) for u in old):
                raise ElasticError(
                    f"elastic job {self.job!r}: every member of generation {g - 1} "
                    f"is gone, and the state with them" + (
                        " (the job has finished)" if self.store.check([done_key(self.job)]) else ""))
            members = stay + fresh
            if self.max_np is not None:
                members = members[:self.max_np]
            if ready and len(members) >= self.min_np:
                decide(self.store, self.job, g, members)
                continue
            if waited >= self.rdzv_timeout and len(members) < self.min_np:
                raise ElasticError(
                    f"elastic job {self.job!r}: generation {g} has {len(members)} "
                    f"member(s), below min_np={self.min_np}, and no newcomer came within "
                    f"{self.rdzv_timeout:g} s (COLLECTIVES_ELASTIC_TIMEOUT)")

    def join(self):
        """The first generation that admits this process (a newcomer waits here for the
        members' next commit), then its default group."""
        self._rendezvous(self._first_undecided())

    def reset(self):
        """After a failure or to admit newcomers: the next generation, its default group."""
        self.resets += 1
        self._rendezvous(self.gen + 1)

    def _rendezvous(self, g):
        self._stop_watch()
        self._drop_groups()
        deadline = time.monotonic() + self.rdzv_timeout
        while True:
            members = self._decide(g)
            if self.uid not in members:
                if time.monotonic() > deadline:
                    raise ElasticError(f"this process ({self.uid}) was not admitted to the "
                                       f"elastic job within {self.rdzv_timeout:g} s "
                                       f"(max_np={self.max_np})")
                g += 1  # decided without us (too late, or over max_np): the next one
                continue
            with self.lock:
                self.gen, self.members = g, members
            self._lease(g)
            try:
                self._form_group(g, members)
            except DistError:
                # a member died (or the store moved) while the group was being made: this
                # generation is broken for everyone; the next one is formed without the dead
                self.break_generation()
                self._drop_groups()
                g += 1
                continue
            self._start_watch(g)
            return

    # -- the default group of a generation ---------------------------------------------------
    def _drop_groups(self):
        """Fail every group's work now and destroy them (no peer is talked to)."""
        from ..core.world import world
        import collectives as api
        for pg in list(world.groups):
            try:
                pg.backend.interrupt()
            except Exception:  # noqa: BLE001  (it is going away in any case)
                pass
        if api.is_initialized():
            api.destroy_process_group()

    def _form_group(self, g, members):
        """The generation's default group; its members meet within FORM_TIMEOUT seconds
        (they come straight from the decision: one that does not has died)."""
        import collectives as api
        from ..store import PrefixStore
        was = self.store.timeout
        self.store.set_timeout(datetime.timedelta(seconds=min(FORM_TIMEOUT, was.total_seconds())))
        try:
            api.init_process_group(self.backend, store=PrefixStore(self._k(f"g{g}/pg"), self.store),
                                   rank=members.index(self.uid), world_size=len(members),
                                   timeout=self.timeout)
        finally:
            self.store.set_timeout(was)

    # -- failure signalling ----------------------------------------------------------------
    def break_generation(self):
        """Tell every member that the current generation is broken (their watchers
        interrupt their groups, so no one waits a timeout out on a dead peer)."""
        try:
            self.store.set(self._k(f"g{self.gen}/abort"), self.uid)
        except DistError:
            pass  # the store is unreachable: the rendezvous will say so

    def broken(self, wait=0.0):
        """Whether the current generation is marked broken (waiting up to ``wait``
        seconds for the mark: the server sets it when a member's connection closes)."""
        key = self._k(f"g{self.gen}/abort")
        try:
            if wait > 0:
                self.store.wait([key], datetime.timedelta(seconds=wait))
                return True
            return self.store.check([key])
        except DistError:
            return False

    def _start_watch(self, g):
        stop = threading.Event()
        self._watch_stop = stop
        threading.Thread(target=self._watch, args=(g, stop), daemon=True,
                         name=f"collectives-elastic-watch-{g}").start()

    def _stop_watch(self):
        if self._watch_stop is not None:
            self._watch_stop.set()
            self._watch_stop = None

    def _watch(self, g, stop):
        key = self._k(f"g{g}/abort")
        store = self.store
        while not stop.is_set():
            try:
                store.wait([key], datetime.timedelta(seconds=0.5))
            except DistError:
                if stop.wait(0.01):
                    return
                continue
            with self.lock:
                if self.gen != g or stop.is_set():
                    return
                from ..core.world import world
                for pg in list(world.groups):
                    try:
                        pg.backend.interrupt()
                    except Exception:  # noqa: BLE001
                        pass
            return

    # -- newcomers -------------------------------------------------------------------------
    def newcomers_waiting(self):
        """Whether a process waits for the next generation and there is room for it."""
        if self.max_np is not None and len(self.members) >= self.max_np:
            return False
        return self._check(f"g{self.gen + 1}/here")

    def finish(self):
        """This process leaves the job normally (its function returned): its exit does not
        break the generation, and the job is marked done."""
        try:
            self._lease(None)
            self.store.set(done_key(self.job), self.uid)
        except DistError:
            pass

    def close(self):
        self._stop_watch()
        for s in (self._leaser,):
            try:
                s.close()
            except Exception:  # noqa: BLE001
                pass
