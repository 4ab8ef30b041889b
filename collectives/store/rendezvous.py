"""init_method URLs to a store: env://, tcp://host:port, file:///path, or a given store.

``meet(...)`` returns ``(store, rank, world_size)`` for ``init_process_group``.
``rendezvous(url, rank, world_size, **kwargs)`` and ``register_rendezvous_handler`` are
torch.distributed's: an iterator of ``(store, rank, world_size)`` from the handler
registered for the URL's scheme (env, tcp and file are built in), and the way to add a
scheme, which ``init_process_group(init_method=...)`` then accepts.
Rank 0 serves the TCPStore and, as torch's does, waits until every rank has
connected; the other ranks never join the server of a group they have destroyed (a
group initialised again on the same port: rank 0's previous server may still answer).
Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) MASTER_PORT is the agent's torch
TCPStore: rank 0 serves ours on a free port and posts it there (``_via_agent_store``).
Rank and world size come from the arguments, then the URL's query
string (``?rank=0&world_size=4``), then the environment: RANK/WORLD_SIZE
(torchrun, collectives-run), else mpiexec's (PMI_RANK/PMI_SIZE for MPICH,
OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE for Open MPI), else Slurm's
(SLURM_PROCID/SLURM_NTASKS). MASTER_ADDR and MASTER_PORT, where unset, come from
Slurm's node list and job id, or are the loopback and a port from the job where mpiexec
put every rank on one host (:mod:`collectives.launcher.hostlist`).

Example:
    >>> store, rank, world = meet("tcp://127.0.0.1:29500", rank=0, world_size=1)
    >>> store, rank, world = next(rendezvous("tcp://127.0.0.1:29500", rank=0, world_size=1))
"""
import os
import re
import secrets
import time
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

from ..security import auth
from ..core.errors import DistError, DistNetworkError, DistStoreError
from . import DEFAULT_TIMEOUT, FileStore, Store, TCPStore, to_seconds

# (rank variable, world-size variable, who sets them), in order of preference
RANK_SOURCES = (
    ("RANK", "WORLD_SIZE", "torchrun/collectives-run"),
    ("PMI_RANK", "PMI_SIZE", "mpiexec (MPICH/hydra)"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpiexec (Open MPI)"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm"),
)
LOCAL_SOURCES = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _env_int(environ, var, minimum):
    raw = environ.get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {var} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"environment variable {var} must be >= {minimum}, got {value}")
    return value


def _first(environ, sources, index, minimum):
    for src in sources:
        value = _env_int(environ, src[index], minimum)
        if value is not None:
            return value
    return None


def env_rank_world(environ=None):
    """``(rank, world_size)`` from the environment a launcher set, None for each one unset.

    RANK/WORLD_SIZE first, then mpiexec's (MPICH PMI_RANK/PMI_SIZE, Open MPI
    OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE), then Slurm's (SLURM_PROCID/SLURM_NTASKS).
    A variable that is set but not a non-negative integer raises ValueError naming it.
    """
    environ = os.environ if environ is None else environ
    return _first(environ, RANK_SOURCES, 0, 0), _first(environ, RANK_SOURCES, 1, 1)


def env_local_rank(environ=None):
    """``(local_rank, local_world_size)`` on this host, from LOCAL_RANK/LOCAL_WORLD_SIZE,
    MPICH, Open MPI or Slurm; None for each one unset."""
    environ = os.environ if environ is None else environ
    return _first(environ, LOCAL_SOURCES, 0, 0), _first(environ, LOCAL_SOURCES, 1, 1)


def _check_int(value, name):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _query_int(query, name, scheme):
    vals = query.get(name)
    if not vals:
        return None
    try:
        value = int(vals[-1])
    except ValueError:
        raise ValueError(f"{scheme}:// rendezvous: {name} in the URL must be an integer, "
                         f"got {vals[-1]!r}") from None
    return value


def _resolve(name, arg, query, scheme, env_index, environ):
    """One of rank/world_size: argument, then URL query, then launcher environment."""
    from_query = _query_int(query, name, scheme)
    if arg is not None and from_query is not None and arg != from_query:
        raise ValueError(f"{scheme}:// rendezvous: {name}={arg} was passed but the URL says "
                         f"{name}={from_query}")
    if arg is not None:
        return arg
    if from_query is not None:
        return from_query
    value = _first(environ, RANK_SOURCES, env_index, 0 if env_index == 0 else 1)
    if value is None:
        var = "RANK" if name == "rank" else "WORLD_SIZE"
        if scheme == "env":
            raise ValueError(f"Error initializing collectives using env:// rendezvous: environment "
                             f"variable {var} expected, but not set (nor mpiexec's or Slurm's "
                             f"equivalent), and no {name}= argument was given")
        raise ValueError(f"Error initializing collectives using {scheme}:// rendezvous: {name} "
                         f"parameter missing (pass {name}=, add ?{name}= to the URL, or set {var})")
    return value


