# cython: language_level=3
"""Same-host shared-memory transport: one segment per group, collectives in C.

Every collective runs in C with the GIL released (shm/shm_coll.c), but for barrier,
small broadcasts and small all_reduces, which begin with it held and release it only
where they must wait longer than a short spin (shm_*_try); this module only converts
arguments and turns error codes into DistBackendError.
"""
cimport cython
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

from ._buffer cimport Buffer

import time
from .. import config as _config
from ..core import dtypes as _D
from ..core import fingerprint as _fp
from ..core.engine_errors import expand as _expand
from ..core.errors import DistBackendError

include "_kernels_import.pxi"


cdef extern from "shm/shm_coll.h" nogil:
    ctypedef struct shm_comm:
        pass
    int SHM_OK, SHM_ETIMEDOUT, SHM_EPEERDEAD, SHM_EBROKEN, SHM_ESYS, SHM_EINVAL, SHM_ECLOSED
    int SHM_EFAILED, SHM_FAIL_NONE, SHM_FAIL_MISMATCH, SHM_FAIL_COUNTS, SHM_FAIL_TEXT_SET
    int shm_comm_open(shm_comm **out, const char *name, int create, int rank, int size,
                      size_t half_bytes, size_t ring_bytes, double timeout_s, int *sys_errno)
    void shm_comm_close(shm_comm *c)
    int shm_comm_unlink(const char *name)
    void shm_comm_set_timeout(shm_comm *c, double timeout_s)
    void shm_comm_set_thresholds(shm_comm *c, size_t oneshot_max, size_t chunk_bytes)
    void shm_comm_set_tuning(shm_comm *c, long long spin, long long yield_us, long long far_ns,
                             long long llc_bytes, int thp, int cma_any_cores)
    int shm_cma_probe(shm_comm *c)
    int shm_cma_enabled(const shm_comm *c)
    int shm_cma_readable(const shm_comm *c)
    void shm_comm_set_cma_min(shm_comm *c, size_t gather_min, size_t bcast_min, size_t ar_min)
    void shm_comm_set_stream(shm_comm *c, int mode)
    int SHM_AR_AUTO, SHM_AR_TWO_SHOT, SHM_AR_SINGLE_COPY
    void shm_comm_set_ar_algo(shm_comm *c, int algo)
    int shm_comm_tune_choice(const shm_comm *c, int kind, size_t nbytes)
    int shm_comm_far(const shm_comm *c)
    int shm_comm_peer_distance(const shm_comm *c, int q)
    int shm_comm_error_peer(const shm_comm *c)
    uint32_t shm_comm_seq(const shm_comm *c)
    size_t shm_comm_half_bytes(const shm_comm *c)
    void shm_comm_abort(shm_comm *c)
    uint32_t shm_comm_coll(const shm_comm *c)
    int shm_comm_fail_record(const shm_comm *c, uint32_t *k, int *a, int *b, uint64_t *wa,
                             uint64_t *wb, const char **text, uint32_t *number)
    void shm_comm_number_next(shm_comm *c, uint32_t number)
    int shm_comm_poison(shm_comm *c, const char *text)
    const char *shm_strerror(int rc)
    const char *shm_comm_error_text(shm_comm *c, int rc, const char *op, int peer,
                                    const char *label, long number)
    int shm_barrier(shm_comm *c, uint64_t fp)
    int SHM_PENDING
    int shm_barrier_try(shm_comm *c, uint64_t fp)
    int shm_broadcast_try(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
    int shm_all_reduce_try(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp)
    int shm_finish(shm_comm *c)
    int shm_broadcast(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
    int shm_all_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp)
    int shm_map_register(shm_comm *c, uint32_t id, const void *lo, size_t n, const uintptr_t *peer)
    void shm_map_unregister(shm_comm *c, uint32_t id)
    uint64_t shm_map_calls(const shm_comm *c)
    int shm_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, int root, uint64_t fp)
    int shm_all_gather(shm_comm *c, void *out, const void *inp, size_t nbytes, uint64_t fp)
    int shm_all_gather_list(shm_comm *c, void *const *outs, const void *inp, size_t nbytes,
                            uint64_t fp)
    int shm_gather(shm_comm *c, void *out, const void *inp, size_t nbytes, int root, uint64_t fp)
    int shm_scatter(shm_comm *c, void *out, const void *inp, size_t nbytes, int root, uint64_t fp)
    int shm_reduce_scatter(shm_comm *c, void *out, const void *inp, size_t count, int dtype, int op,
                           uint64_t fp)
    int shm_all_to_all(shm_comm *c, void *out, const void *inp, const size_t *out_bytes,
                       const size_t *in_bytes, uint64_t fp)
    int shm_p2p_try_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                         size_t nbytes)
    int shm_p2p_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                     size_t nbytes)
    int shm_p2p_poll(shm_comm *c, size_t need, double wait_s, int background, uint32_t since,
                     int *src)
    uint32_t shm_p2p_kicks(const shm_comm *c)
    void shm_p2p_direct(shm_comm *c, int delta, int wake)
    int shm_p2p_read(shm_comm *c, int src, void *buf, size_t nbytes)
    void shm_p2p_kick(shm_comm *c)
    void shm_p2p_attach(shm_comm *c)


