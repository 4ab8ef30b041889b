/* The TCP engine's private header: the frame header, the engine's state, and what its
 * parts share. tcp_transport.c moves frames (sending, receiving, matching, progress and
 * waits), tcp_engine.c holds the engine's lifecycle, point to point and the collective
 * plumbing (sequence numbers, fingerprint frames), tcp_algorithms.c the collectives.
 *
 * Threading: one mutex guards all state. A waiting thread that finds nobody
 * polling becomes the poller: it polls every socket (mutex released while in
 * poll), then reads and writes under the mutex, completing anyone's requests.
 * Other waiters sleep on a condition variable. Waits spin (poll timeout 0) for
 * spin_s, then block, so ranks that outnumber cores stay fast.
 */
#ifndef COLLECTIVES_TCP_INTERNAL_H
#define COLLECTIVES_TCP_INTERNAL_H
#define _GNU_SOURCE
#include "tcp_engine.h"
#include "kernels/reduce_kernels_import.h"

#define TCP_HIDDEN __attribute__((visibility("hidden")))

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <endian.h>

#define MAGIC 0xC011u
#define STAGE (256 * 1024)
#define ERRTEXT 1024

enum { F_DATA = 1, F_ERROR = 2, F_CLOSE = 3, F_MISMATCH = 4 };
/* An F_ERROR frame's text is the group's verdict on the collective, worded alike wherever
 * it is seen (a size mismatch named by both ends of its pair): receivers raise it as is
 * rather than as "rank N reported: ...", so every rank raises the same words. */
#define FLAG_VERDICT 1
/* frame kinds: the collectives' codes equal collectives.core.fingerprint's kind codes */
enum { K_BARRIER = 1, K_BROADCAST, K_ALLREDUCE, K_REDUCE, K_ALLGATHER, K_GATHER,
       K_SCATTER, K_REDUCE_SCATTER, K_ALLTOALL, K_P2P, K_NKINDS };
TCP_HIDDEN extern const char *const KNAMES[K_NKINDS];
enum { W_NONE = 0, W_RQ, W_SQ, W_FILL, W_CLAIM };
enum { M_DISCARD = 0, M_REQ, M_MSG, M_ERR };

/* A frame header as this engine reads it; on the wire it is HDR bytes, little-endian, in
 * this order (hdr_encode/hdr_decode), so ranks of any byte order agree. */
typedef struct {
    uint16_t magic;
    uint8_t version;  /* TCP_WIRE_VERSION */
    uint8_t ftype;
    uint8_t kind;
    uint8_t dtype;    /* point to point: the sender's dtype code (TCP_NO_DTYPE: bytes) */
    uint16_t flags;   /* F_ERROR: FLAG_VERDICT; else 0 */
    uint32_t group;
    int32_t tag;
    uint64_t seq;     /* collectives: the collective's number in the group */
    uint64_t fp;      /* collectives: the sender's call fingerprint (collectives.core.fingerprint) */
    uint64_t aux;     /* all_to_all: the bytes the sender expects back from the receiver */
    uint64_t len;     /* payload bytes */
} hdr_t;
#define HDR ((size_t)48)

/* The error text of a fingerprint mismatch: a placeholder that the Python layer replaces
 * with collectives.core.fingerprint.mismatch_message of the record (tcp_mismatch). */
#define MISMATCH_TEXT "{mismatch}"
#define MISMATCH_LEN 24  /* F_MISMATCH payload: fp_a, fp_b (u64), a, b (u32), little-endian */

/* a collective step's tag, and a fingerprint frame's */
#define TAG(step, seg) ((int32_t)(((uint32_t)(step) << 16) | (uint32_t)(seg)))
#define TAG_FP(round) ((int32_t)(-1 - (round)))  /* data tags (TAG) are never negative */

typedef struct tcp_msg tcp_msg;

struct tcp_req {
    tcp_req *next, *prev;
    int is_send, peer, kind;
    int32_t tag;
    int dtype;     /* point to point: the buffer's dtype code */
    uint64_t seq;
    uint64_t fp;
    uint64_t aux;  /* a send: the header's aux; a receive: the aux expected (what we send back) */
    int flags;     /* a send: the header's flags */
    char *buf;
    size_t len, nbytes;
    int source, state, where, owned;
    tcp_msg *claimed;
    unsigned char hw[HDR];  /* the header as sent (wire encoding) */
    size_t sent;
    char err[320];
};

