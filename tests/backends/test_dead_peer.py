"""A rank that dies inside a call: every other rank raises DistError within the timeout.

Each case starts a fresh world of three ranks (rank 0 serves the store, so it is never the
victim). The victim arms a SIGALRM timer and enters the call; SIGALRM's default action ends
the process from the kernel, wherever it is (blocked in C code, mid-copy, the GIL
released or not). One survivor enters the call at once, and is in it when the victim dies;
the other enters after the victim died (``LATE``; in point to point, rank 0 is late).
Roles are chosen so that each survivor needs the victim in the call: the victim is the
broadcast's and the scatter's root, a sender to the gather's and the reduce's root, and the
symmetric calls need everyone.
:meth:`RankPool.run_dead_peer` keeps the survivors running when the victim dies and
returns what each one saw: the exception's type and message, how long it took, and
whether the call itself or the barrier after it raised.

Sizes: on shared memory a two-copy size (through the segment, chunked) and a single-copy
size (read from the victim's memory, COLLECTIVES_SHM_CMA_* set low); TCP and the
hierarchical mode (two faked hosts) at one size. MPI: a dead rank ends an MPI job, so there
the victim never arrives, and the survivors' async calls raise at the timeout (blocking
collectives end the job by the watchdog: collectives/backends/mpi/watchdog.py).
"""
import os
import time

import numpy as np
import pytest

from tests.support.ranks import CONFIGS, RankPool, config_available
from tests.support.requires import skip_unless_required

pytestmark = pytest.mark.faults

GROUP_TIMEOUT = 5.0
GRACE = 8.0  # "a few seconds" past the timeout on a loaded 2-core machine
WORLD = 3
VICTIM = 2
EARLY, LATE = 0, 1  # the survivor in the call when the victim dies; the one that comes after
DIE_AFTER = 0.3     # seconds after the victim enters the call
LATE_BY = 1.2       # seconds the late survivor waits before entering

COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce",
               "reduce_scatter", "all_to_all", "barrier"]
# point to point, both ways: the survivor EARLY sends to the victim, which died in its
# recv; the victim died in its send, and EARLY receives from it
P2P = ["send_to_dead_receiver", "recv_from_dead_sender"]
OPS = COLLECTIVES + P2P

TWO_COPY = {"COLLECTIVES_SHM_CMA_MIN": str(1 << 40), "COLLECTIVES_SHM_CMA_BCAST_MIN": str(1 << 40),
            "COLLECTIVES_SHM_CMA_AR_MIN": str(1 << 40), "COLLECTIVES_SHM_HALF_BYTES": "16384",
            "COLLECTIVES_SHM_CHUNK_BYTES": "8192", "COLLECTIVES_SHM_ONESHOT_MAX": "2048"}
SINGLE_COPY = {"COLLECTIVES_SHM_CMA_MIN": "64", "COLLECTIVES_SHM_CMA_BCAST_MIN": "64",
               "COLLECTIVES_SHM_CMA_AR_MIN": "64", "COLLECTIVES_SHM_AR_ALGO": "single_copy"}
# name -> (configuration in tests/support/ranks.py, extra environment, float32 elements);
# 1 M elements (4 MiB) is past every socket buffer and shared-memory slot: a victim that
# sends it is still sending when it dies
SETUPS = {
    "shm-two-copy": ("gloo", TWO_COPY, 1 << 20),
    "shm-single-copy": ("gloo", SINGLE_COPY, 1 << 20),
    "tcp": ("gloo-tcp", {}, 1 << 20),
    "hier": ("gloo-hier", {}, 1 << 20),
}


def init(ctx, config):
    """init_process_group for ``config`` with a short timeout (the pool's setup)."""
    from datetime import timedelta

    import collectives as dist
    hosts = os.environ.get("COLLECTIVES_TEST_HOSTS")
    if hosts:
        os.environ["COLLECTIVES_HOST_ID"] = f"host{ctx.rank % int(hosts)}"
    dist.init_process_group(CONFIGS[config][0], timeout=timedelta(seconds=GROUP_TIMEOUT))
    return dist.get_rank()


