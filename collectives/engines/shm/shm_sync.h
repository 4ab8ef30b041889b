/* The shared-memory engine's bottom layer: the segment's layout, a rank's view of it
 * (struct shm_comm), and the synchronisation everything else is built on (counters,
 * waits: spin, yield, futex, dead-peer checks; the group's failure record; fingerprint
 * checks), implemented in shm_segment.c. The layers above include this header and call
 * down only:
 *
 *     shm_coll.c (collectives)                        shm_p2p.c (point-to-point rings)
 *        |            |              |                    |
 *     shm_copy.h     shm_tune.h     shm_mapped.h          |
 *     (copy policy)  (measured      (buffers every        |
 *        |            choice)        rank maps)           |
 *     shm_sync.h / shm_segment.c (segment, counters, waits, failures, fingerprints)
 *
 * An abort that must wake a layer above (p2p's waiting threads) goes through the hook
 * that layer registered (shm_comm.abort_hook), not a call upward. See shm_coll.h for the
 * protocol. */
#ifndef COLLECTIVES_SHM_SYNC_H
#define COLLECTIVES_SHM_SYNC_H
#define _GNU_SOURCE
#include "shm_coll.h"
#include "kernels/reduce_kernels_import.h"

#define SHM_HIDDEN __attribute__((visibility("hidden")))

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
#define SHM_MAGIC 0x636f6c6c73686d37ULL /* "collshm7": the small broadcasts' rings */
#define MAX_STACK_SRCS 64
#define MAPPED_MAX 64         /* buffers a group may register for the mapped all_reduce */
/* a mapped all_reduce's word in xfer.mapped: the buffer's id and the call's offset in it */
#define MAPPED_WORD(id, off) ((1ull << 63) | ((uint64_t)(id) << 40) | (uint64_t)(off))
#define MAPPED_OFF_MAX (1ull << 40)
#define SHM_DECLINED 2        /* (internal) the mapped all_reduce does not apply to this call */

/* Where slice q of cnt elements split among n ranks starts, and its length. */
static inline void slice_of(size_t cnt, int n, int q, size_t *st, size_t *len)
{
    size_t b = cnt / (size_t)n, r = cnt % (size_t)n;
    *st = (size_t)q * b + ((size_t)q < r ? (size_t)q : r);
    *len = b + ((size_t)q < r ? 1 : 0);
}
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
/* the measured choices (shm_tune.c) */
#define TUNE_KINDS 2          /* all_reduce (above one-shot), all_gather */
#define TUNE_BUCKETS 12       /* size classes: one per power of two, the last open */
#define TUNE_ARMS 4           /* plain stores, streaming stores, single copy (in pieces, whole) */

/* A call's fingerprint (collectives/core/fingerprint.py's pack word) for collective number k:
 * each rank's post counter carries FP_SLOTS of them, slot k % FP_SLOTS, in its own cache
 * line, so a peer that sees the post sees the fingerprint without another line's
 * transfer (see "fingerprints" below for why four). */
#define FP_SLOTS 4
typedef struct {
    _Atomic uint32_t v;
    _Atomic uint32_t waiters;
    _Atomic uint32_t fp_k[FP_SLOTS];     /* used in post only */
    _Atomic uint64_t fp_word[FP_SLOTS];
    char pad[CL - 8 - FP_SLOTS * 12];
} ctr_t;
_Static_assert(sizeof(ctr_t) == CL, "a counter and its fingerprint slots fill one cache line");

/* A broadcast of at most BC_INLINE bytes goes through a ring of BC_RING records per rank,
 * one cache line each, record s % BC_RING for the broadcast whose step is s: the root's
 * holds the call's fingerprint and the data, a reader's its fingerprint. A rank rewrites a
 * record, as a root or as a reader, once every rank has acked the last broadcast it was
 * the root of there, so it runs up to BC_RING broadcasts ahead of the slowest reader, and
 * the readers do not wait for each other. */
