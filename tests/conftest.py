"""Shared fixtures, markers and hypothesis profiles of the test suite.

Run it in pieces::

    pytest -m "not slow"                    # the quick suite (3 minutes on 2 cores, a
                                            # process per CPU with pytest-xdist; -n 0: one)
    pytest -m "not slow and not mpi"        # ... without the mpiexec configuration
    pytest -m faults                        # dead peers, cut links, timeouts
    HYPOTHESIS_PROFILE=ci pytest -m "not slow"   # the quick selection at full example counts

Profiles (tests/support/profiles.py): a run that names none gets ``dev`` (a tenth of each
property test's examples, at least 4) when its -m expression contains ``not slow``, else ``ci`` (every
test's own count: ``pytest`` with no -m runs every property at full strength).
    COLLECTIVES_TEST_CONFIGS=gloo pytest    # one backend configuration

Markers (registered in pyproject.toml) are set on the tests themselves: ``@pytest.mark.slow``
(or ``faults``, ``multinode``, ...) on a test, ``pytestmark = ...`` on a module, and
``tests/support/marks.py``'s ``quick_only(values, *quick)`` on a parametrised test whose other
parameter values are slow. This file adds two by configuration: a test parametrised by
``config`` is ``slow`` on every configuration but the primary one, and ``mpi`` on the mpi
one. ``mpi``: ranks under mpiexec; ``gpu``: CUDA; ``multinode``: network namespaces;
``faults``: failure injection; ``slow``: the tests that take most of the suite's time,
measured with ``--durations``, each with a quick sibling where one can be had.
"""
import glob
import os

import pytest

from tests.support import installed_checkout, profiles
from tests.support import ranks
from tests.support.ranks import available_configs

# The quick suite (-m "not slow") runs every configuration-parametrised test on one
# configuration, PRIMARY (the default backend, gloo, where it is available); its runs on
# the other configurations are marked slow here, and those of the mpi configuration mpi.
# Every other marker is on the tests themselves (see the module docstring).


@pytest.fixture(scope="module")
def config(request):
    """A backend configuration from the module's ``CONFIGS`` (default: every available
    one); module scope, so that the tests sharing one run back to back on warm rank pools."""
    return request.param


@pytest.fixture(scope="module", autouse=True)
def _module_pools(request):
    """At a module's end, close the rank pools that only it uses (tests/support/ranks.py)."""
    yield
    ranks.close_module_pools(request.module.__name__)


def _parametrized_directly(metafunc, name):
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = names.split(",") if isinstance(names, str) else names
        if name in [n.strip() for n in names]:
            return True
    return False


def pytest_generate_tests(metafunc):
    if "config" in metafunc.fixturenames and not _parametrized_directly(metafunc, "config"):
        configs = getattr(metafunc.module, "CONFIGS", None)
        if configs is None:
            configs = available_configs()
        metafunc.parametrize("config", list(configs), indirect=True, scope="module")


def _primary():
    configs = available_configs()
    return "gloo" if "gloo" in configs else (configs[0] if configs else None)


QUICK_WORKERS = 4  # at most; the quick suite takes one per CPU up to this


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The quick suite (an -m expression with ``not slow``) runs in one process per CPU (at
    most QUICK_WORKERS) where pytest-xdist is installed and no ``-n`` was given, a test
    module to a process (``--dist loadfile``: a module's tests share its rank pools and
    namespaces). Its tests spend much of their time waiting (timeouts they wait out, ranks
    starting), which another process's tests fill. ``-n 0`` runs it in one process; other
    runs (the full suite, single tests) are not distributed unless ``-n`` says so."""
    opt = config.option
    if (not config.pluginmanager.hasplugin("xdist") or getattr(opt, "numprocesses", 0) is not None
            or "not slow" not in (config.getoption("markexpr", "") or "")
            or os.environ.get("PYTEST_XDIST_WORKER") or config.getoption("collectonly")
            or config.getoption("usepdb")):
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(QUICK_WORKERS, cpus or 1)
    if workers < 2:
        return
    opt.numprocesses = workers
    if getattr(opt, "dist", "no") == "no":
        opt.dist = "loadfile"


def _check_installed():
    """In the installed leg, the tests must import the wheel's package from site-packages,
    never the checkout's: a file missing from the wheel must fail there."""
    checkout = installed_checkout()
    if checkout is None:
        return
    import collectives
    path = os.path.realpath(collectives.__file__)
    inside = path.startswith(os.path.realpath(checkout) + os.sep)
    if inside or "site-packages" not in path.split(os.sep):
        raise pytest.UsageError(
            f"COLLECTIVES_TEST_INSTALLED is set, but collectives was imported from {path}, "
            f"{'inside the checkout ' + checkout if inside else 'not from site-packages'}: run "
            f"the tests from a directory outside the checkout, against an installed wheel")


#: the MPI segment files in /dev/shm when the session began (see pytest_sessionfinish)
_SEGMENTS_AT_START = set()


def pytest_sessionstart(session):
    _SEGMENTS_AT_START.update(glob.glob(ranks.MPI_SEGMENTS))


def pytest_sessionfinish(session, exitstatus):
    """Remove the MPI segment files the session's jobs left and no process maps: a pool's
    killed job removes its own (RankPool.kill), and this takes those of the jobs the tests
    ran under mpiexec themselves and killed, or that ended in MPI_Abort."""
    ranks.close_pools()
    ranks.remove_orphan_segments(_SEGMENTS_AT_START)


def pytest_configure(config):
    _check_installed()
    # before collection: the test modules' settings(max_examples=examples(n)) read it
    profiles.choose(config.getoption("markexpr", ""), config.getoption("--hypothesis-profile", None))


def pytest_report_header(config):
    from hypothesis import settings
    import collectives
    return [f"hypothesis profile: {settings.get_current_profile_name()} (tests/support/profiles.py)",
            f"collectives {collectives.__version__} from {os.path.dirname(collectives.__file__)}"]


def pytest_collection_modifyitems(config, items):
    primary = _primary()
    for item in items:
        callspec = getattr(item, "callspec", None)
        cfg = callspec.params.get("config") if callspec is not None else None
        if cfg == "mpi":
            item.add_marker("mpi")
        if cfg is not None and cfg != primary:
            item.add_marker("slow")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    ranks.CURRENT_TEST = item.nodeid


def _pool_name(key):
    world, setup, setup_args, env, launcher = key
    what = (setup or "bare").rpartition(".")[2] + (setup_args if setup_args != "()" else "")
    env = ",".join(f"{k}={v}" for k, v in env)
    return f"{world} ranks, {what}" + (f", {env}" if env else "") + (
        f", {launcher}" if launcher != "spawn" else "")


def pytest_terminal_summary(terminalreporter):
    if ranks.STARTS:
        secs = sum(s[1] for s in ranks.STARTS)
        again = [s for s in ranks.STARTS if s[2] != "new"]
        terminalreporter.write_line(
            f"rank pools started: {len(ranks.STARTS)} ({len(again)} of them again, after an "
            f"eviction or a kill), {secs:.1f} s until ready "
            f"(tests/support/ranks.py; MAX_POOLS={ranks.MAX_POOLS} kept running at once)")
        verbose = terminalreporter.config.getoption("verbose") > 0
        for key, took, why, test in (ranks.STARTS if verbose else again):
            terminalreporter.write_line(f"  {why:7} {took:5.1f} s  {_pool_name(key)}  ({test})")