def call(dist, op, rank, world, n, async_op=False):
    """``op`` as rank ``rank`` plays it; returns the Work of an async call, else None."""
    x = np.full(n, rank + 1, np.float32)
    kw = {"async_op": True} if async_op else {}
    if op == "all_reduce":
        return dist.all_reduce(x, **kw)
    if op == "broadcast":
        return dist.broadcast(x, VICTIM, **kw)
    if op == "all_gather":
        return dist.all_gather([np.empty(n, np.float32) for _ in range(world)], x, **kw)
    if op == "gather":
        out = [np.empty(n, np.float32) for _ in range(world)] if rank == 0 else None
        return dist.gather(x, out, 0, **kw)
    if op == "scatter":
        src = [np.full(n, i, np.float32) for i in range(world)] if rank == VICTIM else None
        return dist.scatter(x, src, VICTIM, **kw)
    if op == "reduce":
        return dist.reduce(x, 0, **kw)
    if op == "reduce_scatter":
        return dist.reduce_scatter(x, [np.full(n, rank, np.float32) for _ in range(world)], **kw)
    if op == "all_to_all":
        return dist.all_to_all([np.empty(n, np.float32) for _ in range(world)],
                               [np.full(n, rank, np.float32) for _ in range(world)], **kw)
    if op == "barrier":
        return dist.barrier(**kw)
    if op == "send_to_dead_receiver":
        return _send_recv(dist, x, rank, 0, VICTIM, async_op)
    if op == "recv_from_dead_sender":
        return _send_recv(dist, x, rank, VICTIM, 0, async_op)
    raise ValueError(op)


def _send_recv(dist, x, rank, src, dst, async_op):
    """Rank ``src`` sends ``x`` to rank ``dst``, which receives it; the others take no part."""
    if rank == src:
        return dist.isend(x, dst) if async_op else dist.send(x, dst)
    if rank == dst:
        return dist.irecv(x, src) if async_op else dist.recv(x, src)
    return None


def involved(op, rank):
    """Whether ``rank`` takes part in ``op`` (point to point: ranks 0 and the victim)."""
    return op not in P2P or rank in (0, VICTIM)


def late(op):
    """The survivor that enters ``op`` after the victim died: in point to point, rank 0, so
    that the victim is still waiting for it (its receiver, or its sender) when it dies."""
    return 0 if op in P2P else LATE


def die_inside(ctx, op, n):
    """The victim dies DIE_AFTER s into ``op``; a survivor returns what it saw."""
    import signal

    import collectives as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank is up and connected before the fault
    if rank == VICTIM:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the kernel ends the process
        signal.setitimer(signal.ITIMER_REAL, DIE_AFTER)
        call(dist, op, rank, world, n)
        time.sleep(60)  # returned before the timer: die here, after the call
        return "victim outlived the call"
    if not involved(op, rank):
        return {"raised": None, "where": "not involved"}
    if rank == late(op):
        time.sleep(LATE_BY)
    return outcome(dist, lambda: call(dist, op, rank, world, n),
                   follow=None if op in P2P else dist.barrier)


def outcome(dist, fn, follow):
    """Run ``fn`` (then ``follow``, a barrier, if given: a survivor whose part of the call
    needed nothing more from the victim may learn of its death at the next call): what was
    raised, where, and when."""
    t0 = time.monotonic()
    where = "call"
    try:
        fn()
        if follow:
            where = "barrier after"
            follow()
    except Exception as e:  # reported, and judged by the test
        return {"raised": type(e).__name__, "dist_error": isinstance(e, dist.DistError),
                "msg": str(e)[:500], "elapsed": time.monotonic() - t0, "where": where}
    return {"raised": None, "elapsed": time.monotonic() - t0, "where": "nowhere"}


