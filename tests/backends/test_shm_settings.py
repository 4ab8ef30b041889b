"""The shared-memory engine takes its settings from the configuration registry.

The C engine (collectives/engines/shm/shm_*.c) reads no environment variable itself: _shm.pyx
reads COLLECTIVES_SHM_SPIN, _YIELD_US, _FAR_NS, _LLC_BYTES, _THP and _CMA_ANY_CORES
through collectives.config and hands them to shm_comm_set_tuning, so they parse by the
registry's rules. That the values reach the engine is tested in test_shm.py
(COLLECTIVES_SHM_FAR_NS, _THP, _LLC_BYTES, _CMA_ANY_CORES change what the ranks do).
"""
import glob
import os
import re
import secrets

import pytest

pytest.importorskip("collectives.engines._shm", reason="build the _shm extension (COLLECTIVES_ONLY=_shm)")

from collectives.engines._shm import ShmComm, unlink  # noqa: E402
from tests.support import ROOT  # noqa: E402
from tests.support.requires import needs_source_tree  # noqa: E402

SRC = os.path.join(ROOT, "collectives", "engines")


@needs_source_tree
def test_the_engine_reads_no_environment_variable():
    files = glob.glob(os.path.join(SRC, "shm/shm_*.[ch]"))
    assert files
    calls = [f"{os.path.basename(p)}: {line.strip()}" for p in files
             for line in open(p) if re.search(r"\bgetenv\s*\(", line)]
    assert not calls, calls


def _segments():
    return set(glob.glob("/dev/shm/collectives-*"))


@pytest.mark.parametrize("var, value", [("COLLECTIVES_SHM_SPIN", "fast"),
                                        ("COLLECTIVES_SHM_YIELD_US", "-5"),
                                        ("COLLECTIVES_SHM_LLC_BYTES", "32M"),
                                        ("COLLECTIVES_SHM_FAR_NS", "1.5")])
def test_a_bad_value_is_a_value_error_naming_the_variable(monkeypatch, var, value):
    """Before, the C engine's atoi read "fast" as 0 spins; now the registry refuses it,
    before anything is mapped."""
    monkeypatch.setenv(var, value)
    before = _segments()
    name = f"/collectives-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
    with pytest.raises(ValueError, match=var):
        ShmComm(name, True, 0, 1, 1 << 16, 1 << 12, 5.0)
    assert _segments() == before


@pytest.mark.parametrize("var, value", [("COLLECTIVES_SHM_SPIN", "0"),
                                        ("COLLECTIVES_SHM_YIELD_US", "0"),
                                        ("COLLECTIVES_SHM_FAR_NS", "-1"),
                                        ("COLLECTIVES_SHM_LLC_BYTES", "4096"),
                                        ("COLLECTIVES_SHM_THP", "off"),
                                        ("COLLECTIVES_SHM_CMA_ANY_CORES", "0")])
def test_a_one_rank_group_works_with_each_setting(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    name = f"/collectives-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}"
    comm = ShmComm(name, True, 0, 1, 1 << 16, 1 << 12, 5.0)
    try:
        comm.barrier()
        assert comm.cma_probe() is False  # one rank: nobody to copy from
    finally:
        unlink(name)
        comm.close()


def test_one_shot_default_shrinks_where_more_than_two_ranks_run_at_once():
    """COLLECTIVES_SHM_ONESHOT_MAX unset: 64 KiB while at most two ranks run at once (two
    ranks, or two cores), 4 KiB beyond (one-shot reads every rank's whole buffer)."""
    from collectives.backends.shm import default_oneshot_max
    big, small = 64 * 1024, 4 * 1024
    assert [default_oneshot_max(w, 2) for w in (2, 4, 8)] == [big, big, big]
    assert [default_oneshot_max(w, 16) for w in (2, 3, 4, 8, 16)] == [big, small, small, small, small]
    assert default_oneshot_max(2, 1) == big


def test_broadcast_single_copy_default_follows_how_many_ranks_run_at_once():
    """COLLECTIVES_SHM_CMA_BCAST_MIN unset: 64 KiB with two ranks, 256 KiB with more while
    at most two run at once (two cores), never where more do."""
    from collectives.backends.shm import default_cma_bcast_min
    assert [default_cma_bcast_min(w, 2) for w in (2, 4, 8)] == [64 << 10, 256 << 10, 256 << 10]
    assert [default_cma_bcast_min(w, 16) for w in (2, 3, 16)] == [64 << 10, 0, 0]


def test_sized_defaults_yield_to_the_environment(monkeypatch):
    """The one-shot bound and the broadcast's single-copy size depend on the group where
    unset (4 ranks on this host's cores), and are the environment's value where set."""
    from collectives.backends.shm import default_cma_bcast_min, default_oneshot_max, tuning_value
    monkeypatch.delenv("COLLECTIVES_SHM_CMA_BCAST_MIN", raising=False)
    monkeypatch.delenv("COLLECTIVES_SHM_ONESHOT_MAX", raising=False)
    assert tuning_value("COLLECTIVES_SHM_CMA_BCAST_MIN", 2) == 64 * 1024
    assert tuning_value("COLLECTIVES_SHM_CMA_BCAST_MIN", 4) == default_cma_bcast_min(4)
    assert tuning_value("COLLECTIVES_SHM_ONESHOT_MAX", 4) == default_oneshot_max(4)
    monkeypatch.setenv("COLLECTIVES_SHM_CMA_BCAST_MIN", "1000")
    monkeypatch.setenv("COLLECTIVES_SHM_ONESHOT_MAX", "123")
    assert tuning_value("COLLECTIVES_SHM_CMA_BCAST_MIN", 4) == 1000
    assert tuning_value("COLLECTIVES_SHM_ONESHOT_MAX", 4) == 123
