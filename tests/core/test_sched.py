"""The progress threads' short time slice (collectives/core/sched.py)."""
import os
import sys
import threading

import pytest

from collectives.backends.base import Backend
from collectives.core import sched

linux = pytest.mark.skipif(sched._syscalls() is None,
                           reason="sched_setattr is a Linux call (x86_64, aarch64)")


def _in_thread(fn):
    """``fn()`` run in a new thread (so the test's own thread keeps its slice); its value."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    return out[0]


def _custom_slices():
    """Whether this kernel keeps a slice asked for (EEVDF's custom slices, Linux 6.12)."""
    return _in_thread(lambda: sched.short_slice(250)) == 250


@linux
def test_zero_keeps_the_kernels_slice():
    def go():
        before = sched.current_slice()
        return before, sched.short_slice(0), sched.current_slice()
    before, got, after = _in_thread(go)
    assert got is None
    assert after == before


@linux
def test_the_slice_is_the_threads_own_and_nice_and_policy_stay():
    if not _custom_slices():
        pytest.skip("this kernel has no custom slices (Linux < 6.12): the call changes nothing")

    def go():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 3)  # raising nice: allowed
        got = sched.short_slice(120)
        return (got, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                os.sched_getscheduler(0))
    mine = sched.current_slice()
    got, nice, policy = _in_thread(go)
    assert got == 120
    assert nice == 3 and policy == os.SCHED_OTHER
    assert sched.current_slice() == mine  # the caller's own thread is untouched


@linux
def test_a_backends_progress_thread_takes_the_configured_slice(monkeypatch):
    if not _custom_slices():
        pytest.skip("this kernel has no custom slices (Linux < 6.12)")
    seen = []

    for setting, want in (("150", 150), ("0", None)):
        monkeypatch.setenv("COLLECTIVES_PROGRESS_SLICE_US", setting)
        b = Backend(None, 0, 1, 30.0)
        try:
            b.submit(lambda: seen.append(sched.current_slice())).wait(10)
        finally:
            b.shutdown()
        default = _in_thread(sched.current_slice)
        assert seen[-1] == (want if want is not None else default)


def test_a_setting_that_does_not_parse_raises_in_the_caller(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_PROGRESS_SLICE_US", "fast")
    b = Backend(None, 0, 1, 30.0)
    try:
        with pytest.raises(ValueError, match="COLLECTIVES_PROGRESS_SLICE_US"):
            b.submit(lambda: None)
        assert b.pending.n == 0 and b._thread is None  # nothing queued for no thread
    finally:
        b.shutdown()
    assert _in_thread(sched.short_slice) is None  # a thread reading it keeps its slice


def test_elsewhere_it_changes_nothing(monkeypatch):
    monkeypatch.setattr(sched, "_syscalls", lambda: None)
    assert sched.short_slice(100) is None
    assert sched.current_slice() is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
