/* The copy policy: streaming stores, the near/far latency probes that choose them,
 * huge pages for buffers that peers copy, and single copies between the ranks' memories
 * (CMA: process_vm_readv/writev); see shm_sync.h. */
#include "shm_copy.h"

/* Copy that streams its stores past the caches (x86 SSE2), for large copies whose
 * destination is not read again soon: it leaves the shared cache to the source blocks
 * that other ranks are about to read, and skips reading the destination lines first. */
SHM_HIDDEN void copy_stream(void *dst, const void *src, size_t n)
{
#if defined(__SSE2__)
    char *d = dst;
    const char *s = src;
    if (n >= 4096 && d != s) {
        size_t lead = (size_t)(-(uintptr_t)d & 63);
        memcpy(d, s, lead);
        d += lead, s += lead, n -= lead;
        for (; n >= 64; n -= 64, d += 64, s += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i f = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), e);
            _mm_stream_si128((__m128i *)(d + 48), f);
        }
        _mm_sfence();
        dst = d, src = s;
    }
#endif
    copy(dst, src, n);
}

/* ---- near and far peers ---------------------------------------------------------
 *
 * A rank that reads data another core has just written gets it from that core's cache.
 * When the two cores share a cache (or sit close) that is the fastest place to read it
 * from; when they do not (other die, other socket, or virtual CPUs the host has put
 * there), each line is a slow cross-die transfer that the prefetchers do not hide, and
 * reading from memory is several times faster. Which state a pair of cores is in can
 * change while the ranks run, so plain stores cannot be chosen once for all, nor can
 * streaming (non-temporal) ones: each costs several times the other in the wrong state.
 *
 * So with SHM_STREAM_AUTO the ranks measure it: every PROBE_EVERY-th large step, each
 * rank bounces a cache line with one peer (pairs rotate, so every peer gets measured),
 * and a rank whose measured peers are mostly far streams its segment writes. The
 * verdict is local: the protocol is the same either way, only the stores differ.
 * With more ranks than cores a probe gives a verdict only when both ranks hold a core
 * at once, so most give none and a rank can go through a far spell on its old verdict
 * (4 ranks on 2 cores while far, 4 MiB all_reduce: 3.5 ms measured, 1.4 ms streaming).
 * There the cores are the same whichever pair measured them: every successful probe
 * writes its verdict to the segment's header, and every rank follows the latest one
 * from its next step (shared_verdict).
 * Two-shot all_reduce/reduce, the two-copy broadcast, scatter, reduce_scatter and
 * all_to_all use it, and so do the one-shot all_reduce/reduce and the two-copy
 * all_gather/gather, at every size (streamed, they took 0.2-0.6x plain's time while far,
 * about the same while close: docs/design-shm.md, "Near and far peers").
 * Where the outputs fill the last-level cache the copy-in streams in either state
 * (outputs_past_llc). Small steps probe too, once they add up to PROBE_SMALL_EVERY
 * bytes. Constants: PROBE_* in shm_sync.h. */

SHM_HIDDEN int mostly_far(const shm_comm *c)
{
    if (c->shared_verdict)
        return atomic_load_explicit(&((const seg_hdr_t *)c->base)->verdict,
                                    memory_order_relaxed) == PEER_FAR;
    int near = 0, far = 0;
    for (int k = 0; k < c->n; k++) {
        near += c->dist[k] == PEER_NEAR;
        far += c->dist[k] == PEER_FAR;
    }
    return far > near;
}

static int probe_wait(_Atomic uint32_t *v, uint32_t target, int64_t until)
{
    for (int i = 1;; i++) {
        if (ge(atomic_load_explicit(v, memory_order_acquire), target))
            return 1;
        cpu_relax();
        if ((i & 1023) == 0) {
            int64_t t = now_ns();
            if (t > until)
                return 0;
            if (i > 8192)
                sched_yield(); /* the partner may be waiting for this core */
        }
    }
}