_NO_MASTER = (
    "Error initializing collectives using env:// rendezvous: environment variable {var} "
    "expected, but not set. torchrun and collectives-run set MASTER_ADDR and MASTER_PORT; "
    "where they are unset, collectives derives them under Slurm (SLURM_JOB_ID and "
    "SLURM_STEP_NODELIST/SLURM_JOB_NODELIST) and under an mpiexec whose ranks are all on one "
    "host (MPI_LOCALNRANKS or OMPI_COMM_WORLD_LOCAL_SIZE equal to the world size), and "
    "neither applies here. Set MASTER_ADDR to rank 0's host name or address and MASTER_PORT "
    "to a free port on it, the same on every rank (docs/slurm.md)")


def _master_env(environ):
    """MASTER_ADDR/MASTER_PORT, else what Slurm's or a one-host mpiexec's variables give
    (:func:`collectives.launcher.hostlist.derive_master`; written to ``os.environ`` when
    that is what was read, so the interface choice and dump names see them too)."""
    addr = environ.get("MASTER_ADDR")
    raw = environ.get("MASTER_PORT")
    if not addr or not raw:
        from ..launcher.hostlist import derive_master
        derived = derive_master(environ)
        if derived is None:
            raise ValueError(_NO_MASTER.format(var="MASTER_ADDR" if not addr else "MASTER_PORT"))
        d_addr, d_port, _how = derived
        addr = addr or d_addr
        raw = raw or str(d_port)
        if environ is os.environ:
            os.environ.setdefault("MASTER_ADDR", addr)
            os.environ.setdefault("MASTER_PORT", raw)
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"environment variable MASTER_PORT must be an integer, got {raw!r}") from None
    return addr, port


def _check_port(port, world_size, where):
    if not 0 <= port <= 65535:
        raise ValueError(f"{where} must be in [0, 65535], got {port}")
    if port == 0 and world_size > 1:
        raise ValueError(f"{where} is 0, which only a single process can use "
                         f"(world_size={world_size}); give the master's port")


def meet(init_method=None, rank=-1, world_size=-1, timeout=DEFAULT_TIMEOUT, store=None,
         environ=None, auth_key=None):
    """Meet the other ranks: ``(store, rank, world_size)``.

    Args:
        init_method: "env://" (the default when neither it nor ``store`` is given),
            "tcp://host:port", or "file:///path"; query parameters ``rank`` and
            ``world_size`` are accepted.
        rank: this process's rank, or -1 to take it from the URL or the environment.
        world_size: the number of processes, or -1 likewise.
        timeout: timedelta or seconds, for connecting and for every store wait.
        store: an existing Store shared by all ranks (then ``rank`` and ``world_size``
            are required and ``init_method`` must be None).
        environ: the environment to read (default ``os.environ``).
        auth_key: the job's key (str or bytes), else COLLECTIVES_AUTH_KEY's (see
            :mod:`collectives.security.auth`): the TCPStore authenticates with it, and the returned
            store carries it for the TCP transport's connections (a FileStore or given
            store too). None and no COLLECTIVES_AUTH_KEY: no authentication.

    Returns:
        (store, rank, world_size). With env:// and tcp://, rank 0 is the TCPStore master
        and returns only once every rank has connected.

    Raises:
        ValueError / TypeError: a missing or invalid argument or environment variable,
            named, before any connection is tried.
        DistNetworkError / DistStoreError: the other ranks did not arrive within ``timeout``.
    """
    environ = os.environ if environ is None else environ
    secs = to_seconds(timeout)
    key = auth.check_key(auth_key) if auth_key is not None else auth.env_key(environ)
    rank_arg = _check_int(rank, "rank")
    world_arg = _check_int(world_size, "world_size")
    if rank_arg < -1:
        raise ValueError(f"rank must be >= 0 (or -1 for the environment's), got {rank_arg}")
    if world_arg < -1 or world_arg == 0:
        raise ValueError(f"world_size must be >= 1 (or -1 for the environment's), got {world_arg}")
    rank_arg = None if rank_arg == -1 else rank_arg
    world_arg = None if world_arg == -1 else world_arg

    if store is not None:
        if init_method is not None:
            raise ValueError("init_method and store are mutually exclusive; pass only one")
        if not isinstance(store, Store):
            raise TypeError(f"store must be a collectives Store, got {type(store).__name__}")
        if rank_arg is None:
            raise ValueError("rank must be given (>= 0) when store is given")
        if world_arg is None:
            raise ValueError("world_size must be given (>= 1) when store is given")
        _check_rank(rank_arg, world_arg)
        carry_key(store, key, auth_key is not None)
        return store, rank_arg, world_arg

    if init_method is None:
        init_method = "env://"
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str URL, got {type(init_method).__name__}")
    url = urlparse(init_method)
    scheme = url.scheme
    if scheme not in ("env", "tcp", "file"):
        raise ValueError(f"init_method must start with env://, tcp:// or file:// (or a scheme "
                         f"given to register_rendezvous_handler), got {init_method!r}")
    query = parse_qs(url.query)
    rank = _resolve("rank", rank_arg, query, scheme, 0, environ)
    world = _resolve("world_size", world_arg, query, scheme, 1, environ)
    _check_rank(rank, world)

    if scheme == "file":
        path = url.path if not url.netloc else url.netloc + url.path
        if not path:
            raise ValueError(f"file:// rendezvous needs a path, got {init_method!r}")
        store = FileStore(path, world)
        store.set_timeout(timedelta(seconds=secs))
        store._auth_key = key  # for the transport: a file has no handshake of its own
        return store, rank, world

    if scheme == "env":
        host, port = _master_env(environ)
        _check_port(port, world, "MASTER_PORT")
    else:
        host = url.hostname
        try:
            port = url.port
        except ValueError:
            raise ValueError(f"tcp:// rendezvous: invalid port in {init_method!r}") from None
        if not host or port is None:
            raise ValueError(f"tcp:// rendezvous needs tcp://host:port, got {init_method!r}")
        _check_port(port, world, "the tcp:// URL's port")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return _via_agent_store(host, port, world, rank, secs, restart, key), rank, world
    return _fresh_tcp_store(host, port, world, rank, secs, key), rank, world