#define BC_RING 16
#define BC_INLINE 48
typedef struct {
    _Atomic uint32_t k;      /* collective number; 0 while being rewritten */
    uint32_t pad;
    _Atomic uint64_t word;   /* fingerprint */
    char data[BC_INLINE];
} bc_rec_t;
_Static_assert(sizeof(bc_rec_t) == CL, "a small broadcast's record fills one cache line");

typedef struct {
    ctr_t post;   /* last step whose data this rank published */
    ctr_t ack;    /* last step whose data this rank finished reading */
    ctr_t bell;   /* bumped whenever a p2p ring to or from this rank moves */
    struct {
        _Atomic int32_t pid;
        _Atomic int32_t cpu;  /* the CPU this rank last waited on, plus one (0: unknown) */
        char pad[CL - 8];
    } info;
    struct {
        _Atomic uint32_t v;     /* latency probe: pings and pongs (see probe_peer) */
        char pad[CL - 4];
    } pp;
    struct {
        _Atomic uint64_t addr;  /* this rank's buffer for the step it last posted (CMA) */
        _Atomic uint64_t src;   /* a single-copy all_gather's input, for ranks that pull */
        _Atomic uint64_t mapped; /* a mapped all_reduce's buffer: MAPPED_WORD(id, offset), or 0 */
        _Atomic int32_t ok;     /* the CMA probe's verdict from this rank */
        char pad[CL - 28];
    } xfer;
    /* this rank's fastest time (ns) of each all_reduce algorithm in its last round of
     * trials, per size class; written before the post of the call that ends a round,
     * read by every rank at its next call of that class (see shm_tune.c) */
    _Atomic int64_t tune[TUNE_KINDS][TUNE_BUCKETS][TUNE_ARMS];
    char tune_pad[(CL - (TUNE_KINDS * TUNE_BUCKETS * TUNE_ARMS * 8) % CL) % CL];
    bc_rec_t bc[BC_RING];  /* small broadcasts (see bc_rec_t) */
} rank_ctl_t;
_Static_assert(sizeof(rank_ctl_t) % CL == 0, "a rank's control block fills whole cache lines");

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
    uint32_t fail_number;        /* the caller's number of it (shm_comm_number_next), or 0 */
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

/* A size class's state of the measured all_reduce choice; every field but best[] is the
 * same on every rank (it follows the class's call count and the published times). */