struct tcp_msg {
    tcp_msg *next, *prev;
    hdr_t h;
    int peer, complete;
    char *data;
    size_t cap;
    uint64_t arrival;
    tcp_req *claim;
};

typedef struct {
    int fd, dead, closing;
    int lowat;  /* SO_RCVLOWAT in force: poll wakes once a large payload has mostly arrived */
    char deadmsg[256];
    char *stage;
    size_t rpos, rend;
    int phase, mode;
    hdr_t h;
    char *dst;
    size_t left;
    tcp_req *rreq;
    tcp_msg *rmsg;
    char errtext[ERRTEXT];
    tcp_req *sq_head, *sq_tail;
    tcp_msg *uq_head, *uq_tail;
} peer_t;

struct tcp_engine {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int rank, size;
    int *names;  /* the rank each engine rank is called by in messages (NULL: itself) */
    uint32_t group;
    double timeout;
    peer_t *peers;
    tcp_req *rq_head, *rq_tail;
    int polling, nwaiters, closed;
    int wake[2];
    struct pollfd *pfds;
    int *pidx;
    uint64_t arrivals;
    /* payload buffers of consumed unexpected messages, kept for reuse (no page faults) */
    char *spare[4];
    size_t spare_cap[4];
    /* the collective in flight */
    uint64_t seq;
    int seq_shift;         /* messages name collective seq >> seq_shift (tcp_number_next) */
    int coll_active, cur_kind;
    uint64_t cur_fp;       /* this rank's fingerprint of the collective in flight */
    double coll_deadline;
    double coll_span;      /* the timeout coll_deadline was set from (for messages) */
    char coll_err[512];
    int coll_verdict;     /* coll_err is a verdict (FLAG_VERDICT): raised and passed on as is */
    char poison[512];
    uint64_t poison_seq;  /* collectives from this sequence number on fail */
    int poison_verdict;   /* poison is a verdict (FLAG_VERDICT): raised as is */
    /* the first fingerprint mismatch this rank saw or heard of (mm_seq 0: none) */
    uint64_t mm_seq, mm_fp_a, mm_fp_b;
    int mm_a, mm_b;       /* rank a called mm_fp_a, rank b mm_fp_b (a < b) */
    uint64_t *heard;      /* per peer: the collective of the last failure it reported */
    /* per peer: the fingerprint of its own call that its mismatch frame carried, and for
     * which collective (mm_canonical) */
    uint64_t *peer_fp, *peer_fp_seq;
    /* fingerprint frames of a rooted collective (see fp_post) */
    tcp_req *fpreqs;
    tcp_req **fpptr;
    int nfp, fp_on;
    unsigned char *data_to, *data_from;
    tcp_req *creqs;
    tcp_req **cptr;
    size_t ncreqs;
    char *scratch, *tmp;
    size_t scratch_cap, tmp_cap;
    /* tuning */
    double spin_s;
    size_t rd_max, tree_max, seg, direct_max;
    size_t hd_max;     /* all_reduce above rd_max: halving-doubling up to this (above 2 ranks) */
    int use_lowat;
    int seg_split;        /* segments a pipelined block is split into at least (seg_bytes) */
    int fp_direct_world;  /* fingerprint frames: to every peer up to this world size, else rounds */
    size_t duplex_chunk;   /* bytes per sendmsg, and per read while sends wait (0: no limit) */
    int direct_world;  /* large all_reduce: direct two-round exchange up to this world size, else ring */
};

/* ------------------------------------------------------------- small helpers */

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Rank r as messages call it: an engine inside another group (the host leaders of a
 * hierarchical one) names its ranks by their ranks in that group. */
static inline int RN(const tcp_engine *e, int r)
{
    return e->names && r >= 0 && r < e->size ? e->names[r] : r;
}

/* Collective seq as messages number it: the caller's collective, when the engine runs one
 * level of another group and numbers its pieces (tcp_number_next). */
static inline unsigned long long SN(const tcp_engine *e, uint64_t seq)
{
    return (unsigned long long)(seq >> e->seq_shift);
}

static inline void fmt(char *dst, size_t cap, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    vsnprintf(dst, cap, f, ap);
    va_end(ap);
}

static inline int mod(int a, int n) { return ((a % n) + n) % n; }

/* First element of block i when count elements are split into n near-equal blocks. */
static inline size_t blk(size_t count, int n, int i)
{
    size_t q = count / (size_t)n, r = count % (size_t)n;
    return q * (size_t)i + ((size_t)i < r ? (size_t)i : r);
}