def carry_key(store, key, explicit=True):
    """A store given to ``meet`` with an explicit ``auth_key`` carries it for the transport;
    one that has a different key already is an error."""
    if not explicit:
        return  # the transport finds COLLECTIVES_AUTH_KEY (or the store's own key) itself
    have = auth.key_of(store, env=False)
    if have is None:
        store._auth_key = key
    elif have != key:
        raise ValueError("auth_key differs from the key the given store already has; pass one key")


# torchrun's agent already serves a (torch) TCPStore on MASTER_PORT and tells its workers
# so with TORCHELASTIC_USE_AGENT_STORE=True; torch's ranks then join it as clients. Ours
# speak our own store protocol, so there rank 0 starts our server on a free port and
# posts the port under this key of the agent's store (with the restart count, since the
# agent's store outlives the workers it restarts, and a count of meetings, so that a group
# initialised again in the same processes does not read the previous port), and the
# other ranks join it at MASTER_ADDR, the host of the agent that runs rank 0.
_AGENT_PORT_KEY = "collectives/rendezvous/port"
_agent_meetings = 0


def _via_agent_store(host, port, world, rank, secs, restart, key):
    global _agent_meetings
    try:
        import torch.distributed as td
        if not td.is_available():
            raise ImportError("torch.distributed is not available in this torch build")
    except ImportError as e:
        raise DistNetworkError(
            f"TORCHELASTIC_USE_AGENT_STORE=True: MASTER_PORT {port} is torchrun's agent store, "
            f"which only torch can join ({e}); install torch, or launch with collectives-run"
        ) from e
    key = f"{_AGENT_PORT_KEY}/{restart}/{_agent_meetings}"
    _agent_meetings += 1
    try:
        agent = td.TCPStore(host, port, None, False, timedelta(seconds=secs),
                            wait_for_workers=False)
    except Exception as e:  # noqa: BLE001  (torch raises its own error types)
        raise DistNetworkError(f"TORCHELASTIC_USE_AGENT_STORE=True: could not join torchrun's "
                               f"agent store at {host}:{port} within {secs:g} s: {e}") from e
    if rank == 0:
        store = TCPStore(host, 0, world, True, timedelta(seconds=secs), wait_for_workers=False,
                         auth_key=key)
        try:
            agent.set(key, str(store.port))
            store._wait_for_workers(True)
        except BaseException:
            store.close()
            raise
        return store
    try:
        mine = int(agent.get(key))
    except Exception as e:  # noqa: BLE001
        raise DistStoreError(f"TORCHELASTIC_USE_AGENT_STORE=True: rank 0 did not post its "
                             f"store's port (key {key!r}) in torchrun's agent store at "
                             f"{host}:{port} within {secs:g} s: {e}") from e
    return TCPStore(host, mine, world, False, timedelta(seconds=secs), auth_key=key)


# Rank 0 names every TCPStore server it starts for a rendezvous, and destroying a group
# retires the name of the server it met on. A group destroyed and initialised again on
# the same port must not join the previous group's server, which still runs in rank 0's
# process until rank 0, too, has destroyed its group.
_SERVER_ID_KEY = "collectives/rendezvous/server"
_retired = set()


