/* Same-host collectives over one shared-memory segment; see shm_coll.h. */
#define _GNU_SOURCE
#include "shm_coll.h"
#include "reduce_kernels.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define CL 64
#define PAGE 4096
#define SHM_MAGIC 0x636f6c6c73686d33ULL /* "collshm3": fingerprints */
#define MAX_STACK_SRCS 64
/* latency probes (see "near and far peers") */
#define PROBE_EVERY 16
#define PROBE_MIN_BYTES (256 * 1024) /* steps this large count as ticks */
#define PROBE_SMALL_MIN 4096         /* smaller steps of at least this many bytes... */
#define PROBE_SMALL_EVERY (4 << 20)  /* ...probe once they add up to this many */
#define PROBE_ROUNDS 8
#define PROBE_FAR_NS 250             /* round trip: ~90 ns close, ~460 ns far here
                                        (COLLECTIVES_SHM_FAR_NS overrides) */
#define PROBE_MAX_NS 2000            /* slower: someone was descheduled, no verdict */
#define PROBE_WAIT_NS 50000          /* give up on a partner that does not come */
#define PEER_NEAR 1
#define PEER_FAR 2

/* A call's fingerprint (collectives/fingerprint.py's pack word) for collective number k:
 * each rank's post counter carries two, indexed by k & 1, in its own cache line, so a
 * peer that sees the post sees the fingerprint without another line's transfer. */
typedef struct {
    _Atomic uint64_t k;
    _Atomic uint64_t word;
} fp_slot_t;

typedef struct {
    _Atomic uint32_t v;
    _Atomic uint32_t waiters;
    fp_slot_t fp[2];  /* used in post only */
    char pad[CL - 8 - 2 * sizeof(fp_slot_t)];
} ctr_t;
_Static_assert(sizeof(ctr_t) == CL, "a counter and its fingerprint slots fill one cache line");

typedef struct {
    ctr_t post;   /* last step whose data this rank published */
    ctr_t ack;    /* last step whose data this rank finished reading */
    ctr_t bell;   /* bumped whenever a p2p ring to or from this rank moves */
    struct {
        _Atomic int32_t pid;
        char pad[CL - 4];
    } info;
    struct {
        _Atomic uint32_t v;     /* latency probe: pings and pongs (see probe_peer) */
        char pad[CL - 4];
    } pp;
    struct {
        _Atomic uint64_t addr;  /* this rank's buffer for the step it last posted (CMA) */
        _Atomic uint64_t src;   /* a single-copy all_gather's input, for ranks that pull */
        _Atomic int32_t ok;     /* the CMA probe's verdict from this rank */
        char pad[CL - 20];
    } xfer;
} rank_ctl_t;

typedef struct {
    _Atomic uint64_t head; /* bytes written by the sender */
    char pad1[CL - 8];
    _Atomic uint64_t tail; /* bytes consumed by the receiver */
    char pad2[CL - 8];
} ring_ctl_t;

typedef struct {
    uint64_t magic;
    uint64_t size;
    uint64_t half_bytes;
    uint64_t ring_bytes;
    uint64_t total;
    char pad[CL - 40];
    _Atomic uint32_t verdict; /* the latest probe's PEER_NEAR or PEER_FAR, any pair (shared) */
    char pad2[CL - 4];
    /* the group's first failure, for every rank to report alike (first writer wins):
     * its own cache line, written once, so reading it in CHECK costs no transfer */
    _Atomic uint32_t fail_state; /* SHM_FAIL_*; FAIL_WRITING while the writer fills it in */
    uint32_t fail_k;             /* collective number */
    int32_t fail_a, fail_b;      /* the rank that saw it, and the peer it compared with */
    uint64_t fail_wa, fail_wb;   /* their fingerprints (a's, b's) */
    char fail_text[SHM_FAIL_TEXT];
} seg_hdr_t;
#define FAIL_WRITING 1u

/* Buffers that peers copy by CMA: how many ranges are remembered, and after how much
 * time spent in collapses that had to move pages (longer than THP_WORK_NS; a program
 * that hands in fresh buffers at addresses seen before) collapsing stops. */
#define THP_SLOTS 32
#define THP_WORK_NS 100000LL
#define THP_BUDGET_NS 1000000000LL
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

struct shm_comm {
    char *base;
    size_t total;
    int n, me;
    size_t half;          /* bytes per half slot */
    size_t ring;          /* bytes per p2p ring (power of two) */
    size_t oneshot_max;   /* all_reduce bytes up to which one-shot is used */
    size_t chunk;         /* two-shot chunk bytes (<= half) */
    rank_ctl_t *ctl;
    char *slots;
    ring_ctl_t *rctl;
    char *rdata;
    uint32_t seq;         /* last step number used */
    uint32_t blk;         /* blocks written so far (selects the half) */
    uint32_t free_after[2];
    int64_t timeout_ns;
    int spin;             /* polls before yielding */
    int64_t yield_ns;     /* then yield this long before sleeping */
    int err_peer;
    int cma;              /* every rank can read every other's memory (process_vm_readv) */
    size_t cma_min;       /* all_gather/gather blocks of at least this many bytes use it */
    size_t cma_bcast_min; /* broadcasts of at least this many bytes use it */
    size_t cma_ar_min;    /* all_reduces of at least this many bytes (above one-shot) use it */
    size_t llc;           /* bytes of last-level cache */
    int lock_fd;          /* the creator's descriptor of the segment, locked (else -1) */
    char *cma_tmp;        /* (n - 1) * CMA_AR_CHUNK bytes for peers' chunks, made on first use */
    int stream_mode;      /* SHM_STREAM_OFF / _ON / _AUTO */
    int far;              /* segment writes for other ranks stream past the caches */
    uint32_t ticks;       /* large steps that may probe (the same count on every rank) */
    size_t small_bytes;   /* bytes of small steps since the last small-step probe (ditto) */
    uint32_t probes;      /* probes run (the same count on every rank) */
    unsigned char *dist;  /* per peer: 0 not measured, PEER_NEAR or PEER_FAR */
    int shared_verdict;   /* more ranks than cores: the group's latest probe decides */
    int64_t far_ns;       /* a probe's round trip from which a peer counts as far */
    int thp;              /* collapse buffers that peers copy by CMA into huge pages */
    int64_t thp_ns;       /* time spent so far in collapses that had to move pages */
    int thp_next;         /* the table slot to reuse next */
    struct { uintptr_t a, e; int done; } thp_seen[THP_SLOTS];
    uint32_t coll;        /* fingerprinted collectives started so far (their number k) */
    uint64_t fp;          /* this rank's fingerprint of collective coll */
    _Atomic int broken;
    _Atomic int aborted;
};

static inline seg_hdr_t *seg_hdr(const shm_comm *c) { return (seg_hdr_t *)c->base; }

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int ge(uint32_t v, uint32_t t) { return (int32_t)(v - t) >= 0; }

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static inline void ctr_set(ctr_t *c, uint32_t v)
{
    atomic_store_explicit(&c->v, v, memory_order_seq_cst);
    if (atomic_load_explicit(&c->waiters, memory_order_seq_cst))
        futex_wake(&c->v);
}

static inline void ctr_bump(ctr_t *c)
{
    atomic_fetch_add_explicit(&c->v, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&c->waiters, memory_order_seq_cst))
        futex_wake(&c->v);
}

