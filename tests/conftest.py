"""Shared fixtures, markers and hypothesis profiles of the test suite.

Run it in pieces::

    pytest -m "not slow"                    # the quick suite (3 minutes on 2 cores, a
                                            # process per CPU with pytest-xdist; -n 0: one)
    pytest -m "not slow and not mpi"        # ... without the mpiexec configuration
    pytest -m faults                        # dead peers, cut links, timeouts
    HYPOTHESIS_PROFILE=ci pytest -m "not slow"   # the quick selection at full example counts

Profiles (tests/profiles.py): a run that names none gets ``dev`` (a tenth of each
property test's examples) when its -m expression contains ``not slow``, else ``ci`` (every
test's own count: ``pytest`` with no -m runs every property at full strength).
    COLLECTIVES_TEST_CONFIGS=gloo pytest    # one backend configuration

Markers (registered in pyproject.toml) are applied here by module and by name, so test
modules need no decorators for them: ``mpi`` (ranks under mpiexec, or the mpi
configuration), ``gpu`` (CUDA), ``multinode`` (network namespaces), ``faults`` (failure
injection) and ``slow`` (the modules and tests that take most of the suite's time,
measured with ``--durations``).
"""
import os

import pytest

from tests import profiles
from tests import ranks
from tests.ranks import available_configs

# module -> markers for every test in it
MODULE_MARKERS = {
    "test_mpi_backend": ("mpi",),
    "test_nccl": ("gpu",),
    "test_multinode": ("multinode", "faults"),
    "test_faults": ("faults",),
}
# test (module::function) -> markers, for tests outside those modules
TEST_MARKERS = {
    "test_security::test_the_c10d_rendezvous_across_two_nodes_uses_the_key": ("multinode",),
}
# The quick suite (-m "not slow") runs every configuration-parametrised test on one
# configuration, PRIMARY (the default backend, gloo, where it is available); its runs on
# the other configurations are marked slow.
# Tests (module::function for every parameter, module::function[id] for one) and modules
# that are slow on any configuration: measured with --durations on the 2-core
# development machine (see docs/testing.md). Each slow test keeps a quick instance: a
# smaller sibling, another parameter, or its property at the quick profile's examples.
SLOW_TESTS = {
    "test_torch_pg::test_ddp_trains_as_one_process_on_all_ranks_data",
    "test_torch_pg::test_ddp_comm_hooks_whose_callbacks_wait_on_collectives",
    "test_torch_pg::test_who_sets_up_and_tears_down_torchs_default_group",
    "test_torch_pg::test_fsdp_trains_as_one_process_on_all_ranks_data",
    "test_torch_pg::test_a_peer_that_never_arrives_makes_torchs_calls_raise_within_the_timeout",
    "test_nn::test_outputs_and_gradients_match_autograd_in_one_process",
    "test_launcher::test_torchrun_starts_a_collectives_program",
    "test_launcher::test_c10d_a_failure_restarts_every_node_while_max_restarts_allows",
    "test_launcher::test_c10d_a_silent_store_ends_the_other_nodes_part",
    "test_launcher::test_c10d_launchers_number_their_nodes_without_node_rank",
    "test_launcher::test_c10d_elastic_range_starts_with_min_and_takes_a_late_node_in",
    "test_launcher::test_c10d_nodes_may_start_different_numbers_of_ranks",
    "test_launcher::test_c10d_a_signal_ends_launchers_waiting_for_nodes",
    "test_faults::test_the_ranks_left_shrink_the_world_and_go_on",
    "test_faults::test_other_ranks_raise_dist_error_within_the_timeout",
    "test_rendezvous::test_ranks_meet_through_torchruns_agent_store",
    "test_tcp_backend::test_a_few_megabytes_through_every_algorithm",
    # (the quick suite keeps test_worker_memory_flat_over_10k_dropped_tensors)
    "test_master_worker::test_worker_memory_flat_over_100k_dropped_tensors",
    # (test_multinode, all slow, runs the c10d rendezvous across nodes; the quick suite keeps
    # the key tests on one node)
    "test_security::test_the_c10d_rendezvous_across_two_nodes_uses_the_key",
    # load-sensitive: a latency probe gives no verdict while its partner is descheduled,
    # and beside the quick suite's other process 1000 probes in a row once gave none (the
    # full suite runs them in one process)
    "test_shm::test_latency_probes_decide_streaming",
    "test_shm::test_probe_verdict_is_shared_when_ranks_outnumber_cores",
    # tests that wait out timeouts on purpose (8 s and 7 s); the quick suite keeps a group's
    # timeout (test_set_timeout_bounds_the_groups_later_calls) and a queued call's
    # (test_api::test_a_blocking_call_that_times_out_in_the_queue_never_runs_later)
    "test_pg_methods::test_a_calls_own_timeout_bounds_that_call_only",
    "test_device_mesh::test_breakpoint_stops_one_rank_and_the_others_wait_past_the_group_timeout",
}
# Parametrised tests whose quick instances are those with these parameter values (every
# value of a parameter not named here); their other instances are slow. The values kept
# are the most general ones (interleaved hosts, uneven worlds, every case on 3 ranks).
QUICK_PARAMS = {
    "test_mismatch::test_mismatch_raises_on_every_rank": {"n": (3,)},
    "test_shm::test_hierarchical_mode_is_chosen_for_faked_hosts": {
        "hosts": (("a", "b", "a", "b", "b"), ("a", "b", "b"))},
    "test_shm::test_every_collective_matches_numpy": {"world": (2, 3, 6)},
    "test_shm::test_all_reduce_bitwise_identical": {"world": (3,)},
    "test_shm::test_p2p": {"world": (2, 3)},
    "test_shm::test_streamed_segment_writes_match_numpy": {"world": (3,)},
    "test_shm::test_peer_killed_in_single_copy_op_raises": {"op": ("all_reduce",)},
    "test_rendezvous::test_destroy_and_init_again_on_the_same_port": {"world": (3,),
                                                                      "with_torch": (False,)},
    # torch-bridged groups' timeouts: test_torch_pg's own timeout test stays quick
    "test_pg_methods::test_set_timeout_bounds_the_groups_later_calls": {"bridged": (False,)},
    "test_pg_methods::test_monitored_barrier_method_names_the_rank_that_did_not_come": {
        "bridged": (False,)},
    "test_collectives::test_shrink_abort_fails_the_old_groups_pending_work_at_once": {
        "abort": (True,)},
    "test_profiling::test_the_profiler_sees_each_collective_as_one_span": {"world": (2,)},
    # quick: a program without a SIGUSR1 handler of its own (the recorder's wakeup fd)
    "test_flight_recorder::test_sigusr1_dumps_a_rank_blocked_in_a_collective": {
        "own_handler": (False,)},
    # blocked hosts (host blocks are slices) and interleaved ones (the whole group's TCP)
    "test_shm::test_hierarchical_collectives_match_numpy": {
        "hosts": (("a", "a", "b", "b"), ("a", "b", "a", "b", "b"))},
    "test_shm::test_two_copy_gather_streamed_into_output_matches_numpy": {"world": (4,)},
    # torch imported after init, then the bridge installed: both kinds of group in one run
    "test_bridge_decision::test_every_group_of_a_world_is_of_the_kind_decided_at_init": {
        "install": (True,)},
}
SLOW_MODULES = {
    "test_multinode", "test_mpi_backend", "test_tutorial",
}
# words in a test's name that mark a failure-injection test
FAULT_WORDS = ("dies", "dead", "died", "kill", "timeout", "cut", "frozen", "crash", "never_arrives")