cdef int K_BARRIER = _fp.BARRIER, K_BROADCAST = _fp.BROADCAST, K_ALL_REDUCE = _fp.ALL_REDUCE
cdef int K_REDUCE = _fp.REDUCE, K_ALL_GATHER = _fp.ALL_GATHER, K_GATHER = _fp.GATHER
cdef int K_SCATTER = _fp.SCATTER, K_REDUCE_SCATTER = _fp.REDUCE_SCATTER
cdef int K_ALL_TO_ALL = _fp.ALL_TO_ALL, NO_DTYPE = _fp.NO_DTYPE


cdef inline uint64_t _pack(int kind, int dtype, uint64_t count, int root, int op) noexcept:
    """collectives.core.fingerprint.pack, in C (a call's fingerprint costs nanoseconds)."""
    return (<uint64_t>(kind & 0xF) | (<uint64_t>(dtype & 0xF) << 4)
            | (<uint64_t>((op + 1) & 0xF) << 8) | (<uint64_t>((root + 1) & 0xFFF) << 12)
            | ((count & ((<uint64_t>1 << 40) - 1)) << 24))


def pack(int kind, int dtype=NO_DTYPE, uint64_t count=0, int root=-1, int op=-1):
    """The word the collectives below compute when not given one (tests compare it)."""
    return _pack(kind, dtype, count, root, op)


cdef inline size_t _nbytes(Buffer b) noexcept:
    return <size_t>b.count * <size_t>b.itemsize


ctypedef int (*rooted_fn)(shm_comm *c, void *out, const void *inp, size_t nbytes, int root,
                          uint64_t fp) noexcept nogil


cdef inline int _rooted(shm_comm *c, rooted_fn fn, Buffer out, Buffer inp, size_t nbytes,
                        int root, uint64_t fp) noexcept:
    """A rooted block transfer (shm_gather, shm_scatter) without the GIL; the side a rank
    does not hold (None, as the caller's Buffer arguments allow) passes NULL."""
    cdef int rc
    cdef void *o = <void *>out.ptr if out is not None else NULL
    cdef const void *i = <const void *>inp.ptr if inp is not None else NULL
    with nogil:
        rc = fn(c, o, i, nbytes, root, fp)
    return rc


cdef inline int _finish(shm_comm *c, int rc) noexcept:
    """The outcome of a call whose nonblocking half returned ``rc``: where that left the call
    pending, its finish (waiting for the peers without the GIL)."""
    if rc == SHM_PENDING:
        with nogil:
            rc = shm_finish(c)
    return rc


cdef long long _or_default(value):
    """An int setting's value for the C engine: -1 (keep the engine's default) for None."""
    return -1 if value is None else value


def unlink(name):
    """Remove a segment name from /dev/shm (mapped ranks keep their mapping)."""
    return shm_comm_unlink(name.encode()) == SHM_OK


_P2P_OPS = frozenset({"send", "recv", "cma_probe"})  # _check's calls that are no collective