/* 1 if pid is a live process (not a zombie). */
static int pid_alive(int pid)
{
    if (pid <= 0)
        return 1; /* not mapped yet: only the timeout can tell */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : 1;
    ssize_t k = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (k <= 0)
        return 1;
    buf[k] = 0;
    char *p = strrchr(buf, ')');
    if (p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0;
    return 1;
}

/* Wait until ctr->v >= target (wrapping compare). peer < 0: nobody to watch.
 * deadline_ns < 0 means now + the group timeout. */
static int wait_ctr(shm_comm *c, ctr_t *ctr, uint32_t target, int peer, int64_t deadline_ns)
{
    if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
        return SHM_OK;
    for (int i = 0; i < c->spin; i++) {
        cpu_relax();
        if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
            return SHM_OK;
    }
    int64_t t = now_ns();
    if (deadline_ns < 0)
        deadline_ns = t + c->timeout_ns;
    int64_t next_check = t + 20000000LL;
    int64_t yield_until = t + c->yield_ns;
    for (;;) {
        if (atomic_load_explicit(&c->aborted, memory_order_relaxed))
            return SHM_ECLOSED;
        if (atomic_load_explicit(&seg_hdr(c)->fail_state, memory_order_relaxed))
            return SHM_EFAILED;  /* another rank recorded the group's failure */
        if (t < yield_until) {
            sched_yield();
        } else {
            atomic_fetch_add_explicit(&ctr->waiters, 1, memory_order_seq_cst);
            uint32_t v = atomic_load_explicit(&ctr->v, memory_order_seq_cst);
            if (!ge(v, target))
                futex_wait(&ctr->v, v, 10000000LL);
            atomic_fetch_sub_explicit(&ctr->waiters, 1, memory_order_seq_cst);
        }
        if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
            return SHM_OK;
        t = now_ns();
        if (t >= next_check) {
            next_check = t + 50000000LL;
            if (peer >= 0 && !pid_alive(atomic_load(&c->ctl[peer].info.pid))) {
                c->err_peer = peer;
                return SHM_EPEERDEAD;
            }
        }
        if (t >= deadline_ns) {
            c->err_peer = peer;
            return SHM_ETIMEDOUT;
        }
    }
}

/* ---- segment ------------------------------------------------------------- */

static void layout(int n, size_t half, size_t ring, size_t *ctl_off, size_t *slot_off,
                   size_t *rctl_off, size_t *rdata_off, size_t *total)
{
    *ctl_off = PAGE;
    *slot_off = round_up(*ctl_off + (size_t)n * sizeof(rank_ctl_t), PAGE);
    *rctl_off = *slot_off + (size_t)n * 2 * half;
    *rdata_off = round_up(*rctl_off + (size_t)n * n * sizeof(ring_ctl_t), PAGE);
    *total = *rdata_off + (size_t)n * n * ring;
}

/* Size of the largest cache of cpu0, from sysfs (glibc's sysconf reports 320 MiB of L3
 * on a VM whose sysfs and lscpu say 32 MiB); 8 MiB when unknown. */
static size_t llc_bytes(void)
{
    size_t best = 0;
    int best_level = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        int level = 0;
        unsigned long long v = 0;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        if (fscanf(f, "%d", &level) != 1)
            level = 0;
        fclose(f);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        if (!(f = fopen(path, "r")))
            continue;
        int got = fgets(buf, sizeof buf, f) != NULL && sscanf(buf, "%llu%c", &v, &unit) >= 1;
        fclose(f);
        if (!got)
            continue;
        v <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
        if (level > best_level || (level == best_level && v > best)) {
            best_level = level;
            best = (size_t)v;
        }
    }
    return best ? best : (size_t)8 << 20;
}

int shm_comm_open(shm_comm **out, const char *name, int create, int rank, int size,
                  size_t half_bytes, size_t ring_bytes, double timeout_s, int *sys_errno)
{
    *out = NULL;
    *sys_errno = 0;
    if (size < 1 || rank < 0 || rank >= size || half_bytes < PAGE ||
        half_bytes < CL + (size_t)size * 128)
        return SHM_EINVAL;
    if (ring_bytes & (ring_bytes - 1) || ring_bytes < 4096)
        return SHM_EINVAL;
    half_bytes = round_up(half_bytes, PAGE);
    size_t ctl_off, slot_off, rctl_off, rdata_off, total;
    layout(size, half_bytes, ring_bytes, &ctl_off, &slot_off, &rctl_off, &rdata_off, &total);
    int fd = shm_open(name, create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
    if (fd < 0) {
        *sys_errno = errno;
        return SHM_ESYS;
    }
    /* The creator holds a shared lock on the segment while its process lives (the lock
     * goes with the process, however it ends): a segment whose name is still linked but
     * that nobody locks was left by a creator killed before it could unlink the name, and
     * a later creator sweeps it away (backends/shm.py). */
    if (create && (flock(fd, LOCK_SH | LOCK_NB) != 0 || ftruncate(fd, (off_t)total) != 0)) {
        *sys_errno = errno;
        close(fd);
        shm_unlink(name);
        return SHM_ESYS;
    }
    if (!create) {
        struct stat st;
        if (fstat(fd, &st) != 0 || (size_t)st.st_size != total) {
            close(fd);
            return SHM_EINVAL;
        }
    }
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    *sys_errno = errno;
    if (p == MAP_FAILED || !create)
        close(fd);
    if (p == MAP_FAILED) {
        if (create)
            shm_unlink(name);
        return SHM_ESYS;
    }
    seg_hdr_t *h = (seg_hdr_t *)p;
    if (create) {
        h->size = (uint64_t)size;
        h->half_bytes = half_bytes;
        h->ring_bytes = ring_bytes;
        h->total = total;
        atomic_thread_fence(memory_order_release);
        h->magic = SHM_MAGIC;
    } else if (h->magic != SHM_MAGIC || h->size != (uint64_t)size || h->half_bytes != half_bytes ||
               h->ring_bytes != ring_bytes || h->total != total) {
        munmap(p, total);
        return SHM_EINVAL;
    }
    shm_comm *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(p, total);
        if (create)
            close(fd);
        return SHM_ESYS;
    }
    c->lock_fd = create ? fd : -1;
    c->base = p;
    c->total = total;
    c->n = size;
    c->me = rank;
    c->half = half_bytes;
    c->ring = ring_bytes;
    c->chunk = half_bytes;
    c->oneshot_max = half_bytes;
    c->ctl = (rank_ctl_t *)(c->base + ctl_off);
    c->slots = c->base + slot_off;
    c->rctl = (ring_ctl_t *)(c->base + rctl_off);
    c->rdata = c->base + rdata_off;
    c->err_peer = -1;
    if (!(c->dist = calloc((size_t)size, 1))) {
        munmap(p, total);
        if (create)
            close(fd);
        free(c);
        return SHM_ESYS;
    }
    c->llc = llc_bytes();
    const char *llc_env = getenv("COLLECTIVES_SHM_LLC_BYTES");
    if (llc_env && *llc_env)
        c->llc = (size_t)strtoull(llc_env, NULL, 10);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu < 1)
        ncpu = 1;
    /* spin ~2 us, then yield: even when every rank has a core, the scheduler now and
     * then puts two ranks on one core for a while, and a longer spin then burns the
     * time slice the awaited rank needs (measured: 64 KiB broadcast, two ranks pinned
     * to one core, 57.6 us per call with a 50 us spin, 8.0 us with 2 us; unchanged
     * 8.1 us on two cores). pause costs 10-150 ns depending on CPU and load.
     * With more ranks than cores no spin at all: some rank always waits for a core, and
     * every poll keeps it off (measured, 2 cores, per call, no spin vs 2 us: 4 ranks
     * broadcast 4 B 3.6 vs 5.7 us, barrier 4.7 vs 5.8, all_gather 4 B 4.9 vs 7.0;
     * 3 ranks all_reduce 16 KiB 9.2 vs 27.1, all_gather 256 KiB 80 vs 297; 8 ranks
     * barrier 13.4 vs 19.6). */
    int64_t t0 = now_ns();
    for (int i = 0; i < 1000; i++)
        cpu_relax();
    int64_t per = (now_ns() - t0) / 1000;
    if (per < 1)
        per = 1;
    c->spin = size <= ncpu ? (int)(2000 / per) : 0;
    c->shared_verdict = size > ncpu;
    /* then yield (a busy machine deschedules the peer for a while; sleeping right
     * away would cost a scheduler wake-up per step), then sleep on the futex */
    c->yield_ns = size <= ncpu ? 200000 : 20000;
    const char *e = getenv("COLLECTIVES_SHM_SPIN");
    if (e && *e)
        c->spin = atoi(e);
    e = getenv("COLLECTIVES_SHM_YIELD_US");
    if (e && *e)
        c->yield_ns = (int64_t)atoi(e) * 1000;
    c->far_ns = PROBE_FAR_NS;
    e = getenv("COLLECTIVES_SHM_FAR_NS");
    if (e && *e && atoll(e) > 0)  /* anything else (0, negative, not a number): the default */
        c->far_ns = atoll(e);
    e = getenv("COLLECTIVES_SHM_THP");
    c->thp = !(e && *e == '0');
    shm_comm_set_timeout(c, timeout_s);
    atomic_store(&c->ctl[rank].info.pid, (int32_t)getpid());
    *out = c;
    return SHM_OK;
}

