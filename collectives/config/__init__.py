"""The one registry of ``COLLECTIVES_*`` settings.

Every environment variable the package, its build or its tests read is declared here
once: its type, default, parser, whether the ranks of a group must agree on it, and a
one-line doc. ``docs/configuration.md`` is generated from this table
(``python -m collectives.config --markdown -o docs/configuration.md``; CI runs
``--check``), and ``tests/install/test_config.py`` fails for any ``COLLECTIVES_*`` name in the
source that is not declared, so docs and code cannot drift.

Read a setting with :func:`get`::

    from collectives import config
    spin = config.get("COLLECTIVES_TCP_SPIN_US")   # int, the default when unset

Parsing rules, the same for every setting of a type:

* unset or empty: the default (``None`` means "chosen at run time", see the doc line);
* ``bool``: ``0``, ``false``, ``no``, ``off`` (any case) are false, anything else true;
* ``int``: a decimal integer (``_`` separators allowed), checked against its minimum;
* ``choice``: one of the listed values (case-insensitive);
* ``str``: the value, stripped.

A value that does not parse raises ``ValueError`` naming the variable and what it
accepts. "Agree" settings pick an algorithm or a layout: ranks of one group started with
different values could pick different algorithms for one call, so they must be equal on
every rank (where ``rank0`` is set, the backend uses rank 0's value for the whole group).

``COLLECTIVES_NO_EXTENSIONS=1`` is acted on here, at import (the package imports this
module first): it hides the compiled extensions so that every module takes the
pure-Python/NumPy fallback it uses when they are not built.
"""
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

__all__ = ["Setting", "SETTINGS", "get", "declared", "settings", "markdown", "EXTENSIONS"]

_FALSE = frozenset({"0", "false", "no", "off"})

#: the compiled extension modules (``collectives.engines.<name>``) COLLECTIVES_NO_EXTENSIONS hides
EXTENSIONS = ("_core", "_buffer", "_tcp", "_shm", "_mpilog", "_ncclcall")

KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Setting:
    """One ``COLLECTIVES_*`` environment variable.

    Attributes:
        name: the variable's name.
        type: ``"bool"``, ``"int"``, ``"choice"`` or ``"str"``.
        default: the value when unset or empty (``None``: chosen at run time, see ``doc``).
        doc: one line: what it does (and what the default means, where it is not a value).
        agree: whether every rank of a group must have the same value.
        rank0: whether the backend takes rank 0's value for the whole group (so the others'
            environments do not matter).
        scope: ``"runtime"`` (read by the package), ``"build"`` (setup.py) or ``"test"``
            (the test harness).
        read_in: where it is read today (module or C file), for maintainers.
        choices: the accepted values of a ``choice`` setting.
        minimum: the smallest accepted ``int``.
        unit: shown after int values in the docs (``"bytes"``, ``"us"``, ``"ns"``).
    """

    name: str
    type: str
    default: Any
    doc: str
    agree: bool = False
    rank0: bool = False
    scope: str = "runtime"
    read_in: str = ""
    choices: Tuple[str, ...] = ()
    minimum: Optional[int] = 0
    unit: str = ""

    def __post_init__(self):
        # the registry writes a doc as a paragraph (a triple-quoted string over several lines):
        # the setting holds it as one line, its words one space apart
        object.__setattr__(self, "doc", " ".join(self.doc.split()))

    def parse(self, raw: Optional[str]):
        """The value of this setting for the raw environment string ``raw`` (None: unset)."""
        if raw is None or raw.strip() == "":
            return self.default
        return _PARSERS[self.type](self, raw.strip())


def _bool(s, v):
    return v.lower() not in _FALSE


def _int(s, v):
    try:
        n = int(v, 10)
    except ValueError:
        raise ValueError(f"{s.name} must be an integer{_unit(s)}, got {v!r}") from None
    if s.minimum is not None and n < s.minimum:
        raise ValueError(f"{s.name} must be >= {s.minimum}{_unit(s)}, got {n}")
    return n


def _choice(s, v):
    low = v.lower()
    if low not in s.choices:
        raise ValueError(f"{s.name} must be one of {', '.join(map(repr, s.choices))}, got {v!r}")
    return low


