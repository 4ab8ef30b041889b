"""Every public call's argument rules, one row each: a misuse raises ValueError or TypeError
before any communication.

Each row is ``(id, exception, message pattern, call)``; ``call(w)`` makes the misuse as
rank 0 of a world of ``w`` ranks. Rows are NumPy-only, so the table runs without torch
(tests/api/test_api.py's MISUSE holds the torch-specific rules: views, torch dtypes).
Each row runs twice:

- on tests/api/test_api.py's recording backend (a world of 4 seen from rank 0): the
  backend must not have been called at all;
- on a real world of 2 ranks (the gloo configuration) whose rank 1 never calls: the error
  must come at once, not at the group's timeout (a call that communicated first would wait
  for rank 1 there).
"""
import time

import numpy as np
import pytest

import collectives as dist
from tests.api.test_api import Recorder, no_calls
from tests.api.test_api import world  # noqa: F401  (the fixture)
from tests.support.ranks import backend_pool, config_available


def f32(n=1):
    return np.ones(n, np.float32)


def i64(n=1):
    return np.ones(n, np.int64)


ROWS = [
    # ---- all_reduce, all_reduce_coalesced ----
    ("all_reduce not an array", TypeError, "torch.Tensor or numpy.ndarray",
     lambda w: dist.all_reduce([1.0])),
    ("all_reduce op not a ReduceOp", ValueError, "op",
     lambda w: dist.all_reduce(f32(), op="sum")),
    ("all_reduce group not a group", TypeError, "group must be a ProcessGroup",
     lambda w: dist.all_reduce(f32(), group=3)),
    ("all_reduce_coalesced mixed dtypes", ValueError, "dtype",
     lambda w: dist.all_reduce_coalesced([f32(2), i64(2)])),
    ("all_reduce_coalesced an entry not an array", TypeError, "torch.Tensor or numpy.ndarray",
     lambda w: dist.all_reduce_coalesced([f32(2), [1.0]])),
    ("all_reduce_coalesced BAND on floats", ValueError, "not defined for float32",
     lambda w: dist.all_reduce_coalesced([f32(2)], op=dist.ReduceOp.BAND)),
    # ---- reduce, broadcast ----
    ("reduce dst out of range", ValueError, "dst=",
     lambda w: dist.reduce(f32(), w)),
    ("broadcast src negative", ValueError, "src=-1",
     lambda w: dist.broadcast(f32(), -1)),
    # ---- all_gather, all_gather_into_tensor ----
    ("all_gather list too short", ValueError, "must hold",
     lambda w: dist.all_gather([f32()] * (w - 1), f32())),
    ("all_gather output of another dtype", ValueError, "dtype",
     lambda w: dist.all_gather([f32()] * (w - 1) + [i64()], f32())),
    ("all_gather_into_tensor output size", ValueError, "expected",
     lambda w: dist.all_gather_into_tensor(f32(2 * w + 1), f32(2))),
    ("all_gather_into_tensor dtype", ValueError, "dtype",
     lambda w: dist.all_gather_into_tensor(i64(2 * w), f32(2))),
    # ---- gather: the destination's list ----
    ("gather list too short on the destination", ValueError, "must hold",
     lambda w: dist.gather(f32(), [f32()] * (w - 1), dst=0)),
    ("gather list of another dtype on the destination", ValueError, "dtype",
     lambda w: dist.gather(f32(), [f32()] * (w - 1) + [i64()], dst=0)),
    ("gather list of another size on the destination", ValueError, "elements",
     lambda w: dist.gather(f32(), [f32()] * (w - 1) + [f32(2)], dst=0)),
    ("gather list on a non-destination rank", ValueError, "must NOT be specified",
     lambda w: dist.gather(f32(), [f32()] * w, dst=1)),
    # ---- scatter: the source's list ----
    ("scatter list too long on the source", ValueError, "must hold",
     lambda w: dist.scatter(f32(), [f32()] * (w + 1), src=0)),
    ("scatter list of another dtype on the source", ValueError, "dtype",
     lambda w: dist.scatter(f32(), [i64()] + [f32()] * (w - 1), src=0)),
    ("scatter list of another size on the source", ValueError, "elements",
     lambda w: dist.scatter(f32(), [f32(3)] + [f32()] * (w - 1), src=0)),
    ("scatter list missing on the source", ValueError, "scatter_list",
     lambda w: dist.scatter(f32(), None, src=0)),
    ("scatter list on a non-source rank", ValueError, "must NOT be specified",
     lambda w: dist.scatter(f32(), [f32()] * w, src=1)),
    # ---- reduce_scatter, reduce_scatter_tensor ----
    ("reduce_scatter input list too short", ValueError, "must hold",
     lambda w: dist.reduce_scatter(f32(), [f32()] * (w - 1))),
    ("reduce_scatter output size", ValueError, "elements",
     lambda w: dist.reduce_scatter(f32(2), [f32()] * w)),
    ("reduce_scatter input of another dtype", ValueError, "dtype",
     lambda w: dist.reduce_scatter(f32(), [f32()] * (w - 1) + [i64()])),
    ("reduce_scatter_tensor input size", ValueError, "expected",
     lambda w: dist.reduce_scatter_tensor(f32(2), f32(2 * w + 1))),
    ("reduce_scatter_tensor output size", ValueError, "expected",
     lambda w: dist.reduce_scatter_tensor(f32(3), f32(2 * w))),
    ("reduce_scatter_tensor dtype", ValueError, "dtype",
     lambda w: dist.reduce_scatter_tensor(i64(2), f32(2 * w))),
    # ---- all_to_all, all_to_all_single ----
    ("all_to_all output list too short", ValueError, "must hold",
     lambda w: dist.all_to_all([f32()] * (w - 1), [f32()] * w)),
    ("all_to_all input list too long", ValueError, "must hold",
     lambda w: dist.all_to_all([f32()] * w, [f32()] * (w + 1))),
    ("all_to_all output size of the part to itself", ValueError, "sends itself",
     lambda w: dist.all_to_all([f32(2)] + [f32()] * (w - 1), [f32()] * w)),
    ("all_to_all output of another dtype", ValueError, "dtype",
     lambda w: dist.all_to_all([i64()] + [f32()] * (w - 1), [f32()] * w)),
    ("all_to_all_single split of the part to itself", ValueError, "sends itself",
     lambda w: dist.all_to_all_single(f32(w + 1), f32(w + 1), [2] + [1] * (w - 1),
                                      [1] * (w - 1) + [2])),
    ("all_to_all_single split that does not sum", ValueError, "sums to",
     lambda w: dist.all_to_all_single(f32(w), f32(w), [1] * w, [1] * (w - 1) + [0])),
    ("all_to_all_single split of the wrong length", ValueError, "split",
     lambda w: dist.all_to_all_single(f32(w), f32(w), [1] * (w + 1), None)),
    # ---- barrier, monitored_barrier ----
    ("barrier group not a group", TypeError, "group must be a ProcessGroup",
     lambda w: dist.barrier(group="world")),
    ("monitored_barrier negative timeout", ValueError, "timeout",
     lambda w: dist.monitored_barrier(timeout=-1)),
    ("monitored_barrier timeout of another type", TypeError, "timeout",
     lambda w: dist.monitored_barrier(timeout="5s")),
    ("monitored_barrier group not a group", TypeError, "group must be a ProcessGroup",
     lambda w: dist.monitored_barrier(group=[0, 1])),
    # ---- point to point ----
    ("send to self", ValueError, "should not be the same",
     lambda w: dist.send(f32(), 0)),
    ("recv peer out of range", ValueError, "src=",
     lambda w: dist.recv(f32(), w)),
    ("isend tag negative", ValueError, "tag must be",
     lambda w: dist.isend(f32(), 1, tag=-1)),
    ("irecv not an array", TypeError, "torch.Tensor or numpy.ndarray",
     lambda w: dist.irecv("x", 1)),
    # ---- object collectives ----
    ("all_gather_object list too short", ValueError, "must hold",
     lambda w: dist.all_gather_object([None] * (w - 1), 1)),
    ("all_gather_object not a list", TypeError, "must be a list",
     lambda w: dist.all_gather_object((None,) * w, 1)),
    ("gather_object list too short on the destination", ValueError, "must hold",
     lambda w: dist.gather_object(1, [None] * (w - 1), dst=0)),
    ("gather_object list missing on the destination", ValueError, "must be given",
     lambda w: dist.gather_object(1, None, dst=0)),
    ("gather_object list on a non-destination rank", ValueError, "must NOT be specified",
     lambda w: dist.gather_object(1, [None] * w, dst=1)),
    ("gather_object dst out of range", ValueError, "dst=",
     lambda w: dist.gather_object(1, [None] * w, dst=w)),
    ("scatter_object_list input too short on the source", ValueError, "must hold",
     lambda w: dist.scatter_object_list([None], [1] * (w - 1), src=0)),
    ("scatter_object_list input missing on the source", TypeError, "must be a list",
     lambda w: dist.scatter_object_list([None], None, src=0)),
    ("scatter_object_list empty output", ValueError, "at least 1",
     lambda w: dist.scatter_object_list([], [1] * w, src=0)),
    ("scatter_object_list src out of range", ValueError, "src=",
     lambda w: dist.scatter_object_list([None], [1] * w, src=w + 3)),
    ("broadcast_object_list not a list", TypeError, "must be a list",
     lambda w: dist.broadcast_object_list((1, 2), src=0)),
    ("broadcast_object_list src out of range", ValueError, "src=",
     lambda w: dist.broadcast_object_list([1], src=-2)),
    ("send_object_list not a list", TypeError, "must be a list",
     lambda w: dist.send_object_list((1,), dst=1)),
    ("send_object_list to self", ValueError, "should not be the same",
     lambda w: dist.send_object_list([1], dst=0)),
    ("recv_object_list not a list", TypeError, "must be a list",
     lambda w: dist.recv_object_list("ab", src=1)),
    ("recv_object_list from self", ValueError, "should not be the same",
     lambda w: dist.recv_object_list([None], src=0)),
    ("recv_object_list unknown safe mode", (ValueError, TypeError), "safe",
     lambda w: dist.recv_object_list([None], src=1, safe="maybe")),
]
IDS = [r[0] for r in ROWS]


