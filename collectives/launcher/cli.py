"""The launcher's command line (torchrun's flags) and :class:`Config`, the launch it
resolves to (ranks, nodes, master address and port, the ranks' environment)."""
import argparse
import os
import secrets
import sys

from ..security.auth import ENV_KEY, env_key


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
    p.add("--min-np", type=int, default=None,
          help="elastic in place (collectives.elastic): fewest ranks the job runs with; "
               "with --min-np or --max-np a dead rank is replaced (--max-replacements) "
               "without stopping the others, and this launcher serves the job's store")
    p.add("--max-np", type=int, default=None,
          help="elastic in place: most ranks the job runs with (newcomers beyond wait)")
    p.add("--max-replacements", type=int, default=None,
          help="elastic in place: ranks this launcher may start in place of dead ones "
               "(default: --max-restarts)")
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
        self._elastic(args)
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

    def _elastic(self, args):
        """--min-np/--max-np: elastic in place. The ranks meet through a store this
        launcher serves (on --rdzv-endpoint's port, else a free one), or, when
        --rdzv-endpoint names another host's launcher, through that one's."""
        self.elastic = args.min_np is not None or args.max_np is not None
        if not self.elastic:
            if args.max_replacements is not None:
                raise ValueError("--max-replacements needs --min-np or --max-np")
            return
        if self.dynamic or self.nnodes != 1:
            raise ValueError("--min-np/--max-np run each host's launcher on its own (no "
                             "--nnodes, no --rdzv-backend c10d): the ranks meet through "
                             "the store at --rdzv-endpoint, which the first launcher serves")
        self.min_np = 1 if args.min_np is None else args.min_np
        self.max_np = args.max_np
        if self.min_np < 1:
            raise ValueError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ValueError(f"--max-np ({self.max_np}) must be >= --min-np ({self.min_np})")
        self.max_replacements = args.max_restarts if args.max_replacements is None \
            else args.max_replacements
        if self.max_replacements < 0:
            raise ValueError(f"--max-replacements must be >= 0, got {self.max_replacements}")
        # the store: served here on a free port; or --rdzv-endpoint host:port[,host:port...],
        # the primary then its successors: this launcher serves the first entry of this
        # host that no one serves yet (none if every one is taken), and the ranks get the list
        self.store_host, self.store_port, self.serve_store = "127.0.0.1", 0, True
        self.store_list = None
        self.store_candidates = [("127.0.0.1", 0)]
        if args.rdzv_endpoint:
            from .agents import is_local
            entries = []
            for item in args.rdzv_endpoint.split(","):
                host, sep, p = item.strip().rpartition(":")
                if not sep or not p.isdigit() or not host:
                    raise ValueError(f"--rdzv-endpoint must be host:port[,host:port...] with "
                                     f"--min-np/--max-np, got {args.rdzv_endpoint!r}")
                entries.append((host.strip("[]"), int(p)))
            self.store_list = ",".join(f"{h}:{p}" for h, p in entries)
            self.store_candidates = [(h, p) for h, p in entries if is_local(h)]
            self.serve_store = bool(self.store_candidates)

    def _dynamic(self, args):
        """--rdzv-backend c10d: where the launchers meet, and how long they wait."""
        from .agents import parse_conf
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

    def elastic_store(self):
        """The elastic job's store as its ranks get it: host:port[,host:port...]."""
        return self.store_list or f"{self.store_host}:{self.store_port}"

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
        if self.elastic:
            env.update({
                "COLLECTIVES_ELASTIC_STORE": self.elastic_store(),
                "COLLECTIVES_ELASTIC_JOB": self.run_id,
                "COLLECTIVES_ELASTIC_MIN_NP": str(self.min_np),
            })
            if self.max_np is not None:
                env["COLLECTIVES_ELASTIC_MAX_NP"] = str(self.max_np)
            # the first generation waits for this launcher's ranks, unless the job says how
            # many to wait for over all its launchers
            env.setdefault("COLLECTIVES_ELASTIC_NP", str(self.nproc))
            # the primary store's address: the ranks publish the address of the interface
            # that routes there (collectives/backends/tcp/mesh.py's advertised_host)
            host, _, port = env["COLLECTIVES_ELASTIC_STORE"].split(",")[0].rpartition(":")
            env["MASTER_ADDR"], env["MASTER_PORT"] = host, port
        if self.auth_key is not None:  # (security) through the environment, never argv or a log
            env[ENV_KEY] = self.auth_key
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the launcher as they are printed
        if self.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"
        return env