def retire(store):
    """The group that met on ``store`` (from ``meet``) is destroyed in this process:
    a later rendezvous here does not join the same server."""
    name = getattr(store, "_rendezvous_server", None)
    if name is not None:
        _retired.add(name)


def _fresh_tcp_store(host, port, world, rank, secs, key):
    deadline = time.monotonic() + secs
    pause = 0.005
    while True:
        store = TCPStore(host, port, world, rank == 0, timedelta(seconds=secs),
                         wait_for_workers=True, auth_key=key)
        if rank == 0:
            sid = secrets.token_hex(8).encode()
            store.set(_SERVER_ID_KEY, sid)
            store._rendezvous_server = (host, port, sid)
            return store
        try:
            sid = store.get(_SERVER_ID_KEY)
        except DistError:  # e.g. the previous server closed under us: try again
            store.close()
            if time.monotonic() >= deadline:
                raise
        else:
            if (host, port, sid) not in _retired:
                store._rendezvous_server = (host, port, sid)
                return store
            store.close()
            if time.monotonic() >= deadline:
                raise DistStoreError(
                    f"rendezvous at {host}:{port}: after {secs:g} s still only the previous "
                    f"group's store answers there (rank 0 has not started a new one)")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _check_rank(rank, world):
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world_size={world}), got {rank}")


# ---- torch.distributed's handler registry ----------------------------------------------------

def _builtin_handler(url, timeout=DEFAULT_TIMEOUT, **kwargs):
    """env://, tcp:// and file:// as torch's handlers: one (store, rank, world_size), then no
    re-rendezvous. Rank and world size come from the URL's query, else the environment."""
    if kwargs:
        raise TypeError(f"unexpected keyword arguments for {urlparse(url).scheme}:// "
                        f"rendezvous: {sorted(kwargs)}")
    yield meet(url, timeout=timeout)
    raise RuntimeError(f"Unable to perform re-rendezvous using {urlparse(url).scheme}:// method")


_handlers = {"env": _builtin_handler, "tcp": _builtin_handler, "file": _builtin_handler}


def register_rendezvous_handler(scheme, handler):
    """Make ``scheme://`` URLs meet through ``handler`` (torch.distributed's function).

    Args:
        scheme: the URL scheme, e.g. "etcd" for etcd://host/job.
        handler: ``handler(url, **kwargs)`` returning an iterator of
            ``(store, rank, world_size)``; :func:`rendezvous` passes the rank and world
            size in the URL's query (``?rank=0&world_size=4``), and
            ``init_process_group(init_method=url)`` passes ``timeout=timedelta``.
    """
    if not isinstance(scheme, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        # RFC 3986: a letter, then letters, digits, '+', '-' or '.' (what urlparse splits off)
        raise ValueError(f"scheme must be a URL scheme such as 'etcd' or 'etcd-v2', got {scheme!r}")
    if not callable(handler):
        raise TypeError(f"handler must be callable as handler(url, **kwargs), "
                        f"got {type(handler).__name__}")
    if scheme in _handlers:
        raise ValueError(f"Rendezvous handler for {scheme}:// already registered")
    _handlers[scheme] = handler


def rendezvous(url, rank=-1, world_size=-1, **kwargs):
    """torch.distributed's ``rendezvous``: an iterator of ``(store, rank, world_size)``.

    ``rank`` and ``world_size`` (unless -1) are added to the URL's query, which must not
    hold them already, and the handler registered for the URL's scheme is called as
    ``handler(url, **kwargs)`` (built in: env, tcp, file; their one keyword is
    ``timeout``).
    """
    if isinstance(url, bytes):
        url = url.decode()
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}: {url!r}")
    rank, world_size = _check_int(rank, "rank"), _check_int(world_size, "world_size")
    parsed = urlparse(url)
    if rank != -1 or world_size != -1:
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        if "rank" in query or "world_size" in query:
            raise ValueError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
        if rank != -1:
            query["rank"] = str(rank)
        if world_size != -1:
            query["world_size"] = str(world_size)
        url = parsed._replace(query="&".join(f"{k}={v}" for k, v in query.items())).geturl()
    handler = _handlers.get(parsed.scheme)
    if handler is None:
        raise ValueError(f"No rendezvous handler for {parsed.scheme}:// (registered: "
                         f"{', '.join(sorted(_handlers))})")
    return iter(handler(url, **kwargs))


def custom_scheme(init_method):
    """Whether ``init_method`` is a URL of a scheme registered with
    :func:`register_rendezvous_handler` (not one of the built-in three)."""
    if not isinstance(init_method, str):
        return False
    handler = _handlers.get(urlparse(init_method).scheme)
    return handler is not None and handler is not _builtin_handler


__all__ = ["meet", "rendezvous", "register_rendezvous_handler", "env_rank_world",
           "env_local_rank", "RANK_SOURCES"]