void shm_comm_close(shm_comm *c)
{
    if (!c)
        return;
    munmap(c->base, c->total);
    if (c->lock_fd >= 0)
        close(c->lock_fd);
    free(c->cma_tmp);
    free(c->dist);
    free(c);
}

int shm_comm_unlink(const char *name) { return shm_unlink(name) == 0 ? SHM_OK : SHM_ESYS; }

void shm_comm_set_timeout(shm_comm *c, double timeout_s)
{
    if (timeout_s <= 0 || timeout_s > 1e8)
        timeout_s = 1e8;
    c->timeout_ns = (int64_t)(timeout_s * 1e9);
}

void shm_comm_set_thresholds(shm_comm *c, size_t oneshot_max, size_t chunk_bytes)
{
    c->oneshot_max = oneshot_max < c->half ? oneshot_max : c->half;
    if (chunk_bytes < 4096)
        chunk_bytes = 4096;
    c->chunk = chunk_bytes < c->half ? chunk_bytes : c->half;
}

int shm_comm_error_peer(const shm_comm *c) { return c->err_peer; }
uint32_t shm_comm_seq(const shm_comm *c) { return c->seq; }
size_t shm_comm_half_bytes(const shm_comm *c) { return c->half; }

void shm_comm_abort(shm_comm *c)
{
    atomic_store(&c->aborted, 1);
    ctr_bump(&c->ctl[c->me].bell);
}

uint32_t shm_comm_coll(const shm_comm *c) { return c->coll; }

int shm_comm_fail_record(const shm_comm *c, uint32_t *k, int *a, int *b, uint64_t *wa,
                         uint64_t *wb, const char **text)
{
    const seg_hdr_t *h = seg_hdr(c);
    uint32_t st = atomic_load_explicit(&h->fail_state, memory_order_acquire);
    if (st == FAIL_WRITING)
        return SHM_FAIL_NONE;
    *k = h->fail_k;
    *a = h->fail_a;
    *b = h->fail_b;
    *wa = h->fail_wa;
    *wb = h->fail_wb;
    *text = h->fail_text;
    return (int)st;
}

static int record_fail(shm_comm *c, uint32_t state, uint32_t k, int a, int b, uint64_t wa,
                       uint64_t wb, const char *text);

int shm_comm_poison(shm_comm *c, const char *text)
{
    return record_fail(c, SHM_FAIL_TEXT_SET, c->coll, c->me, -1, 0, 0, text);
}

/* ---- steps ----------------------------------------------------------------- */

#define HALF(c, q, h) ((c)->slots + ((size_t)(q) * 2 + (h)) * (c)->half)

static inline int fail(shm_comm *c, int rc)
{
    if (rc != SHM_OK)
        atomic_store(&c->broken, 1);
    return rc;
}

#define CHECK(c)                                                               \
    do {                                                                       \
        if (atomic_load_explicit(&(c)->broken, memory_order_relaxed) ||           \
            atomic_load_explicit(&seg_hdr(c)->fail_state, memory_order_relaxed))      \
            return fail((c), SHM_EBROKEN);                                     \
    } while (0)

#define TRY(c, expr)                      \
    do {                                  \
        int rc_ = (expr);                 \
        if (rc_ != SHM_OK)                \
            return fail((c), rc_);        \
    } while (0)

/* Next block's half of my slot, once every rank has read what it last held. */
static int half_acquire(shm_comm *c, int *h)
{
    *h = (int)(c->blk++ & 1);
    uint32_t need = c->free_after[*h];
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_ctr(c, &c->ctl[q].ack, need, q, -1);
            if (rc)
                return rc;
        }
    return SHM_OK;
}

static int wait_post(shm_comm *c, int q, uint32_t s) { return wait_ctr(c, &c->ctl[q].post, s, q, -1); }

static int wait_posts(shm_comm *c, uint32_t s)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_post(c, q, s);
            if (rc)
                return rc;
        }
    return SHM_OK;
}

static inline void post(shm_comm *c, uint32_t s) { ctr_set(&c->ctl[c->me].post, s); }

/* ---- fingerprints ------------------------------------------------------------------
 *
 * At entry to collective k a rank writes {k, word} into its post line's slot k & 1 and
 * then posts the collective's first step s; every rank posts that step (ranks that read
 * only, an arrival with no data) and, before it touches the user's buffer with a peer's
 * data, compares that peer's slot with its own; before it returns it has compared every
 * peer's. So no rank finishes collective k before every rank has arrived at k: no rank
 * is more than one collective ahead of another, and two slots suffice. A difference is
 * recorded in the segment header (first writer wins) and every rank's waits fail at
 * once; each raises the recorded description. */

static void wake_all(shm_comm *c)
{
    for (int q = 0; q < c->n; q++) {
        ctr_t *cs[3] = {&c->ctl[q].post, &c->ctl[q].ack, &c->ctl[q].bell};
        for (int i = 0; i < 3; i++)
            if (atomic_load_explicit(&cs[i]->waiters, memory_order_seq_cst))
                futex_wake(&cs[i]->v);
    }
}

/* Record the group's failure (first writer wins), break it and wake every waiter. */
static int record_fail(shm_comm *c, uint32_t state, uint32_t k, int a, int b, uint64_t wa,
                       uint64_t wb, const char *text)
{
    seg_hdr_t *h = seg_hdr(c);
    uint32_t none = 0;
    int first = atomic_compare_exchange_strong(&h->fail_state, &none, FAIL_WRITING);
    if (first) {
        h->fail_k = k;
        h->fail_a = a;
        h->fail_b = b;
        h->fail_wa = wa;
        h->fail_wb = wb;
        h->fail_text[0] = 0;
        if (text) {
            strncpy(h->fail_text, text, SHM_FAIL_TEXT - 1);
            h->fail_text[SHM_FAIL_TEXT - 1] = 0;
        }
        atomic_store_explicit(&h->fail_state, state, memory_order_release);
    }
    atomic_store(&c->broken, 1);
    wake_all(c);
    return first;
}

static inline void fp_publish(shm_comm *c, uint64_t word)
{
    uint32_t k = ++c->coll;
    fp_slot_t *sl = &c->ctl[c->me].post.fp[k & 1];
    atomic_store_explicit(&sl->k, k, memory_order_relaxed);
    atomic_store_explicit(&sl->word, word, memory_order_relaxed);  /* the post releases both */
    c->fp = word;
}

/* Compare peer q's fingerprint with mine, once q has posted this collective's first step
 * (the wait's acquire load made q's slot visible). */
static inline int fp_check(shm_comm *c, int q)
{
    fp_slot_t *sl = &c->ctl[q].post.fp[c->coll & 1];
    uint64_t k = atomic_load_explicit(&sl->k, memory_order_relaxed);
    uint64_t w = atomic_load_explicit(&sl->word, memory_order_relaxed);
    if (k == c->coll && w == c->fp)
        return SHM_OK;
    record_fail(c, SHM_FAIL_MISMATCH, c->coll, c->me, q, c->fp, w, NULL);
    c->err_peer = q;
    return SHM_EFAILED;
}

/* Wait for every peer's post of step s (this collective's first) and compare. */
static int fp_check_all(shm_comm *c, uint32_t s)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me) {
            int rc = wait_post(c, q, s);
            if (!rc)
                rc = fp_check(c, q);
            if (rc)
                return rc;
        }
    return SHM_OK;
}

/* A collective with no data on this rank (zero bytes): one step to compare fingerprints. */
static int fp_sync(shm_comm *c, uint64_t word)
{
    fp_publish(c, word);
    uint32_t s = ++c->seq;
    post(c, s);
    return fail(c, fp_check_all(c, s));
}
static inline void ack(shm_comm *c, uint32_t s) { ctr_set(&c->ctl[c->me].ack, s); }