cdef class ShmComm:
    """One rank's view of a group's shared segment.

    Args:
        name: the shm_open name (``/collectives-...``).
        create: True on the rank that creates the segment.
        rank, size: this rank and the number of ranks mapping the segment.
        half_bytes: bytes per half data slot (each rank has two).
        ring_bytes: bytes per point-to-point ring (a power of two).
        timeout: seconds any single wait may take.
        label: names the group in error messages.
    """

    cdef shm_comm *c
    cdef readonly int rank, size
    cdef readonly str label
    cdef readonly double timeout
    cdef public object rank_names  # rank r is called rank_names[r] in messages (None: r)
    cdef public long coll_base     # collectives before the user's first (numbering in messages)
    cdef public uint64_t last_fp   # this rank's latest fingerprint word

    def __cinit__(self, str name, bint create, int rank, int size, size_t half_bytes,
                  size_t ring_bytes, double timeout, str label="shm"):
        self.timeout = timeout
        cdef int err = 0, rc
        cdef bytes bname = name.encode()
        cdef const char *cname = bname
        self.c = NULL
        self.rank = rank
        self.size = size
        self.label = label
        # this rank's tuning, from the registry (a bad value raises before the mapping)
        cdef long long spin = _or_default(_config.get("COLLECTIVES_SHM_SPIN"))
        cdef long long yield_us = _or_default(_config.get("COLLECTIVES_SHM_YIELD_US"))
        cdef long long far_ns = _config.get("COLLECTIVES_SHM_FAR_NS")
        cdef long long llc = _or_default(_config.get("COLLECTIVES_SHM_LLC_BYTES"))
        cdef int thp = _config.get("COLLECTIVES_SHM_THP")
        cdef int any_cores = _config.get("COLLECTIVES_SHM_CMA_ANY_CORES")
        with nogil:
            rc = shm_comm_open(&self.c, cname, create, rank, size, half_bytes, ring_bytes,
                               timeout, &err)
        if rc != SHM_OK:
            import os
            detail = os.strerror(err) if rc == SHM_ESYS else shm_strerror(rc).decode()
            raise DistBackendError(f"{label}: cannot map shared segment {name}: {detail}")
        shm_comm_set_tuning(self.c, spin, yield_us, far_ns, llc, thp, any_cores)
        shm_p2p_attach(self.c)  # an abort wakes the p2p waiters through the hook

    def __dealloc__(self):
        if self.c != NULL:
            shm_comm_close(self.c)
            self.c = NULL

    cdef int _check(self, int rc, str op, int peer=-1) except -1:
        """The engines' one error convention (collectives.core.engine_errors): the engine's
        text for rc, raised as DistBackendError."""
        if rc == SHM_OK:
            return 0
        if self.c == NULL:
            raise DistBackendError(f"{self.label} {op}: communicator is closed")
        cdef bytes bop = op.encode(), blabel = self.label.encode()
        cdef const char *cop = bop
        cdef const char *clabel = blabel
        cdef const char *text
        # a collective's number in the group (as mismatch errors name it); p2p calls: none
        cdef long number = 0 if op in _P2P_OPS else <long>shm_comm_coll(self.c) - self.coll_base
        with nogil:
            text = shm_comm_error_text(self.c, rc, cop, peer, clabel, number)
        raise DistBackendError(_expand(text.decode("utf-8", "replace"), self.rank_names,
                                       failure=self.failure))

    cdef inline shm_comm *_live(self, str op) except NULL:
        if self.c == NULL:
            raise DistBackendError(f"{self.label} {op}: communicator is closed")
        return self.c

    cdef inline uint64_t _fingerprint(self, uint64_t fp, int kind, int dtype, uint64_t count,
                                      int root, int op) noexcept:
        """The call's fingerprint: ``fp`` where the caller passed one (the hierarchical
        backend passes the whole group's call), else packed from the arguments; kept as
        ``last_fp``."""
        if fp == 0:
            fp = _pack(kind, dtype, count, root, op)
        self.last_fp = fp
        return fp

    def number_next(self, uint32_t seq):
        """Messages and failure records call the next collectives #seq (ShmBackend's)."""
        shm_comm_number_next(self._live("number_next"), seq)
        self.coll_base = <long>shm_comm_coll(self.c) + 1 - seq

    def failure(self):
        """The description of the group's recorded failure (the same on every rank), or None.

        Waits briefly for a record being written by another rank."""
        cdef uint32_t k = 0, number = 0
        cdef int a = 0, b = 0, st = SHM_FAIL_NONE, i
        cdef uint64_t wa = 0, wb = 0
        cdef const char *text = NULL
        if self.c == NULL:
            return None
        for i in range(1000):
            if self.c == NULL:  # closed by another thread while this one slept
                return None
            st = shm_comm_fail_record(self.c, &k, &a, &b, &wa, &wb, &text, &number)
            if st != SHM_FAIL_NONE or i == 999:
                break
            time.sleep(0.001)
        names = self.rank_names
        nm = (lambda r: names[r]) if names else (lambda r: r)
        seq = number if number else k - self.coll_base  # the recording rank's, else counted
        if st == SHM_FAIL_MISMATCH:
            # the lower rank first, whichever saw it: the same words on every rank
            if a > b:
                a, b, wa, wb = b, a, wb, wa
            # ranks by their names; roots as the words carry them (a hierarchical group
            # passes its own calls' words, whose roots are already the group's ranks)
            return _fp.mismatch_message(seq, nm(a), wa, nm(b), wb, self.label)
        if st == SHM_FAIL_COUNTS:
            dtype = (self.last_fp >> 4) & 0xF
            isz = _D.ITEMSIZE.get(dtype, 1)
            dname = f"{_D.DTYPE_NAMES[dtype]} elements" if dtype in _D.ITEMSIZE else "bytes"
            return (f"collectives called with different arguments in group {self.label}: in "
                    f"all_to_all (collective #{seq}) rank {nm(b)} sends {wb // isz} {dname} to "
                    f"rank {nm(a)}, which expects {wa // isz} from it")
        if st == SHM_FAIL_TEXT_SET:
            return text.decode("utf-8", "replace")
        return None

    def poison(self, str text):
        """Record ``text`` as the group's failure, unless one is; whether it was first."""
        cdef bytes b = text.encode("utf-8", "replace")
        if self.c == NULL:
            return False
        return bool(shm_comm_poison(self.c, b))

    @property
    def coll(self):
        """Fingerprinted collectives started so far on this rank."""
        return shm_comm_coll(self._live("coll"))

    def close(self):
        """Unmap the segment (idempotent)."""
        if self.c != NULL:
            shm_comm_close(self.c)
            self.c = NULL

    def abort(self):
        """Make current and later waits fail (used at shutdown to stop helper threads)."""
        if self.c != NULL:
            shm_comm_abort(self.c)

    def set_timeout(self, double timeout):
        shm_comm_set_timeout(self._live("set_timeout"), timeout)
        self.timeout = timeout

    def cma_probe(self):
        """Collective: whether every rank can read the others' memory (process_vm_readv).
        Every rank gets the same answer; returns it."""
        cdef shm_comm *c = self._live("cma_probe")
        cdef int rc
        with nogil:
            rc = shm_cma_probe(c)
        self._check(rc, "cma_probe")
        return bool(shm_cma_enabled(c))

    def set_cma_min(self, size_t gather_min, size_t bcast_min, size_t ar_min=0):
        """all_gather/gather blocks of at least ``gather_min`` bytes, broadcasts of at
        least ``bcast_min`` bytes and all_reduces of at least ``ar_min`` bytes go in one
        copy (0: never)."""
        shm_comm_set_cma_min(self._live("set_cma_min"), gather_min, bcast_min, ar_min)

    def set_ar_algo(self, str algo):
        """The all_reduce above the one-shot size: "auto" (the ranks time two-shot with
        plain and with streaming stores and the single copy while they run, and take the
        fastest), "two_shot" or "single_copy" (where CMA is on). Every rank of the group
        must pass the same."""
        codes = {"auto": SHM_AR_AUTO, "two_shot": SHM_AR_TWO_SHOT,
                 "single_copy": SHM_AR_SINGLE_COPY}
        if algo not in codes:
            raise ValueError(f"algo must be 'auto', 'two_shot' or 'single_copy', got {algo!r}")
        shm_comm_set_ar_algo(self._live("set_ar_algo"), codes[algo])

    def ar_choice(self, size_t nbytes):
        """What the measured choice last agreed on for all_reduces of ``nbytes``:
        "two_shot", "two_shot_stream", "single_copy", or None before its first decision."""
        cdef int arm = shm_comm_tune_choice(self._live("ar_choice"), 0, nbytes)
        return (None, "two_shot", "two_shot_stream", "single_copy", None)[arm + 1]

    def ag_choice(self, size_t nbytes):
        """The measured choice last agreed on for all_gathers of ``nbytes`` per rank: "plain"
        or "stream" (two copies through the segment), "single_copy" (blocks written in
        pieces), "single_copy_whole" (in one write), or None (not yet, or not timed)."""
        cdef int arm = shm_comm_tune_choice(self._live("ag_choice"), 1, nbytes)
        return (None, "plain", "stream", "single_copy", "single_copy_whole")[arm + 1]

    def set_stream(self, int mode):
        """Segment writes for other ranks: 0 plain stores, 1 streaming stores, 2 streaming
        while latency probes find the peers mostly far (on another die or socket).
        Every rank of the group must pass the same mode (the probes pair ranks up)."""
        if mode not in (0, 1, 2):
            raise ValueError(f"mode must be 0, 1 or 2, got {mode!r}")
        shm_comm_set_stream(self._live("set_stream"), mode)

    @property
    def far(self):
        """Whether this rank's segment writes stream now."""
        return bool(shm_comm_far(self._live("far")))

    def peer_distance(self, int q):
        """What the latency probes last said of rank ``q``: 0 not measured, 1 near, 2 far."""
        return shm_comm_peer_distance(self._live("peer_distance"), q)

    @property
    def cma(self):
        return bool(shm_cma_enabled(self._live("cma")))

    @property
    def cma_readable(self):
        """Whether the gathers may go in one copy (cma_probe's answer without the cores)."""
        return bool(shm_cma_readable(self._live("cma_readable")))

    def map_register(self, uint32_t id, uintptr_t lo, size_t length, const uint64_t[::1] peers):
        """Collective: this rank's ``length`` bytes at ``lo`` are mapped buffer ``id`` (one id on
        every rank), rank q's is at ``peers[q]`` here (shm_mapped.c); False: the table is full."""
        if peers.shape[0] != self.size:
            raise ValueError(f"peers must hold {self.size} addresses, got {peers.shape[0]}")
        return shm_map_register(self._live("map_register"), id, <const void *>lo, length,
                                <const uintptr_t *>&peers[0]) == 0

    def map_unregister(self, uint32_t id):
        """Mapped buffer ``id`` is gone on this rank (every rank's all_reduces on it decline)."""
        if self.c != NULL:
            shm_map_unregister(self.c, id)

    @property
    def mapped_calls(self):
        """all_reduces that took the mapped path so far."""
        return shm_map_calls(self._live("mapped_calls"))

    def set_thresholds(self, size_t oneshot_max, size_t chunk_bytes):
        shm_comm_set_thresholds(self._live("set_thresholds"), oneshot_max, chunk_bytes)

    @property
    def half_bytes(self):
        return shm_comm_half_bytes(self._live("half_bytes"))

    @property
    def seq(self):
        return shm_comm_seq(self._live("seq"))

    # ---- collectives on Buffers ---------------------------------------------------
    # (binding(False): bound on the backend they are builtin methods, which the dispatcher
    # calls without a bound-method wrapper)
    # Each takes collectives.engines._buffer.Buffer objects and reads their fields in C (a small
    # call's cost is mostly argument passing). fp: the caller's fingerprint of the call
    # (collectives.core.fingerprint.pack; 0: computed here from the arguments); every rank
    # compares every peer's with its own (see shm_coll.h)
    @cython.binding(False)
    def barrier(self, uint64_t fp=0):
        cdef shm_comm *c = self._live("barrier")
        fp = self._fingerprint(fp, K_BARRIER, NO_DTYPE, 0, -1, -1)
        self._check(_finish(c, shm_barrier_try(c, fp)), "barrier")

    @cython.binding(False)
    def broadcast(self, Buffer buf not None, int root, uint64_t fp=0):
        cdef shm_comm *c = self._live("broadcast")
        fp = self._fingerprint(fp, K_BROADCAST, buf.dtype, buf.count, root, -1)
        self._check(_finish(c, shm_broadcast_try(c, <void *>buf.ptr, _nbytes(buf), root, fp)),
                    "broadcast")

    @cython.binding(False)
    def all_reduce(self, Buffer buf not None, int op, uint64_t fp=0):
        cdef shm_comm *c = self._live("all_reduce")
        cdef int dtype = buf.dtype
        cdef size_t count = buf.count
        fp = self._fingerprint(fp, K_ALL_REDUCE, dtype, count, -1, op)
        self._check(_finish(c, shm_all_reduce_try(c, <void *>buf.ptr, count, dtype, op, fp)),
                    "all_reduce")

    @cython.binding(False)
    def reduce(self, Buffer buf not None, int op, int root, uint64_t fp=0):
        cdef shm_comm *c = self._live("reduce")
        cdef int rc, dtype = buf.dtype
        cdef void *p = <void *>buf.ptr
        cdef size_t count = buf.count
        fp = self._fingerprint(fp, K_REDUCE, dtype, count, root, op)
        with nogil:
            rc = shm_reduce(c, p, count, dtype, op, root, fp)
        self._check(rc, "reduce")

    @cython.binding(False)
    def all_gather(self, Buffer out not None, Buffer inp not None, uint64_t fp=0):
        """``out`` takes every rank's ``inp``, rank r's at byte r * inp's size."""
        cdef shm_comm *c = self._live("all_gather")
        cdef int rc
        cdef void *o = <void *>out.ptr
        cdef const void *i = <const void *>inp.ptr
        cdef size_t nbytes = _nbytes(inp)
        fp = self._fingerprint(fp, K_ALL_GATHER, inp.dtype, inp.count, -1, -1)
        with nogil:
            rc = shm_all_gather(c, o, i, nbytes, fp)
        self._check(rc, "all_gather")

    @cython.binding(False)
    def all_gather_list(self, outs, Buffer inp not None, uint64_t fp=0):
        """all_gather into separate blocks: ``outs`` holds one Buffer per rank."""
        cdef shm_comm *c = self._live("all_gather")
        cdef int rc, i, n = self.size
        if len(outs) != n:
            raise ValueError(f"all_gather: outs must have {n} entries, got {len(outs)}")
        cdef const void *ip = <const void *>inp.ptr
        cdef size_t nbytes = _nbytes(inp)
        cdef void **o = <void **>malloc(n * sizeof(void *))
        if o == NULL:
            raise MemoryError()
        fp = self._fingerprint(fp, K_ALL_GATHER, inp.dtype, inp.count, -1, -1)
        try:
            for i in range(n):
                o[i] = <void *>(<Buffer?>outs[i]).ptr
            with nogil:
                rc = shm_all_gather_list(c, <void *const *>o, ip, nbytes, fp)
        finally:
            free(o)
        self._check(rc, "all_gather")

    @cython.binding(False)
    def gather(self, Buffer out, Buffer inp not None, int root, uint64_t fp=0):
        """``out`` (None but on ``root``) takes every rank's ``inp``."""
        cdef shm_comm *c = self._live("gather")
        fp = self._fingerprint(fp, K_GATHER, inp.dtype, inp.count, root, -1)
        self._check(_rooted(c, shm_gather, out, inp, _nbytes(inp), root, fp), "gather")

    @cython.binding(False)
    def scatter(self, Buffer out not None, Buffer inp, int root, uint64_t fp=0):
        """Rank r's ``out`` takes block r of ``root``'s ``inp`` (None elsewhere)."""
        cdef shm_comm *c = self._live("scatter")
        fp = self._fingerprint(fp, K_SCATTER, out.dtype, out.count, root, -1)
        self._check(_rooted(c, shm_scatter, out, inp, _nbytes(out), root, fp), "scatter")

    @cython.binding(False)
    def reduce_scatter(self, Buffer out not None, Buffer inp not None, int op, uint64_t fp=0):
        cdef shm_comm *c = self._live("reduce_scatter")
        cdef int rc, dtype = out.dtype
        cdef void *o = <void *>out.ptr
        cdef const void *i = <const void *>inp.ptr
        cdef size_t count = out.count
        fp = self._fingerprint(fp, K_REDUCE_SCATTER, dtype, count, -1, op)
        with nogil:
            rc = shm_reduce_scatter(c, o, i, count, dtype, op, fp)
        self._check(rc, "reduce_scatter")

    @cython.binding(False)
    def all_to_all(self, Buffer out not None, Buffer inp not None, out_counts, in_counts,
                   uint64_t fp=0):
        """Rank q's block of ``inp`` (``in_counts[q]`` elements) goes to rank q, and rank
        r's block for this rank lands in ``out`` (``out_counts[r]`` elements)."""
        cdef shm_comm *c = self._live("all_to_all")
        cdef int rc, i, n = self.size
        cdef size_t isz = out.itemsize
        if len(out_counts) != n or len(in_counts) != n:
            raise ValueError(f"all_to_all: out_counts and in_counts must have {n} entries")
        cdef void *o = <void *>out.ptr
        cdef const void *ip = <const void *>inp.ptr
        cdef size_t *ob = <size_t *>malloc(2 * n * sizeof(size_t))
        if ob == NULL:
            raise MemoryError()
        cdef size_t *ib = ob + n
        fp = self._fingerprint(fp, K_ALL_TO_ALL, out.dtype, 0, -1, -1)
        try:
            for i in range(n):
                ob[i] = <size_t>out_counts[i] * isz
                ib[i] = <size_t>in_counts[i] * isz
            with nogil:
                rc = shm_all_to_all(c, o, ip, ob, ib, fp)
        finally:
            free(ob)
        self._check(rc, "all_to_all")

    # ---- point to point: byte streams per ordered pair ------------------------------
    cdef int _p2p_send(self, int dst, bytes hdr, size_t ptr, size_t nbytes, bint wait) except -1:
        """hdr + payload into dst's ring: waiting for room, or (not wait) only if it fits
        now; 1 if written, 0 if not (an error raises)."""
        cdef shm_comm *c = self._live("send")
        cdef const char *h = hdr
        cdef size_t hl = len(hdr)
        cdef int rc
        with nogil:
            if wait:
                rc = shm_p2p_send(c, dst, h, hl, <const void *>ptr, nbytes)
            else:
                rc = shm_p2p_try_send(c, dst, h, hl, <const void *>ptr, nbytes)
        if rc < 0:
            self._check(rc, "send", dst)
        return 1 if wait else rc

    def p2p_try_send(self, int dst, bytes hdr, size_t ptr, size_t nbytes):
        """Write hdr + payload to dst's ring if it fits now; True if written."""
        return self._p2p_send(dst, hdr, ptr, nbytes, False) == 1

    def p2p_send(self, int dst, bytes hdr, size_t ptr, size_t nbytes):
        self._p2p_send(dst, hdr, ptr, nbytes, True)

    def p2p_poll(self, size_t need, double wait_s, bint background=False, uint32_t since=0):
        """A source with >= need readable bytes, or -1 after wait_s seconds. It only looks.
        ``background``: the receiver thread's poll, which waits while a thread reads the
        rings for its own receive (``p2p_direct``); otherwise such a thread's poll, which
        also returns -1 once ``p2p_kick`` was called since ``since`` (``p2p_kicks()``)."""
        cdef shm_comm *c = self._live("recv")
        cdef int rc, src = -1
        with nogil:
            rc = shm_p2p_poll(c, need, wait_s, background, since, &src)
        self._check(rc, "recv")
        return src

    def p2p_read(self, int src, size_t ptr, size_t nbytes):
        """Read exactly nbytes from src's stream into ptr (0 discards them)."""
        cdef shm_comm *c = self._live("recv")
        cdef int rc
        with nogil:
            rc = shm_p2p_read(c, src, <void *>ptr, nbytes)
        self._check(rc, "recv", src)

    def p2p_read_bytes(self, int src, size_t nbytes):
        cdef bytearray b = bytearray(nbytes)
        cdef char *p = b
        cdef shm_comm *c = self._live("recv")
        cdef int rc
        with nogil:
            rc = shm_p2p_read(c, src, p, nbytes)
        self._check(rc, "recv", src)
        return bytes(b)

    def p2p_kicks(self):
        """How many times ``p2p_kick`` was called (a waiter's poll returns at the next)."""
        return shm_p2p_kicks(self._live("recv"))

    def p2p_direct(self, int delta, bint wake=True):
        """+1: this thread starts reading the rings for a receive it waits on (the
        background receiver stays out of its way); -1: it stops, and with ``wake`` wakes
        the background receiver (else it sleeps on for 10 ms at most)."""
        if self.c != NULL:
            shm_p2p_direct(self.c, delta, wake)

    def p2p_kick(self):
        if self.c != NULL:
            shm_p2p_kick(self.c)
