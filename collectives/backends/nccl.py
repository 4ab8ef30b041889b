"""'nccl': collectives on CUDA tensors through NCCL, called with ctypes.

The library is the one a CUDA build of torch brings (the ``nvidia-nccl-cu*``
wheel), or any ``libnccl.so.2`` the loader finds (``COLLECTIVES_NCCL_LIB``
names a path). Operations are enqueued on the tensor's device's current torch
stream, as torch's ProcessGroupNCCL does; ``Request.wait`` synchronises it.

Limits, as NCCL's: no any-source receive, no BAND/BOR/BXOR, no int16 and no
complex PRODUCT/MIN/MAX; these raise ValueError before anything is enqueued.
"""
import ctypes
import glob
import importlib.util
import os

from .. import dtypes as D
from ..errors import DistBackendError
from .base import Backend, Request

# ncclDataType_t and ncclRedOp_t values from nccl.h
_NCCL_DTYPE = {
    D.INT8: 0, D.UINT8: 1, D.BOOL: 1, D.INT32: 2, D.INT64: 4, D.FLOAT16: 6,
    D.FLOAT32: 7, D.FLOAT64: 8, D.BFLOAT16: 9,
    D.COMPLEX64: 7, D.COMPLEX128: 8,  # as pairs of reals, for SUM only
}
_NCCL_OP = {D.SUM: 0, D.PRODUCT: 1, D.MAX: 2, D.MIN: 3}
# bool follows torch's gloo: SUM is OR (MAX), PRODUCT is AND (MIN)
_BOOL_OP = {D.SUM: 2, D.PRODUCT: 3, D.MAX: 2, D.MIN: 3}
_UNIQUE_ID_BYTES = 128

_lib = None


