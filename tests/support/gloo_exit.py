"""Ending a program that ran on torch's own gloo without torch's teardown race.

torch's gloo worker thread releases its last work (the final collective's ``AsyncWork``)
after the caller's ``wait()`` has returned. That work holds a ``ThreadLocalState`` with a
Python object in it. When the main thread has meanwhile begun the interpreter's
finalisation, the worker's GIL acquire for that decref ends the thread inside a
``noexcept`` destructor, and the process aborts with "terminate called without an active
exception". The core dumps show exactly this stack: ``runLoop`` →
``~AsyncBarrierWork`` → ``~ThreadLocalState`` → ``gil_scoped_acquire`` →
``PyThread_exit_thread`` → ``std::terminate``. It hit 7 of 100 runs of
``train_by_name.py gloo`` on the 2-core VM (0 of 80 with this module), and once in CI.
pytorch/pytorch#179291 (closed unmerged) describes the same race.

So a reference run on torch's gloo leaves through ``os._exit`` once its output is
written: no finalisation, no race. A run on collectives returns and exits the usual way,
so its own teardown stays under test.
"""
import os
import sys


def end_if_torch_gloo(backend):
    """Leave now, status 0, when ``backend`` is torch's gloo; otherwise return."""
    if backend != "gloo":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
