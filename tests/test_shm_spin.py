"""The shared-memory receive whose waiter spins on a flag before it blocks
(``collectives.backends.shm._SpinRequest``): used where every rank's waiting and
receiving threads fit the cores, so forced here. Two ranks of one group live in this
process, one per thread."""
import threading

import numpy as np
import pytest

from collectives.errors import DistError
from collectives.store import HashStore
from collectives.tensors import to_buffer

pytest.importorskip("collectives._shm", reason="build the _shm extension (COLLECTIVES_ONLY=_shm)")
from collectives.backends import shm as shm_backend  # noqa: E402
from collectives._shm import SpinFlag  # noqa: E402


def _pair(monkeypatch, timeout=10.0):
    """Two ShmBackends of one group (ranks 0 and 1), with spinning receives."""
    monkeypatch.setattr(shm_backend.os, "sched_getaffinity", lambda pid: set(range(64)))
    store, out, errs = HashStore(), [None, None], []

    def make(r):
        try:
            out[r] = shm_backend.ShmBackend(store, r, 2, timeout)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errs.append(e)
    ts = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errs, errs
    return out


def _shutdown(bes):
    ts = [threading.Thread(target=be.shutdown) for be in bes]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)


@pytest.mark.timeout(60)
def test_ping_pong_with_spinning_receives_delivers_every_message(monkeypatch):
    a, b = _pair(monkeypatch)
    n, errs = 300, []

    def echo():  # rank 1: receive k, send back k + 1
        try:
            buf = np.zeros(3, np.int64)
            for _ in range(n):
                req = b.irecv(to_buffer(buf), 0, 7)
                assert isinstance(req, shm_backend._SpinRequest) or req.test()
                req.wait()
                b.isend(to_buffer(buf + 1), 0, 8).wait()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
    t = threading.Thread(target=echo)
    t.start()
    try:
        got = np.zeros(3, np.int64)
        for k in range(n):
            a.isend(to_buffer(np.full(3, k, np.int64)), 1, 7).wait()
            req = a.irecv(to_buffer(got), 1, 8)
            req.wait()
            assert req.source == 1
            assert got.tolist() == [k + 1] * 3
    finally:
        t.join(30)
        _shutdown((a, b))
    assert not errs, errs


@pytest.mark.timeout(60)
def test_a_spinning_receive_still_times_out_and_reports_a_wrong_dtype(monkeypatch):
    a, b = _pair(monkeypatch)
    try:
        req = a.irecv(to_buffer(np.zeros(4, np.float32)), 1, 3)
        assert isinstance(req, shm_backend._SpinRequest)
        with pytest.raises(DistError, match="irecv from rank 1"):
            req.wait(0.3)
        # the message arrives later and completes the posted receive with the dtype error
        b.isend(to_buffer(np.zeros(4, np.int32)), 0, 3).wait()
        with pytest.raises(DistError, match="int32"):
            req.wait(10)
    finally:
        _shutdown((a, b))
    assert a._comm.await_flag(SpinFlag()) is False  # closed: returns at once


@pytest.mark.timeout(60)
def test_await_flag_returns_once_set_and_gives_up_after_the_budget(monkeypatch):
    a, b = _pair(monkeypatch)
    try:
        flag = SpinFlag()
        assert not flag.is_set()
        assert a._comm.await_flag(flag) is False  # nobody sets it: the budget runs out
        threading.Timer(0.01, flag.set).start()
        while not a._comm.await_flag(flag):
            pass
        assert flag.is_set()
    finally:
        _shutdown((a, b))