/* Probe number r pairs rank me with (r - me) mod n (a rank paired with itself sits out),
 * so n probes in a row measure every pair once. The lower rank pings, the higher pongs;
 * both time PROBE_ROUNDS round trips after the first (which absorbs their skew). */
SHM_HIDDEN void probe_peer(shm_comm *c)
{
    int n = c->n, me = c->me;
    uint32_t r = c->probes++;
    int q = (int)(((int64_t)(r % (uint32_t)n) - me + n) % n);
    if (q == me)
        return;
    _Atomic uint32_t *mine = &c->ctl[me].pp.v, *theirs = &c->ctl[q].pp.v;
    uint32_t base = r * (PROBE_ROUNDS + 2);
    int64_t until = now_ns() + PROBE_WAIT_NS, t0 = 0;
    for (uint32_t i = 0; i <= PROBE_ROUNDS; i++) {
        uint32_t v = base + i + 1;
        if (me < q) {
            atomic_store_explicit(mine, v, memory_order_release);
            if (!probe_wait(theirs, v, until))
                return;
        } else {
            if (!probe_wait(theirs, v, until))
                return;
            atomic_store_explicit(mine, v, memory_order_release);
        }
        if (i == 0)
            t0 = now_ns();
    }
    int64_t rt = (now_ns() - t0) / PROBE_ROUNDS;
    if (rt < PROBE_MAX_NS) {
        c->dist[q] = rt < c->far_ns ? PEER_NEAR : PEER_FAR;
        if (c->shared_verdict)
            atomic_store_explicit(&((seg_hdr_t *)c->base)->verdict, c->dist[q],
                                  memory_order_relaxed);
    }
    c->far = mostly_far(c);
}

/* process_vm_readv/writev pins the peer's pages one by one: from a buffer backed by
 * 2 MiB pages it copies about twice as fast as from 4 KiB pages (the pinned side is what
 * counts; figures: docs/design-shm.md, "Single copy (CMA)"). numpy
 * backs arrays of 4 MiB and more with huge pages, torch's allocator does not. So a rank
 * whose buffer its peers will copy asks the kernel to collapse the buffer's 2 MiB-aligned
 * interior into huge pages (MADV_COLLAPSE, Linux 6.1; the contents stay): only the
 * second time it sees the same range, because a collapse that moves pages costs ~0.45 ms
 * per 2 MiB, and never again once such collapses have taken THP_BUDGET_NS in all.
 * COLLECTIVES_SHM_THP=0 turns it off. */
SHM_HIDDEN void thp_prepare(shm_comm *c, const void *p, size_t len)
{
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (!c->thp)
        return;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t e = ((uintptr_t)p + len) & ~(huge - 1);
    if (e <= a)
        return;
    for (int i = 0; i < THP_SLOTS; i++) {
        if (c->thp_seen[i].a != a || c->thp_seen[i].e != e)
            continue;
        if (c->thp_seen[i].done)
            return;
        c->thp_seen[i].done = 1;
        /* a failure (no MADV_COLLAPSE in this kernel, huge pages off, a buffer marked
         * MADV_NOHUGEPAGE or pinned) costs a system call and is left at that */
        int64_t t0 = now_ns();
        (void)madvise((void *)a, e - a, MADV_COLLAPSE);
        int64_t took = now_ns() - t0;
        if (took > THP_WORK_NS && (c->thp_ns += took) > THP_BUDGET_NS)
            c->thp = 0;
        return;
    }
    c->thp_seen[c->thp_next].a = a;
    c->thp_seen[c->thp_next].e = e;
    c->thp_seen[c->thp_next].done = 0;
    c->thp_next = (c->thp_next + 1) % THP_SLOTS;
}

/* Copy nbytes between `local` here and `remote` in rank q's address space, in one kernel
 * copy (process_vm_readv, or process_vm_writev when `write`). */