def _str(s, v):
    return v


def _unit(s):
    return f" ({s.unit})" if s.unit else ""


_PARSERS: "dict[str, Callable[[Setting, str], Any]]" = {
    "bool": _bool, "int": _int, "choice": _choice, "str": _str}


def _section(**common):
    """The declarer of one section of the registry: its settings share the keywords
    ``common`` (a keyword a setting names itself wins)."""
    def declare(*args, **kw):
        return Setting(*args, **{**common, **kw})
    return declare


_s = _section()
_engine = _section(read_in="backends/tcp/__init__.py -> engines/tcp/tcp_engine.c")
_shm = _section(read_in="backends/shm.py", agree=True, rank0=True)
_fr = _section(read_in="diagnostics/fr_registry.py")
_build = _section(scope="build", read_in="setup.py")
_test = _section(scope="test", read_in="tests/support/ranks.py")
_el = _section(read_in="elastic/runtime.py")


# ---- the registry: add a new setting HERE (and nowhere else) -----------------------------
# Each section declares through its own declarer, which fills the keywords the section's
# settings share (where they are read, their scope); a setting names only what is its own,
# then its doc: a paragraph, wrapped freely (the Setting joins it into one line).
SETTINGS = (
    # transport selection and addressing
    _s("COLLECTIVES_TRANSPORT", "choice", "auto",
        agree=True, choices=("auto", "tcp", "shm"), read_in="backends/select.py", doc="""
        Transport of the default backend ('gloo'): auto (shared memory within a host, the
        hierarchical mode across hosts), tcp (our TCP transport across the whole group), shm (shared
        memory only; init fails if the ranks span hosts)."""),
    _s("COLLECTIVES_HOST_ID", "str", None, read_in="backends/select.py", doc="""
        This process's host identity: ranks with equal identities share memory. Default: host name,
        boot id and IPC namespace. Tests and benchmarks set it to fake several hosts."""),
    _s("COLLECTIVES_IFNAME", "str", None, read_in="backends/tcp/__init__.py, torch_bridge/gloo.py", doc="""
        Network interface whose IPv4 address TCP peers connect to (the first of a comma-separated
        list). Default: torch's GLOO_SOCKET_IFNAME, else the interface that routes to MASTER_ADDR. A
        name without an IPv4 address raises ValueError at init."""),
    # the TCP engine
    _s("COLLECTIVES_TCP_SPIN_US", "int", 20,
        unit="us", read_in="backends/tcp/__init__.py, backends/tcp/mesh.py", doc="""
        How long a TCP wait polls before it blocks."""),
    _s("COLLECTIVES_TCP_SOCKBUF", "int", 4 * MiB,
        unit="bytes", read_in="backends/tcp/__init__.py, backends/tcp/mesh.py", doc="""
        Socket send/receive buffer size; 0 keeps the operating system's default. A size above the
        kernel's cap (net.core.wmem_max / rmem_max) is not set, so the kernel keeps tuning that
        buffer itself instead of cutting it to the cap."""),
    _engine("COLLECTIVES_TCP_RD_MAX", "int", 64 * KiB, agree=True, unit="bytes", doc="""
        all_reduce uses recursive doubling up to this size, reduce-scatter + all-gather above.
        Unset, a group of more than 2 ranks that span hosts uses 32 KiB."""),
    _engine("COLLECTIVES_TCP_HD_MAX", "int", 0, agree=True, unit="bytes", doc="""
        all_reduce above COLLECTIVES_TCP_RD_MAX uses recursive halving-doubling up to this size in
        groups of more than 2 ranks, the ring or direct exchange above; 0: never. Unset, a group of
        more than 2 ranks that span hosts uses 64 KiB."""),
    _engine("COLLECTIVES_TCP_TREE_MAX", "int", 64 * KiB, agree=True, unit="bytes", doc="""
        broadcast uses a hypercube exchange and reduce a binomial tree up to this size (broadcast
        also with 2 ranks), a pipelined chain above."""),
    _engine("COLLECTIVES_TCP_SEGMENT", "int", 1 * MiB, agree=True, minimum=1, unit="bytes", doc="""
        Pipelining segment of the large-message algorithms."""),
    _engine("COLLECTIVES_TCP_DIRECT_MAX", "int", 64 * KiB, agree=True, unit="bytes", doc="""
        all_gather and reduce_scatter use a one-round direct exchange up to this size."""),
    _engine("COLLECTIVES_TCP_DIRECT_WORLD", "int", 8, agree=True, doc="""
        Large all_reduce uses the two-round direct exchange up to this world size, the ring above
        it. Unset, a group whose ranks span hosts uses the ring at every size (one flow per link)."""),
    _engine("COLLECTIVES_TCP_DUPLEX_CHUNK", "int", 1 * MiB, unit="bytes", doc="""
        Bytes written per send call, and read per call while sends to that peer wait, so both
        directions of an exchange flow; 0: no limit."""),
    _engine("COLLECTIVES_TCP_NO_LOWAT", "bool", False, doc="""
        True: never raise SO_RCVLOWAT while a large payload arrives (by default poll wakes once 256
        KiB-1 MiB of it is there)."""),
    # the shared-memory backend
    _s("COLLECTIVES_SHM_HALF_BYTES", "int", 2 * MiB,
        agree=True, unit="bytes", read_in="backends/shm.py", doc="""
        Bytes per half data slot of the group's segment (at least 4096 and 64 + 128 x world size).
        It sets the segment's layout."""),
    _shm("COLLECTIVES_SHM_ONESHOT_MAX", "int", 64 * KiB, unit="bytes", doc="""
        Largest all_reduce done one-shot (one synchronisation); two-shot above. Unset: 64 KiB,
        or 4 KiB where more than two ranks run at once (more than two ranks and more than two
        cores: one-shot's reads of every rank's whole buffer then cost more)."""),
    _shm("COLLECTIVES_SHM_CHUNK_BYTES", "int", 512 * KiB, minimum=1, unit="bytes", doc="""
        Chunk of the two-shot all_reduce and reduce."""),
    _shm("COLLECTIVES_SHM_CMA_MIN", "int", 256 * KiB, unit="bytes", doc="""
        all_gather, gather and scatter blocks from this size go in one copy (process_vm_readv/writev)
        where the ranks may read each other's memory, reduce_scatter blocks from 16 times it; 0 turns
        it off. An all_gather's single copy times each block written whole against in 256 KiB
        pieces and takes the faster; where the ranks outnumber the cores it is instead timed
        against the two-copy path and taken only where it is faster."""),
    _shm("COLLECTIVES_SHM_MAP_MIN", "int", 1 * MiB, unit="bytes",
         read_in="backends/shm.py, torch_bridge/mapped.py", doc="""
        DDP's gradient buckets (a torch CPU tensor that torch all_reduces during backward, the
        whole of its storage) of at least this size move into shared memory at their second
        all_reduce (torch's share_memory_), and the ranks map each other's: from then on their
        all_reduce reads and writes the others' buckets directly, with no copy through the
        segment. 0 turns it off."""),
    _shm("COLLECTIVES_SHM_CMA_BCAST_MIN", "int", 64 * KiB, unit="bytes", doc="""
        broadcast from this size goes in one copy where at most two ranks share a core; 0 turns it
        off. Unset: 64 KiB with two ranks, 256 KiB with more, 0 where more than two ranks run at
        once (more than two ranks and more than two cores)."""),
    _shm("COLLECTIVES_SHM_CMA_AR_MIN", "int", 64 * KiB, unit="bytes", doc="""
        all_reduce from this size (above the one-shot size) may go in one copy; 0 turns the single
        copy off for all_reduce."""),
    _shm("COLLECTIVES_SHM_AR_ALGO", "choice", "auto", choices=("auto", "two_shot", "single_copy"), doc="""
        all_reduce above the one-shot size: auto (the ranks time two-shot with plain and with
        streaming stores and the single copy on their own calls, per size class, and all take the
        fastest), two_shot (stores by COLLECTIVES_SHM_STREAM) or single_copy (where the ranks may
        read each other's memory)."""),
    _shm("COLLECTIVES_SHM_STREAM", "choice", "2", choices=("0", "1", "2"), doc="""
        How the segment is written for other ranks: 0 plain stores, 1 streaming (non-temporal)
        stores, 2 measured: the all_reduce and the all_gather time both kinds on their own calls and
        take the faster, the other collectives stream while the ranks' probes find their peers far
        (another die or socket)."""),
    _s("COLLECTIVES_SHM_CMA_ANY_CORES", "bool", False,
       read_in="engines/_shm.pyx -> engines/shm/shm_copy.c", doc="""
        Allow the all_reduce's single copy with more ranks than cores and the broadcast's with more
        than two ranks a core (measured no faster there; the tests use it), and the all_gather's from
        COLLECTIVES_SHM_CMA_MIN on without timing it against the two-copy path. The gather's and
        scatter's single copy runs there regardless."""),
    _s("COLLECTIVES_SHM_SPIN", "int", None, read_in="engines/_shm.pyx -> engines/shm/shm_segment.c", doc="""
        Polls before a waiting rank yields. Default: about 2 us worth when every rank has a core,
        none when the ranks outnumber the cores."""),
    _s("COLLECTIVES_SHM_YIELD_US", "int", None,
        unit="us", read_in="engines/_shm.pyx -> engines/shm/shm_segment.c", doc="""
        How long a waiting rank yields before it sleeps on a futex. Default: 200 us when every rank
        has a core, 20 us otherwise."""),
    _s("COLLECTIVES_SHM_FAR_NS", "int", 250,
        minimum=None, unit="ns", read_in="engines/_shm.pyx -> engines/shm/shm_copy.c", doc="""
        Cache-line round trip from which a peer counts as far (streaming stores pay off); 0 or less:
        the default."""),
    _s("COLLECTIVES_SHM_LLC_BYTES", "int", None,
        unit="bytes", read_in="engines/_shm.pyx -> engines/shm/shm_copy.c", doc="""
        Last-level cache size: an all_gather whose outputs (all ranks' together) fill it writes the
        local block with streaming stores. Default: read from sysfs."""),
    _s("COLLECTIVES_SHM_THP", "bool", True, read_in="engines/_shm.pyx -> engines/shm/shm_copy.c", doc="""
        Collapse buffers that peers copy by process_vm_readv/writev into huge pages (MADV_COLLAPSE,
        Linux 6.1; they copy twice as fast); false turns it off."""),
    # other backends and torch
    _s("COLLECTIVES_MPI_WATCHDOG", "bool", True, read_in="backends/mpi/watchdog.py", doc="""
        The mpi backend's watchdog: a blocking call stuck past the group timeout prints its stack
        and calls MPI_Abort. False: such a call waits forever."""),
    _s("COLLECTIVES_NCCL_LIB", "str", None, read_in="backends/nccl.py", doc="""
        Path of the libnccl the nccl backend loads. Default: torch's nvidia-nccl wheel, else any
        libnccl.so.2 the loader finds."""),
    _s("COLLECTIVES_TORCH_BRIDGE", "bool", True,
        agree=True, read_in="api/group.py, torch_bridge/torch_pg.py", doc="""
        Where torch is imported, our groups are torch.distributed ProcessGroups too and the default
        group becomes torch's; false turns that off."""),
    _s("COLLECTIVES_TORCH_BACKEND", "str", "gloo", agree=True, read_in="torch_bridge/torch_pg.py", doc="""
        Backend of the groups that torch.distributed.init_process_group('collectives') makes."""),
    _s("COLLECTIVES_FSDP_SHARED", "bool", True, agree=True,
        read_in="torch_bridge/torch_pg.py, torch_bridge/fsdp.py", doc="""
        FSDP2 (fully_shard) on our groups, all ranks on one host: its all_gathers and
        reduce_scatters go through buffers the ranks share from a module's first forward
        (collectives.torch_bridge.fsdp); false keeps FSDP2's own calls. Read when torch's side of
        our groups is loaded and at each FSDP2 module's first forward."""),
    _s("COLLECTIVES_PROGRESS_SLICE_US", "int", 100,
        unit="us", read_in="core/sched.py", doc="""
        Time slice the progress threads and the thread completing torch's futures ask of the
        kernel (sched_setattr's sched_runtime, Linux 6.12 and later; unprivileged): a short one
        runs them as soon as they wake instead of after the computing thread's slice; 0 keeps the
        kernel's. Older kernels ignore it."""),
    _s("COLLECTIVES_TIMELINE", "bool", False, read_in="core/timeline.py", doc="""
        Record when each asynchronous collective was posted, started, finished and its torch
        future completed (collectives.core.timeline; for bench/bench_train.py's timelines)."""),
    # elastic training in place (collectives/elastic, docs/elastic.md); collectives-run sets them
    _el("COLLECTIVES_ELASTIC_STORE", "str", None, doc="""
        host:port of the job's store, served outside the training ranks (collectives-run's
        supervisor, or ``python -m collectives.elastic.store``); elastic.init() meets there."""),
    _el("COLLECTIVES_ELASTIC_JOB", "str", "job", doc="""
        The elastic job's name: processes with the same store and name form one job."""),
    _el("COLLECTIVES_ELASTIC_NP", "int", None, minimum=1, doc="""
        Processes the first generation waits for (default: WORLD_SIZE, else the minimum)."""),
    _el("COLLECTIVES_ELASTIC_MIN_NP", "int", 1, minimum=1, doc="""
        Fewest members a generation may have: below it the members wait for newcomers, then
        fail with ElasticError."""),
    _el("COLLECTIVES_ELASTIC_MAX_NP", "int", None, minimum=1, doc="""
        Most members a generation may have (default: no limit); newcomers beyond it wait."""),
    _el("COLLECTIVES_ELASTIC_TIMEOUT", "int", 600, minimum=1, unit="s", doc="""
        Seconds a rendezvous may take: the wait for newcomers below the minimum, and for a
        live member that does not come to the rendezvous."""),
    # security (docs/security.md)
    _s("COLLECTIVES_AUTH_KEY", "str", None, agree=True, read_in="security/auth.py", doc="""
        The job's shared key: every store and rank-to-rank connection opens with an HMAC-SHA256
        challenge-response on it, and a peer without it is refused. collectives-run sets a random
        one for a single-node job (or takes --auth-key-file). Default: no key, no handshake (torch's
        behaviour)."""),
    _s("COLLECTIVES_MALLOC_TRIM", "int", 64 * MiB, unit="bytes", read_in="core/heap.py", doc="""
        At its first group a process fixes glibc's malloc thresholds: requests under 32 MiB come
        from the heap, whose free top goes back to the kernel only beyond this many bytes, so a
        training step's freed memory is reused instead of faulted in again every step (see
        docs/compatibility.md). 0, a MALLOC_*_ variable or glibc.malloc in GLIBC_TUNABLES: glibc's
        own behaviour."""),
    _s("COLLECTIVES_SAFE_OBJECTS", "bool", False, read_in="security/safe_pickle.py", doc="""
        The object calls (broadcast_object_list, all_gather_object, ...) unpickle with an allow-list
        (plain data, NumPy arrays, torch tensors) instead of full pickle; per call: safe=True."""),
    # the flight recorder (collectives/diagnostics/fr_registry.py; torch's TORCH_FR_* names first)
    _fr("COLLECTIVES_FR_BUFFER_SIZE", "int", 256, doc="""
        Collectives the flight recorder keeps per group (torch's TORCH_FR_BUFFER_SIZE, where set,
        comes first); 0 turns the recorder, its dumps and progress posts off."""),
    _fr("COLLECTIVES_WAIT_WARN_S", "int", 60, unit="s",
        read_in="diagnostics/progress.py, store/rendezvous.py", doc="""
        A rank blocked this long in a collective (or at the rendezvous) logs a warning naming the
        call (its number and name) and the ranks that have not arrived, then again after twice,
        four times... as long; 0: never. The collective's warning comes from the flight
        recorder's thread (COLLECTIVES_FR_BUFFER_SIZE > 0), which learns where the other ranks are
        from their progress posts in the job's store (the mpi backend under mpiexec has none: its
        warning names the call only). The group's timeout (default 1800 s) still ends the wait
        with an error."""),
    _fr("COLLECTIVES_FR_DUMP", "str", None, doc="""
        Path prefix of the flight recorder's dumps, the global rank appended (torch's
        TORCH_FR_DUMP_TEMP_FILE, where set, comes first). Default: a file in the temp directory
        named after the job."""),
    _fr("COLLECTIVES_FR_STACK", "bool", False, doc="""
        Record the Python stack of every call in the flight recorder (costly)."""),
    _s("COLLECTIVES_NO_EXTENSIONS", "bool", False, agree=True, read_in="config/__init__.py", doc="""
        Hide the compiled extensions (_core, _buffer, _tcp, _shm, _mpilog, _ncclcall): the package
        runs on its pure-Python/NumPy fallback, as when they are not built (kernels and the mpi and
        registered backends work; the gloo backend needs _tcp). For tests and debugging."""),
    # build (setup.py)
    _build("COLLECTIVES_ONLY", "str", None, doc="""
        Comma-separated extensions to build (e.g. _shm,_core); default all. _tcp and _shm call
        _core's kernels, and _core and _shm read _buffer's Buffer, so they import only where those
        are built."""),
    _build("COLLECTIVES_MARCH_NATIVE", "bool", False, doc="""
        Compile with -march=native (not for wheels; the kernels dispatch at run time anyway)."""),
    _build("COLLECTIVES_DEBUG_SYMBOLS", "bool", False, doc="""
        Keep debug information in the extensions (for gdb or perf on a checkout). By default they
        are compiled with -g0 and linked with --strip-all, as released wheels are."""),
    # tests (tests/support/ranks.py and the test modules)
    _test("COLLECTIVES_TEST_CONFIGS", "str", None, doc="""
        Comma-separated backend configurations to test (store, gloo, gloo-tcp, gloo-hier, mpi,
        nccl); default every available host configuration."""),
    _test("COLLECTIVES_TEST_REQUIRE", "str", None, read_in="tests/support/requires.py", doc="""
        Comma-separated parts the test run must have (gloo, shm, hier, mpi, slurm, netns,
        frameworks: Lightning and accelerate installed, for tests/frameworks): a test
        that needs a listed part fails where it is missing instead of skipping (.ci/run sets it)."""),
    _test("COLLECTIVES_TEST_START_TIMEOUT", "int", 120, minimum=1, doc="""
        Seconds a rank pool may take to start."""),
    _test("COLLECTIVES_TEST_GROUP_TIMEOUT", "int", 30, minimum=1, doc="""
        Group timeout (seconds) of the test pools' process groups."""),
    _test("COLLECTIVES_TEST_MAX_POOLS", "int", 8, minimum=1, doc="""
        Rank pools kept running at once (the least recently used is closed; a test module's own
        pools close at its end)."""),
    _test("COLLECTIVES_TEST_HOSTS", "int", None, minimum=1, doc="""
        Fake this many hosts in a pool, ranks dealt out in turn (the gloo-hier configuration)."""),
    _test("COLLECTIVES_TEST_POOL", "str", None, doc="""
        A label that keeps pools apart (tests give pools that import torch their own)."""),
    _test("COLLECTIVES_TEST_INSTALLED", "str", None, read_in="tests/support/__init__.py", doc="""
        Set by .ci/run's installed leg to the checkout the wheel was built from: the run fails if
        collectives is imported from there rather than from site-packages."""),
    _test("COLLECTIVES_POOL_ADDR", "str", None, doc="""
        Set by the test harness for its rank processes: where to connect back. Not for users."""),
    _test("COLLECTIVES_POOL_KEY", "str", None, doc="""
        Set by the test harness for its rank processes: the connection's key. Not for users."""),
)