@pytest.mark.parametrize("what,exc,msg,call", ROWS, ids=IDS)
def test_misuse_raises_before_the_backend_is_called(world, what, exc, msg, call):  # noqa: F811
    world(size=4, rank=0)
    with pytest.raises(exc, match=msg):
        call(4)
    assert no_calls(), f"{what}: the backend was called: {[r.calls for r in Recorder.instances]}"


def run_row(ctx, index):
    """Rank 0 makes row ``index``'s misuse; rank 1 never calls. (exception type, seconds)."""
    if ctx.rank != 0:
        return None
    call = ROWS[index][3]
    t0 = time.monotonic()
    try:
        call(ctx.world_size)
    except Exception as e:  # judged by the test
        return type(e).__name__, isinstance(e, ROWS[index][1]), time.monotonic() - t0
    return None, False, time.monotonic() - t0


@pytest.mark.timeout(300)
def test_misuse_raises_at_once_in_a_real_world_whose_other_rank_never_calls():
    ok, why = config_available("gloo")
    if not ok:
        pytest.skip(why)
    pool = backend_pool("gloo", 2)
    bad = []
    for i, row in enumerate(ROWS):
        got = pool.run(run_row, i, timeout=60)[0]
        if got is None or not got[1] or got[2] > 2.0:
            bad.append((row[0], got))
    assert not bad, bad
