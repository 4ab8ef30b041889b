"""A short time slice for the threads that run and complete asynchronous calls.

A progress thread sleeps until a call is posted, or until a peer's part of the call
arrives, then runs briefly. When every core is busy computing (DDP's backward pass with
as many ranks as cores, or more), a woken thread that asks for nothing waits for the
computing thread's slice to end before it runs (about 1.4 ms with two CPUs), and the
ranks' parts of one call, each waiting for the others, reach their cores at different
times.

Linux's EEVDF scheduler (6.12 and later) lets a thread ask for a shorter slice through
``sched_setattr``'s ``sched_runtime`` (at least 100 us), unprivileged: a thread with a
short slice has an early deadline, so it preempts the computing thread when it wakes, and
gives the core back after at most that slice. Its share of the core stays its fair share;
only the latency changes. Older kernels ignore the field, and other systems have no such
call: there :func:`short_slice` changes nothing.

``COLLECTIVES_PROGRESS_SLICE_US`` sets the slice (0 keeps the kernel's).
"""
import ctypes
import os
import platform
import sys

from .. import config

# (sched_setattr, sched_getattr) system call numbers by machine
_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class _Attr(ctypes.Structure):
    """The kernel's ``struct sched_attr`` (its first version's fields and the util clamps)."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


_libc = None


def _syscalls():
    """(libc, setattr number, getattr number), or None where there are none."""
    global _libc
    calls = _CALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if calls is None:
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    return _libc, calls[0], calls[1]


def _attr():
    """(libc, setattr number, the calling thread's sched_attr), or None where it cannot be
    read."""
    sc = _syscalls()
    if sc is None:
        return None
    libc, setattr_nr, getattr_nr = sc
    attr = _Attr()
    if libc.syscall(getattr_nr, 0, ctypes.byref(attr), ctypes.sizeof(_Attr), 0) != 0:
        return None
    return libc, setattr_nr, attr


def short_slice(us=None):
    """Ask the kernel for a slice of ``us`` microseconds (default
    ``COLLECTIVES_PROGRESS_SLICE_US``) for the calling thread, keeping its policy and nice
    value. Returns the slice the thread now has in microseconds, or None where it was not
    set (turned off, no such call, or the kernel refused). It never raises: a thread that
    reads a setting which does not parse keeps its slice (the backends read the setting in
    the caller's thread first, where the ValueError reaches the program)."""
    if us is None:
        try:
            us = config.get("COLLECTIVES_PROGRESS_SLICE_US")
        except ValueError:
            return None
    got = _attr() if us else None
    if got is None:
        return None
    libc, setattr_nr, attr = got
    if attr.sched_policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return None  # a real-time or deadline thread has no fair slice to shorten
    attr.size = ctypes.sizeof(_Attr)
    attr.sched_flags = 0  # (keeps the clamps: their flags are not set)
    attr.sched_runtime = int(us) * 1000
    if libc.syscall(setattr_nr, 0, ctypes.byref(attr), 0) != 0:
        return None
    return current_slice()


def current_slice():
    """The calling thread's slice in microseconds as the kernel reports it (the kernel's
    default where none was asked for; 0 on kernels before 6.12), or None where it cannot
    tell."""
    got = _attr()
    return None if got is None else got[2].sched_runtime // 1000


__all__ = ["current_slice", "short_slice"]
