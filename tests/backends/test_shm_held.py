"""The shared-memory engine's small calls begun with the GIL held (engines/shm/shm_coll.c,
"small calls under the caller's lock": barrier, broadcasts of at most 48 bytes,
all_reduces under 4 KiB). Each tries its call with the GIL held and a short spin, and
releases the GIL only where it must wait longer (shm_finish takes the call up there).

- Results: drawn runs of such calls (and larger ones, which are left whole to the
  blocking path) where one drawn rank comes late to some of them, so that the others'
  held attempts run out and the blocking path finishes the call, give every rank
  NumPy's results.
- Progress: while a rank waits in one of these calls for a peer that has not come, the
  rank's other Python threads run. The peer comes only once such a thread has finished
  some Python work: a wait that kept the GIL would never end (the call's timeout fails
  the test; nothing is timed).
- One CPU: the same runs with both ranks on one CPU (where a waiting rank yields at once
  instead of spinning) give NumPy's results.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.backends.test_shm_small_broadcast import GROUP_TIMEOUT_S, expected, run_sequence
from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool

pytestmark = pytest.mark.skipif("gloo" not in available_configs(),
                                reason="needs the default (shared-memory) configuration")


LATE = dict(late=st.integers(0, 3), delay_ms=st.sampled_from([0, 0, 0, 1, 5]))
CALL = st.one_of(
    st.tuples(st.just("broadcast"), st.integers(0, 3), st.integers(1, 12), *LATE.values()),
    st.tuples(st.just("broadcast"), st.integers(0, 3), st.integers(13, 300), *LATE.values()),
    st.tuples(st.just("all_reduce"), st.just(0), st.integers(1, 1023), *LATE.values()),
    st.tuples(st.just("all_reduce"), st.just(0), st.integers(1024, 3000), *LATE.values()),
    st.tuples(st.just("barrier"), st.just(0), st.just(0), *LATE.values()),
)


@pytest.mark.timeout(600)
@settings(max_examples=examples(10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 4), calls=st.lists(CALL, min_size=1, max_size=40))
def test_small_calls_with_late_ranks_match_numpy(n, calls):
    """Each call (kind, root, count, late, delay_ms): rank ``late % n`` sleeps first."""
    got = backend_pool("gloo", n).run(run_sequence, calls, timeout=4 * GROUP_TIMEOUT_S)
    want = expected(calls, n)
    for r in range(n):
        assert got[r] == want, f"rank {r}"


def run_waiting_with_a_thread(ctx, kind, waiter, path):
    """Run on every rank: ``kind`` (barrier, small broadcast from the late rank, small
    all_reduce) once in a fresh group. Rank ``waiter`` starts a thread that does some
    Python work and then creates ``path``, and calls at once; the other ranks call once
    ``path`` exists. Returns the call's result and how many steps the thread made."""
    import os
    import threading
    import time
    from datetime import timedelta

    import numpy as np

    import collectives as dist
    n, me = ctx.world_size, ctx.rank
    grp = dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    late = (waiter + 1) % n
    steps = []
    try:
        if me == waiter:
            def work():
                for i in range(200):  # Python work that needs the GIL all along
                    steps.append(sum(range(i * 100)))
                    time.sleep(0)
                with open(path, "w") as f:
                    f.write("go")
            t = threading.Thread(target=work)
            t.start()
        else:
            t = None
            deadline = time.monotonic() + GROUP_TIMEOUT_S
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise AssertionError(f"rank {waiter}'s thread did not finish its work while "
                                         f"rank {waiter} waited in {kind}")
                time.sleep(0.001)
        x = np.arange(4, dtype=np.float32) + 10 * me
        if kind == "broadcast":
            dist.broadcast(x, src=late, group=grp)
        elif kind == "all_reduce":
            dist.all_reduce(x, group=grp)
        else:
            dist.barrier(group=grp)
        if t is not None:
            t.join()
        return x.tolist(), len(steps)
    finally:
        dist.destroy_process_group(grp)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["barrier", "broadcast", "all_reduce"])
def test_other_threads_run_while_a_small_call_waits(tmp_path, n, kind):
    import numpy as np
    waiter = 0
    path = str(tmp_path / f"go-{kind}-{n}")
    got = backend_pool("gloo", n).run(run_waiting_with_a_thread, kind, waiter, path,
                                      timeout=4 * GROUP_TIMEOUT_S)
    base = np.arange(4, dtype=np.float32)
    want = {"barrier": base + 10 * 0, "broadcast": base + 10 * ((waiter + 1) % n),
            "all_reduce": sum(base + 10 * r for r in range(n))}[kind]
    for r in range(n):
        res, steps = got[r]
        if kind != "barrier":
            assert res == want.tolist(), f"rank {r}"
        assert steps == (200 if r == waiter else 0)


def run_on_one_cpu(ctx, calls):
    """``run_sequence`` with every rank on one CPU (as a busy machine's scheduler often puts
    two ranks): a waiting rank then yields at once instead of spinning (engines/shm/
    shm_segment.c, same_cpu). The rank's CPUs are restored after."""
    import os
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        return run_sequence(ctx, calls)
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.timeout(600)
@settings(max_examples=examples(4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(CALL, min_size=1, max_size=30))
def test_small_calls_on_one_cpu_match_numpy(calls):
    got = backend_pool("gloo", 2).run(run_on_one_cpu, calls, timeout=4 * GROUP_TIMEOUT_S)
    want = expected(calls, 2)
    for r in range(2):
        assert got[r] == want, f"rank {r}"
