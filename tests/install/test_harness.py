"""The multi-rank harness itself: results come back by rank, failures and hangs fail fast,
and a killed MPI job leaves no file behind."""
import glob
import time

import pytest

from tests.support.ranks import MPI_SEGMENTS, RankError, RankPool, get_pool, mpiexec_path


def who(ctx):
    return (ctx.rank, ctx.world_size)


def remember(ctx, value):
    ctx.state["v"] = value * (ctx.rank + 1)


def recall(ctx):
    return ctx.state["v"]


def fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one fails")
    return ctx.rank


def mpi_barrier(ctx):
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()


def hang(ctx):
    time.sleep(60)


@pytest.mark.timeout(60)
def test_results_come_back_in_rank_order_and_state_persists():
    pool = get_pool(3)
    assert pool.run(who) == [(0, 3), (1, 3), (2, 3)]
    pool.run(remember, 10)
    assert pool.run(recall) == [10, 20, 30]


@pytest.mark.timeout(60)
def test_remote_exception_carries_the_rank_traceback_and_pool_survives():
    pool = get_pool(2)
    with pytest.raises(RankError, match="rank one fails"):
        pool.run(fail_on_rank_1)
    assert pool.run(who) == [(0, 2), (1, 2)]


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_a_hang_kills_the_pool_within_the_timeout():
    pool = get_pool(2, env={"HARNESS_TEST": "hang"})
    t0 = time.monotonic()
    with pytest.raises(RankError, match="timed out"):
        pool.run(hang, timeout=1)
    assert time.monotonic() - t0 < 15
    assert not pool.alive()
    assert get_pool(2, env={"HARNESS_TEST": "hang"}).run(who) == [(0, 2), (1, 2)]


@pytest.mark.timeout(90)
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (pip install 'collectives[mpi]')")
def test_mpiexec_launcher_numbers_ranks_from_the_mpi_environment():
    assert get_pool(2, launcher="mpiexec").run(who) == [(0, 2), (1, 2)]


@pytest.mark.faults
@pytest.mark.timeout(90)
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (pip install 'collectives[mpi]')")
def test_a_killed_mpi_job_leaves_no_shared_memory_file():
    """MPICH's ranks share a file in /dev/shm that MPI_Finalize removes; a pool whose ranks
    are killed (a dead-peer test, a timeout) removes it itself."""
    pytest.importorskip("mpi4py")
    before = set(glob.glob(MPI_SEGMENTS))
    pool = RankPool(2, launcher="mpiexec")
    try:
        pool.run(mpi_barrier)
        made = set(glob.glob(MPI_SEGMENTS)) - before
    finally:
        pool.kill()
    if not made:
        pytest.skip(f"this MPI made no file matching {MPI_SEGMENTS}")
    assert set(glob.glob(MPI_SEGMENTS)) - before == set()
