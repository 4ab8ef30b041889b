"""The timeline's marks (collectives.core.timeline, COLLECTIVES_TIMELINE).

Property: with the timeline on, each asynchronous call whose torch future is taken leaves
post, start, end and done marks, in that order, under its group's name and sequence number,
the post with the call's bytes; off, it leaves none.
"""
import time

import pytest

from tests.support.ranks import available_configs, backend_pool

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif("gloo" not in available_configs(),
                                reason="the gloo configuration is not available")


def _late_call(ctx, delay):
    """An async all_reduce whose peer (rank 1) joins ``delay`` seconds late: rank 0's
    future is taken while the call is still in flight."""
    import torch.distributed as td
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 1:
        time.sleep(delay)
    return td.all_reduce(t, async_op=True), t


def timeline_marks(ctx, on):
    import torch.distributed as td

    from collectives.core import timeline
    from tests.support.torch_training import bridged as _bridged
    _bridged()
    was = timeline.ON
    timeline.ON = on
    try:
        timeline.take()
        work, t = _late_call(ctx, 0.1)
        work.get_future().wait()
        marks = timeline.take()
        td.barrier()
        return [(what, seq, extra) for what, _group, seq, _t, extra in marks]
    finally:
        timeline.ON = was


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on", [True, False])
def test_the_timeline_marks_each_async_call_posted_started_ended_and_done(on):
    for marks in backend_pool("gloo", 2).run(timeline_marks, on, timeout=60):
        if not on:
            assert marks == [], marks
            continue
        assert [m[0] for m in marks] == ["post", "start", "end", "done"], marks
        assert len({m[1] for m in marks}) == 1, marks  # one call's sequence number
        assert marks[0][2] == 16, marks  # 4 float32