static inline void copy(void *dst, const void *src, size_t n)
{
    if (dst != src && n)
        memmove(dst, src, n);
}

/* Copy that streams its stores past the caches (x86 SSE2), for large copies whose
 * destination is not read again soon: it leaves the shared cache to the source blocks
 * that other ranks are about to read, and skips reading the destination lines first. */
static void copy_stream(void *dst, const void *src, size_t n)
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

/* Whether the outputs of all ranks, `total` bytes together, fill the last-level cache:
 * the all_gather copies into them then stream (measured with 2 cores sharing 32 MiB:
 * single copy, 2 ranks, streaming 305 -> 373 us at 4 MiB per rank, 1207 -> 1118 at 8 MiB,
 * 2298 -> 2082 at 16 MiB; two-copy, 4 ranks: 614 -> 739 us at 1 MiB, 3824 -> 3360 at
 * 4 MiB, 13654 -> 12915 at 16 MiB; a two-copy broadcast was slower streamed). Since
 * the single copy writes into the readers' outputs (2 ranks, samples alternating in one
 * run, streamed/plain): 8 MiB, whose outputs are exactly the cache's size, 0.92-0.99;
 * 16 MiB 0.78-0.82; 4 MiB 1.04-1.13; 2 MiB 1.33-1.5. 4 ranks at 2 MiB: unchanged.
 * Past it, the two-copy all_gather/gather streams its copy into the segment too, whatever
 * the probes say: the blocks would not stay in the cache for the readers anyway. 4 ranks
 * on 2 cores, streamed/plain copy-in (samples alternating in one run): 2 MiB 0.99x,
 * 4 MiB 0.99x, 16 MiB 0.99x while the cores are close; 0.48-0.56x while far, where the
 * probes of 4 ranks on 2 cores often get no verdict (a partner is descheduled) and a
 * 16 MiB all_gather took 22.4 ms plain against 10.8 ms streamed (MPICH: 13.6-22 ms
 * in this session's runs). */
static inline int outputs_past_llc(const shm_comm *c, size_t total)
{
    return total >= c->llc;
}

static inline void copy_out(void *dst, const void *src, size_t n, int stream)
{
    if (dst == src)  /* an all_gather whose input is this rank's block of the output */
        return;
    if (stream)
        copy_stream(dst, src, n);
    else
        copy(dst, src, n);
}

/* ---- near and far peers ---------------------------------------------------------
 *
 * A rank that reads data another core has just written gets it from that core's cache.
 * When the two cores share a cache (or sit close) that is the fastest place to read it
 * from; when they do not (other die, other socket, or a VM whose vCPUs the host has put
 * there), each line is a slow cross-die transfer that the prefetchers do not hide, and
 * reading from memory is several times faster. Measured on this project's VM, whose
 * two vCPUs switch between the two states every few seconds to minutes (cache-line
 * round trip ~90 ns, then ~460 ns): two-shot all_reduce of 1 MiB on 2 ranks took 66 us
 * with plain stores and 152 us streaming while close, 499 us plain and 116 us streaming
 * while far (16 MiB: 1.40 vs 3.00 ms close, 8.18 vs 2.16 ms far; a 1 MiB two-copy
 * broadcast 23 vs 37 us close, 426 vs 38 us far).
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
 * all_to_all use it (2 ranks while far, bench/bench_stream.py, measured/plain: 1 MiB
 * reduce_scatter 0.21x, all_to_all 0.31x, scatter 0.46x; 16 MiB reduce_scatter 0.27x,
 * all_to_all 0.61x; while close 0.99-1.03x), and so do the one-shot all_reduce/reduce
 * and the two-copy all_gather/gather (while far: all_reduce 8 KiB 0.47x, 16 KiB 0.41x,
 * 64 KiB 0.33x, 37.3 -> 12.2 us; all_gather 64 KiB 0.41x, 128 KiB 0.40x; while close
 * 1.00-1.01x; an earlier measurement that had the one-shot slower streamed was taken
 * while close). The two-copy all_gather's blocks from 256 KiB used to stay plain, from
 * a 2-rank measurement on an earlier VM (1 MiB 137 us plain in either state, 171 us
 * streamed); on this AMD EPYC VM (samples alternating, labelled by a cache-line probe
 * run outside the group) measured/plain while far: 4 ranks 256 KiB 0.67x, 1 MiB 0.48x,
 * 2 MiB 0.50x; 2 ranks 256 KiB 0.60x, 1 MiB 0.42x, 16 MiB 0.40x; while close 1.00-1.06x.
 * Where the outputs fill the last-level cache the copy-in streams in either state
 * (outputs_past_llc). Small steps probe too, once they add up to PROBE_SMALL_EVERY
 * bytes. Constants: PROBE_* at the top of this file. */

static int mostly_far(const shm_comm *c)
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
static void probe_peer(shm_comm *c)
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

/* A step of `nbytes` (the same on every rank): every PROBE_EVERY-th large one probes,
 * and small ones once they add up to PROBE_SMALL_EVERY bytes, so a program of small
 * collectives keeps its verdict too (64 KiB all_reduces: one probe per 64 calls). */
static inline void tick(shm_comm *c, size_t nbytes)
{
    if (c->stream_mode != SHM_STREAM_AUTO)
        return;
    if (c->shared_verdict)  /* another pair's probe may have decided since */
        c->far = mostly_far(c);
    if (nbytes >= PROBE_MIN_BYTES) {
        if (c->ticks++ % PROBE_EVERY == 0)
            probe_peer(c);
    } else if (nbytes >= PROBE_SMALL_MIN && (c->small_bytes += nbytes) >= PROBE_SMALL_EVERY) {
        c->small_bytes = 0;
        probe_peer(c);
    }
}

