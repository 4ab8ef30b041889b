"""Where torch's futures of our calls are completed, and the timeline's marks.

Properties:

- A future nobody chained Python callbacks on (what DDP's reducer waits on) is completed
  by the thread that finished the call (the group's progress thread), without a handoff;
  one whose Python code chained a callback (``then``, ``add_done_callback``) before the
  call finished is completed by a completer thread (the callback may issue collectives and
  wait for them, which the progress thread runs); one chained after the call finished
  runs its callback in the chaining thread. The values are the reduced tensors either way.
- With the timeline on, each asynchronous call leaves post, start, end and done marks, in
  that order, under its group's name and sequence number; off, it leaves none.
"""
import time

import pytest

from tests.support.ranks import available_configs, backend_pool

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif("gloo" not in available_configs(),
                                reason="the gloo configuration is not available")


def _late_call(ctx, delay):
    """An async all_reduce whose peer (rank 1) joins ``delay`` seconds late: rank 0's
    future is taken, and chained, while the call is still in flight."""
    import torch.distributed as td
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 1:
        time.sleep(delay)
    return td.all_reduce(t, async_op=True), t


def completing_threads(ctx):
    import threading

    from collectives.torch_bridge import torch_work
    from tests.torch_bridge.test_torch_pg import _bridged
    _bridged()
    settled = []
    orig = torch_work.TorchWork._settle

    def spy(self, fut):
        settled.append(threading.current_thread().name)
        return orig(self, fut)

    torch_work.TorchWork._settle = spy
    try:
        out = {}
        work, t = _late_call(ctx, 0.3)
        fut = work.get_future()
        out["plain"] = (fut.wait()[0].tolist(), settled[-1])
        work, t = _late_call(ctx, 0.3)
        seen = []
        chained = work.get_future().then(lambda f: seen.append(threading.current_thread().name)
                                         or f.value()[0].tolist())
        out["chained"] = (chained.wait(), settled[-1])
        work, t = _late_call(ctx, 0.0)
        work.wait()
        fut = work.get_future()
        late = fut.then(lambda f: threading.current_thread().name)
        out["after"] = (fut.wait()[0].tolist(), late.wait() == threading.current_thread().name)
        return out
    finally:
        torch_work.TorchWork._settle = orig


@pytest.mark.timeout(120)
def test_unchained_futures_complete_on_the_finishing_thread_chained_ones_on_a_completer():
    results = backend_pool("gloo", 2).run(completing_threads, timeout=60)
    got = results[0]  # rank 0 took and chained its futures while its peer was late
    assert got["plain"] == ([3.0] * 4, "collectives-shm-progress"), got
    assert got["chained"] == ([3.0] * 4, "collectives-torch-futures"), got
    assert got["after"] == ([3.0] * 4, True), got
    for r in results:
        assert r["plain"][0] == r["chained"][0] == r["after"][0] == [3.0] * 4


def timeline_marks(ctx, on):
    import torch.distributed as td

    from collectives.core import timeline
    from tests.torch_bridge.test_torch_pg import _bridged
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
