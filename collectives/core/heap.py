"""Keep freed heap memory in the process instead of handing it back to the kernel every step.

glibc's malloc serves a large request (from 128 KiB, a threshold it raises to the size of
the largest mapped block freed so far, 32 MiB at most) with a fresh ``mmap`` and unmaps it
when freed, and it hands the free space at the top of its heap back to the kernel once that
exceeds twice the threshold. A training step frees and requests the same tens of MiB every
step (autograd's temporaries, the gradients' partial results), so the same pages are
handed back and faulted in again, each zeroed by the kernel: on two cores, DDP's backward
of a 17.9M-parameter MLP faulted 4,000-8,000 pages a step (16-32 MiB), its no-op-hook
floor's as well (bench/results/2026-11-30-ddp-heap.md).
Whether it does depends on the process's history: a 25 MiB block freed early (DDP's first
buckets) raises the thresholds for good, so the same program ran 20% faster or slower by
what it had freed before.

At the first group a process makes, :func:`keep_freed_memory` fixes glibc's thresholds:
requests below 32 MiB (the most glibc allows) come from the heap, and free space at the
heap's top goes back to the kernel only beyond ``COLLECTIVES_MALLOC_TRIM`` bytes (64 MiB).
A rank then keeps up to that much memory it freed, as torch's CUDA caching allocator and
jemalloc do. Nothing is changed where the setting is 0, where the environment already tunes
glibc's malloc (a ``MALLOC_*_`` variable or ``glibc.malloc`` in ``GLIBC_TUNABLES``), or off
glibc (musl, macOS); with another allocator preloaded (jemalloc, tcmalloc) the call only
tunes glibc's, which then serves nothing.
"""
import ctypes
import os
import sys

from .. import config

M_TRIM_THRESHOLD = -1    # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)

#: what the first call did: None before it, else "set", "off" (the setting is 0),
#: "environment" (the user tunes malloc), "not glibc" or "refused" (mallopt said no)
state = None


def _user_tunes_malloc(environ):
    return (any(k.startswith("MALLOC_") and k.endswith("_") for k in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def keep_freed_memory(environ=None):
    """Once a process: fix glibc's mmap and trim thresholds (see the module's docstring).
    Returns what was done (the module's ``state``)."""
    global state
    if state is not None:
        return state
    environ = os.environ if environ is None else environ
    trim = config.get("COLLECTIVES_MALLOC_TRIM", environ)
    if not trim:
        state = "off"
    elif _user_tunes_malloc(environ):
        state = "environment"
    else:
        state = _mallopt(trim)
    return state


def _mallopt(trim):
    if not sys.platform.startswith("linux"):
        return "not glibc"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's own: musl has mallopt, not this
        return "not glibc"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = ok and mallopt(M_TRIM_THRESHOLD, min(trim, 2 ** 31 - 1)) == 1
    return "set" if ok else "refused"
