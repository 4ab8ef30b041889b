"""Shared-memory receives whose waiting thread reads the rings itself
(``collectives.backends.shm._DirectRequest``) while the engine's receiver thread stays out
of its way. Two ranks of one group live in this process, one per thread. The poll slice
is raised far above the tests' timeouts, so that a wake-up the engine loses (a request
completed by another thread while its waiter sleeps) fails the test instead of costing
one slice."""
import threading
import time

import numpy as np
import pytest

from collectives.core.errors import DistError
from collectives.store import HashStore
from collectives.core.tensors import to_buffer

pytest.importorskip("collectives.engines._shm", reason="build the _shm extension (COLLECTIVES_ONLY=_shm)")
from collectives.backends import shm as shm_backend  # noqa: E402


@pytest.fixture
def pair(monkeypatch):
    """Two ShmBackends of one group (ranks 0 and 1)."""
    monkeypatch.setattr(shm_backend, "_POLL_SLICE", 60.0)
    store, out, errs = HashStore(), [None, None], []

    def make(r):
        try:
            out[r] = shm_backend.ShmBackend(store, r, 2, 20.0)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errs.append(e)
    _each(make, range(2))
    assert not errs, errs
    yield out
    _each(lambda be: be.shutdown(), out)


def _each(fn, items):
    ts = [threading.Thread(target=fn, args=(x,)) for x in items]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)


def _echo(be, n, errs, src_tag=7, dst_tag=8):
    """Rank 1: receive k, send back k + 1, n times."""
    try:
        buf = np.zeros(3, np.int64)
        for _ in range(n):
            req = be.irecv(to_buffer(buf), 0, src_tag)
            req.wait(15)
            be.isend(to_buffer(buf + 1), 0, dst_tag).wait(15)
    except BaseException as e:  # noqa: BLE001
        errs.append(e)


@pytest.mark.timeout(120)
def test_ping_pong_delivers_every_message_in_order(pair):
    a, b = pair
    n, errs = 2000, []
    t = threading.Thread(target=_echo, args=(b, n, errs))
    t.start()
    try:
        got = np.zeros(3, np.int64)
        for k in range(n):
            a.isend(to_buffer(np.full(3, k, np.int64)), 1, 7).wait(15)
            req = a.irecv(to_buffer(got), 1, 8)
            assert isinstance(req, shm_backend._DirectRequest) or req.test()
            req.wait(15)
            assert req.source == 1
            assert got.tolist() == [k + 1] * 3
    finally:
        t.join(30)
    assert not errs, errs


@pytest.mark.timeout(120)
def test_waiters_and_receives_nobody_waits_on_complete_side_by_side(pair):
    """Rank 0 has two threads: one waits on its receives (tag 8), the other posts receives
    (tag 9) and only polls them with test(), so the receiver thread or the waiter must
    complete those. Every message arrives, each where it was posted."""
    a, b = pair
    n, errs = 500, []

    def poller():
        try:
            for k in range(n):
                buf = np.zeros(2, np.int64)
                req = a.irecv(to_buffer(buf), 1, 9)
                while not req.test():
                    pass
                req.wait(0)
                assert buf.tolist() == [k, -k]
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    def rank1():
        try:
            for k in range(n):
                b.isend(to_buffer(np.array([k, -k], np.int64)), 0, 9).wait(15)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
        _echo(b, n, errs)
    ts = [threading.Thread(target=poller), threading.Thread(target=rank1)]
    for t in ts:
        t.start()
    try:
        got = np.zeros(3, np.int64)
        for k in range(n):
            a.isend(to_buffer(np.full(3, k, np.int64)), 1, 7).wait(15)
            a.irecv(to_buffer(got), 1, 8).wait(15)
            assert got.tolist() == [k + 1] * 3
    finally:
        for t in ts:
            t.join(60)
    assert not errs, errs


@pytest.mark.timeout(60)
def test_a_waited_receive_times_out_then_reports_a_wrong_dtype(pair, monkeypatch):
    a, b = pair
    monkeypatch.setattr(shm_backend, "_POLL_SLICE", 0.05)
    req = a.irecv(to_buffer(np.zeros(4, np.float32)), 1, 3)
    with pytest.raises(DistError,
                       match=r"irecv from rank 1 \(tag 3\) did not finish: Timed out waiting 300ms"):
        req.wait(0.3)
    # the message arrives later and completes the posted receive with the dtype error
    b.isend(to_buffer(np.zeros(4, np.int32)), 0, 3).wait()
    with pytest.raises(DistError, match="int32"):
        req.wait(10)


@pytest.mark.timeout(60)
def test_a_receive_completed_by_another_thread_wakes_its_waiter(pair):
    """Another thread (here the test's, standing in for the receiver thread) takes the
    message off the ring; the receive's waiter starts waiting after that, finds the ring
    empty and sleeps in its poll; only then is the receive completed. The completing
    thread must wake it (with the poll slice at 60 s, a lost wake-up fails the test)."""
    a, b = pair
    eng = a._engine()
    got = np.zeros(2, np.int32)
    req = a.irecv(to_buffer(got), 1, 5)
    done = threading.Event()

    def waiter():
        req.wait(15)
        done.set()
    t = threading.Thread(target=waiter)
    complete = req.set_result

    def late_set_result(src):  # the message is off the ring now
        t.start()
        for _ in range(1000):
            if req._waiter:
                break
            time.sleep(0.01)
        assert req._waiter, "the waiter never started reading the rings"
        time.sleep(0.3)  # (it is asleep in its poll by now, or soon: either way it must wake)
        complete(src)
    req.set_result = late_set_result
    with eng.reading:  # nobody else takes a message off a ring meanwhile
        b.isend(to_buffer(np.array([4, 2], np.int32)), 0, 5).wait()
        src = a._comm.p2p_poll(shm_backend._HDR.size, 10.0)
        assert src == 1
        eng._take(src)
    assert done.wait(10), "the waiter was not woken"
    t.join(10)
    assert got.tolist() == [4, 2]


@pytest.mark.timeout(60)
def test_shutdown_ends_a_waited_receive_and_later_waits(pair):
    """A thread waiting on a receive when its backend shuts down raises at once (it is
    inside the C code: shutdown waits for it to leave before unmapping); so does a wait
    started afterwards."""
    a, b = pair
    req = a.irecv(to_buffer(np.zeros(2, np.int32)), 1, 5)
    later = a.irecv(to_buffer(np.zeros(2, np.int32)), 1, 6)
    errs = []

    def waiter():
        try:
            req.wait(30)
        except DistError as e:
            errs.append(e)
    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(1000):
        if req._waiter:
            break
        time.sleep(0.01)
    t0 = time.monotonic()
    a.shutdown()
    t.join(20)
    assert not t.is_alive() and time.monotonic() - t0 < 15
    assert len(errs) == 1 and "shut down" in str(errs[0]), errs
    with pytest.raises(DistError, match="shut down"):
        later.wait(30)