@pytest.fixture(scope="module")
def config(request):
    """A backend configuration from the module's ``CONFIGS`` (default: every available
    one); module scope, so that the tests sharing one run back to back on warm rank pools."""
    return request.param


@pytest.fixture(scope="module", autouse=True)
def _module_pools(request):
    """At a module's end, close the rank pools that only it uses (tests/ranks.py)."""
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


# Tests that read the checkout's own files (sources, docs): the installed leg copies only
# tests/, examples/ and bench/ out of the tree, so they skip there, saying so.
SOURCE_TREE_TESTS = {
    "test_layers",
    "test_config::test_every_name_in_the_source_is_declared",
    "test_config::test_every_declared_name_is_read_somewhere",
    "test_config::test_generated_page_is_current",
    "test_shm_settings::test_the_engine_reads_no_environment_variable",
    "test_install::test_the_first_program_in_the_docs_is_the_example_file",
}


def installed_checkout():
    """The checkout that .ci/run's installed leg built the wheel from
    (COLLECTIVES_TEST_INSTALLED), or None in an ordinary run."""
    return os.environ.get("COLLECTIVES_TEST_INSTALLED") or None


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


def pytest_configure(config):
    _check_installed()
    # before collection: the test modules' settings(max_examples=examples(n)) read it
    profiles.choose(config.getoption("markexpr", ""), config.getoption("--hypothesis-profile", None))


def pytest_report_header(config):
    from hypothesis import settings
    import collectives
    return [f"hypothesis profile: {settings.get_current_profile_name()} (tests/profiles.py)",
            f"collectives {collectives.__version__} from {os.path.dirname(collectives.__file__)}"]


def callspec_value(item, name):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(name) if callspec is not None else None


def pytest_collection_modifyitems(config, items):
    primary = _primary()
    installed = installed_checkout() is not None
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        for m in MODULE_MARKERS.get(module, ()):
            item.add_marker(m)
        name = getattr(item, "originalname", None) or item.name
        for m in TEST_MARKERS.get(f"{module}::{name}", ()):
            item.add_marker(m)
        if (module in SLOW_MODULES or f"{module}::{name}" in SLOW_TESTS
                or f"{module}::{item.name}" in SLOW_TESTS):
            item.add_marker("slow")
        keep = QUICK_PARAMS.get(f"{module}::{name}")
        if keep and any(callspec_value(item, k) not in v for k, v in keep.items()):
            item.add_marker("slow")
        if any(w in name for w in FAULT_WORDS):
            item.add_marker("faults")
        callspec = getattr(item, "callspec", None)
        cfg = callspec.params.get("config") if callspec is not None else None
        if cfg == "mpi":
            item.add_marker("mpi")
        if cfg is not None and cfg != primary:
            item.add_marker("slow")
        if installed and (module in SOURCE_TREE_TESTS or f"{module}::{name}" in SOURCE_TREE_TESTS):
            item.add_marker(pytest.mark.skip(
                reason="reads the checkout's sources or docs; the installed leg runs the tests "
                       "outside it"))


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
            f"(tests/ranks.py; MAX_POOLS={ranks.MAX_POOLS} kept running at once)")
        verbose = terminalreporter.config.getoption("verbose") > 0
        for key, took, why, test in (ranks.STARTS if verbose else again):
            terminalreporter.write_line(f"  {why:7} {took:5.1f} s  {_pool_name(key)}  ({test})")