def check_survivors(answers, died, victim, op):
    assert victim in died, f"the victim did not die: {answers.get(victim)}"
    survivors = [r for r in answers if r != victim]
    assert len(survivors) == WORLD - 1, answers
    for r in survivors:
        got = answers[r]
        if not involved(op, r):
            continue
        assert got["raised"] is not None, f"rank {r} raised nothing in {op}: {got}"
        assert got["dist_error"], f"rank {r} raised {got['raised']}, not a DistError: {got}"
        assert got["raised"] in ("DistBackendError", "DistNetworkError", "DistError"), got
        assert got["elapsed"] < GROUP_TIMEOUT + GRACE, \
            f"rank {r} took {got['elapsed']:.1f} s: {got}"


# calls in which the victim sends data the survivors need; over TCP, loopback's socket
# buffers take a few MiB at once (a 4 MiB send completed before its sender died, and its
# receiver rightly got all of it), so the victim sends 64 MiB there
VICTIM_SENDS = {"broadcast", "scatter", "gather", "reduce", "recv_from_dead_sender"}
BIG = 1 << 24


def run_case(setup, op):
    config, env, n = SETUPS[setup]
    if config != "gloo" and op in VICTIM_SENDS:
        n = BIG
    ok, why = config_available(config)
    if not ok:  # the part COLLECTIVES_TEST_REQUIRE names: shm, hier, or gloo for TCP
        skip_unless_required("gloo" if setup == "tcp" else setup.split("-")[0], why)
    pool = RankPool(WORLD, init, (config,), dict(CONFIGS[config][2], **env))
    answers, died = pool.run_dead_peer(die_inside, op, n, victims={VICTIM},
                                       timeout=GROUP_TIMEOUT + GRACE + 30)
    check_survivors(answers, died, VICTIM, op)
    return answers


# the quick suite runs one collective and one point-to-point case per setup
QUICK = {("shm-two-copy", "all_reduce"), ("shm-single-copy", "broadcast"), ("tcp", "all_gather"),
         ("hier", "reduce_scatter"), ("shm-two-copy", "recv_from_dead_sender"),
         ("tcp", "send_to_dead_receiver")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setup,op", [
    pytest.param(s, op, marks=() if (s, op) in QUICK else pytest.mark.slow, id=f"{s}-{op}")
    for s in SETUPS for op in OPS])
def test_every_survivor_raises_a_dist_error_within_the_timeout(setup, op):
    run_case(setup, op)


# ---- MPI: the peer that never arrives ------------------------------------------------------

def never_arrives(ctx, op):
    """The victim skips ``op``; each survivor's async call must raise at its wait."""
    import collectives as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == VICTIM:  # back to the pool's loop: no MPI call until the pool ends
        return "absent"
    if not involved(op, rank):
        return {"raised": None, "where": "not involved"}
    # 4 MiB: past MPICH's eager limit, so a send waits for its receiver
    return outcome(dist, lambda: call(dist, op, rank, world, 1 << 20, async_op=True).wait(),
                   follow=None if op in P2P else lambda: dist.barrier(async_op=True).wait())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("op", [pytest.param(op, marks=() if op == "all_reduce" else pytest.mark.slow)
                                for op in OPS])
def test_mpi_survivors_of_a_peer_that_never_arrives_raise_at_the_timeout(op):
    ok, why = config_available("mpi")
    if not ok:
        skip_unless_required("mpi", why)
    pool = RankPool(WORLD, init, ("mpi",), CONFIGS["mpi"][2], launcher="mpiexec")
    answers, died = pool.run_dead_peer(never_arrives, op, victims={VICTIM},
                                       timeout=3 * GROUP_TIMEOUT + 2 * GRACE + 30)
    assert answers.get(VICTIM) == "absent", (answers, died)
    for r in range(WORLD):
        if r == VICTIM or not involved(op, r):
            continue
        got = answers[r]
        assert got["raised"] == "DistBackendError", f"rank {r}: {got}"
        # at the call's timeout, or at the barrier's after a call that needed nothing more
        limit = GROUP_TIMEOUT + GRACE if got["where"] == "call" else 2 * GROUP_TIMEOUT + GRACE
        assert GROUP_TIMEOUT - 0.5 <= got["elapsed"] < limit, got
