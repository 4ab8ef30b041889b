"""Multi-rank test harness: pools of running ranks, reused across test examples.

A :class:`RankPool` starts ``world_size`` worker processes (plain subprocesses, or
under ``mpiexec``) that connect back to the test process and then run, on every
rank, whatever module-level function the test sends::

    pool = get_pool(4)
    results = pool.run(fn, 1, 2, timeout=60)   # fn(ctx, 1, 2) on each rank

``fn(ctx, *args)`` sees ``ctx.rank``, ``ctx.world_size``, ``ctx.port`` and
``ctx.state`` (a dict kept across calls on that rank). A remote exception comes
back as :class:`RankError` carrying each failing rank's traceback. A call that
does not answer within its timeout kills the pool (a hang fails, it never
stalls the run) and raises RankError; the next ``get_pool`` starts a new one.

``backend_pool(config, world_size)`` gives a pool whose ranks already ran
``init_process_group`` for one of the backend configurations in ``CONFIGS``.
"""
import atexit
import collections
import glob
import importlib.util
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client, Listener

from tests.support import ROOT

START_TIMEOUT = float(os.environ.get("COLLECTIVES_TEST_START_TIMEOUT", "120"))
GROUP_TIMEOUT = float(os.environ.get("COLLECTIVES_TEST_GROUP_TIMEOUT", "30"))
MAX_POOLS = int(os.environ.get("COLLECTIVES_TEST_MAX_POOLS", "24"))


class RankError(AssertionError):
    """A rank raised, died, or did not answer in time."""


class Ctx:
    """What a function sent to a rank sees."""

    def __init__(self, rank, world_size, port):
        self.rank = rank
        self.world_size = world_size
        self.port = port
        self.state = {"atexit": []}


def free_port():
    """A port for a rank to listen on: below the kernel's ephemeral range, so no outgoing
    connection takes it first (CI once lost that race with a bound-to-0-and-closed port)."""
    from collectives.run import free_port as pick
    return pick()


def ipv4_interfaces():
    """{interface: IPv4 address} for this machine's network interfaces that have one."""
    from collectives.backends.tcp import _interface_ipv4
    found = {}
    for _, name in socket.if_nameindex():
        try:
            found[name] = _interface_ipv4(name)
        except ValueError:
            pass
    return found


#: the files MPICH's ranks share memory through; a rank killed before MPI_Finalize leaves
#: its job's file behind in /dev/shm
MPI_SEGMENTS = "/dev/shm/mpich_shm_*"


def mapped_files():
    """The paths any process this user can read maps (from /proc/*/maps)."""
    paths = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    fields = [line.split(None, 5) for line in f]
            except OSError:  # gone, or not ours to read
                continue
            paths.update(x[5].strip() for x in fields if len(x) == 6)
    return paths


def remove_orphan_segments(before):
    """Unlink the MPI segment files that were not there in ``before`` (a set of paths) and
    that no live process maps: those of jobs whose ranks were killed. A live job's file
    is mapped by its ranks and stays. Returns the paths removed."""
    new = set(glob.glob(MPI_SEGMENTS)) - before
    if not new:
        return []
    orphans = sorted(new - mapped_files())
    for path in orphans:
        try:
            os.unlink(path)
        except OSError:
            pass
    return orphans


