"""The launcher: ``collectives-run`` / ``python -m collectives.run``, torchrun's flags.

Starts ``--nproc-per-node`` copies of a script (or ``-m module``, or with
``--no-python`` any program) with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK/NODE_RANK, MASTER_ADDR and MASTER_PORT set, prefixes each whole line a
rank prints with ``[rank] `` (a line left unfinished with no more output for 0.3 s, such
as a prompt, is written as one), gives rank 0 the launcher's stdin (as mpiexec; the others read
/dev/null), and supervises them: when one rank fails the others
get SIGTERM, then SIGKILL after ``--term-timeout`` seconds, and the launcher exits
non-zero with a summary (the rank, its exit code or signal, its last stderr lines).
SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to every rank. Each rank
runs in its own session, and its whole process group is signalled, so no
grandchild outlives the launcher; a launcher killed by SIGKILL leaves that to a small
reaper process it starts, which kills every rank's process group it left running.

Example:
    collectives-run --nproc-per-node 4 train.py --epochs 3
    python -m collectives.run --standalone --nproc_per_node=2 -m mypkg.main
"""
import argparse
import collections
import errno
import os
import secrets
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time

from .auth import ENV_KEY, env_key

TAIL_LINES = 20
MAX_LINE = 1 << 16  # a longer run of bytes without a newline is written as it is
PARTIAL_AFTER = 0.3  # an unfinished line after this long with no more output is written
                     # (a prompt: pdb's, input())


# Ports the launcher picks come from below the kernel's ephemeral range. A port bound to
# 0 and closed again (the usual trick) can be handed to any outgoing connection before
# rank 0 listens on it; ports below the range are never handed out that way.
PORT_LO, PORT_HI = 20000, 32000
_next_port = None


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port):
    """Whether nothing listens on (or holds) ``port``, on every address as a TCPStore binds."""
    addrs = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "")]
    if socket.has_ipv6:
        addrs.append((socket.AF_INET6, "::"))
    for family, addr in addrs:
        try:
            with socket.socket(family) as s:
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == getattr(errno, "EADDRNOTAVAIL", None):
                continue  # no IPv6 on this host
            return False
    return True


def free_port():
    """A TCP port nobody uses that the kernel will not give to an outgoing connection
    (below the ephemeral range; successive calls in one process return different ports)."""
    global _next_port
    hi = min(PORT_HI, _ephemeral_low())
    span = hi - PORT_LO
    if span > 0:
        if _next_port is None:
            _next_port = PORT_LO + (os.getpid() * 7919 + time.monotonic_ns()) % span
        for _ in range(span):
            port = _next_port
            _next_port = PORT_LO + (_next_port + 1 - PORT_LO) % span
            if _bindable(port):
                return port
    with socket.socket() as s:  # no low port free: the kernel's choice
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- command line ------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def add(self, *names, **kw):
        """Add an option under its dash spelling and its underscore spelling, as torchrun."""
        spellings = []
        for n in names:
            spellings.append(n)
            if n.startswith("--") and "-" in n[2:]:
                spellings.append("--" + n[2:].replace("-", "_"))
        return self.add_argument(*spellings, **kw)