typedef struct {
    uint32_t calls;               /* all_reduces of this class so far */
    uint32_t trial_at;            /* the call that starts the next round of trials */
    uint32_t decide_at;           /* the call at whose start the round's times are read */
    uint32_t gap;                 /* calls from a decision to the next round */
    int arm;                      /* the agreed algorithm (TUNE_ARMS: none yet) */
    uint32_t benched[TUNE_ARMS];  /* an arm that lost by far sits out the rounds before
                                     this call (0: it does not) */
    int round[TUNE_ARMS];         /* the arms timed in the current round, */
    int round_k;                  /* ... how many (0: no round begun yet) */
    int64_t best[TUNE_ARMS];      /* this rank's fastest trial of each arm this round */
} tune_t;

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
    int cma;              /* every rank can read every other's memory (process_vm_readv) and
                             has a core of its own (or COLLECTIVES_SHM_CMA_ANY_CORES): the
                             all_reduce's single copy */
    int cma_readable;     /* every rank can read every other's memory: the gathers' single
                             copy, at any ranks-to-cores ratio */
    int cma_bcast;        /* ... and the ranks are at most two a core (or
                             COLLECTIVES_SHM_CMA_ANY_CORES): the broadcast's single copy */
    size_t cma_min;       /* all_gather/gather blocks of at least this many bytes use it */
    size_t cma_bcast_min; /* broadcasts of at least this many bytes use it */
    size_t cma_ar_min;    /* all_reduces of at least this many bytes (above one-shot) may use it */
    int ar_algo;          /* SHM_AR_AUTO (measured), SHM_AR_TWO_SHOT or SHM_AR_SINGLE_COPY */
    tune_t tune[TUNE_KINDS][TUNE_BUCKETS];
    size_t llc;           /* bytes of last-level cache */
    int lock_fd;          /* the creator's descriptor of the segment, locked (else -1) */
    char *cma_tmp;        /* (n - 1) * CMA_AR_CHUNK bytes for peers' chunks, made on first use */
    /* buffers every rank maps (a torch storage moved into shared memory, each rank's
     * mapped by the others: collectives/torch_bridge/mapped.py); a registration takes a
     * dead entry before it adds one. It is collective on the group, whose calls run one at
     * a time, so no lookup of this group runs while it rewrites an entry */
    int mapped_on;        /* the group registered one (the same on every rank): a large
                             all_reduce first asks whether every rank's buffer is mapped */
    int n_mapped;
    uint64_t mapped_calls;  /* all_reduces that took the mapped path */
    struct mapped_buf {
        _Atomic int live;
        uint32_t id;          /* the same on every rank for one buffer */
        uintptr_t lo;         /* this rank's buffer */
        size_t len;
        uintptr_t *peer;      /* where each rank's buffer is mapped here (n entries) */
    } mapped[MAPPED_MAX];
    int stream_mode;      /* SHM_STREAM_OFF / _ON / _AUTO */
    int far;              /* segment writes for other ranks stream past the caches */
    uint32_t ticks;       /* large steps that may probe (the same count on every rank) */
    size_t small_bytes;   /* bytes of small steps since the last small-step probe (ditto) */
    uint32_t probes;      /* probes run (the same count on every rank) */
    unsigned char *dist;  /* per peer: 0 not measured, PEER_NEAR or PEER_FAR */
    uint32_t *seen;       /* per peer: the post and the ack counter as last read (wait_seen) */
    int shared_verdict;   /* more ranks than cores: the group's latest probe decides */
    int64_t far_ns;       /* a probe's round trip from which a peer counts as far */
    int thp;              /* collapse buffers that peers copy by CMA into huge pages */
    int cma_any_cores;    /* allow the single copy with more ranks than cores */
    int64_t thp_ns;       /* time spent so far in collapses that had to move pages */
    int thp_next;         /* the table slot to reuse next */
    struct { uintptr_t a, e; int done; } thp_seen[THP_SLOTS];
    uint32_t coll;        /* fingerprinted collectives started so far (their number k) */
    uint64_t fp;          /* this rank's fingerprint of collective coll */
    /* broadcasts whose root returned without comparing the readers' fingerprints: compared
     * at the root's next wait that finds them arrived (fp_settle) */
    struct { uint32_t k, s0; uint64_t word; } fp_due[FP_SLOTS];
    int n_due;
    /* the caller's numbers of its latest collectives: {first collective, number}, a ring
     * of SEQ_MARKS (shm_comm_number_next), for the failure record (fail_number) */
#define SEQ_MARKS 8
    struct { uint32_t first, number; } marks[SEQ_MARKS];
    unsigned marks_n;
    uint32_t s0_of[FP_SLOTS];  /* the first step of collective k, at k % FP_SLOTS */
    /* this rank finished a small broadcast without knowing that every peer is past the
     * collectives before it: its next post-line fingerprint waits for them (fp_publish) */
    int ahead;
    uint32_t bc_last;  /* the step of this rank's last small broadcast */
    /* small broadcasts this rank was the root of, per ring record: compared with every
     * peer when the record is reused or at the next fp_check_all (due); unread: not yet
     * known to be read by every peer (a reader's use of the record waits for that) */
    struct { uint32_t k, s; uint64_t word; int due, unread; } bc_due[BC_RING];
    int bc_n_due;
    /* a small call begun with the caller's lock held and left to shm_finish (shm_coll.c,
     * "small calls under the caller's lock"): what is left, and the call's arguments */
    struct { int what; uint32_t s; int h, root, dtype, op; void *buf; size_t n; uint64_t fp; } pend;
    _Atomic int broken;
    _Atomic int aborted;
    /* this process's receives waited on by their own thread (shm_p2p_direct): while there
     * are any, the background receiver sleeps on direct_word instead of the bell */
    _Atomic int direct;
    _Atomic uint32_t direct_word;
    _Atomic int bg_sleeping;
    _Atomic uint32_t kicks;  /* shm_p2p_kick calls (a waiter's poll returns at one) */
    void (*abort_hook)(shm_comm *c);  /* set by a layer above that an abort must wake */
    char errbuf[SHM_ERR_TEXT];        /* shm_comm_error_text's last text */
    int reported;                     /* this rank's error text gave the record already */
};

