"""torch's Work for a collectives call, and the threads that complete its futures (needs torch)."""
import threading
from datetime import timedelta

import torch
import torch.distributed as td

from ..core import timeline as _timeline
from ..core.sched import short_slice


def _timeout(timeout):
    """torch passes timedelta(0) (its kNoTimeout) for "the group's timeout"."""
    if timeout is None or (isinstance(timeout, timedelta) and timeout == timedelta(0)):
        return None
    return timeout


class TorchWork(td._Work):
    """torch's Work for a collectives call: ``wait``, ``is_completed``, ``result`` and a
    ``torch.futures.Future`` from ``get_future`` whose value is the output tensors."""

    def __init__(self, work, result, group=None):
        super().__init__()
        self._work = work          # a collectives Work, or None when the call already ran
        self._result = list(result)
        self._group = group
        self._fut = None
        self._lock = threading.Lock()

    def wait(self, timeout=None):
        if self._work is not None:
            self._work.wait(_timeout(timeout))
        return True

    def is_completed(self):
        return self._work is None or self._work.is_completed()

    def is_success(self):
        return self._work is None or self._work.is_success()

    def result(self):
        return list(self._result)

    def _source_rank(self):
        """The sender's rank in the group (torch's recv from any source asks this)."""
        return self._group.group_rank(self._work.source_rank(), "source")

    source_rank = _source_rank

    def get_future(self):
        """The call's future. A failed call's error reaches the future as torch's C++
        sees errors: a Python future's ``set_exception`` is a *result* to C++ (a PyObject
        holding the exception), which DDP's reducer reads as the reduced tensors and
        crashes on (a segfault when a peer died mid-backward). So the future returned is
        a ``then`` child of the one settled here: its callback re-raises the error, which
        marks the child failed in C++ (Python's ``wait()`` on it raises RuntimeError
        naming the DistError, as torch's own futures do)."""
        with self._lock:
            if self._fut is None:
                raw = torch.futures.Future()
                self._fut = raw.then(_unwrap)
                if self._work is None or self._work.is_completed():
                    self._settle(raw)
                else:
                    fut = raw
                    req = self._work._req
                    if hasattr(req, "add_done_callback"):  # handed over by the thread finishing it
                        req.add_done_callback(lambda _r: _completer.put(self, fut))
                    else:  # settled by a helper thread that waits for it
                        self._work.get_future().add_done_callback(lambda _f: self._settle(fut))
            return self._fut

    def _settle(self, fut):
        try:
            if self._work is not None:
                self._work.wait()
        except Exception as e:  # noqa: BLE001  (handed on to the future's waiters)
            fut.set_exception(e)
        else:
            if _timeline.ON and self._work is not None:
                _timeline.mark_request("done", self._work._req)
            fut.set_result(self._result)


def _unwrap(fut):
    return fut.wait()  # the value, or the error raised (see TorchWork.get_future)


class _Completer:
    """Threads that complete torch futures. Not the progress thread that finished their
    calls: the futures' callbacks (DDP's, a comm hook's) may issue and wait for
    collectives of their own, which the progress thread runs.

    A thread waiting for calls takes the next one that finishes (with callbacks that
    return promptly, one thread completes them all, in the order their calls finished).
    When none is waiting, every thread is inside a callback, which may be waiting for this
    very call (PowerSGD's hook waits, in its callback, on a call it issues there): a new
    thread completes it, so no future waits on the thread that waits for it. torch's gloo
    likewise runs callbacks on its worker threads. A thread idle for ``IDLE_S`` seconds
    ends, unless a call was promised to it.
    """

    IDLE_S = 30.0

    def __init__(self):
        self._queue = None
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call that no put() has promised them yet

    def put(self, work, fut):
        with self._lock:
            if self._idle:
                self._idle -= 1  # one waiting thread is this call's
                start = False
            else:
                start = True
                if self._queue is None:
                    import queue
                    self._queue = queue.SimpleQueue()
        if start:
            threading.Thread(target=self._loop, args=(work, fut), daemon=True,
                             name="collectives-torch-futures").start()
        else:
            self._queue.put((work, fut))

    def _loop(self, work, fut):
        import queue
        short_slice()  # a finished call's future completed at once (see core/sched.py)
        q = self._queue
        while True:
            try:
                work._settle(fut)
            except Exception:  # noqa: BLE001  (a callback's error must not stop the others)
                import traceback
                traceback.print_exc()
            work = fut = None
            with self._lock:
                self._idle += 1
            while True:
                try:
                    work, fut = q.get(timeout=self.IDLE_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle:  # more threads wait than calls are promised: leave
                            self._idle -= 1
                            return


_completer = _Completer()