def build_parser():
    p = _Parser(prog="collectives-run", allow_abbrev=False,
                description="Start a distributed job: N processes per node, torchrun's flags.")
    p.add("--nnodes", default="1",
          help="number of nodes, N, or MIN:MAX with --rdzv-backend c10d (default 1)")
    p.add("-n", "--nproc-per-node", default="1",
          help="processes per node: an int, 'cpu'/'auto' (one per core) or 'gpu' (default 1)")
    p.add("--node-rank", type=int, default=0, help="this node's rank among the nodes (default 0)")
    p.add("--master-addr", default=None, help="address of rank 0's node (default 127.0.0.1)")
    p.add("--master-port", type=int, default=None,
          help="port of rank 0's store; 0 picks a free one (default: free port on one node, "
               "29500 on several)")
    p.add("--standalone", action="store_true",
          help="single node, local master on a free port")
    p.add("--rdzv-backend", default="static",
          help="static (--node-rank numbers the nodes) or c10d (the launchers number "
               "themselves through a store at --rdzv-endpoint; --nnodes may be MIN:MAX)")
    p.add("--rdzv-endpoint", default="",
          help="host:port of the rendezvous: the c10d store (default port 29400), or with "
               "static the master (as --master-addr/port)")
    p.add("--rdzv-id", default="none", help="the job's id (TORCHELASTIC_RUN_ID)")
    p.add("--rdzv-conf", default="",
          help="c10d: join_timeout=S,last_call_timeout=S,close_timeout=S,read_timeout=S "
               "(torchrun's keys; defaults 600, 30, 30, 60)")
    p.add("--max-restarts", type=int, default=0, help="restart every rank up to N times on failure")
    p.add("--monitor-interval", type=float, default=0.1, help="seconds between checks of the ranks")
    p.add("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
          help="accepted for torchrun compatibility (ranks are always new processes)")
    p.add("--role", default="default", help="ROLE_NAME of the ranks")
    p.add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add("--no-python", action="store_true", help="run the script as a program, without python")
    p.add("--run-path", action="store_true", help="accepted for torchrun compatibility")
    p.add("-r", "--redirects", default="0", help="accepted for torchrun compatibility")
    p.add("-t", "--tee", default="0", help="accepted for torchrun compatibility")
    p.add("--log-dir", default=None, help="also write each rank's output to DIR/rank<r>.{out,err}")
    p.add("--local-ranks-filter", default="",
          help="show output of these local ranks only (comma-separated)")
    p.add("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add("--term-timeout", type=float, default=3.0,
          help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)")
    p.add("--auth-key-file", default=None, metavar="PATH",
          help="file holding the job's shared key (the same file on every node); default: "
               "COLLECTIVES_AUTH_KEY if set, else a random key per job on one node, and no "
               "authentication for a job across nodes")
    p.add_argument("training_script", help="script, module (with -m) or program (with --no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _nproc(value):
    v = value.strip().lower()
    if v in ("cpu", "auto"):
        return os.cpu_count() or 1
    if v == "gpu":
        try:
            import torch
            n = torch.cuda.device_count()
        except ImportError:
            n = 0
        if n < 1:
            raise ValueError("--nproc-per-node=gpu but no GPU is visible")
        return n
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"--nproc-per-node must be an int, 'cpu', 'auto' or 'gpu', got {value!r}") from None
    if n < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {n}")
    return n


