"""A third-party backend built only on the public API: ``collectives.backends`` and a Store.

Importing this module registers it as ``"store"``::

    import tests.support.store_backend
    dist.init_process_group("store", ...)

Every operation moves its bytes through the group's store with set/get, so it is
slow but simple enough to be obviously correct: it is the reference backend of
the front-end tests, and the proof that a backend can be added without touching
the package. Reductions run in NumPy, in rank order on every rank, so every rank
computes bitwise the same result.
"""
import threading
import time
from datetime import timedelta

import numpy as np

from collectives.core import dtypes as D
from collectives.backends import Backend, DoneRequest, Request, register_backend
from collectives.core.errors import DistBackendError, DistError
from collectives.core.views import view_numpy

_NP_BINOP = {D.SUM: np.add, D.PRODUCT: np.multiply, D.MIN: np.minimum, D.MAX: np.maximum,
             D.BAND: np.bitwise_and, D.BOR: np.bitwise_or, D.BXOR: np.bitwise_xor}
_BOOL_BINOP = {D.SUM: np.logical_or, D.MAX: np.logical_or, D.BOR: np.logical_or,
               D.PRODUCT: np.logical_and, D.MIN: np.logical_and, D.BAND: np.logical_and,
               D.BXOR: np.logical_xor}


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even; NaN becomes 0x7FC0 (as torch's scalar bfloat16)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def np_reduce(dst, src, dtype, op):
    """``dst = op(dst, src)`` on NumPy views of buffers of ``dtype`` (bfloat16 as uint16 bits)."""
    if dtype == D.BFLOAT16:
        dst[...] = f32_to_bf16(_NP_BINOP[op](bf16_to_f32(dst), bf16_to_f32(src)))
    elif dtype == D.BOOL:
        _BOOL_BINOP[op](dst, src, out=dst)
    else:
        with np.errstate(all="ignore"):
            _NP_BINOP[op](dst, src, out=dst)


class _RecvRequest(Request):
    def __init__(self, backend, buf, src, tag):
        self._be, self._buf, self._src, self._tag = backend, buf, src, tag
        self._done = False
        self._exc = None
        self._source = -1

    def wait(self, timeout=None):
        self._be._complete(self, self._be.timeout if timeout is None else timeout, block=True)
        if self._exc is not None:
            raise self._exc

    def test(self):
        if not self._done:
            try:
                self._be._complete(self, 0, block=False)
            except DistError:
                pass
        return self._done


class StoreBackend(Backend):
    """Every collective and point-to-point operation as set/get on ``store``."""

    name = "store"

    def __init__(self, store, rank, size, timeout, options=None):
        if store is None:
            raise ValueError("the store backend needs a store (init_method or store=)")
        super().__init__(store, rank, size, timeout, options)
        self._seq = 0
        self._p2p_lock = threading.RLock()
        self._inbox = {}     # tag -> [cursor, consumed indices, {index: (src, payload)}]
        self._pending = []   # posted receives, in posting order

    # ---- store access with the group's timeout and our error type -------------------------
    def _wait(self, keys, what, peer):
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as e:
            raise DistBackendError(f"store backend: {what} (seq {self._seq}, rank {self.rank}) "
                                   f"did not get data from rank {peer} within {self.timeout} s: {e}") from e

    def _get(self, key, what, peer):
        self._wait([key], what, peer)
        try:
            return self.store.get(key)
        except Exception as e:
            raise DistBackendError(f"store backend: {what} failed reading from rank {peer}: {e}") from e

    def _set(self, key, value, what):
        try:
            self.store.set(key, value)
        except Exception as e:
            raise DistBackendError(f"store backend: {what} failed on rank {self.rank}: {e}") from e

    def _next(self, what):
        self._seq += 1
        return f"c{self._seq}/{what}"

    @staticmethod
    def _np(buf):
        # view_numpy, not Buffer.numpy(): the latter returns the whole owner array for a slice
        return view_numpy(buf.ptr, buf.count, buf.dtype, buf.obj)

    def _bytes(self, buf):
        return self._np(buf).tobytes()

    def _fill(self, buf, data):
        if buf.count:
            self._np(buf).view(np.uint8)[...] = np.frombuffer(data, np.uint8)

    def _gather_all(self, base, what, ranks):
        return {r: self._get(f"{base}/{r}", what, r) for r in ranks}

    # ---- collectives ------------------------------------------------------------------------------
    def broadcast(self, buf, root):
        base = self._next("broadcast")
        if self.rank == root:
            self._set(f"{base}/{root}", self._bytes(buf), "broadcast")
        else:
            self._fill(buf, self._get(f"{base}/{root}", "broadcast", root))

    def _reduced(self, parts, buf, op):
        acc = np.frombuffer(parts[0], self._np(buf).dtype).copy()
        for r in range(1, self.size):
            np_reduce(acc, np.frombuffer(parts[r], acc.dtype), buf.dtype, op)
        return acc

    def all_reduce(self, buf, op):
        base = self._next("all_reduce")
        self._set(f"{base}/{self.rank}", self._bytes(buf), "all_reduce")
        parts = self._gather_all(base, "all_reduce", range(self.size))
        if buf.count:
            self._np(buf)[...] = self._reduced(parts, buf, op)

    def reduce(self, buf, op, root):
        base = self._next("reduce")
        self._set(f"{base}/{self.rank}", self._bytes(buf), "reduce")
        if self.rank == root:
            parts = self._gather_all(base, "reduce", range(self.size))
            if buf.count:
                self._np(buf)[...] = self._reduced(parts, buf, op)

    def all_gather(self, out, inp):
        base = self._next("all_gather")
        self._set(f"{base}/{self.rank}", self._bytes(inp), "all_gather")
        n = inp.count
        for r, data in self._gather_all(base, "all_gather", range(self.size)).items():
            self._fill(out.slice(r * n, (r + 1) * n), data)

    def gather(self, out, inp, root):
        base = self._next("gather")
        self._set(f"{base}/{self.rank}", self._bytes(inp), "gather")
        if self.rank == root:
            n = inp.count
            for r, data in self._gather_all(base, "gather", range(self.size)).items():
                self._fill(out.slice(r * n, (r + 1) * n), data)

    def scatter(self, out, inp, root):
        base = self._next("scatter")
        n = out.count
        if self.rank == root:
            for r in range(self.size):
                self._set(f"{base}/{r}", self._bytes(inp.slice(r * n, (r + 1) * n)), "scatter")
        self._fill(out, self._get(f"{base}/{self.rank}", "scatter", root))

    def reduce_scatter(self, out, inp, op):
        base = self._next("reduce_scatter")
        n = out.count
        for r in range(self.size):
            part = self._bytes(inp.slice(r * n, (r + 1) * n))
            self._set(f"{base}/{self.rank}->{r}", part, "reduce_scatter")
        parts = [self._get(f"{base}/{r}->{self.rank}", "reduce_scatter", r) for r in range(self.size)]
        if n:
            self._np(out)[...] = self._reduced(parts, out, op)

    def all_to_all(self, out, inp, out_counts, in_counts):
        base = self._next("all_to_all")
        off = 0
        for r, c in enumerate(in_counts):
            self._set(f"{base}/{self.rank}->{r}", self._bytes(inp.slice(off, off + c)), "all_to_all")
            off += c
        off = 0
        for r, c in enumerate(out_counts):
            data = self._get(f"{base}/{r}->{self.rank}", "all_to_all", r)
            if len(data) != c * out.itemsize:
                raise DistBackendError(f"store backend: all_to_all got {len(data)} bytes from rank {r}, "
                                       f"expected {c * out.itemsize} (split sizes disagree)")
            self._fill(out.slice(off, off + c), data)
            off += c

    def barrier(self):
        base = self._next("barrier")
        try:
            arrived = self.store.add(f"{base}/arrived", 1)
        except Exception as e:
            raise DistBackendError(f"store backend: barrier failed on rank {self.rank}: {e}") from e
        if arrived == self.size:
            self._set(f"{base}/done", b"1", "barrier")
        self._wait([f"{base}/done"], "barrier", "any")

    # ---- point to point ----------------------------------------------------------------------------
    def isend(self, buf, dst, tag=0):
        try:
            i = self.store.add(f"p2p/{dst}/{tag}/n", 1) - 1
            self.store.set(f"p2p/{dst}/{tag}/{i}", self.rank.to_bytes(4, "little") + self._bytes(buf))
        except Exception as e:
            return DoneRequest(exc=DistBackendError(f"store backend: send to rank {dst} failed: {e}"))
        return DoneRequest()

    def irecv(self, buf, src, tag=0):
        req = _RecvRequest(self, buf, src, tag)
        with self._p2p_lock:
            self._pending.append(req)
        return req

    def _complete(self, req, timeout, block):
        """Match posted receives in posting order, up to and including ``req``."""
        deadline = time.monotonic() + (timeout if timeout else 0)
        with self._p2p_lock:
            for p in list(self._pending):
                if req._done:
                    return
                # earlier receives take their messages first (without waiting for them)
                if self._match(p, deadline, block and p is req) is not None:
                    self._pending.remove(p)
                if p is req:
                    return

    def _match(self, req, deadline, block):
        st = self._inbox.setdefault(req._tag, [0, set(), {}])
        delay = 1e-4
        i = st[0]
        while True:
            if i in st[1]:
                i += 1
                continue
            key = f"p2p/{self.rank}/{req._tag}/{i}"
            if i not in st[2]:
                try:
                    present = self.store.check([key])
                    if present:
                        raw = self.store.get(key)
                        self.store.delete_key(key)
                except Exception as e:
                    req._exc, req._done = DistBackendError(f"store backend: recv failed: {e}"), True
                    return req
                if not present:
                    if not block:
                        return None
                    if time.monotonic() > deadline:
                        peer = "any rank" if req._src is None else f"rank {req._src}"
                        raise DistBackendError(f"store backend: recv from {peer} (tag {req._tag}) "
                                               f"timed out on rank {self.rank}")
                    time.sleep(delay)
                    delay = min(delay * 2, 0.01)
                    continue
                st[2][i] = (int.from_bytes(raw[:4], "little"), raw[4:])
            src, payload = st[2][i]
            if req._src is None or req._src == src:
                del st[2][i]
                st[1].add(i)
                while st[0] in st[1]:
                    st[1].discard(st[0])
                    st[0] += 1
                if len(payload) != req._buf.nbytes:
                    req._exc = DistBackendError(f"store backend: recv of {req._buf.nbytes} bytes got "
                                                f"{len(payload)} from rank {src}")
                else:
                    self._fill(req._buf, payload)
                req._source, req._done = src, True
                return req
            i += 1


register_backend("store", StoreBackend)

__all__ = ["StoreBackend", "np_reduce", "bf16_to_f32", "f32_to_bf16"]