/* Write n bytes into this rank's part of the segment, for other ranks to read. */
static inline void seg_put(const shm_comm *c, void *dst, const void *src, size_t n)
{
    if (c->far)
        copy_stream(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* ---- collectives ------------------------------------------------------------- */

/* process_vm_readv/writev pins the peer's pages one by one: from a buffer backed by
 * 2 MiB pages it copies about twice as fast as from 4 KiB pages (measured here, 4 MiB
 * 12.7 -> 26.6 GB/s, 16 MiB 5.1 -> 16.3 GB/s; the pinned side is what counts). numpy
 * backs arrays of 4 MiB and more with huge pages, torch's allocator does not. So a rank
 * whose buffer its peers will copy asks the kernel to collapse the buffer's 2 MiB-aligned
 * interior into huge pages (MADV_COLLAPSE, Linux 6.1; the contents stay): only the
 * second time it sees the same range, because a collapse that moves pages costs ~0.45 ms
 * per 2 MiB, and never again once such collapses have taken THP_BUDGET_NS in all.
 * Measured through ../shared/tools/bench_vs.py, torch tensors, two ranks: broadcast
 * 16 MiB 1.11-1.51 -> 0.49-0.66 ms, all_gather 16 MiB 3.9-4.5 -> 2.96-3.27 ms, all_gather
 * 4 MiB 571-653 -> 468-527 us. COLLECTIVES_SHM_THP=0 turns it off. */
static void thp_prepare(shm_comm *c, const void *p, size_t len)
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

static int cma_read(shm_comm *c, int q, void *dst, uint64_t remote, size_t nbytes)
{
    return cma_copy(c, q, dst, remote, nbytes, 0);
}

static int cma_write(shm_comm *c, int q, uint64_t remote, const void *src, size_t nbytes)
{
    return cma_copy(c, q, (void *)src, remote, nbytes, 1);
}

int shm_barrier(shm_comm *c, uint64_t fp)
{
    CHECK(c);
    if (c->n == 1)
        return SHM_OK;
    return fp_sync(c, fp);
}

/* Single-copy broadcast: the readers copy straight from the root's buffer. From
 * CMA_SPLIT bytes the root, otherwise idle, writes the last 1/n of each reader's
 * buffer itself while the readers read the rest, so every rank copies the same amount.
 * Every rank posts the address of its buffer; a reader returns once the root has acked
 * (its writes are done), the root once every reader has acked (its reads are done).
 * Measured on this VM (two ranks, 64 KiB .. 4 MiB, before the split): 0.9x, 0.63x,
 * 1.5x, 1.3x the pipelined two-copy path's time while the two vCPUs share caches well,
 * and 0.27x, 0.15x, 0.15x, 0.12x during the stretches when they do not (two-copy: every
 * byte crosses between the cores' caches twice). */
#define CMA_SPLIT (256 * 1024)
static int broadcast_cma(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
{
    int n = c->n, me = c->me;
    size_t head = nbytes;  /* bytes each reader reads; the root writes the rest */
    if (nbytes >= CMA_SPLIT)
        head = (nbytes / (size_t)n * (size_t)(n - 1)) & ~(size_t)4095;
    thp_prepare(c, buf, nbytes);
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)buf, memory_order_relaxed);
    fp_publish(c, fp);
    uint32_t s = ++c->seq;
    post(c, s);
    if (me == root) {
        if (head < nbytes)
            for (int k = 1; k < n; k++) {
                int q = (me + k) % n;
                TRY(c, wait_post(c, q, s));
                TRY(c, fp_check(c, q));  /* before writing into q's buffer */
                uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
                TRY(c, cma_write(c, q, addr + head, (const char *)buf + head, nbytes - head));
            }
        ack(c, s);
        TRY(c, fp_check_all(c, s));
        for (int q = 0; q < n; q++)  /* every reader is done with buf */
            if (q != me)
                TRY(c, wait_ctr(c, &c->ctl[q].ack, s, q, -1));
        return SHM_OK;
    }
    TRY(c, wait_post(c, root, s));
    TRY(c, fp_check(c, root));  /* before reading the root's buffer into mine */
    uint64_t addr = atomic_load_explicit(&c->ctl[root].xfer.addr, memory_order_relaxed);
    TRY(c, cma_read(c, root, buf, addr, head));
    ack(c, s);
    TRY(c, fp_check_all(c, s));
    if (head < nbytes)  /* the root's part has landed */
        TRY(c, wait_ctr(c, &c->ctl[root].ack, s, root, -1));
    return SHM_OK;
}

int shm_broadcast(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
{
    CHECK(c);
    if (c->n == 1)
        return SHM_OK;
    if (nbytes == 0)
        return fp_sync(c, fp);
    if (c->cma && c->cma_bcast_min && nbytes >= c->cma_bcast_min)
        return broadcast_cma(c, buf, nbytes, root, fp);
    tick(c, nbytes);
    uint32_t s0 = c->seq + 1;  /* the first step: every rank posts it */
    fp_publish(c, fp);
    /* whole halves: measured as fast as 1 MiB blocks or faster (4 ranks, 2 cores) */
    for (size_t off = 0; off < nbytes;) {
        size_t len = nbytes - off < c->half ? nbytes - off : c->half;
        int h = (int)(c->blk & 1);
        uint32_t s;
        if (c->me == root) {
            TRY(c, half_acquire(c, &h));
            /* a block larger than a core's cache is out of it by the time it is read
             * (2 MiB: far, 1.17 ms plain, 1.20 streaming for 16 MiB; close, 0.83 vs 1.15) */
            if (len <= (1 << 20))
                seg_put(c, HALF(c, root, h), (char *)buf + off, len);
            else
                memcpy(HALF(c, root, h), (char *)buf + off, len);
            s = ++c->seq;
            post(c, s);
            c->free_after[h] = s;
            ack(c, s);
        } else {
            c->blk++;
            s = ++c->seq;
            if (s == s0)
                post(c, s);  /* arrival: nobody reads a reader's half */
            TRY(c, wait_post(c, root, s));
            if (s == s0)
                TRY(c, fp_check(c, root));  /* before copying the root's data into buf */
            memcpy((char *)buf + off, HALF(c, root, h), len);  /* streaming: measured slower */
            ack(c, s);
        }
        off += len;
    }
    TRY(c, fp_check_all(c, s0));
    return SHM_OK;
}

static void slice_of(size_t cnt, int n, int q, size_t *st, size_t *len)
{
    size_t b = cnt / (size_t)n, r = cnt % (size_t)n;
    *st = (size_t)q * b + ((size_t)q < r ? (size_t)q : r);
    *len = b + ((size_t)q < r ? 1 : 0);
}

/* Single-copy all_reduce: rank r owns slice r of the buffer. It reads the other ranks'
 * slice r straight from their buffers (in chunks, into a private scratch), reduces
 * them into its own buffer (its own values first, then the others in rank order), and
 * then every rank reads the other owners' finished slices from their buffers. Each
 * element is computed once, by its owner, so every rank holds the same bytes. Steps:
 * s1 = addresses published; s2 = every slice reduced (so no one's slice r is still
 * being read when its owner's peers overwrite it); the acks of s2 = every rank has read
 * the finished slices (so no one returns while its buffer is still being read). */
#define CMA_AR_CHUNK (256 * 1024)
static int all_reduce_cma(shm_comm *c, void *buf, size_t count, int dtype, int op, size_t isz,
                          const void **srcs /* n entries, the caller's */, uint64_t fp)
{
    int n = c->n, me = c->me;
    if (!c->cma_tmp && !(c->cma_tmp = malloc((size_t)(n - 1) * CMA_AR_CHUNK)))
        return SHM_ESYS;
    int rc = SHM_OK;
    char *ubuf = buf;
    thp_prepare(c, buf, count * isz);
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)buf, memory_order_relaxed);
    fp_publish(c, fp);
    uint32_t s1 = ++c->seq;
    post(c, s1);
    if ((rc = fp_check_all(c, s1)))
        return rc;
    size_t st, len;
    slice_of(count, n, me, &st, &len);
    size_t ce = CMA_AR_CHUNK / isz;
    for (size_t off = 0; off < len; off += ce) {
        size_t cnt = len - off < ce ? len - off : ce;
        size_t at = (st + off) * isz;
        srcs[0] = ubuf + at;
        for (int q = 0, k = 1; q < n; q++) {
            if (q == me)
                continue;
            char *tmp = c->cma_tmp + (size_t)(k - 1) * CMA_AR_CHUNK;
            uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
            if ((rc = cma_read(c, q, tmp, addr + at, cnt * isz)))
                return rc;
            srcs[k++] = tmp;
        }
        if ((rc = coll_reduce_many(ubuf + at, srcs, n, cnt, dtype, op)))
            return rc;
    }
    uint32_t s2 = ++c->seq;
    post(c, s2);
    for (int k = 1; k < n; k++) {
        int q = (me + k) % n;
        if ((rc = wait_post(c, q, s2)))
            return rc;
        size_t qst, qlen;
        slice_of(count, n, q, &qst, &qlen);
        uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
        if (qlen && (rc = cma_read(c, q, ubuf + qst * isz, addr + qst * isz, qlen * isz)))
            return rc;
    }
    ack(c, s2);
    for (int q = 0; q < n; q++)
        if (q != me && (rc = wait_ctr(c, &c->ctl[q].ack, s2, q, -1)))
            return rc;
    return SHM_OK;
}