def _nnodes(value):
    lo, _, hi = value.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def _job_key(path, one_node):
    """The job's key (str) and a note for the launcher to print, or None: --auth-key-file's
    content, else COLLECTIVES_AUTH_KEY's, else a random key when the job runs on this node
    only (a job across nodes needs every node to hold the same key: without one given, it
    runs without authentication, and the note says so)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as e:
            raise ValueError(f"--auth-key-file: cannot read {path!r}: {e.strerror}") from None
        try:
            key = raw.decode().strip()
        except UnicodeDecodeError:
            raise ValueError(f"--auth-key-file {path!r} must hold text (e.g. from "
                             f"'openssl rand -hex 32'), not binary data") from None
        if not key:
            raise ValueError(f"--auth-key-file {path!r} is empty")
        return key, None
    key = env_key()
    if key:
        return key.decode(errors="surrogateescape"), None
    if one_node:
        return secrets.token_hex(32), None
    return None, (f"this job spans nodes and no key was given (--auth-key-file or {ENV_KEY}): "
                  f"its store and connections accept anyone who can reach them")


RDZV_BACKENDS = ("static", "c10d")
C10D_PORT = 29400  # torchrun's default rendezvous port


class Config:
    """The launch, resolved from the command line."""

    def __init__(self, args):
        self.min_nodes, self.max_nodes = _nnodes(args.nnodes)
        self.nnodes = self.max_nodes
        self.nproc = _nproc(args.nproc_per_node)
        self.node_rank = args.node_rank
        if args.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(f"--rdzv-backend must be one of {', '.join(RDZV_BACKENDS)}, "
                             f"got {args.rdzv_backend!r}")
        if args.standalone:
            if self.nnodes != 1 or self.min_nodes != 1:
                raise ValueError(f"--standalone runs one node, got --nnodes={args.nnodes}")
        self.dynamic = args.rdzv_backend == "c10d" and not args.standalone
        if self.dynamic:
            self._dynamic(args)
        elif self.min_nodes != self.max_nodes:
            raise ValueError(f"--nnodes={args.nnodes}: an elastic node range needs "
                             f"--rdzv-backend c10d and --rdzv-endpoint")
        if not 0 <= self.node_rank < self.nnodes and not self.dynamic:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        addr, port = args.master_addr, args.master_port
        if self.dynamic:
            addr, port = self.rdzv_host, 0  # the round's (node 0 posts a free port)
        elif args.rdzv_endpoint and not args.standalone:
            host, _, p = args.rdzv_endpoint.rpartition(":")
            if not host:
                host, p = args.rdzv_endpoint, ""
            addr = addr or host.strip("[]")
            if port is None and p:
                try:
                    port = int(p)
                except ValueError:
                    raise ValueError("--rdzv-endpoint must be host:port, "
                                     f"got {args.rdzv_endpoint!r}") from None
        if args.standalone:
            addr, port = "127.0.0.1", 0
        self.master_addr = addr or "127.0.0.1"
        if port is None:
            port = 0 if self.nnodes == 1 else 29500
        if not 0 <= port <= 65535:
            raise ValueError(f"--master-port must be in [0, 65535], got {port}")
        if port == 0 and self.nnodes > 1 and not self.dynamic:
            raise ValueError("--master-port 0 (a free port) works on one node only; "
                             "give the same port to every node")
        self.auto_port = port == 0 and not self.dynamic
        self.master_port = port
        if args.module and args.no_python:
            raise ValueError("--module and --no-python cannot be used together")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if args.term_timeout < 0:
            raise ValueError(f"--term-timeout must be >= 0, got {args.term_timeout}")
        self.max_restarts = args.max_restarts
        self.term_timeout = args.term_timeout
        self.monitor_interval = max(0.01, args.monitor_interval)
        self.prefix = not args.no_prefix
        self.role = args.role
        self.run_id = args.rdzv_id
        self.log_dir = args.log_dir
        self.show = None
        if args.local_ranks_filter:
            try:
                self.show = {int(x) for x in args.local_ranks_filter.split(",") if x.strip()}
            except ValueError:
                raise ValueError("--local-ranks-filter must be comma-separated ints, "
                                 f"got {args.local_ranks_filter!r}") from None
        if args.no_python:
            self.cmd = [args.training_script]
        elif args.module:
            self.cmd = [sys.executable, "-u", "-m", args.training_script]
        else:
            self.cmd = [sys.executable, "-u", args.training_script]
        self.cmd += args.training_script_args
        self.world_size = self.nnodes * self.nproc
        self.rank_base = self.node_rank * self.nproc  # the global rank of local rank 0
        self.auth_key, self.auth_note = _job_key(args.auth_key_file,
                                                 self.nnodes == 1 and not self.dynamic)

    def _dynamic(self, args):
        """--rdzv-backend c10d: where the launchers meet, and how long they wait."""
        from ._agents import parse_conf
        if not args.rdzv_endpoint:
            raise ValueError("--rdzv-backend c10d needs --rdzv-endpoint host[:port]")
        host, sep, p = args.rdzv_endpoint.rpartition(":")
        if not sep or "]" in p:  # no port (or a bare IPv6 address)
            host, p = args.rdzv_endpoint, ""
        self.rdzv_host = host.strip("[]")
        try:
            self.rdzv_port = int(p) if p else C10D_PORT
        except ValueError:
            raise ValueError(f"--rdzv-endpoint must be host[:port], got {args.rdzv_endpoint!r}") \
                from None
        if not 0 <= self.rdzv_port <= 65535:
            raise ValueError(f"--rdzv-endpoint port must be in [0, 65535], got {self.rdzv_port}")
        if self.rdzv_port == 0 and self.max_nodes > 1:
            raise ValueError("--rdzv-endpoint port 0 (a free port) works on one node only; "
                             "give every node the same port")
        self.rdzv_conf = parse_conf(args.rdzv_conf)

    def set_round(self, node_rank, nprocs, master_port):
        """A c10d rendezvous round: this node's rank, every node's --nproc-per-node (nodes
        may differ), the ranks' port."""
        self.node_rank, self.nnodes, self.master_port = node_rank, len(nprocs), master_port
        self.rank_base = sum(nprocs[:node_rank])
        self.world_size = sum(nprocs)

    def env(self, local_rank, restart):
        rank = self.rank_base + local_rank
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank), "NODE_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes), "ROLE_NAME": self.role,
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,  # is_torchelastic_launched() is True, as under torchrun
        })
        if self.auth_key is not None:  # (security) through the environment, never argv or a log
            env[ENV_KEY] = self.auth_key
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the launcher as they are printed
        if self.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"
        return env