_BY_NAME = {s.name: s for s in SETTINGS}
assert len(_BY_NAME) == len(SETTINGS), "a setting is declared twice"


def declared(name):
    """The :class:`Setting` called ``name``; KeyError naming the registry for any other."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in collectives/config/__init__.py (declare every "
                       f"COLLECTIVES_* setting there)") from None


def get(name, environ=None, first=None):
    """The parsed value of setting ``name`` from ``environ`` (default ``os.environ``).

    Args:
        name: a declared ``COLLECTIVES_*`` name.
        environ: a mapping to read instead of the process environment.
        first: another variable for the same setting (torch's name) that comes first where
            it is set and not empty; parsed by the same rule, its errors naming it.

    Returns:
        The value, of the setting's type; its default when unset or empty.

    Raises:
        KeyError: ``name`` is not declared.
        ValueError: the value does not parse (the message names the variable).
    """
    s = declared(name)
    env = os.environ if environ is None else environ
    if first is not None and env.get(first, "").strip():
        return replace(s, name=first).parse(env[first])
    return s.parse(env.get(name))


def settings(scope=None):
    """The declared settings, in registry order (only ``scope``'s where given)."""
    return tuple(s for s in SETTINGS if scope is None or s.scope == scope)


# ---- COLLECTIVES_NO_EXTENSIONS ------------------------------------------------------------

def _hide_extensions():
    """Make ``import collectives.engines.<ext>`` raise ImportError (a None entry in sys.modules is
    Python's documented way), so every import site takes its fallback."""
    pkg = __name__.rpartition(".")[0] or "collectives"
    for ext in EXTENSIONS:
        full = f"{pkg}.engines.{ext}"
        if sys.modules.get(full) is None:
            sys.modules[full] = None


if get("COLLECTIVES_NO_EXTENSIONS"):
    _hide_extensions()


# ---- the generated reference page --------------------------------------------------------

_SCOPES = (
    ("runtime", "Run time",
     "Read by the package in every rank's process. Set them in the environment of the "
     "launcher (`collectives-run`, `mpiexec`, `torchrun`), which passes it on to the ranks."),
    ("build", "Build", "Read by `setup.py` while the extensions compile."),
    ("test", "Tests", "Read by the test harness (`tests/support/ranks.py`) and the test modules."),
)


def _fmt_default(s):
    if s.default is None:
        return "(see text)" if s.scope == "runtime" or "Default" in s.doc else "unset"
    if s.type == "bool":
        return "true" if s.default else "false"
    if s.type == "int" and s.unit == "bytes" and s.default and s.default % KiB == 0:
        d = s.default
        return f"{d // MiB} MiB" if d % MiB == 0 else f"{d // KiB} KiB"
    return f"{s.default} {s.unit}".strip() if s.type == "int" else str(s.default)


def _fmt_type(s):
    if s.type == "choice":
        return " \\| ".join(s.choices)
    return f"int ({s.unit})" if s.unit else s.type


def _fmt_agree(s):
    if s.rank0:
        return "rank 0's"
    return "must agree" if s.agree else "per rank"


def markdown():
    """docs/configuration.md, generated from :data:`SETTINGS`."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m collectives.config --markdown -o docs/configuration.md` "
        "from collectives/config/__init__.py; do not edit by hand (CI checks it is current). -->",
        "",
        "Every `COLLECTIVES_*` environment variable, declared once in `collectives/config/__init__.py`."
        " Parsing is the same for every setting of a type: unset or empty gives the default; a"
        " bool is false for `0`, `false`, `no`, `off` (any case) and true otherwise; an int is a"
        " decimal integer; a value that does not parse raises `ValueError` naming the variable.",
        "",
        "The *Group* column says whether the ranks of one group must be started with equal "
        "values: *must agree* (the setting picks an algorithm or a layout, so ranks that differ "
        "could pick different ones for one call), *rank 0's* (the backend sends rank 0's value "
        "to the others at group creation, so only rank 0's environment counts), or *per rank*.",
        "",
        "Read a value from Python with `collectives.config.get(\"COLLECTIVES_TCP_SPIN_US\")`.",
        "",
    ]
    for scope, title, intro in _SCOPES:
        rows = settings(scope)
        out += [f"## {title}", "", intro, "",
                "| Setting | Type | Default | Group | What it does |",
                "|---|---|---|---|---|"]
        for s in rows:
            doc = s.doc.replace("|", "\\|")
            out.append(f"| `{s.name}` | {_fmt_type(s)} | {_fmt_default(s)} | {_fmt_agree(s)} | {doc} |")
        out.append("")
    out += ["## Where each is read", "",
            "For maintainers: the call sites today (the registry's accessor replaces their own "
            "parsing as they are switched over).", "",
            "| Setting | Read in |", "|---|---|"]
    out += [f"| `{s.name}` | {s.read_in} |" for s in SETTINGS]
    out.append("")
    return "\n".join(out)