/* Reduce to every rank (root < 0) or to root only. */
static int reduce_impl(shm_comm *c, void *buf, size_t count, int dtype, int op, int root,
                       uint64_t fp)
{
    CHECK(c);
    size_t isz = coll_itemsize(dtype);
    if (!isz)
        return COLL_EDTYPE;
    if (!coll_op_valid(dtype, op))
        return COLL_EOP;
    if (c->n == 1)
        return SHM_OK;
    if (count == 0)
        return fp_sync(c, fp);
    int n = c->n, me = c->me;
    const void *stack_srcs[MAX_STACK_SRCS];
    const void **srcs = n <= MAX_STACK_SRCS ? stack_srcs : malloc(sizeof(void *) * (size_t)n);
    if (!srcs)
        return SHM_ESYS;
    int rc = SHM_OK;
    size_t nbytes = count * isz;
    if (nbytes <= c->oneshot_max) {
        /* one-shot: every reader reduces all inputs in rank order: bitwise identical */
        int h;
        if ((rc = half_acquire(c, &h)))
            goto out;
        seg_put(c, HALF(c, me, h), buf, nbytes);
        fp_publish(c, fp);
        uint32_t s = ++c->seq;
        post(c, s);
        c->free_after[h] = s;
        if ((rc = fp_check_all(c, s)))  /* a reduce's non-roots too, before they return */
            goto out;
        if (root < 0 || root == me) {
            for (int q = 0; q < n; q++)
                srcs[q] = HALF(c, q, h);
            rc = coll_reduce_many(buf, srcs, n, count, dtype, op);
        }
        ack(c, s);
        tick(c, nbytes);
        goto out;
    }
    if (root < 0 && c->cma && c->cma_ar_min && nbytes >= c->cma_ar_min) {
        rc = all_reduce_cma(c, buf, count, dtype, op, isz, srcs, fp);
        goto out;
    }
    fp_publish(c, fp);
    const uint32_t s0 = c->seq + 1;  /* the first chunk's first step */
    /* two-shot: each rank reduces its own slice of the chunk (from its own buffer and
     * the others' copies) into its half, then every rank copies the other slices out.
     * Each element is computed once, by its owner, so all ranks get the same bytes. */
    size_t ce = c->chunk / isz;
    /* far: reduce in place, then stream the result into the segment (not on a reduce's
     * non-roots, whose buffers stay as they were) */
    const int far = c->far && (root < 0 || root == me);
    for (size_t off = 0; off < count; off += ce) {
        size_t cnt = count - off < ce ? count - off : ce;
        char *ubuf = (char *)buf + off * isz;
        char *mine;
        size_t st, len;
        int h;
        if ((rc = half_acquire(c, &h)))
            goto out;
        mine = HALF(c, me, h);
        for (int q = 0; q < n; q++)
            if (q != me) {  /* only the slices other ranks reduce */
                slice_of(cnt, n, q, &st, &len);
                seg_put(c, mine + st * isz, ubuf + st * isz, len * isz);
            }
        uint32_t s1 = ++c->seq;
        post(c, s1);
        if ((rc = s1 == s0 ? fp_check_all(c, s1) : wait_posts(c, s1)))
            goto out;
        slice_of(cnt, n, me, &st, &len);
        if (len) {
            srcs[0] = ubuf + st * isz;
            for (int q = 0, k = 1; q < n; q++)
                if (q != me)
                    srcs[k++] = HALF(c, q, h) + st * isz;
            if ((rc = coll_reduce_many((far ? ubuf : mine) + st * isz, srcs, n, len, dtype, op)))
                goto out;
            if (far)
                seg_put(c, mine + st * isz, ubuf + st * isz, len * isz);
        }
        uint32_t s2 = ++c->seq;
        post(c, s2);
        c->free_after[h] = s2;
        if (root < 0 || root == me) {
            if (!far)
                memcpy(ubuf + st * isz, mine + st * isz, len * isz);
            if ((rc = wait_posts(c, s2)))
                goto out;
            for (int q = 0; q < n; q++)
                if (q != me) {
                    slice_of(cnt, n, q, &st, &len);
                    memcpy(ubuf + st * isz, HALF(c, q, h) + st * isz, len * isz);
                }
        }
        ack(c, s2);
    }
    tick(c, nbytes);  /* here every rank has posted the last step: they arrive together */
out:
    if (srcs != stack_srcs)
        free((void *)srcs);
    return fail(c, rc);
}

int shm_all_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp)
{
    return reduce_impl(c, buf, count, dtype, op, -1, fp);
}

int shm_reduce(shm_comm *c, void *buf, size_t count, int dtype, int op, int root, uint64_t fp)
{
    return reduce_impl(c, buf, count, dtype, op, root, fp);
}

/* Rank q's block of a gather's output: contiguous blocks of `out`, or outs[q]. */
#define GATHER_BLOCK(out, outs, q, nbytes) \
    ((outs) ? (char *)(outs)[q] : (char *)(out) + (size_t)(q) * (nbytes))

/* Single-copy gather. A reader whose output is one buffer posts its address, and every
 * rank writes its block straight into it (process_vm_writev), 1 MiB at a time so the
 * block is read from the cache for every reader after the first. A reader whose output is
 * a list of separate blocks (outs, all_gather only) posts none and reads every other
 * rank's input into its blocks instead (each rank posts its input's address too), so the
 * ranks of one call may mix the two forms. A writer returns as soon as its writes are
 * done; a reader once every rank has acked (for an all_gather: every rank, since a list
 * reader reads the others' inputs until it acks).
 * Writing rather than reading: the kernel pins the remote side page by page, and a
 * reader's output, n blocks long, is the buffer likelier to hold 2 MiB pages (numpy's
 * from 4 MiB, or thp_prepare's). Measured against each rank reading the others' blocks
 * (two ranks, samples alternating in one run, push/pull time): 2 MiB 0.72-0.85, 4 MiB
 * 0.94-1.01, 8 MiB 0.89-1.01, 16 MiB 0.92-1.01, 256 KiB-1 MiB 0.92-1.0. */
#define CMA_PUSH_CHUNK (1 << 20)
static int gather_cma(shm_comm *c, void *out, void *const *outs, const void *in, size_t nbytes,
                      int root, uint64_t fp)
{
    int n = c->n, me = c->me;
    int reader = root < 0 || root == me;
    int pull = outs != NULL;
    if (reader)
        thp_prepare(c, pull ? in : out, pull ? nbytes : (size_t)n * nbytes);
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)(reader && !pull ? out : NULL),
                          memory_order_relaxed);
    atomic_store_explicit(&c->ctl[me].xfer.src, (uint64_t)(uintptr_t)in, memory_order_relaxed);
    fp_publish(c, fp);
    uint32_t s = ++c->seq;
    post(c, s);
    /* every writer and reader compares with every peer before a byte moves: a gather's
     * writers may write only into a root that called the same */
    TRY(c, fp_check_all(c, s));
    int stream = !pull && outputs_past_llc(c, (size_t)(root < 0 ? n : 1) * (size_t)n * nbytes);
    for (size_t off = 0; off < nbytes; off += CMA_PUSH_CHUNK) {
        size_t len = nbytes - off < CMA_PUSH_CHUNK ? nbytes - off : CMA_PUSH_CHUNK;
        for (int k = 0; k < n; k++) {
            int q = (me + k) % n;
            if (!(root < 0 || q == root))
                continue;
            if (q == me) {
                copy_out(GATHER_BLOCK(out, outs, me, nbytes) + off, (const char *)in + off, len,
                         stream);
                continue;
            }
            TRY(c, wait_post(c, q, s));
            uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
            if (addr)  /* q takes writes */
                TRY(c, cma_write(c, q, addr + (uint64_t)me * nbytes + off,
                                 (const char *)in + off, len));
            if (pull)  /* I read q's block */
                TRY(c, cma_read(c, q, (char *)outs[q] + off,
                                atomic_load_explicit(&c->ctl[q].xfer.src, memory_order_relaxed) + off,
                                len));
        }
    }
    ack(c, s);
    if (reader)  /* every writer is done with my output, every reader with my input */
        for (int q = 0; q < n; q++)
            if (q != me)
                TRY(c, wait_ctr(c, &c->ctl[q].ack, s, q, -1));
    return SHM_OK;
}

/* Whether every rank of the group can read every other's memory with
 * process_vm_readv (same user, no ptrace restrictions) and has a core of its own;
 * all ranks get the same answer. */
int shm_cma_probe(shm_comm *c)
{
    static const uint64_t probe = 0x636d612070726f62ULL; /* "cma prob" */
    CHECK(c);
    c->cma = 0;
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
    int ok = cma_read(c, q, &got, addr, sizeof got) == SHM_OK && got == probe;
    /* measured: with more ranks than cores the readers queue for the cores and the
     * two-copy path, which overlaps writers and readers, is as fast or faster */
    ok = ok && ((long)n <= sysconf(_SC_NPROCESSORS_ONLN) || getenv("COLLECTIVES_SHM_CMA_ANY_CORES"));
    c->err_peer = -1;
    atomic_store_explicit(&c->ctl[me].xfer.ok, ok, memory_order_relaxed);
    s = ++c->seq;
    post(c, s);
    TRY(c, wait_posts(c, s));
    int all = 1;
    for (int r = 0; r < n; r++)
        all &= atomic_load_explicit(&c->ctl[r].xfer.ok, memory_order_relaxed) != 0;
    c->cma = all;
    return SHM_OK;
}

