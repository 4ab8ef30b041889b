"""The shared-memory engine's small broadcasts (at most 48 bytes, engines/shm/shm_coll.c's
broadcast_inline): the root writes into a ring of 16 records and runs up to 16 calls ahead
of the slowest reader, and the readers do not wait for each other.

- Results: runs of small broadcasts from drawn roots, longer than the ring, mixed with
  other collectives, give every rank the root's data (checked against NumPy).
- Mismatches: a small broadcast against another call (another root, dtype or count, an
  all_reduce, a broadcast too large for the ring, a barrier) raises on every rank, at the
  call or (a rank that called a small broadcast) at its next call, naming both calls
  (tests/test_mismatch.py's check, with counts that fit the ring).
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.diagnostics.test_mismatch import GROUP_TIMEOUT_S, _run
from tests.support.profiles import examples
from tests.support.ranks import available_configs, backend_pool

pytestmark = pytest.mark.skipif("gloo" not in available_configs(),
                                reason="needs the default (shared-memory) configuration")

SMALL = dict(kind="broadcast", dtype="float32", count=4, root=0)  # 16 bytes: the ring

CASES = [
    ("root", SMALL, dict(SMALL, root=1)),
    ("dtype", SMALL, dict(SMALL, dtype="int32")),
    ("count", SMALL, dict(SMALL, count=5)),
    ("ring_vs_block", SMALL, dict(SMALL, count=100)),
    ("ring_vs_all_reduce", SMALL, dict(kind="all_reduce", dtype="float32", count=4)),
    ("all_reduce_vs_ring", dict(kind="all_reduce", dtype="float32", count=4), SMALL),
    ("ring_vs_barrier", SMALL, dict(kind="barrier")),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("odd", [0, -1], ids=["odd_root", "odd_last"])
@pytest.mark.parametrize("name,common,odd_spec", CASES, ids=[c[0] for c in CASES])
def test_small_broadcast_mismatch_raises_on_every_rank(n, odd, name, common, odd_spec):
    for s in (common, odd_spec):
        if s.get("root", 0) >= n:
            pytest.skip("root outside the group")
    _run("gloo", n, common, odd_spec, odd=odd % n)


def run_sequence(ctx, calls):
    """Run on every rank: ``calls`` in a fresh group; each is (kind, root, count), or (kind,
    root, count, late, delay_ms): rank ``late % n`` sleeps that long first. Returns every
    broadcast's and all_reduce's result."""
    import time
    from datetime import timedelta

    import numpy as np

    import collectives as dist
    n, me = ctx.world_size, ctx.rank
    grp = dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    out = []
    try:
        for i, (kind, root, count, *late) in enumerate(calls):
            if late and late[0] % n == me and late[1]:
                time.sleep(late[1] / 1000)
            x = (np.arange(count, dtype=np.float32) + 1000 * i + 10 * me)
            if kind == "broadcast":
                dist.broadcast(x, src=root % n, group=grp)
            elif kind == "all_reduce":
                dist.all_reduce(x, group=grp)
            else:
                dist.barrier(group=grp)
                continue
            out.append(x.tolist())
        return out
    finally:
        dist.destroy_process_group(grp)


def expected(calls, n):
    import numpy as np
    out = []
    for i, (kind, root, count, *_) in enumerate(calls):
        base = np.arange(count, dtype=np.float32) + 1000 * i
        if kind == "broadcast":
            out.append((base + 10 * (root % n)).tolist())
        elif kind == "all_reduce":
            out.append(sum(base + 10 * r for r in range(n)).tolist())
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("late", [1, -1], ids=["late_1", "late_last"])
def test_a_root_that_ran_ahead_keeps_its_record_for_a_late_reader(n, late):
    """Rank 0 roots a ring's worth of small broadcasts while a reader sleeps, then reads one
    (from rank 1): its reader's fingerprint goes into the record of its first broadcast, which
    the late reader has not read yet. Rank 0 waits for that read first; it once did not, and
    the late reader raised a mismatch at its first call (every time, as written here)."""
    seq = ([("broadcast", 0, 4, late % n, 200)]
           + [("broadcast", 0, 1 + i % 12) for i in range(1, 16)] + [("broadcast", 1, 3)])
    got = backend_pool("gloo", n).run(run_sequence, seq, timeout=4 * GROUP_TIMEOUT_S)
    want = expected(seq, n)
    for r in range(n):
        assert got[r] == want, f"rank {r}"


CALL = st.one_of(
    st.tuples(st.just("broadcast"), st.integers(0, 3), st.integers(1, 12)),  # the ring
    st.tuples(st.just("broadcast"), st.integers(0, 3), st.integers(13, 300)),
    st.tuples(st.just("all_reduce"), st.just(0), st.integers(1, 64)),
    st.tuples(st.just("barrier"), st.just(0), st.just(0)),
)


@pytest.mark.timeout(600)
@settings(max_examples=examples(8), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 4), run=st.integers(17, 60), root=st.integers(0, 3),
       calls=st.lists(CALL, max_size=40))
def test_small_broadcasts_deliver_the_roots_data(n, run, root, calls):
    """A run of small broadcasts from one root longer than the ring (the root laps the
    readers' records), then drawn calls: every rank gets every root's data."""
    seq = [("broadcast", root, 1 + i % 12) for i in range(run)] + calls
    got = backend_pool("gloo", n).run(run_sequence, seq, timeout=4 * GROUP_TIMEOUT_S)
    want = expected(seq, n)
    for r in range(n):
        assert got[r] == want, f"rank {r}"