static int cma_copy(shm_comm *c, int q, void *local, uint64_t remote, size_t nbytes, int write)
{
    pid_t pid = (pid_t)atomic_load(&c->ctl[q].info.pid);
    while (nbytes) {
        struct iovec l = {local, nbytes}, r = {(void *)(uintptr_t)remote, nbytes};
        ssize_t k = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                          : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (k <= 0) {
            if (k < 0 && errno == EINTR)
                continue;
            c->err_peer = q;
            return k < 0 && errno == ESRCH ? SHM_EPEERDEAD : SHM_ESYS;
        }
        local = (char *)local + k;
        remote += (uint64_t)k;
        nbytes -= (size_t)k;
    }
    return SHM_OK;
}

SHM_HIDDEN int cma_read(shm_comm *c, int q, void *dst, uint64_t remote, size_t nbytes)
{
    return cma_copy(c, q, dst, remote, nbytes, 0);
}

SHM_HIDDEN int cma_write(shm_comm *c, int q, uint64_t remote, const void *src, size_t nbytes)
{
    return cma_copy(c, q, (void *)src, remote, nbytes, 1);
}

/* Whether every rank of the group can read every other's memory with
 * process_vm_readv (same user, no ptrace restrictions) and has a core of its own (c->cma,
 * returned by shm_cma_enabled: the all_reduce's single copy), whether every rank can read
 * every other's (c->cma_readable: the gathers') and whether also the ranks are at most two
 * a core (c->cma_bcast: the broadcast's); all ranks get the same answers. */
int shm_cma_probe(shm_comm *c)
{
    static const uint64_t probe = 0x636d612070726f62ULL; /* "cma prob" */
    CHECK(c);
    c->cma = c->cma_readable = c->cma_bcast = 0;
    if (c->n == 1)
        return SHM_OK;
    int n = c->n, me = c->me;
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)&probe, memory_order_relaxed);
    uint32_t s = ++c->seq;
    post(c, s);
    TRY(c, wait_posts(c, s));
    int q = (me + 1) % n;
    uint64_t got = 0;
    uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
    int readable = cma_read(c, q, &got, addr, sizeof got) == SHM_OK && got == probe;
    /* with more ranks than cores the all_reduce's single copy was measured as fast as or
     * slower than two-shot (its measured choice would mostly drop it), and the all_gather's
     * as fast or slower on some hosts (there it is timed: gather_impl); the gather's and
     * scatter's single copy runs regardless (gather_cma), the broadcast's up to two ranks a
     * core (broadcast_cma) */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int cores = (long)n <= ncpu || c->cma_any_cores;
    /* (where more than two ranks run at once the broadcast's single copy is off by its
     * size's default instead: backends/shm.py, default_cma_bcast_min) */
    int bcast_ok = (long)n <= 2 * ncpu || c->cma_any_cores;
    c->err_peer = -1;
    atomic_store_explicit(&c->ctl[me].xfer.ok,
                          readable ? 1 | cores << 1 | bcast_ok << 2 : 0, memory_order_relaxed);
    s = ++c->seq;
    post(c, s);
    TRY(c, wait_posts(c, s));
    int all = 7;
    for (int r = 0; r < n; r++)
        all &= atomic_load_explicit(&c->ctl[r].xfer.ok, memory_order_relaxed);
    c->cma_readable = (all & 1) != 0;
    c->cma = (all & 2) != 0;
    c->cma_bcast = (all & 4) != 0;
    return SHM_OK;
}

int shm_cma_enabled(const shm_comm *c) { return c->cma; }

int shm_cma_readable(const shm_comm *c) { return c->cma_readable; }

void shm_comm_set_stream(shm_comm *c, int mode)
{
    c->stream_mode = mode;
    c->far = mode == SHM_STREAM_ON || (mode == SHM_STREAM_AUTO && mostly_far(c));
}

int shm_comm_far(const shm_comm *c) { return c->far; }

int shm_comm_peer_distance(const shm_comm *c, int q)
{
    return q >= 0 && q < c->n ? c->dist[q] : 0;
}

void shm_comm_set_cma_min(shm_comm *c, size_t gather_min, size_t bcast_min, size_t ar_min)
{
    c->cma_min = gather_min;
    c->cma_bcast_min = bcast_min;
    c->cma_ar_min = ar_min;
}