int shm_cma_enabled(const shm_comm *c) { return c->cma; }

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

/* Everyone publishes in; readers (all, or root only) copy every rank's block into `out`
 * (blocks back to back) or, for a list all_gather, into outs[q]. */
static int gather_impl(shm_comm *c, void *out, void *const *outs, const void *in, size_t nbytes,
                       int root, uint64_t fp)
{
    CHECK(c);
    int n = c->n, me = c->me;
    int reader = root < 0 || root == me;
    if (n == 1) {
        if (reader)
            copy(GATHER_BLOCK(out, outs, 0, nbytes), in, nbytes);
        return SHM_OK;
    }
    if (nbytes == 0)
        return fp_sync(c, fp);
    if (c->cma && c->cma_min && nbytes >= c->cma_min)
        return gather_cma(c, out, outs, in, nbytes, root, fp);
    fp_publish(c, fp);
    const uint32_t s0 = c->seq + 1;
    int stream = outputs_past_llc(c, (size_t)(root < 0 ? n : 1) * (size_t)n * nbytes);
    for (size_t off = 0; off < nbytes;) {
        size_t len = nbytes - off < c->half ? nbytes - off : c->half;
        int h;
        TRY(c, half_acquire(c, &h));
        if (stream)
            copy_stream(HALF(c, me, h), (const char *)in + off, len);
        else
            seg_put(c, HALF(c, me, h), (const char *)in + off, len);
        uint32_t s = ++c->seq;
        post(c, s);
        c->free_after[h] = s;
        if (s == s0)  /* every rank, before a reader copies anything */
            TRY(c, fp_check_all(c, s));
        if (reader) {
            TRY(c, wait_posts(c, s));
            for (int q = 0; q < n; q++)
                if (q != me || GATHER_BLOCK(out, outs, me, nbytes) != (const char *)in)
                    copy_out(GATHER_BLOCK(out, outs, q, nbytes) + off, HALF(c, q, h), len, stream);
        }
        ack(c, s);
        off += len;
    }
    tick(c, nbytes);
    return SHM_OK;
}

int shm_all_gather(shm_comm *c, void *out, const void *in, size_t nbytes, uint64_t fp)
{
    return gather_impl(c, out, NULL, in, nbytes, -1, fp);
}

int shm_all_gather_list(shm_comm *c, void *const *outs, const void *in, size_t nbytes,
                        uint64_t fp)
{
    return gather_impl(c, NULL, outs, in, nbytes, -1, fp);
}

int shm_gather(shm_comm *c, void *out, const void *in, size_t nbytes, int root, uint64_t fp)
{
    return gather_impl(c, out, NULL, in, nbytes, root, fp);
}

int shm_scatter(shm_comm *c, void *out, const void *in, size_t nbytes, int root, uint64_t fp)
{
    CHECK(c);
    int n = c->n, me = c->me;
    if (n == 1) {
        if (me == root)
            copy(out, in, nbytes);
        return SHM_OK;
    }
    if (nbytes == 0)
        return fp_sync(c, fp);
    tick(c, nbytes);
    fp_publish(c, fp);
    const uint32_t s0 = c->seq + 1;  /* the first step: every rank posts it */
    size_t p = (c->half / (size_t)n) & ~(size_t)63;
    for (size_t off = 0; off < nbytes; off += p) {
        size_t len = nbytes - off < p ? nbytes - off : p;
        int h = (int)(c->blk & 1);
        uint32_t s;
        if (me == root) {
            TRY(c, half_acquire(c, &h));
            for (int q = 0; q < n; q++)
                if (q != me)
                    seg_put(c, HALF(c, me, h) + (size_t)q * p, (const char *)in + (size_t)q * nbytes + off,
                            len);
            s = ++c->seq;
            post(c, s);
            c->free_after[h] = s;
        } else {
            c->blk++;
            s = ++c->seq;
            if (s == s0)
                post(c, s);  /* arrival */
            TRY(c, wait_post(c, root, s));
            if (s == s0)
                TRY(c, fp_check(c, root));  /* before copying the root's data into out */
            memcpy((char *)out + off, HALF(c, root, h) + (size_t)me * p, len);
        }
        ack(c, s);
    }
    TRY(c, fp_check_all(c, s0));
    if (me == root)
        copy(out, (const char *)in + (size_t)me * nbytes, nbytes);
    return SHM_OK;
}

int shm_reduce_scatter(shm_comm *c, void *out, const void *in, size_t count, int dtype, int op,
                       uint64_t fp)
{
    CHECK(c);
    size_t isz = coll_itemsize(dtype);
    if (!isz)
        return COLL_EDTYPE;
    if (!coll_op_valid(dtype, op))
        return COLL_EOP;
    int n = c->n, me = c->me;
    if (n == 1) {
        copy(out, in, count * isz);
        return SHM_OK;
    }
    if (count == 0)
        return fp_sync(c, fp);
    const void *stack_srcs[MAX_STACK_SRCS];
    const void **srcs = n <= MAX_STACK_SRCS ? stack_srcs : malloc(sizeof(void *) * (size_t)n);
    if (!srcs)
        return SHM_ESYS;
    int rc = SHM_OK;
    size_t ce = c->half / ((size_t)n * isz);
    uintptr_t o0 = (uintptr_t)out, i0 = (uintptr_t)in;
    /* my own slice is reduced straight from my input unless the output overlaps the input
     * otherwise than as exactly that slice (coll_reduce_many may write over one source) */
    const int direct = o0 + count * isz <= i0 || i0 + (size_t)n * count * isz <= o0
                       || o0 == i0 + (size_t)me * count * isz;
    fp_publish(c, fp);
    const uint32_t s0 = c->seq + 1;
    for (size_t off = 0; off < count; off += ce) {
        size_t cnt = count - off < ce ? count - off : ce;
        int h;
        if ((rc = half_acquire(c, &h)))
            goto out;
        for (int q = 0; q < n; q++)
            if (q != me || !direct)
                seg_put(c, HALF(c, me, h) + (size_t)q * cnt * isz,
                       (const char *)in + ((size_t)q * count + off) * isz, cnt * isz);
        uint32_t s = ++c->seq;
        post(c, s);
        c->free_after[h] = s;
        if ((rc = s == s0 ? fp_check_all(c, s) : wait_posts(c, s)))
            goto out;
        for (int q = 0; q < n; q++)
            srcs[q] = q == me && direct ? (const char *)in + ((size_t)me * count + off) * isz
                                        : HALF(c, q, h) + (size_t)me * cnt * isz;
        if ((rc = coll_reduce_many((char *)out + off * isz, srcs, n, cnt, dtype, op)))
            goto out;
        ack(c, s);
    }
    tick(c, count * isz);
out:
    if (srcs != stack_srcs)
        free((void *)srcs);
    return fail(c, rc);
}

/* all_to_all's half: a header (rounds, then the bytes this rank sends to each rank, then
 * the bytes it expects from each), then one part of p bytes per rank */
static inline size_t a2a_header(int n) { return round_up(8 + 16 * (size_t)n, CL); }

