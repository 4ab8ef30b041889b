"""The flag a FutureRequest completes on (``collectives.backends.base._Flag``): Event's
is_set/set/wait on one raw lock."""
import threading
import time

import pytest

from collectives.backends.base import FutureRequest, _Flag
from collectives.core.errors import DistError


def test_a_flag_is_clear_until_set_and_then_stays_set():
    f = _Flag()
    assert not f.is_set()
    assert f.wait(0) is False
    assert f.wait(0.05) is False
    f.set()
    f.set()  # a second set does nothing
    assert f.is_set() and f.wait(0) and f.wait(None) and f.wait(5)


@pytest.mark.timeout(30)
def test_every_waiter_wakes_when_the_flag_is_set():
    f, woke = _Flag(), []
    ts = [threading.Thread(target=lambda: woke.append(f.wait(20))) for _ in range(5)]
    for t in ts:
        t.start()
    time.sleep(0.1)  # (let them block; they must wake whether or not they did)
    f.set()
    for t in ts:
        t.join(20)
    assert woke == [True] * 5


@pytest.mark.timeout(30)
def test_a_future_request_times_out_then_completes_and_runs_its_callbacks():
    req, seen = FutureRequest("test op", 0.05), []
    with pytest.raises(DistError, match="test op did not finish: Timed out waiting 50ms"):
        req.wait()
    req.add_done_callback(lambda r: seen.append(r.source))
    threading.Timer(0.05, req.set_result, args=(3,)).start()
    req.wait(20)
    assert req.test() and req.source == 3 and seen == [3]