# ---- output ------------------------------------------------------------------------

class _Sink:
    """Writes whole lines to one of the launcher's fds (never a partial line)."""

    def __init__(self, fd):
        self.fd = fd
        self.broken = False

    def write(self, data):
        if self.broken:
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:  # a closed pipe (| head): keep supervising, drop output
                self.broken = True
                return
            view = view[n:]


class _Stream:
    """One rank's stdout or stderr: splits into lines, prefixes, keeps a tail."""

    def __init__(self, rank, sink, prefix, show, log, keep_tail):
        self.prefix = (b"[%d] " % rank) if prefix else b""
        self.sink = sink
        self.show = show
        self.log = log
        self.buf = bytearray()
        self.last_feed = 0.0  # when output last came
        self.tail = collections.deque(maxlen=TAIL_LINES) if keep_tail else None

    def feed(self, data):
        if self.log is not None:
            self.log.write(data)
        self.buf += data
        end = self.buf.rfind(b"\n")
        if end < 0 and len(self.buf) >= MAX_LINE:
            end = len(self.buf) - 1
        if end >= 0:
            chunk = bytes(self.buf[:end + 1])
            del self.buf[:end + 1]
            self._emit(chunk.split(b"\n")[:-1] if chunk.endswith(b"\n") else [chunk])
        self.last_feed = time.monotonic()

    def flush_partial(self, now):
        """Write an unfinished line, as a line of its own, once the rank has written nothing
        more for PARTIAL_AFTER seconds (a prompt waiting for input)."""
        if self.buf and now - self.last_feed >= PARTIAL_AFTER:
            self._emit([bytes(self.buf)])
            self.buf.clear()

    def close(self):
        if self.buf:
            self._emit([bytes(self.buf)])
            self.buf.clear()
        if self.log is not None:
            self.log.close()

    def _emit(self, lines):
        if self.tail is not None:
            self.tail.extend(line.decode(errors="replace") for line in lines)
        if self.show:
            self.sink.write(b"".join(self.prefix + line + b"\n" for line in lines))


# ---- supervision -------------------------------------------------------------------------

class Rank:
    def __init__(self, rank, local_rank, proc, out, err):
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.out = out
        self.err = err
        self.returncode = None
        self.ended = None
        self.killed_by_us = False

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


# The reaper: reads "+PGID" / "-PGID" lines (a rank's process group started, or ended)
# until the launcher's end of the pipe closes, then SIGKILLs the groups still listed.
# Signals to the launcher's terminal or group do not end it: only the pipe does.
_REAPER = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
fd, live, buf = int(sys.argv[1]), set(), b""
while True:
    data = os.read(fd, 4096)
    if not data:
        break
    *lines, buf = (buf + data).split(b"\n")
    for line in lines:
        (live.add if line[:1] == b"+" else live.discard)(int(line[1:]))