def mpiexec_path():
    """The mpiexec next to this interpreter (the mpich wheel's), else on PATH, else None."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else shutil.which("mpiexec")


class RankPool:
    """``world_size`` running ranks that execute functions sent by the test process.

    Args:
        world_size: number of ranks.
        setup: optional ``fn(ctx, *setup_args)`` run once on every rank after start.
        env: extra environment variables for the ranks.
        launcher: "spawn" (one process per rank, forked by a starter process after the
            imports every rank makes) or "mpiexec".
    """

    def __init__(self, world_size, setup=None, setup_args=(), env=None, launcher="spawn"):
        self.world_size = world_size
        self.launcher = launcher
        self.dead = False
        self._closing = False
        self.port = free_port()
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key, backlog=max(world_size, 16))
        host, lport = self._listener.address
        base_env = dict(os.environ)
        base_env.update({
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "PYTHONPATH": ROOT + os.pathsep + base_env.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", "COLLECTIVES_POOL_ADDR": f"{host}:{lport}",
            "COLLECTIVES_POOL_KEY": key.hex(),
        })
        base_env.update(env or {})
        worker = [sys.executable, "-m", "tests.support.ranks"]
        self._procs = []
        self._segments = set(glob.glob(MPI_SEGMENTS)) if launcher == "mpiexec" else None
        if launcher == "mpiexec":
            mpiexec = mpiexec_path()
            if mpiexec is None:
                raise RankError("launcher='mpiexec' but no mpiexec found")
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
                base_env.pop(k, None)
            self._procs.append(subprocess.Popen(
                [mpiexec, "-n", str(world_size)] + worker, env=base_env, cwd=ROOT,
                start_new_session=True))
        elif launcher == "spawn":
            # one starter process forks the ranks after the imports they all make, which
            # were most of a pool's start-up (see _fork_ranks)
            for k in ("RANK", "LOCAL_RANK"):
                base_env.pop(k, None)
            self._procs.append(subprocess.Popen(worker + ["--fork", str(world_size)],
                                                env=base_env, cwd=ROOT, start_new_session=True))
        else:
            raise ValueError(f"launcher must be 'spawn' or 'mpiexec', got {launcher!r}")
        self._conns = [None] * world_size
        try:
            self._accept_all()
            if setup is not None:
                self.run(setup, *setup_args, timeout=START_TIMEOUT)
        except BaseException:
            self.kill()
            raise

    def _accept_all(self):
        sock = self._listener._listener._socket
        sock.settimeout(1.0)
        deadline = time.monotonic() + START_TIMEOUT
        accepted = 0
        while accepted < self.world_size:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise RankError(f"ranks did not connect back within {START_TIMEOUT} s "
                                f"(exit codes {[p.poll() for p in self._procs]})")
            try:
                conn = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            self._conns[conn.recv()] = conn
            accepted += 1

    def run(self, fn, *args, timeout=60):
        """``fn(ctx, *args)`` on every rank; the list of their return values, by rank."""
        def closed(r, errors):
            raise RankError(f"rank {r} died during {fn.__name__}" + self._format(errors))

        def idle(pending, errors):
            if any(p.poll() is not None for p in self._procs):
                # give a last chance to read answers already sent, then fail
                time.sleep(0.05)
                if all(not self._conns[r].poll(0) for r in pending):
                    raise RankError(f"ranks {sorted(pending)} died during {fn.__name__}"
                                    + self._format(errors))

        if self.dead:
            raise RankError("pool is dead")
        try:
            answers, errors = self._collect(fn, args, timeout, closed, idle)
        except RankError:
            self.kill()
            raise
        if errors:  # the ranks are fine: the pool serves on
            raise RankError(f"{fn.__name__} failed" + self._format(errors))
        return [answers[r] for r in range(self.world_size)]

    def run_dead_peer(self, fn, *args, victims, timeout=60):
        """``fn(ctx, *args)`` on every rank, where the ranks in ``victims`` are meant to die
        inside it: a victim's death does not stop the run (as it does in :meth:`run`), the
        others keep running until they answer. Returns ``(answers, died)``: ``{rank: value}``
        for every rank that answered (a victim may answer if it did not die) and the set of
        ranks that died. A rank outside ``victims`` that dies, raises, or does not answer
        within ``timeout`` is a RankError. The pool is killed afterwards: its group lost a
        rank."""
        victims, died = set(victims), set()

        def closed(r, errors):
            if r not in victims:
                raise RankError(f"rank {r}, not a victim, died during {fn.__name__}"
                                + self._format(errors))
            died.add(r)

        if self.dead:
            raise RankError("pool is dead")
        try:
            answers, errors = self._collect(fn, args, timeout, closed)
        finally:
            self.kill()
        if errors:
            raise RankError(f"{fn.__name__} failed" + self._format(errors))
        return answers, died

    def _collect(self, fn, args, timeout, closed, idle=None):
        """Send ``fn(ctx, *args)`` to every rank and gather the answers: ``({rank: value},
        {rank: traceback})`` of the ranks that returned and that raised. ``closed(rank,
        errors)`` is told of a rank whose connection ended before it answered,
        ``idle(pending, errors)`` (if given) of the ranks still pending after each round;
        either raises RankError to stop. Ranks that have not answered within ``timeout``
        are a RankError (with the tracebacks so far)."""
        payload = pickle.dumps((fn, args))
        for c in self._conns:
            c.send_bytes(payload)
        deadline = time.monotonic() + timeout
        answers, errors = {}, {}
        pending = set(range(self.world_size))
        while pending:
            for r in sorted(pending):
                try:
                    if not self._conns[r].poll(0.01):
                        continue
                    answer = self._conns[r].recv()
                except (EOFError, OSError):
                    answer = None
                pending.discard(r)
                if answer is None:
                    closed(r, errors)
                elif answer[0] == "ok":
                    answers[r] = answer[1]
                else:
                    errors[r] = answer[1]
            if pending and time.monotonic() > deadline:
                raise RankError(f"{fn.__name__} timed out after {timeout} s on ranks "
                                f"{sorted(pending)}" + self._format(errors))
            if pending and idle is not None:
                idle(pending, errors)
        return answers, errors

    @staticmethod
    def _format(errors):
        return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))

    def alive(self):
        return not self.dead and all(p.poll() is None for p in self._procs)

    def close(self, timeout=10):
        self.begin_close()
        self.end_close(time.monotonic() + timeout)

    def begin_close(self):
        """Tell the ranks to finish (they run their exit callbacks and exit)."""
        if self.dead:
            return
        self.dead = self._closing = True
        for c in self._conns:
            try:
                if c is not None:
                    c.send_bytes(pickle.dumps(None))
            except OSError:
                pass

    def end_close(self, deadline):
        """Wait until ``deadline`` (monotonic) for the ranks to exit, then kill what is left."""
        if not self._closing:  # (dead before begin_close: killed already)
            return
        self._closing = False
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self):
        self.dead = True
        for p in self._procs:
            # the whole process group (start_new_session: its id is p.pid), even when p
            # itself has exited: a spawn pool's starter exits when one rank dies, and
            # the ranks left must not outlive the pool
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                if p.poll() is None:
                    p.kill()
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for c in self._conns:
            if c is not None:
                c.close()
        self._listener.close()
        if self._segments is not None:  # the MPI job's file, where its ranks were killed
            remove_orphan_segments(self._segments)


_POOLS = collections.OrderedDict()
#: (pool key, seconds, why, test) of every pool started in this process: the harness'
#: fixed cost, which conftest.py reports at the end of a run. ``why`` is "new" (the key's
#: first start), "evicted" (its pool was closed to keep MAX_POOLS) or "died" (its pool was
#: killed: a timeout, a killed rank); ``test`` is CURRENT_TEST when it started.
STARTS = []
#: the test running now (set by conftest.py), so that STARTS can name who started a pool
CURRENT_TEST = None
_EVICTED = set()


def _key_of(fn):
    return None if fn is None else f"{fn.__module__}.{fn.__qualname__}"


def get_pool(world_size, setup=None, setup_args=(), env=None, launcher="spawn"):
    """A cached running pool for these parameters (started if absent or dead)."""
    key = (world_size, _key_of(setup), repr(setup_args), tuple(sorted((env or {}).items())), launcher)
    pool = _POOLS.get(key)
    if pool is not None and pool.alive():
        _POOLS.move_to_end(key)
        return pool
    why = "evicted" if key in _EVICTED else "new"
    if pool is not None:
        pool.kill()
        del _POOLS[key]
        why = "died"
    while len(_POOLS) >= MAX_POOLS:
        old_key, old = _POOLS.popitem(last=False)
        old.close()
        _EVICTED.add(old_key)
    _EVICTED.discard(key)
    t0 = time.monotonic()
    pool = RankPool(world_size, setup, setup_args, env, launcher)
    STARTS.append((key, time.monotonic() - t0, why, CURRENT_TEST))
    _POOLS[key] = pool
    return pool


def close_module_pools(module):
    """Close the pools whose setup function is defined in test module ``module`` (a
    module's own ``setup=`` pools serve no other module), so that the pools that modules
    share (``backend_pool``, bare ``get_pool``) keep the MAX_POOLS places."""
    _close_all([_POOLS.pop(k) for k in list(_POOLS) if (k[1] or "").startswith(module + ".")])


def close_pools():
    _close_all([_POOLS.pop(k) for k in list(_POOLS)])


def _close_all(pools, timeout=10):
    """Close pools side by side: every pool's ranks are told first, then each is waited
    for (their exits overlap; one after the other, a module's pools once took 11 s)."""
    for pool in pools:
        pool.begin_close()
    deadline = time.monotonic() + timeout
    for pool in pools:
        pool.end_close(deadline)


atexit.register(close_pools)


# ---- backend configurations --------------------------------------------------------

# name -> (backend, launcher, env)
CONFIGS = {
    "store": ("store", "spawn", {}),
    "gloo": ("gloo", "spawn", {}),
    "gloo-tcp": ("gloo", "spawn", {"COLLECTIVES_TRANSPORT": "tcp"}),
    # ranks on two faked hosts, interleaved (rank % 2): the hierarchical mode
    "gloo-hier": ("gloo", "spawn", {"COLLECTIVES_TEST_HOSTS": "2"}),
    "mpi": ("mpi", "mpiexec", {}),
    # CUDA tensors through NCCL; ranks that share a GPU each name a host of their own to
    # NCCL (NCCL_HOSTID), which refuses two ranks of one host on one device, so they talk
    # through its socket transport on loopback. Run by tests/backends/test_nccl.py only.
    "nccl": ("nccl", "spawn", {"NCCL_SOCKET_IFNAME": "lo"}),
}
# configurations that take CUDA tensors: not in the generic suites' default list
CUDA_CONFIGS = {"nccl"}


def _has(path):
    if path.startswith("collectives/"):  # the package imported: the checkout's or an installed one
        import collectives
        base = os.path.dirname(os.path.dirname(os.path.abspath(collectives.__file__)))
        return os.path.exists(os.path.join(base, path))
    return os.path.exists(os.path.join(ROOT, path))


_NO_EXTENSION = ("collectives.engines.{} is not built, or COLLECTIVES_NO_EXTENSIONS hides the "
                 "extensions (gloo runs on them)")


def _ext_built(name):
    """Whether the extension ``name`` is there to import: built, and not hidden by
    COLLECTIVES_NO_EXTENSIONS (which the package applies at its import, so it comes first)."""
    import collectives  # noqa: F401
    return importlib.util.find_spec(f"collectives.engines.{name}") is not None


def config_available(name):
    """(available, reason) for a configuration on this machine and tree."""
    if name == "store":
        return _has("tests/support/store_backend.py"), "tests/support/store_backend.py missing"
    if name in ("gloo", "gloo-tcp", "gloo-hier"):
        if name != "gloo" and not _ext_built("_shm"):
            return False, f"no shared-memory path, so {name} would repeat gloo"
        return _ext_built("_tcp"), _NO_EXTENSION.format("_tcp")
    if name == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return False, "mpi4py is not installed (pip install 'collectives[mpi]')"
        if mpiexec_path() is None:
            return False, "no mpiexec on PATH"
        return _has("collectives/backends/mpi/__init__.py"), "collectives/backends/mpi/__init__.py missing"
    if name == "nccl":
        from collectives.backends import nccl
        return nccl.is_available(), "needs torch with CUDA, a GPU and libnccl (none here)"
    return False, f"unknown configuration {name!r}"


def available_configs():
    """Configurations to test: COLLECTIVES_TEST_CONFIGS (comma-separated) or all available."""
    wanted = os.environ.get("COLLECTIVES_TEST_CONFIGS")
    names = wanted.split(",") if wanted else [n for n in CONFIGS if n not in CUDA_CONFIGS]
    return [n for n in names if config_available(n)[0]]


def init_config(ctx, config):
    """Run on every rank: init_process_group for ``config``; destroyed at pool close."""
    import collectives
    backend = CONFIGS[config][0]
    if backend == "store":
        import tests.support.store_backend  # noqa: F401  (registers the 'store' backend)
    hosts = os.environ.get("COLLECTIVES_TEST_HOSTS")
    if hosts:  # fake that many hosts, ranks dealt out in turn
        os.environ["COLLECTIVES_HOST_ID"] = f"host{ctx.rank % int(hosts)}"
    if backend == "nccl":
        share_gpus(ctx.rank, ctx.world_size)
    collectives.init_process_group(backend, timeout=timedelta(seconds=GROUP_TIMEOUT))
    ctx.state["config"] = config
    ctx.state["atexit"].append(collectives.destroy_process_group)
    return collectives.get_rank()


def share_gpus(rank, world_size):
    """Give this rank a GPU (rank % count); where ranks outnumber GPUs, tell NCCL each rank
    is a host of its own (see CONFIGS['nccl'])."""
    import torch
    count = torch.cuda.device_count()
    torch.cuda.set_device(rank % count)
    if world_size > count:
        os.environ["NCCL_HOSTID"] = f"collectives-test-rank-{rank}"


def backend_pool(config, world_size):
    """A pool of ``world_size`` ranks initialised with configuration ``config``."""
    backend, launcher, env = CONFIGS[config]
    pool = get_pool(world_size, init_config, (config,), env, launcher)
    return pool


# ---- the worker side ---------------------------------------------------------------

def _worker_main():
    host, port = os.environ["COLLECTIVES_POOL_ADDR"].rsplit(":", 1)
    key = bytes.fromhex(os.environ["COLLECTIVES_POOL_KEY"])
    rank = None
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var):
            rank = int(os.environ[var])
            break
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE")
                or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    ctx = Ctx(rank, world, int(os.environ["MASTER_PORT"]))
    conn = Client((host, int(port)), authkey=key)
    conn.send(rank)
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if msg is None:
                break
            fn, args = msg
            try:
                out = ("ok", fn(ctx, *args))
            except BaseException:
                out = ("err", traceback.format_exc())
            try:
                conn.send(out)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                conn.send(("err", f"result of {fn.__name__} is not picklable: {e!r}"))
    finally:
        for cb in reversed(ctx.state.get("atexit", [])):
            try:
                cb()
            except Exception:
                pass


def _fork_ranks(world_size):
    """The starter of a "spawn" pool: import what every rank imports (the package, NumPy),
    then fork the ``world_size`` ranks, RANK and LOCAL_RANK set in each. Returns True in a
    rank. The starter itself waits: it exits when every rank has exited, and at once, with
    that rank's status, when one fails (an exit status other than 0, or a signal), so that
    ``RankPool`` sees a dead rank as a dead process. Nothing runs between the imports and the
    fork: no thread, socket or group exists yet, and the environment is the pool's."""
    try:
        import collectives  # noqa: F401  (as init_config would, in each rank)
    except Exception:
        pass  # a rank that needs it raises the error itself
    ranks = {}
    for r in range(world_size):
        pid = os.fork()
        if pid == 0:
            os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(r)
            return True
        ranks[pid] = r
    while ranks:
        pid, status = os.wait()
        if ranks.pop(pid, None) is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            sys.exit(code if code > 0 else 128 - code)
    return False


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork"]:
        if _fork_ranks(int(sys.argv[2])):
            _worker_main()
    else:
        _worker_main()


def error_text(e):
    """An error's message without the flight recorder's note (which names this rank's own
    dump file), so ranks that failed alike compare equal."""
    return str(e).split(" [flight recorder: ")[0]
