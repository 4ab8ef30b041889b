"""Our collectives in torch's profiler, under torch's names, and ``record_comm``.

While ``torch.profiler.profile`` (or ``torch.autograd.profiler.profile``) runs, each
collective is one span named as torch's gloo names its work (``gloo:all_reduce``,
``gloo:broadcast``, ``mpi:barrier``: the group's backend, then the op), or the name a
``record_comm`` block gives. As torch's ``Work`` does, the span opens on the calling
thread when the op is issued and closes when the op has run, on whichever thread ran it,
so an ``async_op`` collective's span covers its time in the queue and on the progress
thread. ``isend``/``irecv`` spans close when a ``wait()`` or ``is_completed()`` first
finds them done.

The front end tests one flag per call, torch's own "fast python check"
(``torch.autograd.profiler._is_profiler_enabled``), and nothing at all where torch has
not been imported: no profiler can run there.
"""
import contextlib
import sys
import threading
import types


# stands for torch's profiler module until torch has been imported (a module too, so the
# attribute test takes the interpreter's fast path for modules)
_Off = types.ModuleType("collectives.core.profiling._Off")
_Off._is_profiler_enabled = False


# torch.autograd.profiler once seen in sys.modules: its flag is set while a profiler runs
tap = _Off
_local = threading.local()
_bound = []  # the globals of the front-end modules that test the flag, as their ``_prof``


def bind(module_globals):
    """Give a module the flag's holder as its global ``_prof``, kept current by refresh:
    the hot calls test ``_prof._is_profiler_enabled`` (a global and a module attribute,
    ~10 ns) rather than reaching through this module (~25 ns)."""
    module_globals["_prof"] = tap
    _bound.append(module_globals)


def refresh():
    """Find torch's profiler flag once torch has been imported (called when a group is
    made, when a torch tensor is first converted, and by record_comm)."""
    global tap
    if tap is _Off:
        mod = sys.modules.get("torch.autograd.profiler")
        if mod is not None and hasattr(mod, "_is_profiler_enabled"):
            tap = mod
            for g in _bound:
                g["_prof"] = mod


def _torch_comm_name():
    """The name torch's own ``record_comm`` has set on this thread, or None."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    get = getattr(c10d, "_get_comm_profiling_name", None)
    return (get() or None) if get is not None else None


def label(pg, op):
    """The span's name: record_comm's (ours, then torch's), else ``backend:op``."""
    return getattr(_local, "name", None) or _torch_comm_name() or f"{pg.backend_name}:{op}"


def _fast_record():
    """torch's cheapest same-thread span (``_RecordFunctionFast``: ~1.5 us, against ~15 us
    for the op-dispatched one), else its ``record_function``."""
    import torch
    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    return fast if fast is not None else torch.autograd.profiler.record_function


class _Span:
    """One open span. Closed on the thread that opened it, it ends there. One that may
    close on another thread (``anywhere``) is closed through a torch Future, as torch
    closes its own async work's: the profiler records an end only on a thread that
    carries its state, and the Future's callback runs with the opening thread's."""

    __slots__ = ("_rec", "_fut")

    def __init__(self, name, anywhere):
        import torch
        self._fut = None
        if anywhere:
            ops = torch.ops.profiler
            self._fut = torch.futures.Future()
            ops._call_end_callbacks_on_jit_fut(ops._record_function_enter_new(name, None), self._fut)
            self._rec = None
        else:
            self._rec = _fast_record()(name)
            self._rec.__enter__()

    def close(self):
        rec, fut, self._rec, self._fut = self._rec, self._fut, None, None
        if fut is not None:
            fut.set_result(None)
        elif rec is not None:
            rec.__exit__(None, None, None)


def run(pg, name, fn, args):
    """``pg.run(fn, *args)`` (a blocking call) as one span on the calling thread."""
    with _fast_record()(label(pg, name)):
        pg.run(fn, *args)


class Recorded:
    """``fn(*args)`` (an async call) as one span: opened now, on the issuing thread;
    closed once it has run, on whichever thread runs it (a call never run leaves its
    span open, as torch leaves a Work's that never finishes)."""

    __slots__ = ("__name__", "fn", "args", "_span")

    def __init__(self, pg, name, fn, args):
        self.__name__ = name  # what a backend's messages call the queued operation
        self.fn = fn
        self.args = args
        self._span = _Span(label(pg, name), True)

    def __call__(self):
        try:
            self.fn(*self.args)
        finally:
            self._span.close()


def issue(pg, name, anywhere, post, *args):
    """``post(*args)`` (a backend's isend/irecv) and its span, opened first (``anywhere``:
    one that may close on another thread); the span is closed again if ``post`` raises.
    The request's wait or test closes it (api.tracked.TrackedRequest)."""
    span = _Span(label(pg, name), anywhere)
    try:
        return post(*args), span
    except BaseException:
        span.close()
        raise


@contextlib.contextmanager
def record_comm(name):
    """Name the profiler spans of the collectives issued in this block ``name``.

    As torch's ``torch.distributed.record_comm``; with torch imported, torch's own
    collectives inside the block get the name too.

    Example:
        >>> with dist.record_comm("FSDP::all_gather (layer1)"):
        ...     dist.all_gather_into_tensor(output, input)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    refresh()
    torch_record = getattr(sys.modules.get("torch.distributed"), "record_comm", None)
    prev = getattr(_local, "name", None)
    _local.name = name
    try:
        if torch_record is not None:
            with torch_record(name):
                yield
        else:
            yield
    finally:
        _local.name = prev


__all__ = ["record_comm"]