for pgid in live:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class _Reaper:
    """Kills the ranks' process groups if the launcher dies without doing it (SIGKILL,
    the OOM killer): a process of its own reads the groups from a pipe and kills those
    still running once the pipe closes, which it does however the launcher ends. A group
    is struck off once the launcher has killed it, so a reused number is never hit."""

    def __init__(self):
        self.fd = None
        r, w = os.pipe()
        try:
            subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(r)], pass_fds=(r,),
                             start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:  # no reaper: the launcher still cleans up whenever it can
            os.close(w)
            w = None
        finally:
            os.close(r)
        self.fd = w

    def _send(self, line):
        if self.fd is not None:
            try:
                os.write(self.fd, line.encode())
            except OSError:
                pass

    def watch(self, rank):
        self._send(f"+{rank.proc.pid}\n")

    def forget(self, rank):
        self._send(f"-{rank.proc.pid}\n")

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _signal_group(rank, sig):
    try:
        os.killpg(rank.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    def __init__(self, cfg):
        self.cfg = cfg
        self.out = _Sink(sys.stdout.fileno())
        self.err = _Sink(sys.stderr.fileno())
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
            rank = cfg.rank_base + local
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
                for r in ranks:
                    _signal_group(r, signal.SIGKILL)
                    self._forget(r)
                raise ValueError(f"cannot start {shlex.join(cfg.cmd)}: {e}") from e
            ranks.append(Rank(rank, local, proc,
                              _Stream(rank, self.out, cfg.prefix, show, logs[0], False),
                              _Stream(rank, self.err, cfg.prefix, show, logs[1], True)))
            self._watch(ranks[-1])
        return ranks

    def supervise(self, ranks, watch=None, lost_grace=0.0):
        """Run until every rank has ended; returns the ranks that failed on their own.
        ``watch(now)``: a reason to stop every rank, or None (the c10d rendezvous: another
        node failed, or a new round begins); the reason is left in ``self.stopped_for``.
        A reason of kind "lost" (the rendezvous store) stops the ranks ``lost_grace``
        seconds later, unless they end (or one fails) first."""
        cfg = self.cfg
        sel = selectors.DefaultSelector()
        for r in ranks:
            for pipe, stream in ((r.proc.stdout, r.out), (r.proc.stderr, r.err)):
                os.set_blocking(pipe.fileno(), False)
                sel.register(pipe, selectors.EVENT_READ, stream)
        failed = []
        stopping_since = None
        killed = False
        forwarded = 0
        all_ended_at = None
        grace_until = None
        self.stopped_for = None
        while True:
            for key, _ in sel.select(cfg.monitor_interval):
                try:
                    data = os.read(key.fileobj.fileno(), 1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                if data:
                    key.data.feed(data)
                else:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    key.data.close()
            now = time.monotonic()
            for r in ranks:
                r.out.flush_partial(now)
                r.err.flush_partial(now)
                if r.returncode is None and r.proc.poll() is not None:
                    r.returncode = r.proc.returncode
                    r.ended = now
                    if r.returncode != 0 and not r.killed_by_us and self.signal_received is None:
                        failed.append(r)
            if self.signal_count > forwarded:  # forward every signal the launcher got
                forwarded = self.signal_count
                sig = signal.SIGKILL if forwarded > 1 else self.signal_received
                for r in ranks:
                    if r.returncode is None:
                        r.killed_by_us = True
                        _signal_group(r, sig)
                stopping_since = stopping_since or now
            if watch is not None and stopping_since is None and not failed \
                    and self.signal_received is None and self.stopped_for is None:
                self.stopped_for = watch(now)
                if self.stopped_for is not None and self.stopped_for[0] == "lost":
                    grace_until = time.monotonic() + lost_grace  # (watch may have waited)
            stop_now = self.stopped_for is not None and (grace_until is None or now >= grace_until)
            if (failed or stop_now) and stopping_since is None:
                stopping_since = now
                for r in ranks:
                    if r.returncode is None:
                        r.killed_by_us = True
                        _signal_group(r, signal.SIGTERM)
            running = [r for r in ranks if r.returncode is None]
            if running and stopping_since is not None and not killed \
                    and now - stopping_since >= cfg.term_timeout:
                killed = True
                for r in running:
                    _signal_group(r, signal.SIGKILL)
            if not running:
                # the ranks are gone: drain their pipes, unless a grandchild keeps one open
                all_ended_at = all_ended_at or now
                if not sel.get_map() or now - all_ended_at > 1.0:
                    break
        for key in list(sel.get_map().values()):
            sel.unregister(key.fileobj)
            key.fileobj.close()
            key.data.close()
        sel.close()
        for r in ranks:  # leave no grandchild behind
            _signal_group(r, signal.SIGKILL)
            self._forget(r)
        return failed

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
        if tail:
            lines.append(f"last {len(tail)} lines of rank {first.rank}'s stderr:")
            lines += ["  " + t for t in tail]
        else:
            lines.append(f"rank {first.rank} wrote nothing to stderr")
        self.note("\n".join(lines))

    def run(self):
        handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, self._on_signal)
        self.reaper = _Reaper()
        if self.cfg.auth_note:
            self.note(self.cfg.auth_note)
        try:
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
        """The job's rounds under the c10d rendezvous (collectives/_agents.py)."""
        from ._agents import NodeRendezvous, Stop
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


def main(argv=None):
    """Entry point of ``collectives-run``; returns through sys.exit with the job's status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = Config(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        code = Launcher(cfg).run()
    except ValueError as e:
        print(f"collectives-run: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