static inline seg_hdr_t *seg_hdr(const shm_comm *c) { return (seg_hdr_t *)c->base; }

static inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static inline int64_t now_ns(void)
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

static inline void futex_wait(_Atomic uint32_t *addr, uint32_t val, int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static inline void futex_wake(_Atomic uint32_t *addr)
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

/* ---- waits and steps (shm_segment.c) ------------------------------------------ */

/* wait_ctr past its first look at the counter */
SHM_HIDDEN int wait_ctr_slow(shm_comm *c, ctr_t *ctr, uint32_t target, int peer,
                             int64_t deadline_ns);

/* Wait until ctr->v >= target (wrapping compare). peer < 0: nobody to watch.
 * deadline_ns < 0 means now + the group timeout. */
static inline int wait_ctr(shm_comm *c, ctr_t *ctr, uint32_t target, int peer,
                           int64_t deadline_ns)
{
    if (ge(atomic_load_explicit(&ctr->v, memory_order_acquire), target))
        return SHM_OK;
    return wait_ctr_slow(c, ctr, target, peer, deadline_ns);
}

#define HALF(c, q, h) ((c)->slots + ((size_t)(q) * 2 + (h)) * (c)->half)

static inline int fail(shm_comm *c, int rc)
{
    if (rc != SHM_OK)
        atomic_store(&c->broken, 1);
    return rc;
}

/* Whether the group has recorded a failure of collective k or of an earlier one (one being
 * written counts). */
static inline int failed_by(const shm_comm *c, uint32_t k)
{
    const seg_hdr_t *h = seg_hdr(c);
    uint32_t st = atomic_load_explicit(&h->fail_state, memory_order_acquire);
    return st != 0 && (st == FAIL_WRITING || (int32_t)(h->fail_k - k) <= 0);
}

/* Whether the group's recorded failure is of a collective after this rank's current one
 * (found by ranks ahead of this one: a mismatch of their next call, say). */
static inline int failed_later(const shm_comm *c)
{
    return atomic_load_explicit(&seg_hdr(c)->fail_state, memory_order_relaxed)
           && !failed_by(c, c->coll);
}

/* A call fails at entry once this rank has failed, or the group recorded a failure of
 * the collective it begins or of an earlier one. A failure of a later collective (ranks
 * ahead of this one found it) lets the call run: it finishes where its peers did their
 * part of it already, and its first wait that must sleep fails. */
#define CHECK(c)                                                               \
    do {                                                                       \
        if (atomic_load_explicit(&(c)->broken, memory_order_relaxed) ||           \
            failed_by((c), (c)->coll + 1))                                     \
            return fail((c), SHM_EBROKEN);                                     \
    } while (0)

#define TRY(c, expr)                      \
    do {                                  \
        int rc_ = (expr);                 \
        if (rc_ != SHM_OK)                \
            return fail((c), rc_);        \
    } while (0)

/* Wait until peer q's post (ack = 0) or ack (ack = 1) reaches s, as wait_ctr; the value
 * read is kept, so that a wait for an older step (a small broadcast's root, for the record
 * it reuses) reads no line of q's (the acquire load that saw it ordered q's writes). */
static inline int wait_seen(shm_comm *c, int q, int ack, uint32_t s)
{
    uint32_t *seen = &c->seen[2 * q + ack];
    if (ge(*seen, s))
        return SHM_OK;
    ctr_t *ctr = ack ? &c->ctl[q].ack : &c->ctl[q].post;
    int rc = wait_ctr(c, ctr, s, q, -1);
    if (!rc)
        *seen = atomic_load_explicit(&ctr->v, memory_order_acquire);
    return rc;
}

SHM_HIDDEN int half_acquire(shm_comm *c, int *h);
static int wait_post(shm_comm *c, int q, uint32_t s) { return wait_ctr(c, &c->ctl[q].post, s, q, -1); }
SHM_HIDDEN int wait_posts(shm_comm *c, uint32_t s);
static inline void post(shm_comm *c, uint32_t s) { ctr_set(&c->ctl[c->me].post, s); }
static inline void ack(shm_comm *c, uint32_t s) { ctr_set(&c->ctl[c->me].ack, s); }

/* ---- fingerprints ------------------------------------------------------------------
 *
 * At entry to collective k a rank writes {k, word} into its post line's slot k % 4 and
 * then posts the collective's first step s; every rank posts that step (ranks that read
 * only, an arrival with no data) and, before it touches the user's buffer with a peer's
 * data, compares that peer's slot with its own; before it returns it has compared every
 * peer's. So no rank finishes collective k before every rank has arrived at k. One
 * exception: the root of a broadcast of one block returns once its data is in the
 * segment, without waiting for the readers (as MPI's roots do; the readers compare its
 * slot before they copy, and the root compares theirs at its next wait that finds them
 * arrived, learning of a mismatch at its next call). A rank runs ahead only while its
 * calls are such broadcasts, and it rewrites its half only once every rank has acked the
 * broadcast that last used it, two of its calls before; so no rank publishes collective
 * k + 4 while another is still inside k, and four slots suffice. A root's deferred
 * comparison may come later than that: a slot reused meanwhile is skipped (the readers of
 * that broadcast compared it at the call). A broadcast of at most BC_INLINE bytes keeps
 * its fingerprints in the ring records instead (bc_rec_t; broadcast_inline in shm_coll.c)
 * and may run up to BC_RING calls ahead; a rank that did so waits before its next
 * post-line fingerprint until every peer is past collective k - 4 (fp_catch_up). A
 * difference is recorded in the segment header (first writer wins) and
 * every rank's waits fail at once; each raises the recorded description. */

SHM_HIDDEN int record_fail(shm_comm *c, uint32_t state, uint32_t k, int a, int b, uint64_t wa,
                           uint64_t wb, const char *text);

/* Write {k, word} where a peer may be reading an older one: k reads k | FP_WRITING in
 * between, so a reader that sees k before and after the word has k's word (fp_find).
 * (Collective numbers are taken to stay below 2^31.) */
#define FP_WRITING 0x80000000u
static inline void fp_store(_Atomic uint32_t *kp, _Atomic uint64_t *wp, uint32_t k, uint64_t word)
{
    atomic_store_explicit(kp, k | FP_WRITING, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(wp, word, memory_order_relaxed);
    atomic_store_explicit(kp, k, memory_order_release);
}

/* A rank ahead after small broadcasts: wait until every peer is past collective k - 4. */
SHM_HIDDEN int fp_catch_up(shm_comm *c, uint32_t k);

/* Start collective number ++coll, whose first step is seq + 1: its fingerprint in the post
 * line (the first step's post releases it), or, for a small broadcast, the ring record. */
static inline int fp_publish(shm_comm *c, uint64_t word)
{
    uint32_t k = c->coll + 1;
    if (c->ahead) {
        int rc = fp_catch_up(c, k);
        if (rc)
            return rc;
    }
    c->coll = k;
    ctr_t *p = &c->ctl[c->me].post;
    fp_store(&p->fp_k[k % FP_SLOTS], &p->fp_word[k % FP_SLOTS], k, word);
    c->s0_of[k % FP_SLOTS] = c->seq + 1;
    c->fp = word;
    return SHM_OK;
}

#define FP_FOUND 0
#define FP_ABSENT 1  /* not where q would have put it: q called something else */
#define FP_GONE 2    /* q has moved past k and reused the place */

/* Whether ring record e holds collective k's word (*w; *k2: the k read after it). */
static inline int rec_read(const bc_rec_t *e, uint32_t k, uint64_t *w, uint32_t *k2)
{
    uint32_t e1 = atomic_load_explicit(&e->k, memory_order_acquire);
    uint64_t ew = atomic_load_explicit(&e->word, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    *k2 = atomic_load_explicit(&e->k, memory_order_relaxed);
    if (e1 != k || *k2 != k)
        return 0;
    *w = ew;
    return 1;
}

static inline int rec_find(const bc_rec_t *e, uint32_t k, uint64_t *w)
{
    uint32_t k2;
    return rec_read(e, k, w, &k2);
}

/* Peer q's fingerprint of collective k, whose first step is s, once q has posted s: in q's
 * post line or in q's small-broadcast record of step s. */
static inline int fp_find(const shm_comm *c, int q, uint32_t k, uint32_t s, uint64_t *w)
{
    const ctr_t *p = &c->ctl[q].post;
    uint32_t k1 = atomic_load_explicit(&p->fp_k[k % FP_SLOTS], memory_order_acquire);
    uint64_t pw = atomic_load_explicit(&p->fp_word[k % FP_SLOTS], memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    uint32_t k2 = atomic_load_explicit(&p->fp_k[k % FP_SLOTS], memory_order_relaxed);
    *w = pw;
    if (k1 == k && k2 == k)
        return FP_FOUND;
    /* not in the post line: the ring record (another line) */
    uint32_t e2;
    if (rec_read(&c->ctl[q].bc[s % BC_RING], k, w, &e2))
        return FP_FOUND;
    /* rewritten since, or being rewritten: q published a later collective there */
    k2 &= ~FP_WRITING;
    e2 &= ~FP_WRITING;
    if ((k2 && (int32_t)(k2 - k) > 0) || (e2 && (int32_t)(e2 - k) > 0))
        return FP_GONE;
    return FP_ABSENT;
}

static inline int fp_mismatch(shm_comm *c, int q, uint32_t k, uint64_t mine, uint64_t theirs)
{
    record_fail(c, SHM_FAIL_MISMATCH, k, c->me, q, mine, theirs, NULL);
    c->err_peer = q;
    return SHM_EFAILED;
}

/* Compare peer q's fingerprint of collective k (first step s) with word, once q has
 * posted s (the wait's acquire load made it visible). skip_gone: a peer that has moved on
 * since counts as compared (the comparisons of a call made later). */
static inline int fp_check_word(shm_comm *c, int q, uint32_t k, uint32_t s, uint64_t word,
                                int skip_gone)
{
    uint64_t w;
    int found = fp_find(c, q, k, s, &w);
    if ((found == FP_FOUND && w == word) || (found == FP_GONE && skip_gone))
        return SHM_OK;
    return fp_mismatch(c, q, k, word, w);
}

static inline int fp_check(shm_comm *c, int q)
{
    return fp_check_word(c, q, c->coll, c->s0_of[c->coll % FP_SLOTS], c->fp, 0);
}

/* Every peer's post of step s, each compared (and the deferred comparisons settled). */
SHM_HIDDEN int fp_check_all(shm_comm *c, uint32_t s);
/* The root of a one-block broadcast whose first step is s0 returns without comparing:
 * the comparison waits for a later wait of the root's (at most two stay due at once). */
SHM_HIDDEN int fp_defer(shm_comm *c, uint32_t s0);
/* Compare the due broadcasts whose first step is s or earlier with every peer. */
SHM_HIDDEN int fp_settle(shm_comm *c, uint32_t s);
SHM_HIDDEN int fp_sync(shm_comm *c, uint64_t word);
/* Compare the small broadcast this rank was the root of in ring record i with every peer. */
SHM_HIDDEN int bc_settle(shm_comm *c, int i);

#endif
