"""Starting and supervising the ranks: :class:`Launcher` starts a node's ranks, relays
their output, stops them all when one fails or a signal comes, restarts them, and runs
the c10d rendezvous's rounds (:mod:`collectives.launcher.agents`)."""
import os
import selectors
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .output import Sink, Stream
from .ports import free_port
from .reaper import Reaper

WATCH_S = 0.5  # seconds between looks at the elastic job, once this launcher's ranks are gone
GONE_GRACE = 5.0  # seconds no process of the job may hold a lease before it counts as over


@dataclass(eq=False)
class Rank:
    """One started rank: its process, output streams and how it ended."""
    rank: int
    local_rank: int
    proc: subprocess.Popen
    out: Stream
    err: Stream
    returncode: Optional[int] = None
    ended: Optional[float] = None
    killed_by_us: bool = False

    def describe(self):
        rc = self.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"killed by {name}"
        return f"exit code {rc}"


def _signal_group(rank, sig):
    try:
        os.killpg(rank.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Stopping:
    """A run's stop: signals forwarded so far, when stopping began, whether SIGKILL followed,
    when the last rank ended."""

    def __init__(self):
        self.forwarded = 0
        self.since = None
        self.killed = False
        self.all_ended_at = None


class _Pipes:
    """The ranks' stdout and stderr, read without blocking into their output streams."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()

    def add(self, rank):
        for pipe, stream in ((rank.proc.stdout, rank.out), (rank.proc.stderr, rank.err)):
            os.set_blocking(pipe.fileno(), False)
            self.sel.register(pipe, selectors.EVENT_READ, stream)

    def pump(self, timeout):
        """Feed what the pipes hold (waiting up to ``timeout`` s); close those at EOF."""
        for key, _ in self.sel.select(timeout):
            try:
                data = os.read(key.fileobj.fileno(), 1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            if data:
                key.data.feed(data)
            else:
                self._drop(key)

    def any_open(self):
        return bool(self.sel.get_map())

    def _drop(self, key):
        self.sel.unregister(key.fileobj)
        key.fileobj.close()
        key.data.close()

    def close(self):
        for key in list(self.sel.get_map().values()):
            self._drop(key)
        self.sel.close()


class Launcher:
    def __init__(self, cfg):
        self.cfg = cfg
        self.out = Sink(sys.stdout.fileno())
        self.err = Sink(sys.stderr.fileno())
        self.signal_received = None
        self.signal_count = 0
        self.reaper = None

    def _on_signal(self, signum, frame):
        self.signal_received = signum
        self.signal_count += 1

    def note(self, msg):
        self.err.write(f"collectives-run: {msg}\n".encode())

    def start(self, restart):
        cfg = self.cfg
        if cfg.auto_port:
            cfg.master_port = free_port()
        ranks = []
        for local in range(cfg.nproc):
            try:
                ranks.append(self._start_one(local, restart))
            except ValueError:
                for r in ranks:
                    _signal_group(r, signal.SIGKILL)
                    self._forget(r)
                raise
        return ranks

    def _start_one(self, local, restart, rank=None):
        """Start one rank (``rank``: its label, default the launch's numbering)."""
        cfg = self.cfg
        rank = cfg.rank_base + local if rank is None else rank
        show = cfg.show is None or local in cfg.show
        logs = [None, None]
        if cfg.log_dir:
            os.makedirs(cfg.log_dir, exist_ok=True)
            logs = [open(os.path.join(cfg.log_dir, f"rank{rank}.{s}"), "ab") for s in ("out", "err")]
        try:
            # rank 0 reads the launcher's stdin, as under mpiexec (input(), pdb,
            # dist.breakpoint); the others get none
            stdin = None if rank == 0 else subprocess.DEVNULL
            proc = subprocess.Popen(cfg.cmd, env=cfg.env(local, restart), stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            raise ValueError(f"cannot start {shlex.join(cfg.cmd)}: {e}") from e
        r = Rank(rank, local, proc, Stream(rank, self.out, cfg.prefix, show, logs[0], False),
                 Stream(rank, self.err, cfg.prefix, show, logs[1], True))
        self._watch(r)
        return r

    def supervise(self, ranks, watch=None, lost_grace=0.0):
        """Run until every rank has ended; returns the ranks that failed on their own.
        ``watch(now)``: a reason to stop every rank, or None (the c10d rendezvous: another
        node failed, or a new round begins); the reason is left in ``self.stopped_for``.
        A reason of kind "lost" (the rendezvous store) stops the ranks ``lost_grace``
        seconds later, unless they end (or one fails) first."""
        cfg = self.cfg
        pipes = _Pipes()
        for r in ranks:
            pipes.add(r)
        failed = []
        stop = _Stopping()
        grace_until = None
        self.stopped_for = None
        while True:
            pipes.pump(cfg.monitor_interval)
            now = time.monotonic()
            failed += self._poll(ranks, now)
            self._forward_signals(ranks, stop, now)
            if watch is not None and stop.since is None and not failed \
                    and self.signal_received is None and self.stopped_for is None:
                self.stopped_for = watch(now)
                if self.stopped_for is not None and self.stopped_for[0] == "lost":
                    grace_until = time.monotonic() + lost_grace  # (watch may have waited)
            stop_now = self.stopped_for is not None and (grace_until is None or now >= grace_until)
            if (failed or stop_now) and stop.since is None:
                stop.since = now
                for r in ranks:
                    if r.returncode is None:
                        r.killed_by_us = True
                        _signal_group(r, signal.SIGTERM)
            if self._over(ranks, pipes, stop, now):
                break
        self._end(ranks, pipes)
        return failed

    def _poll(self, ranks, now):
        """Flush the ranks' partial output lines and note the exit of each rank that ended
        since the last look; returns those of them that failed on their own (a nonzero exit
        code, neither stopped by the launcher nor after a signal the launcher got)."""
        failed = []
        for r in ranks:
            r.out.flush_partial(now)
            r.err.flush_partial(now)
            if r.returncode is None and r.proc.poll() is not None:
                r.returncode = r.proc.returncode
                r.ended = now
                if r.returncode != 0 and not r.killed_by_us and self.signal_received is None:
                    failed.append(r)
        return failed

    def _over(self, ranks, pipes, stop, now):
        """Whether a supervising loop may end: SIGKILL the ranks that outlive the stop's
        ``term_timeout``; once every rank has ended, drain their pipes (for up to 1 s more,
        should a grandchild keep one open)."""
        running = [r for r in ranks if r.returncode is None]
        self._escalate(running, stop, now)
        if running:
            return False
        stop.all_ended_at = stop.all_ended_at or now
        return not pipes.any_open() or now - stop.all_ended_at > 1.0

    def _forward_signals(self, ranks, stop, now):
        """Forward each signal the launcher got to the running ranks (SIGKILL from the
        second); stopping begins."""
        if self.signal_count > stop.forwarded:
            stop.forwarded = self.signal_count
            sig = signal.SIGKILL if stop.forwarded > 1 else self.signal_received
            for r in ranks:
                if r.returncode is None:
                    r.killed_by_us = True
                    _signal_group(r, sig)
            stop.since = stop.since or now

    def _escalate(self, running, stop, now):
        """SIGKILL the ranks still running ``term_timeout`` s after stopping began."""
        if running and stop.since is not None and not stop.killed \
                and now - stop.since >= self.cfg.term_timeout:
            stop.killed = True
            for r in running:
                _signal_group(r, signal.SIGKILL)

    def _job_finishes(self):
        """Every rank here died and none may replace them, while the others may go on:
        wait for the job's end, with this launcher's store still served (they may fail over
        to it) until no process of the job has held its lease for GONE_GRACE s (just after
        a move to a successor store the survivors lease again there). True if a rank
        finished the job (seen the moment it is marked done: the store may go with its own
        launcher right after); False if none did, if no store answers, or on a signal."""
        import datetime
        from ..core.errors import DistError, DistStoreError
        from ..store.elastic_job import done_key, job_alive
        from ..store.failover import FailoverStore
        cfg = self.cfg
        self.note("every rank of this launcher is gone; waiting for the job's other ranks"
                  + (" (the store is still served here)" if cfg.serve_store else ""))
        done_at = done_key(cfg.run_id)
        done, gone_since = False, None
        try:
            client = FailoverStore(cfg.elastic_store(), 30.0, cfg.auth_key)
        except (DistError, OSError):
            return False
        try:
            while self.signal_received is None:
                if done:
                    time.sleep(WATCH_S)
                else:
                    try:
                        client.wait([done_at], datetime.timedelta(seconds=WATCH_S))
                        done = True
                    except DistStoreError:  # not within WATCH_S
                        pass
                now = time.monotonic()
                if job_alive(client, cfg.run_id):
                    gone_since = None
                elif gone_since is None:
                    gone_since = now
                elif now - gone_since >= GONE_GRACE:
                    return done
        except (DistError, OSError):
            return done  # the store is gone (with its launcher, once its ranks ended)
        finally:
            client.close()
        return False

    def _end(self, ranks, pipes):
        """Close the ranks' pipes and leave no grandchild behind."""
        pipes.close()
        for r in ranks:
            _signal_group(r, signal.SIGKILL)
            self._forget(r)

    def _watch(self, rank):  # (no reaper when start() runs outside run())
        if self.reaper is not None:
            self.reaper.watch(rank)

    def _forget(self, rank):
        if self.reaper is not None:
            self.reaper.forget(rank)

    def summary(self, failed, elapsed):
        first = failed[0]
        lines = [f"rank {first.rank} (local rank {first.local_rank}, pid {first.proc.pid}) failed "
                 f"with {first.describe()} after {elapsed:.2f} s; the other ranks were stopped"]
        for r in failed[1:]:
            lines.append(f"rank {r.rank} also failed with {r.describe()}")
        tail = list(first.err.tail)
        if not tail:
            lines.append(f"rank {first.rank} wrote nothing to stderr")
        elif first.err.show:  # its traceback went by already: once is enough
            lines.append(f"rank {first.rank}'s stderr is above; its last line: {tail[-1]}")
        else:
            lines.append(f"last {len(tail)} lines of rank {first.rank}'s stderr:")
            lines += ["  " + t for t in tail]
        self.note("\n".join(lines))

    def run(self):
        handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, self._on_signal)
        self.reaper = Reaper()
        if self.cfg.auth_note:
            self.note(self.cfg.auth_note)
        try:
            if self.cfg.elastic:
                return self.run_elastic()
            if self.cfg.dynamic:
                return self.run_c10d()
            for attempt in range(self.cfg.max_restarts + 1):
                t0 = time.monotonic()
                ranks = self.start(attempt)
                failed = self.supervise(ranks)
                if self.signal_received is not None:
                    self.note(f"received {signal.Signals(self.signal_received).name}; "
                              f"stopped {len(ranks)} ranks")
                    return 128 + self.signal_received
                if not failed:
                    return 0
                self.summary(failed, time.monotonic() - t0)
                if attempt < self.cfg.max_restarts:
                    self.note(f"restarting every rank ({attempt + 1} of {self.cfg.max_restarts})")
            rc = failed[0].returncode
            return rc if 0 < rc < 256 else 128 + (-rc if rc < 0 else 1)
        finally:
            self.reaper.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)


    @staticmethod
    def _exit_code(rank):
        rc = rank.returncode
        return rc if 0 < rc < 256 else 128 + (-rc if rc < 0 else 1)

    def run_c10d(self):
        """The job's rounds under the c10d rendezvous (collectives/launcher/agents.py)."""
        from .agents import NodeRendezvous, Stop
        cfg = self.cfg
        try:
            rdzv = NodeRendezvous(cfg.rdzv_host, cfg.rdzv_port, cfg.run_id, cfg.min_nodes,
                                  cfg.max_nodes, cfg.rdzv_conf, free_port,
                                  lambda: self.signal_received is not None, cfg.auth_key)
        except Stop as e:
            self.note(str(e))
            return 128 + self.signal_received if self.signal_received is not None else 1
        restarts = 0
        try:
            while True:
                rdzv.join(cfg.nproc)
                cfg.set_round(rdzv.node_rank, rdzv.nprocs, rdzv.master_port)
                self.note(f"node {rdzv.node_rank} of {rdzv.nnodes} (round {rdzv.round}): ranks "
                          f"{cfg.rank_base}..{cfg.rank_base + cfg.nproc - 1} of {cfg.world_size}")
                t0 = time.monotonic()
                ranks = self.start(restarts)
                failed = self.supervise(ranks, rdzv.poll, lost_grace=rdzv.read_timeout)
                event = self.stopped_for
                if self.signal_received is not None:
                    name = signal.Signals(self.signal_received).name
                    rdzv.fail(f"node {rdzv.node_rank}'s launcher received {name}")
                    self.note(f"received {name}; stopped {len(ranks)} ranks")
                    return 128 + self.signal_received
                if failed:
                    self.summary(failed, time.monotonic() - t0)
                    first = failed[0]
                    why = f"rank {first.rank} on node {rdzv.node_rank} failed with {first.describe()}"
                    if restarts >= cfg.max_restarts:
                        rdzv.fail(f"{why}; no restart left")
                        return self._exit_code(first)
                    event = ("restart", rdzv.restart("F", why))
                elif event is None:
                    event = rdzv.finish(lambda: self.signal_received is not None)
                    if event is None:
                        return 0
                    if event[0] == "signal":
                        name = signal.Signals(self.signal_received).name
                        rdzv.fail(f"node {rdzv.node_rank}'s launcher received {name}")
                        return 128 + self.signal_received
                kind, why = event
                if kind in ("failed", "lost"):
                    self.note(f"stopping: {why}")
                    return 1
                if why.startswith("F"):
                    if restarts >= cfg.max_restarts:  # (another node asked first)
                        rdzv.fail(f"{why[3:]}; no restart left")
                        self.note(f"stopping: {why[3:]}; no restart left")
                        return 1
                    restarts += 1
                    self.note(f"restarting every rank ({restarts} of {cfg.max_restarts}): {why[3:]}")
                else:
                    self.note(f"restarting every rank in a new round: {why[3:]}")
        except Stop as e:
            self.note(f"stopping: {e}")
            if self.signal_received is not None:
                rdzv.fail(f"a launcher received {signal.Signals(self.signal_received).name}")
                return 128 + self.signal_received
            return 1
        finally:
            rdzv.close()

    # ---- elastic in place (collectives.elastic) ----------------------------------------------
    def run_elastic(self):
        """Serve the job's store here (unless another launcher does), start the ranks, and
        start a new one in place of each that dies, up to --max-replacements, without
        touching the others: they go on without it and admit the newcomer at their next
        commit (collectives.elastic). The job succeeds when a rank finishes with 0 and
        every rank still running at the end does."""
        cfg = self.cfg
        server = None
        if cfg.serve_store:
            from ..store.server import StoreServer
            from ..security.auth import check_key
            key = None if cfg.auth_key is None else check_key(cfg.auth_key)
            for host, port in cfg.store_candidates:  # the first this host has free
                try:
                    server = StoreServer(port, None, host, key)
                except OSError:
                    continue
                cfg.store_host, cfg.store_port = host, server.port
                break
            if server is not None:
                self.note(f"elastic job {cfg.run_id!r}: store on {cfg.store_host}:{server.port} "
                          f"(in this launcher, pid {os.getpid()}); --min-np {cfg.min_np}"
                          + (f", --max-np {cfg.max_np}" if cfg.max_np is not None else ""))
        try:
            return self._supervise_elastic()
        finally:
            if server is not None:
                server.stop(1.0)

    def _supervise_elastic(self):
        cfg = self.cfg
        t0 = time.monotonic()
        ranks = self.start(0)
        pipes = _Pipes()
        for r in ranks:
            pipes.add(r)
        replaced = 0
        next_label = cfg.nproc
        failures = []
        stop = _Stopping()
        while True:
            pipes.pump(cfg.monitor_interval)
            now = time.monotonic()
            for r in self._poll(ranks, now):
                failures.append(r)
                finished = any(x.returncode == 0 for x in ranks)
                if replaced < cfg.max_replacements and not finished:
                    replaced += 1
                    new = self._start_one(r.local_rank, replaced, rank=next_label)
                    next_label += 1
                    ranks.append(new)
                    pipes.add(new)
                    self.note(f"rank {r.rank} (pid {r.proc.pid}) died with {r.describe()}; "
                              f"the others go on; started rank {new.rank} (pid "
                              f"{new.proc.pid}) in its place ({replaced} of "
                              f"{cfg.max_replacements})")
                else:
                    self.note(f"rank {r.rank} (pid {r.proc.pid}) died with {r.describe()}; "
                              f"the others go on" + ("" if finished else
                                                     " (no replacement left)"))
            self._forward_signals(ranks, stop, now)
            if self._over(ranks, pipes, stop, now):
                break
        self._end(ranks, pipes)
        if self.signal_received is not None:
            self.note(f"received {signal.Signals(self.signal_received).name}; "
                      f"stopped {len(ranks)} ranks")
            return 128 + self.signal_received
        ok = [r for r in ranks if r.returncode == 0]
        last = [r for r in ranks if r not in failures]
        if ok and all(r.returncode == 0 for r in last):
            return 0
        if not last and cfg.store_list is not None and self._job_finishes():
            self.note(f"the job finished without this launcher's {len(ranks)} rank(s)")
            return 0
        if self.signal_received is not None:
            return 128 + self.signal_received
        bad = [r for r in last if r.returncode != 0] or failures
        self.summary(bad, (bad[0].ended or time.monotonic()) - t0)
        return self._exit_code(bad[0])