int shm_all_to_all(shm_comm *c, void *out, const void *in, const size_t *out_bytes,
                   const size_t *in_bytes, uint64_t fp)
{
    CHECK(c);
    int n = c->n, me = c->me;
    if (n == 1) {
        copy(out, in, in_bytes[0]);
        return SHM_OK;
    }
    const size_t hb = a2a_header(n);
    size_t p = ((c->half - hb) / (size_t)n) & ~(size_t)63;
    size_t *in_off = malloc(sizeof(size_t) * 2 * (size_t)n);
    if (!in_off)
        return SHM_ESYS;
    size_t *out_off = in_off + n;
    size_t mx = 0, a = 0, b = 0;
    for (int q = 0; q < n; q++) {
        in_off[q] = a;
        out_off[q] = b;
        a += in_bytes[q];
        b += out_bytes[q];
        if (in_bytes[q] > mx)
            mx = in_bytes[q];
    }
    uint64_t my_rounds = (mx + p - 1) / p, rounds = 1;
    int rc = SHM_OK;
    fp_publish(c, fp);
    for (uint64_t t = 0; t < rounds; t++) {
        int h;
        if ((rc = half_acquire(c, &h)))
            break;
        char *mine = HALF(c, me, h);
        if (t == 0) {  /* round 0 also agrees on the number of rounds, and on the sizes */
            ((uint64_t *)mine)[0] = my_rounds;
            for (int q = 0; q < n; q++) {
                ((uint64_t *)mine)[1 + q] = in_bytes[q];
                ((uint64_t *)mine)[1 + n + q] = out_bytes[q];
            }
        }
        size_t o = (size_t)t * p;
        for (int q = 0; q < n; q++)
            if (in_bytes[q] > o)
                seg_put(c, mine + hb + (size_t)q * p, (const char *)in + in_off[q] + o,
                        in_bytes[q] - o < p ? in_bytes[q] - o : p);
        uint32_t s = ++c->seq;
        post(c, s);
        c->free_after[h] = s;
        if ((rc = t == 0 ? fp_check_all(c, s) : wait_posts(c, s)))
            break;
        /* what q sends r must be what r expects from q, for every pair (so every rank finds
         * the same first bad pair, and none returns), before anyone copies any */
        for (int r = 0; t == 0 && r < n && !rc; r++)
            for (int q = 0; q < n; q++) {
                uint64_t sent = ((const uint64_t *)HALF(c, q, h))[1 + r];
                uint64_t want = ((const uint64_t *)HALF(c, r, h))[1 + n + q];
                if (sent != want) {
                    record_fail(c, SHM_FAIL_COUNTS, c->coll, r, q, want, sent, NULL);
                    c->err_peer = q == me ? r : q;
                    rc = SHM_EFAILED;
                    break;
                }
            }
        if (rc)
            break;
        for (int q = 0; q < n; q++) {
            const char *theirs = HALF(c, q, h);
            if (t == 0 && *(const uint64_t *)theirs > rounds)
                rounds = *(const uint64_t *)theirs;
            if (out_bytes[q] > o)
                memcpy((char *)out + out_off[q] + o, theirs + hb + (size_t)me * p,
                       out_bytes[q] - o < p ? out_bytes[q] - o : p);
        }
        ack(c, s);
    }
    if (rc == SHM_OK)
        tick(c, (size_t)rounds * p);  /* rounds: the same on every rank, agreed in round 0 */
    free(in_off);
    return fail(c, rc);
}

/* ---- point to point ------------------------------------------------------------ */

static void ring_write(shm_comm *c, int dst, uint64_t pos, const void *src, size_t len)
{
    char *data = c->rdata + ((size_t)c->me * c->n + dst) * c->ring;
    size_t at = (size_t)(pos & (c->ring - 1));
    size_t first = c->ring - at < len ? c->ring - at : len;
    memcpy(data + at, src, first);
    if (len > first)
        memcpy(data, (const char *)src + first, len - first);
}

static void ring_read(shm_comm *c, int src, uint64_t pos, void *dst, size_t len)
{
    char *data = c->rdata + ((size_t)src * c->n + c->me) * c->ring;
    size_t at = (size_t)(pos & (c->ring - 1));
    size_t first = c->ring - at < len ? c->ring - at : len;
    if (dst) {
        memcpy(dst, data + at, first);
        if (len > first)
            memcpy((char *)dst + first, data, len - first);
    }
}

int shm_p2p_try_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                     size_t nbytes)
{
    CHECK(c);
    ring_ctl_t *r = &c->rctl[(size_t)c->me * c->n + dst];
    uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    if (c->ring - (size_t)(head - tail) < hdr_len + nbytes)
        return 0;
    ring_write(c, dst, head, hdr, hdr_len);
    ring_write(c, dst, head + hdr_len, buf, nbytes);
    atomic_store_explicit(&r->head, head + hdr_len + nbytes, memory_order_release);
    ctr_bump(&c->ctl[dst].bell);
    return 1;
}

static int stream_send(shm_comm *c, int dst, const char *p, size_t len)
{
    ring_ctl_t *r = &c->rctl[(size_t)c->me * c->n + dst];
    ctr_t *bell = &c->ctl[c->me].bell;
    /* The timeout runs from the last progress on this ring: the bell also rings for
     * other rings' traffic, which must not restart it. */
    int64_t deadline = -1;
    while (len) {
        uint32_t b = atomic_load_explicit(&bell->v, memory_order_acquire);
        uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
        uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
        size_t room = c->ring - (size_t)(head - tail);
        if (room == 0) {
            if (deadline < 0)
                deadline = now_ns() + c->timeout_ns;
            int rc = wait_ctr(c, bell, b + 1, dst, deadline);
            if (rc)
                return rc;
            continue;
        }
        size_t k = room < len ? room : len;
        ring_write(c, dst, head, p, k);
        atomic_store_explicit(&r->head, head + k, memory_order_release);
        ctr_bump(&c->ctl[dst].bell);
        p += k;
        len -= k;
        deadline = -1;
    }
    return SHM_OK;
}

int shm_p2p_send(shm_comm *c, int dst, const void *hdr, size_t hdr_len, const void *buf,
                 size_t nbytes)
{
    CHECK(c);
    int rc = stream_send(c, dst, hdr, hdr_len);
    if (!rc)
        rc = stream_send(c, dst, buf, nbytes);
    return fail(c, rc);  /* a half-written message tears the stream: no later send may follow it */
}

int shm_p2p_poll(shm_comm *c, size_t need, double wait_s, int *src)
{
    *src = -1;
    CHECK(c);
    ctr_t *bell = &c->ctl[c->me].bell;
    int64_t deadline = now_ns() + (int64_t)(wait_s * 1e9);
    static __thread int start = 0;
    for (;;) {
        if (atomic_load(&c->aborted))
            return SHM_ECLOSED;
        uint32_t b = atomic_load_explicit(&bell->v, memory_order_acquire);
        for (int i = 0; i < c->n; i++) {
            int q = (start + i) % c->n;
            if (q == c->me)
                continue;
            ring_ctl_t *r = &c->rctl[(size_t)q * c->n + c->me];
            uint64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
            uint64_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
            if (head - tail >= need) {
                *src = q;
                start = q + 1;
                return SHM_OK;
            }
        }
        if (now_ns() >= deadline)
            return SHM_OK;
        int rc = wait_ctr(c, bell, b + 1, -1, deadline);
        if (rc == SHM_ETIMEDOUT)
            return SHM_OK;
        if (rc)
            return rc;
    }
}

int shm_p2p_read(shm_comm *c, int src, void *buf, size_t nbytes)
{
    CHECK(c);
    ring_ctl_t *r = &c->rctl[(size_t)src * c->n + c->me];
    ctr_t *bell = &c->ctl[c->me].bell;
    char *p = buf;
    int64_t deadline = -1;  /* from the last progress on this ring, as in stream_send */
    while (nbytes) {
        uint32_t b = atomic_load_explicit(&bell->v, memory_order_acquire);
        uint64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
        uint64_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
        size_t avail = (size_t)(head - tail);
        if (avail == 0) {
            if (deadline < 0)
                deadline = now_ns() + c->timeout_ns;
            int rc = wait_ctr(c, bell, b + 1, src, deadline);
            if (rc)
                return rc;
            continue;
        }
        deadline = -1;
        size_t k = avail < nbytes ? avail : nbytes;
        ring_read(c, src, tail, p, k);
        atomic_store_explicit(&r->tail, tail + k, memory_order_release);
        ctr_bump(&c->ctl[src].bell);
        if (p)
            p += k;
        nbytes -= k;
    }
    return SHM_OK;
}

void shm_p2p_kick(shm_comm *c) { ctr_bump(&c->ctl[c->me].bell); }