def _library_paths():
    env = os.environ.get("COLLECTIVES_NCCL_LIB")
    if env:
        yield env
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            yield from sorted(glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*")))
    yield "libnccl.so.2"


def _load():
    global _lib
    if _lib is None:
        errors = []
        for path in _library_paths():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise RuntimeError("NCCL library not found (" + "; ".join(errors) + ")")
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def is_available():
    """True when torch sees a CUDA device and libnccl loads (nothing is initialised)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        _load()
    except RuntimeError:
        return False
    return True


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class _StreamRequest(Request):
    """Finished when the stream it was enqueued on has reached it."""

    def __init__(self, event, source=-1):
        self._event = event
        self._source = source

    def wait(self, timeout=None):
        self._event.synchronize()

    def test(self):
        return self._event.query()

    @property
    def source(self):
        return self._source


class NcclBackend(Backend):
    """One NCCL communicator per group, built from a unique id shared through the store."""

    name = "nccl"
    takes_cuda = True

    def __init__(self, store, rank, size, timeout, options=None):
        super().__init__(store, rank, size, timeout, options)
        import torch
        self._torch = torch
        self._lib = _load()
        self._device = torch.cuda.current_device()
        uid = _UniqueId()
        if rank == 0:
            self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            store.set("nccl/unique_id", bytes(uid.internal))
        else:
            raw = store.get("nccl/unique_id")
            ctypes.memmove(ctypes.byref(uid), raw, _UNIQUE_ID_BYTES)
        self._comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(self._comm), size, uid, rank),
                    "ncclCommInitRank")

    # ---- helpers ---------------------------------------------------------------
    def _check(self, code, what):
        if code != 0:
            msg = self._lib.ncclGetErrorString(code).decode()
            raise DistBackendError(f"nccl {what} failed on rank {self.rank}: {msg} (code {code})")

    def _stream(self):
        return ctypes.c_void_p(self._torch.cuda.current_stream(self._device).cuda_stream)

    def _dtype(self, buf, op=None):
        if buf.device < 0:
            raise ValueError("nccl backend needs CUDA tensors, got host memory")
        if buf.dtype not in _NCCL_DTYPE:
            raise ValueError(f"nccl has no type for {D.DTYPE_NAMES[buf.dtype]}")
        count = buf.count * 2 if buf.dtype in D.COMPLEX else buf.count
        if op is None:
            return _NCCL_DTYPE[buf.dtype], count
        if buf.dtype in D.COMPLEX and op != D.SUM:
            raise ValueError(f"nccl reduces complex tensors with SUM only, got {D.OP_NAMES[op]}")
        table = _BOOL_OP if buf.dtype == D.BOOL else _NCCL_OP
        if op not in table:
            raise ValueError(f"nccl has no {D.OP_NAMES[op]} reduction")
        return _NCCL_DTYPE[buf.dtype], count, table[op]

    def _done(self, source=-1):
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self._device))
        return _StreamRequest(ev, source)

    def _bytes(self, buf):
        return _NCCL_DTYPE[D.UINT8], buf.nbytes

    # ---- collectives -------------------------------------------------------------
    def all_reduce(self, buf, op):
        dt, n, rop = self._dtype(buf, op)
        self._check(self._lib.ncclAllReduce(ctypes.c_void_p(buf.ptr), ctypes.c_void_p(buf.ptr),
                                            ctypes.c_size_t(n), dt, rop, self._comm, self._stream()),
                    "ncclAllReduce")

    def broadcast(self, buf, root):
        dt, n = self._bytes(buf)
        self._check(self._lib.ncclBroadcast(ctypes.c_void_p(buf.ptr), ctypes.c_void_p(buf.ptr),
                                            ctypes.c_size_t(n), dt, root, self._comm, self._stream()),
                    "ncclBroadcast")

    def reduce(self, buf, op, root):
        dt, n, rop = self._dtype(buf, op)
        # non-root buffers stay unchanged: NCCL writes recvbuff on root only
        self._check(self._lib.ncclReduce(ctypes.c_void_p(buf.ptr), ctypes.c_void_p(buf.ptr),
                                         ctypes.c_size_t(n), dt, rop, root, self._comm,
                                         self._stream()), "ncclReduce")

    def all_gather(self, out, inp):
        dt, n = self._bytes(inp)
        self._check(self._lib.ncclAllGather(ctypes.c_void_p(inp.ptr), ctypes.c_void_p(out.ptr),
                                            ctypes.c_size_t(n), dt, self._comm, self._stream()),
                    "ncclAllGather")

    def reduce_scatter(self, out, inp, op):
        dt, n, rop = self._dtype(out, op)
        self._check(self._lib.ncclReduceScatter(ctypes.c_void_p(inp.ptr), ctypes.c_void_p(out.ptr),
                                                ctypes.c_size_t(n), dt, rop, self._comm,
                                                self._stream()), "ncclReduceScatter")

    def _grouped(self, sends, recvs, what):
        """sends/recvs: lists of (ptr, nbytes, peer); one ncclGroupStart/End around them."""
        stream = self._stream()
        u8 = _NCCL_DTYPE[D.UINT8]
        self._check(self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            for ptr, nbytes, peer in sends:
                self._check(self._lib.ncclSend(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), u8,
                                               peer, self._comm, stream), what)
            for ptr, nbytes, peer in recvs:
                self._check(self._lib.ncclRecv(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), u8,
                                               peer, self._comm, stream), what)
        finally:
            self._check(self._lib.ncclGroupEnd(), "ncclGroupEnd")

    def gather(self, out, inp, root):
        nb = inp.nbytes
        if self.rank == root:
            recvs = [(out.ptr + r * nb, nb, r) for r in range(self.size)]
            self._grouped([(inp.ptr, nb, root)], recvs, "gather")
        else:
            self._grouped([(inp.ptr, nb, root)], [], "gather")

    def scatter(self, out, inp, root):
        nb = out.nbytes
        sends = [(inp.ptr + r * nb, nb, r) for r in range(self.size)] if self.rank == root else []
        self._grouped(sends, [(out.ptr, nb, root)], "scatter")

    def all_to_all(self, out, inp, out_counts, in_counts):
        isz = inp.itemsize
        sends, recvs, so, ro = [], [], 0, 0
        for r in range(self.size):
            sends.append((inp.ptr + so * isz, in_counts[r] * isz, r))
            recvs.append((out.ptr + ro * isz, out_counts[r] * isz, r))
            so += in_counts[r]
            ro += out_counts[r]
        self._grouped(sends, recvs, "all_to_all")

    def barrier(self):
        torch = self._torch
        one = torch.ones(1, device=self._device)
        self._check(self._lib.ncclAllReduce(ctypes.c_void_p(one.data_ptr()),
                                            ctypes.c_void_p(one.data_ptr()), ctypes.c_size_t(1),
                                            _NCCL_DTYPE[D.FLOAT32], 0, self._comm, self._stream()),
                    "barrier")
        torch.cuda.current_stream(self._device).synchronize()

    # ---- point to point ------------------------------------------------------------
    def isend(self, buf, dst, tag=0):
        self._grouped([(buf.ptr, buf.nbytes, dst)], [], "send")
        return self._done()

    def irecv(self, buf, src, tag=0):
        if src is None:
            raise ValueError("nccl cannot receive from any source; pass src")
        self._grouped([], [(buf.ptr, buf.nbytes, src)], "recv")
        return self._done(src)

    def submit(self, fn, *args):
        # NCCL ops are already asynchronous on the stream: enqueue now, finish on wait
        fn(*args)
        return self._done()

    def run(self, fn, *args):
        return fn(*args)

    def shutdown(self):
        if self._comm:
            self._lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p()
        super().shutdown()


def create_nccl_backend(store, rank, size, timeout, options=None):
    """The factory registered as 'nccl'; a clear error where NCCL cannot run."""
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the nccl backend needs torch with CUDA: pip install 'collectives[torch]' "
                           "with a CUDA build of torch")
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device; torch.cuda.is_available() is False "
                           "(use backend='gloo' for CPU tensors)")
    try:
        _load()
    except RuntimeError as e:
        raise RuntimeError(f"the nccl backend needs libnccl: {e}; install torch's CUDA build "
                           "(it brings nvidia-nccl) or set COLLECTIVES_NCCL_LIB") from None
    return NcclBackend(store, rank, size, timeout, options)


__all__ = ["NcclBackend", "create_nccl_backend", "is_available"]