/* ------------------------------------------------- shared between the parts */

/* sending, receiving, matching, progress (tcp_transport.c) */
TCP_HIDDEN void req_list_remove(tcp_req **head, tcp_req **tail, tcp_req *r);
TCP_HIDDEN void req_fail(tcp_engine *e, tcp_req *r, const char *why);
TCP_HIDDEN void msg_drop(tcp_engine *e, int pi, tcp_msg *m);
TCP_HIDDEN void peer_dead(tcp_engine *e, int pi, const char *why);
TCP_HIDDEN void flush_peer(tcp_engine *e, int pi);
TCP_HIDDEN void fill_hdr(tcp_engine *e, tcp_req *r, int ftype);
TCP_HIDDEN void post_send_locked(tcp_engine *e, tcp_req *r);
TCP_HIDDEN void send_control(tcp_engine *e, int pi, int ftype, uint64_t seq, const void *data,
                             size_t len, uint64_t fp, int flags);
TCP_HIDDEN void report_mismatch(tcp_engine *e, int pi, const hdr_t *h);
TCP_HIDDEN void mismatch_encode(const tcp_engine *e, unsigned char *w);
TCP_HIDDEN void post_recv_locked(tcp_engine *e, tcp_req *r);
TCP_HIDDEN void cancel_req(tcp_engine *e, tcp_req *r);
TCP_HIDDEN void poll_once(tcp_engine *e, int ms);
TCP_HIDDEN int wait_locked(tcp_engine *e, tcp_req **rs, int n, double deadline, double span,
                       int coll, char *err, size_t errlen);

/* Make *r a fresh request (every other field zero): direction, peer, traffic kind and tag,
 * the call it belongs to (seq, fp), what it carries; a receive's source is unknown (-1)
 * until it matches. */
static inline void req_init(tcp_req *r, int is_send, int peer, int kind, int32_t tag,
                            uint64_t seq, uint64_t fp, int dtype, const void *buf, size_t len)
{
    *r = (tcp_req){.is_send = is_send, .peer = peer, .kind = kind, .tag = tag, .seq = seq,
                   .fp = fp, .dtype = dtype, .buf = (char *)buf, .len = len, .source = -1};
}

/* The two turns of a wait, mutex held. A thread that finds nobody polling becomes the
 * poller for one poll_once (up to ms) and wakes the sleepers after; any other sleeps on the
 * condition variable until the poller wakes it, 50 ms pass or the deadline comes. */
static inline void poll_as_poller(tcp_engine *e, int ms)
{
    e->polling = 1;
    poll_once(e, ms);
    e->polling = 0;
    if (e->nwaiters) pthread_cond_broadcast(&e->cv);
}

static inline void sleep_while_polled(tcp_engine *e, double t, double deadline)
{
    double until = deadline < t + 0.05 ? deadline : t + 0.05;
    struct timespec ts;
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    e->nwaiters++;
    pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    e->nwaiters--;
}

/* collective plumbing and fingerprint frames (tcp_engine.c) */
TCP_HIDDEN int ensure_buf(char **p, size_t *cap, size_t need);
TCP_HIDDEN int ensure_reqs(tcp_engine *e, size_t n);
TCP_HIDDEN int coll_begin(tcp_engine *e, int kind, uint64_t fp, char *err, size_t errlen);
TCP_HIDDEN int coll_end(tcp_engine *e, int rc, char *err, size_t errlen);
TCP_HIDDEN tcp_req *cset(tcp_engine *e, int i, int is_send, int peer, int32_t tag, const void *buf, size_t len);
TCP_HIDDEN void cpost(tcp_engine *e, int lo, int hi);
TCP_HIDDEN int cwait(tcp_engine *e, int lo, int hi, char *err, size_t errlen);
TCP_HIDDEN void cancel_range(tcp_engine *e, int lo, int hi);
TCP_HIDDEN int cxfer(tcp_engine *e, int n, char *err, size_t errlen);
TCP_HIDDEN void links_clear(tcp_engine *e);
TCP_HIDDEN void tree_links(tcp_engine *e, int root, unsigned char *up, unsigned char *down);
TCP_HIDDEN void fp_begin(tcp_engine *e);
TCP_HIDDEN int fp_finish(tcp_engine *e, int rc, char *err, size_t errlen);

#endif
