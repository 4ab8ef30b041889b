/* TCP transport engine: framed messages over one socket per peer, a poll-driven
 * full-duplex progress loop shared by every waiting thread, and the collectives.
 *
 * Threading: one mutex guards all state. A waiting thread that finds nobody
 * polling becomes the poller: it polls every socket (mutex released while in
 * poll), then reads and writes under the mutex, completing anyone's requests.
 * Other waiters sleep on a condition variable. Waits spin (poll timeout 0) for
 * spin_s, then block, so ranks that outnumber cores stay fast.
 */
#define _GNU_SOURCE
#include "tcp_engine.h"
#include "reduce_kernels.h"

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
/* frame kinds: the collectives' codes equal collectives.fingerprint's kind codes */
enum { K_BARRIER = 1, K_BROADCAST, K_ALLREDUCE, K_REDUCE, K_ALLGATHER, K_GATHER,
       K_SCATTER, K_REDUCE_SCATTER, K_ALLTOALL, K_P2P, K_NKINDS };
static const char *KNAMES[K_NKINDS] = {"?", "barrier", "broadcast", "all_reduce", "reduce",
                                       "all_gather", "gather", "scatter", "reduce_scatter",
                                       "all_to_all", "send/recv"};
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
    uint16_t flags;   /* 0 (reserved) */
    uint32_t group;
    int32_t tag;
    uint64_t seq;     /* collectives: the collective's number in the group */
    uint64_t fp;      /* collectives: the sender's call fingerprint (collectives.fingerprint) */
    uint64_t len;     /* payload bytes */
} hdr_t;
#define HDR ((size_t)40)

static void hdr_encode(const hdr_t *h, unsigned char *w)
{
    uint16_t u16;
    uint32_t u32;
    uint64_t u64;
    u16 = htole16(h->magic); memcpy(w, &u16, 2);
    w[2] = h->version;
    w[3] = h->ftype;
    w[4] = h->kind;
    w[5] = h->dtype;
    u16 = htole16(h->flags); memcpy(w + 6, &u16, 2);
    u32 = htole32(h->group); memcpy(w + 8, &u32, 4);
    u32 = htole32((uint32_t)h->tag); memcpy(w + 12, &u32, 4);
    u64 = htole64(h->seq); memcpy(w + 16, &u64, 8);
    u64 = htole64(h->fp); memcpy(w + 24, &u64, 8);
    u64 = htole64(h->len); memcpy(w + 32, &u64, 8);
}

static void hdr_decode(const unsigned char *w, hdr_t *h)
{
    uint16_t u16;
    uint32_t u32;
    uint64_t u64;
    memcpy(&u16, w, 2); h->magic = le16toh(u16);
    h->version = w[2];
    h->ftype = w[3];
    h->kind = w[4];
    h->dtype = w[5];
    memcpy(&u16, w + 6, 2); h->flags = le16toh(u16);
    memcpy(&u32, w + 8, 4); h->group = le32toh(u32);
    memcpy(&u32, w + 12, 4); h->tag = (int32_t)le32toh(u32);
    memcpy(&u64, w + 16, 8); h->seq = le64toh(u64);
    memcpy(&u64, w + 24, 8); h->fp = le64toh(u64);
    memcpy(&u64, w + 32, 8); h->len = le64toh(u64);
}

void tcp_wire_header(unsigned char *out, int ftype, int kind, int dtype, uint32_t group,
                     int32_t tag, uint64_t seq, uint64_t fp, uint64_t len)
{
    hdr_t h = {MAGIC, TCP_WIRE_VERSION, (uint8_t)ftype, (uint8_t)kind, (uint8_t)dtype, 0,
               group, tag, seq, fp, len};
    hdr_encode(&h, out);
}

void tcp_wire_header_parse(const unsigned char *in, uint64_t *fields)
{
    hdr_t h;
    hdr_decode(in, &h);
    uint64_t f[11] = {h.magic, h.version, h.ftype, h.kind, h.dtype, h.flags, h.group,
                      (uint64_t)(int64_t)h.tag, h.seq, h.fp, h.len};
    memcpy(fields, f, sizeof f);
}

typedef struct tcp_msg tcp_msg;

struct tcp_req {
    tcp_req *next, *prev;
    int is_send, peer, kind;
    int32_t tag;
    int dtype;     /* point to point: the buffer's dtype code */
    uint64_t seq;
    uint64_t fp;
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
    int coll_active, cur_kind;
    uint64_t cur_fp;       /* this rank's fingerprint of the collective in flight */
    double coll_deadline;
    double coll_span;      /* the timeout coll_deadline was set from (for messages) */
    char coll_err[512];
    char poison[512];
    uint64_t poison_seq;  /* collectives from this sequence number on fail */
    /* the first fingerprint mismatch this rank saw or heard of (mm_seq 0: none) */
    uint64_t mm_seq, mm_fp_a, mm_fp_b;
    int mm_a, mm_b;       /* rank a called mm_fp_a, rank b mm_fp_b */
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
    int use_lowat;
    int fp_direct_world;  /* fingerprint frames: to every peer up to this world size, else rounds */
    size_t duplex_chunk;   /* bytes per sendmsg, and per read while sends wait (0: no limit) */
    int direct_world;  /* large all_reduce: direct two-round exchange up to this world size, else ring */
};

/* ------------------------------------------------------------------ helpers */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Rank r as messages call it: an engine inside another group (the host leaders of a
 * hierarchical one) names its ranks by their ranks in that group. */
static int RN(const tcp_engine *e, int r)
{
    return e->names && r >= 0 && r < e->size ? e->names[r] : r;
}

static void fmt(char *dst, size_t cap, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    vsnprintf(dst, cap, f, ap);
    va_end(ap);
}

static void req_list_append(tcp_req **head, tcp_req **tail, tcp_req *r)
{
    r->next = NULL;
    r->prev = *tail;
    if (*tail) (*tail)->next = r; else *head = r;
    *tail = r;
}

static void req_list_remove(tcp_req **head, tcp_req **tail, tcp_req *r)
{
    if (r->prev) r->prev->next = r->next; else *head = r->next;
    if (r->next) r->next->prev = r->prev; else *tail = r->prev;
    r->next = r->prev = NULL;
}

static void msg_list_append(peer_t *p, tcp_msg *m)
{
    m->next = NULL;
    m->prev = p->uq_tail;
    if (p->uq_tail) p->uq_tail->next = m; else p->uq_head = m;
    p->uq_tail = m;
}

static void msg_list_remove(peer_t *p, tcp_msg *m)
{
    if (m->prev) m->prev->next = m->next; else p->uq_head = m->next;
    if (m->next) m->next->prev = m->prev; else p->uq_tail = m->prev;
    m->next = m->prev = NULL;
}

static void describe_req(tcp_engine *e, const tcp_req *r, char *out, size_t cap)
{
    if (r->kind == K_P2P) {
        if (r->is_send)
            fmt(out, cap, "isend to rank %d (tag %d)", RN(e, r->peer), r->tag);
        else if (r->peer < 0)
            fmt(out, cap, "irecv from any rank (tag %d)", r->tag);
        else
            fmt(out, cap, "irecv from rank %d (tag %d)", RN(e, r->peer), r->tag);
    } else {
        fmt(out, cap, "%s #%llu (%s rank %d)", KNAMES[r->kind], (unsigned long long)r->seq,
            r->is_send ? "sending to" : "receiving from", RN(e, r->peer));
    }
    (void)e;
}

static void wake_poller(tcp_engine *e)
{
    if (e->polling) {
        char c = 1;
        ssize_t k = write(e->wake[1], &c, 1);
        (void)k;
    }
}

static void req_complete(tcp_engine *e, tcp_req *r)
{
    r->where = W_NONE;
    r->state = 1;
    if (r->owned) free(r);
    (void)e;
}

static void req_fail(tcp_engine *e, tcp_req *r, const char *why)
{
    char d[160];
    describe_req(e, r, d, sizeof d);
    r->where = W_NONE;
    r->state = -1;
    fmt(r->err, sizeof r->err, "%s failed: %s", d, why);
    if (r->owned) free(r);
}

static void coll_set_err(tcp_engine *e, const char *msg)
{
    if (!e->coll_err[0]) fmt(e->coll_err, sizeof e->coll_err, "%s", msg);
    if (e->nwaiters) pthread_cond_broadcast(&e->cv);
    wake_poller(e);
}

/* ------------------------------------------------------------ peer failure */

#define SPARE_MIN (64 * 1024)

static void spare_put(tcp_engine *e, char *d, size_t cap)
{
    if (!d) return;
    if (cap >= SPARE_MIN) {
        int best = -1;
        for (int i = 0; i < 4; i++) {  /* keep the largest buffers */
            if (!e->spare[i]) { best = i; break; }
            if (best < 0 || e->spare_cap[i] < e->spare_cap[best]) best = i;
        }
        if (!e->spare[best] || e->spare_cap[best] < cap) {
            free(e->spare[best]);
            e->spare[best] = d;
            e->spare_cap[best] = cap;
            return;
        }
    }
    free(d);
}

static char *spare_get(tcp_engine *e, size_t len, size_t *cap)
{
    int best = -1;
    for (int i = 0; i < 4; i++)
        if (e->spare[i] && e->spare_cap[i] >= len && (best < 0 || e->spare_cap[i] < e->spare_cap[best]))
            best = i;
    if (best >= 0) {
        char *d = e->spare[best];
        *cap = e->spare_cap[best];
        e->spare[best] = NULL;
        return d;
    }
    *cap = len;
    return malloc(len);
}

static void msg_drop(tcp_engine *e, int pi, tcp_msg *m)
{
    peer_t *p = &e->peers[pi];
    if (p->rmsg == m) {  /* still arriving: skip the rest of it */
        p->rmsg = NULL;
        p->mode = M_DISCARD;
        p->dst = NULL;
    }
    msg_list_remove(p, m);
    spare_put(e, m->data, m->cap);
    free(m);
}

static void peer_dead(tcp_engine *e, int pi, const char *why)
{
    peer_t *p = &e->peers[pi];
    if (p->dead) return;
    p->dead = 1;
    fmt(p->deadmsg, sizeof p->deadmsg, "%s", why);
    if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
    if (p->rreq) {
        tcp_req *r = p->rreq;
        p->rreq = NULL;
        req_fail(e, r, why);
    }
    if (p->rmsg) {
        tcp_msg *m = p->rmsg;
        if (m->claim) {
            m->claim->claimed = NULL;
            req_fail(e, m->claim, why);
        }
        msg_drop(e, pi, m);
    }
    p->phase = 0;
    p->mode = M_DISCARD;
    p->dst = NULL;
    p->rpos = p->rend = 0;
    while (p->sq_head) {
        tcp_req *r = p->sq_head;
        req_list_remove(&p->sq_head, &p->sq_tail, r);
        req_fail(e, r, why);
    }
    int alive = 0;
    for (int i = 0; i < e->size; i++)
        if (i != e->rank && !e->peers[i].dead) alive++;
    tcp_req *r = e->rq_head;
    while (r) {
        tcp_req *nx = r->next;
        if (r->peer == pi || (r->peer < 0 && !alive)) {
            req_list_remove(&e->rq_head, &e->rq_tail, r);
            req_fail(e, r, r->peer < 0 ? "every peer has closed its connection" : why);
        }
        r = nx;
    }
    if (e->nwaiters) pthread_cond_broadcast(&e->cv);
}

static void peer_dead_errno(tcp_engine *e, int pi, int err)
{
    char m[200];
    fmt(m, sizeof m, "connection to rank %d failed: %s", RN(e, pi), strerror(err));
    peer_dead(e, pi, m);
}

/* ------------------------------------------------------------------ sending */

/* Write as much of pi's send queue as the socket takes, at most duplex_chunk bytes per
 * call: the poller then reads before it writes more, so both directions of an exchange
 * keep flowing (one large sendmsg fills the peer's buffers while the peer does the
 * same, and each then drains the other's data alone, measured 1.5x slower at 16 MiB). */
static void flush_peer(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    size_t quota = e->duplex_chunk ? e->duplex_chunk : (size_t)-1;
    while (p->sq_head && !p->dead && quota) {
        tcp_req *r = p->sq_head;
        struct iovec iov[2];
        int n = 0;
        if (r->sent < HDR) {
            iov[n].iov_base = r->hw + r->sent;
            iov[n++].iov_len = HDR - r->sent;
            if (r->len) {
                iov[n].iov_base = r->buf;
                iov[n++].iov_len = r->len;
            }
        } else {
            iov[n].iov_base = r->buf + (r->sent - HDR);
            iov[n++].iov_len = r->len - (r->sent - HDR);
        }
        if (iov[n - 1].iov_len > quota) iov[n - 1].iov_len = quota;
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = n;
        ssize_t k = sendmsg(p->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            peer_dead_errno(e, pi, errno);
            return;
        }
        r->sent += (size_t)k;
        quota = (size_t)k >= quota ? 0 : quota - (size_t)k;
        if (r->sent == HDR + r->len) {
            req_list_remove(&p->sq_head, &p->sq_tail, r);
            req_complete(e, r);
        }
    }
}

static void fill_hdr(tcp_engine *e, tcp_req *r, int ftype)
{
    hdr_t h = {MAGIC, TCP_WIRE_VERSION, (uint8_t)ftype, (uint8_t)r->kind, (uint8_t)r->dtype, 0,
               e->group, r->tag, r->seq, r->fp, r->len};
    hdr_encode(&h, r->hw);
}

static void post_send_locked(tcp_engine *e, tcp_req *r)
{
    peer_t *p = &e->peers[r->peer];
    r->state = 0;
    r->sent = 0;
    if (p->dead) {
        req_fail(e, r, p->deadmsg);
        return;
    }
    int first = p->sq_head == NULL;
    r->where = W_SQ;
    req_list_append(&p->sq_head, &p->sq_tail, r);
    if (first) flush_peer(e, r->peer);
    if (p->sq_head) wake_poller(e);  /* the poller must add POLLOUT */
}

static void send_control(tcp_engine *e, int pi, int ftype, uint64_t seq, const void *data, size_t len)
{
    if (len >= ERRTEXT) len = ERRTEXT - 1;
    tcp_req *r = calloc(1, sizeof(tcp_req) + len);
    if (!r) return;
    r->owned = 1;
    r->is_send = 1;
    r->peer = pi;
    r->kind = K_P2P;
    r->dtype = TCP_NO_DTYPE;
    r->seq = seq;
    r->buf = (char *)(r + 1);
    r->len = len;
    if (len) memcpy(r->buf, data, len);
    fill_hdr(e, r, ftype);
    post_send_locked(e, r);
}

/* ---------------------------------------------------------------- receiving */

/* The error text of a fingerprint mismatch: a placeholder that the Python layer replaces
 * with collectives.fingerprint.mismatch_message of the record (tcp_mismatch). */
#define MISMATCH_TEXT "{mismatch}"
#define MISMATCH_LEN 24  /* F_MISMATCH payload: fp_a, fp_b (u64), a, b (u32), little-endian */

/* Keep the earliest mismatch: rank a called fp_a, rank b fp_b, as collective seq; it
 * poisons the group from that collective on. */
static void record_mismatch(tcp_engine *e, uint64_t seq, int a, uint64_t fa, int b, uint64_t fb)
{
    if (e->mm_seq && e->mm_seq <= seq) return;
    e->mm_seq = seq;
    e->mm_a = a;
    e->mm_fp_a = fa;
    e->mm_b = b;
    e->mm_fp_b = fb;
    if (!e->poison[0] || seq <= e->poison_seq) {
        fmt(e->poison, sizeof e->poison, "%s", MISMATCH_TEXT);
        e->poison_seq = seq;
    }
}

static void report_mismatch(tcp_engine *e, int pi, const hdr_t *h)
{
    record_mismatch(e, h->seq, e->rank, e->cur_fp, pi, h->fp);
    coll_set_err(e, MISMATCH_TEXT);
}

static void mismatch_encode(const tcp_engine *e, unsigned char *w)
{
    uint64_t u64;
    uint32_t u32;
    u64 = htole64(e->mm_fp_a); memcpy(w, &u64, 8);
    u64 = htole64(e->mm_fp_b); memcpy(w + 8, &u64, 8);
    u32 = htole32((uint32_t)e->mm_a); memcpy(w + 16, &u32, 4);
    u32 = htole32((uint32_t)e->mm_b); memcpy(w + 20, &u32, 4);
}

/* An F_MISMATCH frame from pi arrived (payload in its errtext). */
static void mismatch_decode(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    const unsigned char *w = (const unsigned char *)p->errtext;
    uint64_t fa, fb;
    uint32_t a, b;
    memcpy(&fa, w, 8);
    memcpy(&fb, w + 8, 8);
    memcpy(&a, w + 16, 4);
    memcpy(&b, w + 20, 4);
    a = le32toh(a);
    b = le32toh(b);
    if (a >= (uint32_t)e->size || b >= (uint32_t)e->size) a = b = (uint32_t)pi;
    record_mismatch(e, p->h.seq, (int)a, le64toh(fa), (int)b, le64toh(fb));
}

static void new_unexpected(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    tcp_msg *m = calloc(1, sizeof *m);
    size_t cap = 0;
    char *d = p->h.len ? spare_get(e, p->h.len, &cap) : NULL;
    if (!m || (p->h.len && !d)) {
        free(m);
        free(d);
        peer_dead(e, pi, "out of memory buffering an unexpected message");
        return;
    }
    m->h = p->h;
    m->peer = pi;
    m->data = d;
    m->cap = cap;
    m->arrival = ++e->arrivals;
    msg_list_append(p, m);
    p->rmsg = m;
    p->dst = d;
    p->mode = M_MSG;
}

static void fill_req(tcp_engine *e, int pi, tcp_req *r)
{
    peer_t *p = &e->peers[pi];
    r->source = pi;
    r->nbytes = p->h.len;
    r->where = W_FILL;
    p->rreq = r;
    p->dst = r->buf;
    p->mode = M_REQ;
}

/* "25 x {dtype:2} (100 bytes)": a payload as messages show it ({dtype:N} is replaced by the
 * dtype's name in Python). */
static void describe_payload(char *out, size_t cap, int dtype, uint64_t len)
{
    size_t es = dtype == TCP_NO_DTYPE ? 0 : coll_itemsize(dtype);
    if (es && len % es == 0)
        fmt(out, cap, "%llu x {dtype:%d} (%llu bytes)", (unsigned long long)(len / es), dtype,
            (unsigned long long)len);
    else
        fmt(out, cap, "%llu bytes", (unsigned long long)len);
}

/* A point-to-point message must fill its receive exactly, with the receive's dtype (a byte
 * buffer, TCP_NO_DTYPE, takes any): else 1 and the reason in out. */
static int p2p_mismatch(tcp_engine *e, int pi, const hdr_t *h, const tcp_req *r, char *out, size_t cap)
{
    int dt_ok = h->dtype == r->dtype || h->dtype == TCP_NO_DTYPE || r->dtype == TCP_NO_DTYPE;
    if (h->len == r->len && dt_ok) return 0;
    char a[96], b[96];
    describe_payload(a, sizeof a, h->dtype, h->len);
    describe_payload(b, sizeof b, r->dtype, r->len);
    fmt(out, cap, "rank %d sent %s; this receive expects %s (a different size or dtype on the "
        "two sides)", RN(e, pi), a, b);
    return 1;
}

static void match_p2p(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    tcp_req *r;
    for (r = e->rq_head; r; r = r->next)
        if (r->kind == K_P2P && (r->peer == pi || r->peer < 0) && r->tag == p->h.tag) break;
    if (!r) {
        new_unexpected(e, pi);
        return;
    }
    req_list_remove(&e->rq_head, &e->rq_tail, r);
    char m[300];
    if (p2p_mismatch(e, pi, &p->h, r, m, sizeof m)) {
        req_fail(e, r, m);  /* the message is consumed (discarded), as matching ordered it */
        return;
    }
    fill_req(e, pi, r);
}

static void match_coll(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    const hdr_t *h = &p->h;
    if (h->seq < e->seq || (h->seq == e->seq && !e->coll_active)) return;  /* stale: discard */
    if (e->coll_active && h->seq == e->seq) {
        if (h->fp != e->cur_fp || h->kind != e->cur_kind) {
            report_mismatch(e, pi, h);  /* before any of its payload lands anywhere */
            return;
        }
        for (tcp_req *r = e->rq_head; r; r = r->next) {
            if (r->kind == K_P2P || r->peer != pi || r->seq != h->seq || r->tag != h->tag) continue;
            req_list_remove(&e->rq_head, &e->rq_tail, r);
            if (h->len != r->len) {
                char m[300];
                fmt(m, sizeof m, "%s #%llu: rank %d sent %llu bytes where this rank expects %zu "
                    "(different sizes on different ranks?)", KNAMES[e->cur_kind],
                    (unsigned long long)e->seq, RN(e, pi), (unsigned long long)h->len, r->len);
                req_fail(e, r, m);
                coll_set_err(e, m);
                return;
            }
            fill_req(e, pi, r);
            return;
        }
    }
    new_unexpected(e, pi);
}

/* A payload ended. Returns 1 when that completed a request (a waiter may be done). */
static int payload_done(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    int mode = p->mode;
    p->phase = 0;
    p->mode = M_DISCARD;
    p->dst = NULL;
    if (mode == M_REQ) {
        tcp_req *r = p->rreq;
        p->rreq = NULL;
        req_complete(e, r);
        return 1;
    } else if (mode == M_MSG) {
        tcp_msg *m = p->rmsg;
        p->rmsg = NULL;
        m->complete = 1;
        if (m->claim) {
            tcp_req *r = m->claim;
            if (m->h.len) memcpy(r->buf, m->data, m->h.len);
            r->claimed = NULL;
            msg_drop(e, pi, m);
            req_complete(e, r);
            return 1;
        }
    } else if (mode == M_ERR) {
        p->errtext[p->h.len] = 0;
        if (p->h.ftype == F_MISMATCH) {
            mismatch_decode(e, pi);
        } else if (!e->poison[0] || p->h.seq < e->poison_seq) {
            fmt(e->poison, sizeof e->poison, "rank %d reported: %s", RN(e, pi), p->errtext);
            e->poison_seq = p->h.seq;
        }
        /* a failure of a later collective must not fail one this rank can still finish */
        if (e->coll_active && e->seq >= e->poison_seq) coll_set_err(e, e->poison);
    }
    return 0;
}

static void on_header(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    char m[200];
    if (p->h.magic != MAGIC || p->h.group != e->group) {
        fmt(m, sizeof m, "received a corrupted frame from rank %d (bad magic or group id)", RN(e, pi));
        peer_dead(e, pi, m);
        return;
    }
    if (p->h.version != TCP_WIRE_VERSION) {
        fmt(m, sizeof m, "rank %d speaks wire protocol version %u, this rank version %u",
            RN(e, pi), p->h.version, TCP_WIRE_VERSION);
        peer_dead(e, pi, m);
        return;
    }
    p->left = p->h.len;
    p->dst = NULL;
    p->mode = M_DISCARD;
    switch (p->h.ftype) {
    case F_CLOSE:
        p->closing = 1;
        break;
    case F_ERROR:
        if (p->h.len >= ERRTEXT) {
            fmt(m, sizeof m, "received a corrupted error frame from rank %d", RN(e, pi));
            peer_dead(e, pi, m);
            return;
        }
        p->mode = M_ERR;
        p->dst = p->errtext;
        break;
    case F_MISMATCH:
        if (p->h.len != MISMATCH_LEN) {
            fmt(m, sizeof m, "received a corrupted mismatch frame from rank %d", RN(e, pi));
            peer_dead(e, pi, m);
            return;
        }
        p->mode = M_ERR;
        p->dst = p->errtext;
        break;
    case F_DATA:
        if (p->h.kind == K_P2P) match_p2p(e, pi);
        else if (p->h.kind < K_NKINDS) match_coll(e, pi);
        else {
            fmt(m, sizeof m, "received a frame of unknown kind from rank %d", RN(e, pi));
            peer_dead(e, pi, m);
            return;
        }
        break;
    default:
        fmt(m, sizeof m, "received a corrupted frame from rank %d (bad frame type)", RN(e, pi));
        peer_dead(e, pi, m);
        return;
    }
    if (p->dead) return;
    if (p->left == 0) (void)payload_done(e, pi);
    else p->phase = 1;
}

static void peer_eof(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    char m[200];
    if (p->closing && p->phase == 0)
        fmt(m, sizeof m, "rank %d shut down its backend (clean close)", RN(e, pi));
    else
        fmt(m, sizeof m, "rank %d closed the connection unexpectedly (the process exited or crashed)", RN(e, pi));
    peer_dead(e, pi, m);
}

#define LOWAT_MIN (256 * 1024)
#define LOWAT_MAX (1024 * 1024)

static void progress_recv_inner(tcp_engine *e, int pi);

/* Read what pi's socket holds (bounded), parsing frames and filling buffers; then
 * ask poll to wake us only when a good part of a large payload is there (never more
 * than the rest of the current frame, so a wake-up always comes). */
static void progress_recv(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    progress_recv_inner(e, pi);
    if (p->dead) return;
    int want = 1;
    if (e->use_lowat && p->phase == 1 && p->left >= LOWAT_MIN) want = p->left < LOWAT_MAX ? (int)p->left : LOWAT_MAX;
    if (want != p->lowat && setsockopt(p->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0)
        p->lowat = want;
}

static void progress_recv_inner(tcp_engine *e, int pi)
{
    peer_t *p = &e->peers[pi];
    /* while sends to pi wait, read one chunk and let the poller write (see flush_peer) */
    size_t budget = e->duplex_chunk && p->sq_head ? e->duplex_chunk : 16u << 20;
    while (!p->dead) {
        size_t avail = p->rend - p->rpos;
        if (p->phase == 0) {
            if (avail >= HDR) {
                hdr_decode((const unsigned char *)p->stage + p->rpos, &p->h);
                p->rpos += HDR;
                on_header(e, pi);
                continue;
            }
            if (!budget) return;
            if (p->rpos) {
                memmove(p->stage, p->stage + p->rpos, avail);
                p->rpos = 0;
                p->rend = avail;
            }
            ssize_t k = recv(p->fd, p->stage + p->rend, STAGE - p->rend, MSG_DONTWAIT);
            if (k > 0) {
                p->rend += (size_t)k;
                budget = (size_t)k >= budget ? 0 : budget - (size_t)k;
                continue;
            }
            if (k == 0) { peer_eof(e, pi); return; }
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            peer_dead_errno(e, pi, errno);
            return;
        }
        if (avail) {
            size_t m = avail < p->left ? avail : p->left;
            if (p->dst) {
                memcpy(p->dst, p->stage + p->rpos, m);
                p->dst += m;
            }
            p->rpos += m;
            p->left -= m;
            if (!p->left && payload_done(e, pi) && p->rpos == p->rend) return;
            continue;
        }
        if (!budget) return;
        p->rpos = p->rend = 0;
        ssize_t k;
        int direct = p->dst && p->left >= 8192;
        if (direct) k = recv(p->fd, p->dst, p->left < budget ? p->left : budget, MSG_DONTWAIT);
        else k = recv(p->fd, p->stage, STAGE, MSG_DONTWAIT);
        if (k > 0) {
            budget = (size_t)k >= budget ? 0 : budget - (size_t)k;
            if (direct) {
                p->dst += k;
                p->left -= (size_t)k;
                /* a request completed: leave what follows in the socket for now, so that a
                 * frame its receiver has not posted yet (the next collective's, say) is
                 * read straight into that receive once posted, not buffered and copied */
                if (!p->left && payload_done(e, pi)) return;
            } else {
                p->rend = (size_t)k;
            }
            continue;
        }
        if (k == 0) { peer_eof(e, pi); return; }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        peer_dead_errno(e, pi, errno);
        return;
    }
}

/* Post a receive: take a matching unexpected message if one arrived, else queue it. */
static void post_recv_locked(tcp_engine *e, tcp_req *r)
{
    r->state = 0;
    r->nbytes = 0;
    r->source = -1;
    r->claimed = NULL;
    tcp_msg *best = NULL;
    int lo = r->peer < 0 ? 0 : r->peer, hi = r->peer < 0 ? e->size - 1 : r->peer;
    for (int pi = lo; pi <= hi; pi++) {
        if (pi == e->rank) continue;
        for (tcp_msg *m = e->peers[pi].uq_head; m; m = m->next) {
            if (m->claim) continue;
            int ok = r->kind == K_P2P ? (m->h.kind == K_P2P && m->h.tag == r->tag)
                                      : (m->h.kind != K_P2P && m->h.seq == r->seq && m->h.tag == r->tag);
            if (ok) {
                if (!best || m->arrival < best->arrival) best = m;
                break;
            }
        }
    }
    if (best) {
        int pi = best->peer;
        char msg[400];
        if (r->kind != K_P2P && (best->h.fp != e->cur_fp || best->h.kind != e->cur_kind)) {
            report_mismatch(e, pi, &best->h);
            msg_drop(e, pi, best);
            req_fail(e, r, MISMATCH_TEXT);
            return;
        }
        if (r->kind == K_P2P ? p2p_mismatch(e, pi, &best->h, r, msg, sizeof msg) : best->h.len != r->len) {
            if (r->kind != K_P2P)
                fmt(msg, sizeof msg, "%s #%llu: rank %d sent %llu bytes where this rank expects %zu "
                    "(different sizes on different ranks?)", KNAMES[e->cur_kind],
                    (unsigned long long)e->seq, RN(e, pi), (unsigned long long)best->h.len, r->len);
            msg_drop(e, pi, best);
            req_fail(e, r, msg);
            if (r->kind != K_P2P) coll_set_err(e, msg);
            return;
        }
        r->source = pi;
        r->nbytes = best->h.len;
        if (best->complete) {
            if (best->h.len) memcpy(r->buf, best->data, best->h.len);
            msg_drop(e, pi, best);
            r->state = 1;
            r->where = W_NONE;
        } else {
            best->claim = r;
            r->claimed = best;
            r->where = W_CLAIM;
        }
        return;
    }
    if (r->peer >= 0 && e->peers[r->peer].dead) {
        req_fail(e, r, e->peers[r->peer].deadmsg);
        return;
    }
    if (r->peer < 0) {
        int alive = 0;
        for (int i = 0; i < e->size; i++)
            if (i != e->rank && !e->peers[i].dead) alive++;
        if (!alive) {
            req_fail(e, r, "every peer has closed its connection");
            return;
        }
    }
    r->where = W_RQ;
    req_list_append(&e->rq_head, &e->rq_tail, r);
}

/* Withdraw a pending request (timeout, failure of its collective, or free). */
static void cancel_req(tcp_engine *e, tcp_req *r)
{
    switch (r->where) {
    case W_RQ:
        req_list_remove(&e->rq_head, &e->rq_tail, r);
        break;
    case W_FILL: {
        peer_t *p = &e->peers[r->source];
        if (p->rreq == r) {
            p->rreq = NULL;
            p->mode = M_DISCARD;
            p->dst = NULL;
        }
        break;
    }
    case W_CLAIM:
        if (r->claimed) r->claimed->claim = NULL;
        r->claimed = NULL;
        break;
    case W_SQ: {
        peer_t *p = &e->peers[r->peer];
        if (r->sent == 0) {
            req_list_remove(&p->sq_head, &p->sq_tail, r);
        } else {
            /* half written: finish the frame from an engine-owned copy so the stream stays framed */
            tcp_req *c = malloc(sizeof(tcp_req) + r->len);
            if (!c) {
                req_list_remove(&p->sq_head, &p->sq_tail, r);
                peer_dead(e, r->peer, "out of memory while cancelling a send");
                break;
            }
            *c = *r;
            c->buf = (char *)(c + 1);
            if (r->len) memcpy(c->buf, r->buf, r->len);
            c->owned = 1;
            if (c->prev) c->prev->next = c; else p->sq_head = c;
            if (c->next) c->next->prev = c; else p->sq_tail = c;
            r->next = r->prev = NULL;
        }
        break;
    }
    default:
        break;
    }
    r->where = W_NONE;
}

/* --------------------------------------------------------------- progress */

/* One poll pass; called by the poller with the mutex held (released inside poll). */
static void poll_once(tcp_engine *e, int ms)
{
    int np = 0;
    e->pfds[np].fd = e->wake[0];
    e->pfds[np].events = POLLIN;
    e->pidx[np++] = -1;
    for (int i = 0; i < e->size; i++) {
        peer_t *p = &e->peers[i];
        if (i == e->rank || p->dead) continue;
        e->pfds[np].fd = p->fd;
        e->pfds[np].events = POLLIN | (p->sq_head ? POLLOUT : 0);
        e->pidx[np++] = i;
    }
    pthread_mutex_unlock(&e->mu);
    int k = poll(e->pfds, (nfds_t)np, ms);
    pthread_mutex_lock(&e->mu);
    if (k <= 0 || e->closed) return;
    for (int j = 0; j < np; j++) {
        short rev = e->pfds[j].revents;
        if (!rev) continue;
        int pi = e->pidx[j];
        if (pi < 0) {
            char buf[64];
            while (read(e->wake[0], buf, sizeof buf) > 0) {}
            continue;
        }
        peer_t *p = &e->peers[pi];
        if (p->dead || p->fd != e->pfds[j].fd) continue;
        if (rev & POLLOUT) flush_peer(e, pi);
        if (rev & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) progress_recv(e, pi);
    }
}

/* Wait until every request in rs[0..n) finished; mutex held. On failure, cancels the
 * pending ones and fills err. span: the timeout the deadline was set from (named in the
 * message, in torch gloo's words). coll: also fail when the running collective failed,
 * and withdraw the requests at the deadline; otherwise (point to point) a wait that runs
 * out returns -2 and leaves them posted, as torch's gloo does: a message that arrives
 * later still lands in its receive. */
static int wait_locked(tcp_engine *e, tcp_req **rs, int n, double deadline, double span,
                       int coll, char *err, size_t errlen)
{
    double t0 = now_s();
    const char *why = NULL;
    char tmsg[400];
    for (;;) {
        int all = 1;
        /* a mismatch explains whatever else failed since (peers closing after it, say) */
        if (coll && e->coll_err[0] && e->mm_seq && e->mm_seq <= e->seq) { why = e->coll_err; goto fail; }
        for (int i = 0; i < n; i++) {
            if (rs[i]->state < 0) { why = rs[i]->err; goto fail; }
            if (rs[i]->state == 0) all = 0;
        }
        if (all) return 0;
        if (coll && e->coll_err[0]) { why = e->coll_err; goto fail; }
        if (e->closed) { why = "the backend was shut down"; goto fail; }
        double t = now_s();
        if (t >= deadline) {
            for (int i = 0; i < n; i++) {
                if (rs[i]->state == 0) {
                    char d[200];
                    describe_req(e, rs[i], d, sizeof d);
                    fmt(tmsg, sizeof tmsg, "%s: Timed out waiting %.0fms (the peer did not answer)",
                        d, span * 1000.0);
                    break;
                }
            }
            why = tmsg;
            if (!coll) {
                if (err) fmt(err, errlen, "%s", why);
                return -2;
            }
            goto fail;
        }
        if (!e->polling) {
            e->polling = 1;
            int ms = 0;
            if (t - t0 >= e->spin_s) {
                double rem = deadline - t;
                if (rem > 1.0) rem = 1.0;
                ms = (int)ceil(rem * 1000.0);
                if (ms < 1) ms = 1;
            }
            poll_once(e, ms);
            e->polling = 0;
            if (e->nwaiters) pthread_cond_broadcast(&e->cv);
            if (!ms) {
                /* spinning: let ranks that share our core run (they are often whom we wait for) */
                pthread_mutex_unlock(&e->mu);
                sched_yield();
                pthread_mutex_lock(&e->mu);
            }
        } else {
            double until = deadline < t + 0.05 ? deadline : t + 0.05;
            struct timespec ts;
            ts.tv_sec = (time_t)until;
            ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
            e->nwaiters++;
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
            e->nwaiters--;
        }
    }
fail:
    if (err) fmt(err, errlen, "%s", why);
    for (int i = 0; i < n; i++) {
        if (rs[i]->state == 0) {
            cancel_req(e, rs[i]);
            rs[i]->state = -1;
            fmt(rs[i]->err, sizeof rs[i]->err, "%s", err ? err : "cancelled");
        }
    }
    return -1;
}

/* --------------------------------------------------------------- lifecycle */

tcp_engine *tcp_engine_new(int rank, int size, const int *fds, uint32_t group, double timeout_s)
{
    tcp_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->rank = rank;
    e->size = size;
    e->group = group;
    e->timeout = timeout_s;
    e->peers = calloc((size_t)size, sizeof(peer_t));
    e->pfds = calloc((size_t)size + 1, sizeof(struct pollfd));
    e->pidx = calloc((size_t)size + 1, sizeof(int));
    e->fpreqs = calloc(2 * (size_t)size, sizeof(tcp_req));
    e->fpptr = calloc(2 * (size_t)size, sizeof(tcp_req *));
    e->data_to = calloc(2 * (size_t)size, 1);
    if (!e->peers || !e->pfds || !e->pidx || !e->fpreqs || !e->fpptr || !e->data_to || pipe2(e->wake, O_NONBLOCK | O_CLOEXEC) != 0) goto bad;
    for (int i = 0; i < size; i++) {
        peer_t *p = &e->peers[i];
        p->fd = i == rank ? -1 : fds[i];
        p->lowat = 1;
        if (i == rank) continue;
        p->stage = malloc(STAGE);
        if (!p->stage) goto bad;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    e->spin_s = 20e-6;
    e->data_from = e->data_to + size;
    e->use_lowat = 1;
    e->fp_direct_world = 8;
    e->duplex_chunk = 1024 * 1024;
    e->direct_world = 8;
    e->rd_max = 64 * 1024;
    e->tree_max = 64 * 1024;
    e->seg = 1024 * 1024;
    e->direct_max = 64 * 1024;
    return e;
bad:
    if (e->peers)
        for (int i = 0; i < size; i++) free(e->peers[i].stage);
    free(e->peers);
    free(e->pfds);
    free(e->pidx);
    free(e->fpreqs);
    free(e->fpptr);
    free(e->data_to);
    free(e);
    return NULL;
}

void tcp_set_tuning(tcp_engine *e, int key, int64_t v)
{
    pthread_mutex_lock(&e->mu);
    switch (key) {
    case TCP_TUNE_SPIN_US: e->spin_s = v * 1e-6; break;
    case TCP_TUNE_ALLREDUCE_RD_MAX: e->rd_max = (size_t)v; break;
    case TCP_TUNE_BCAST_TREE_MAX: e->tree_max = (size_t)v; break;
    case TCP_TUNE_SEGMENT: e->seg = v > 0 ? (size_t)v : 1; break;
    case TCP_TUNE_GATHER_DIRECT_MAX: e->direct_max = (size_t)v; break;
    case TCP_TUNE_ALLREDUCE_DIRECT_WORLD: e->direct_world = (int)v; break;
    case TCP_TUNE_DUPLEX_CHUNK: e->duplex_chunk = v > 0 ? (size_t)v : 0; break;
    case TCP_TUNE_LOWAT: e->use_lowat = v != 0; break;
    case TCP_TUNE_FP_DIRECT_WORLD: e->fp_direct_world = (int)v; break;
    default: break;
    }
    pthread_mutex_unlock(&e->mu);
}

int64_t tcp_get_tuning(tcp_engine *e, int key)
{
    switch (key) {
    case TCP_TUNE_SPIN_US: return (int64_t)llround(e->spin_s * 1e6);
    case TCP_TUNE_ALLREDUCE_RD_MAX: return (int64_t)e->rd_max;
    case TCP_TUNE_BCAST_TREE_MAX: return (int64_t)e->tree_max;
    case TCP_TUNE_SEGMENT: return (int64_t)e->seg;
    case TCP_TUNE_GATHER_DIRECT_MAX: return (int64_t)e->direct_max;
    case TCP_TUNE_ALLREDUCE_DIRECT_WORLD: return e->direct_world;
    case TCP_TUNE_DUPLEX_CHUNK: return (int64_t)e->duplex_chunk;
    case TCP_TUNE_LOWAT: return e->use_lowat;
    case TCP_TUNE_FP_DIRECT_WORLD: return e->fp_direct_world;
    default: return -1;
    }
}

void tcp_set_timeout(tcp_engine *e, double timeout_s)
{
    pthread_mutex_lock(&e->mu);
    e->timeout = timeout_s;
    pthread_mutex_unlock(&e->mu);
}

int tcp_set_rank_names(tcp_engine *e, const int *names)
{
    int *copy = NULL;
    if (names) {
        copy = malloc(sizeof(int) * (size_t)e->size);
        if (!copy) return -1;
        memcpy(copy, names, sizeof(int) * (size_t)e->size);
    }
    pthread_mutex_lock(&e->mu);
    free(e->names);
    e->names = copy;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

uint64_t tcp_engine_seq(tcp_engine *e)
{
    return e->seq;
}

int tcp_mismatch(tcp_engine *e, uint64_t *seq, int *a, uint64_t *fp_a, int *b, uint64_t *fp_b)
{
    pthread_mutex_lock(&e->mu);
    int found = e->mm_seq != 0;
    if (found) {
        *seq = e->mm_seq;
        *a = e->mm_a;
        *fp_a = e->mm_fp_a;
        *b = e->mm_b;
        *fp_b = e->mm_fp_b;
    }
    pthread_mutex_unlock(&e->mu);
    return found;
}

void tcp_engine_close(tcp_engine *e)
{
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    for (int i = 0; i < e->size; i++)
        if (i != e->rank && !e->peers[i].dead) send_control(e, i, F_CLOSE, e->seq, NULL, 0);
    /* flush what is queued (bounded), so peers see every message and then a clean close */
    double deadline = now_s() + (e->timeout < 2.0 ? e->timeout : 2.0);
    for (;;) {
        int np = 0;
        for (int i = 0; i < e->size; i++) {
            peer_t *p = &e->peers[i];
            if (i == e->rank || p->dead || !p->sq_head) continue;
            flush_peer(e, i);
            if (p->dead || !p->sq_head) continue;
            e->pfds[np].fd = p->fd;
            e->pfds[np].events = POLLOUT;
            np++;
        }
        double t = now_s();
        if (!np || t >= deadline) break;
        /* no other thread reads or writes while closed is unset and we hold the mutex */
        poll(e->pfds, (nfds_t)np, 20);
    }
    e->closed = 1;
    for (int i = 0; i < e->size; i++) {
        peer_t *p = &e->peers[i];
        if (i == e->rank) continue;
        if (p->fd >= 0) shutdown(p->fd, SHUT_WR);
    }
    for (int i = 0; i < e->size; i++) {
        if (i == e->rank) continue;
        if (!e->peers[i].dead) peer_dead(e, i, "the backend was shut down");
    }
    while (e->rq_head) {
        tcp_req *r = e->rq_head;
        req_list_remove(&e->rq_head, &e->rq_tail, r);
        req_fail(e, r, "the backend was shut down");
    }
    char c = 1;
    ssize_t k = write(e->wake[1], &c, 1);
    (void)k;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void tcp_engine_free(tcp_engine *e)
{
    if (!e) return;
    tcp_engine_close(e);
    for (int i = 0; i < e->size; i++) {
        peer_t *p = &e->peers[i];
        if (p->fd >= 0) close(p->fd);
        while (p->uq_head) msg_drop(e, i, p->uq_head);
        free(p->stage);
    }
    for (int i = 0; i < 4; i++) free(e->spare[i]);
    close(e->wake[0]);
    close(e->wake[1]);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e->peers);
    free(e->pfds);
    free(e->pidx);
    free(e->names);
    free(e->creqs);
    free(e->cptr);
    free(e->fpreqs);
    free(e->fpptr);
    free(e->data_to);
    free(e->scratch);
    free(e->tmp);
    free(e);
}

/* ----------------------------------------------------------- point to point */

static tcp_req *p2p_new(tcp_engine *e, int is_send, void *buf, size_t len, int dtype, int peer,
                        int32_t tag, char *err, size_t errlen)
{
    tcp_req *r = calloc(1, sizeof *r);
    if (!r) {
        fmt(err, errlen, "out of memory");
        return NULL;
    }
    r->is_send = is_send;
    r->peer = peer;
    r->kind = K_P2P;
    r->tag = tag;
    r->dtype = dtype;
    r->buf = buf;
    r->len = len;
    r->source = -1;
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        free(r);
        fmt(err, errlen, "the tcp backend is shut down");
        return NULL;
    }
    if (is_send) {
        fill_hdr(e, r, F_DATA);
        post_send_locked(e, r);
    } else {
        post_recv_locked(e, r);
    }
    pthread_mutex_unlock(&e->mu);
    return r;
}

tcp_req *tcp_isend(tcp_engine *e, const void *buf, size_t len, int dtype, int dst, int32_t tag,
                   char *err, size_t errlen)
{
    return p2p_new(e, 1, (void *)buf, len, dtype, dst, tag, err, errlen);
}

tcp_req *tcp_irecv(tcp_engine *e, void *buf, size_t len, int dtype, int src, int32_t tag,
                   char *err, size_t errlen)
{
    return p2p_new(e, 0, buf, len, dtype, src, tag, err, errlen);
}

int tcp_req_wait(tcp_engine *e, tcp_req *r, double timeout_s, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    double span = timeout_s < 0 ? e->timeout : timeout_s;
    int rc = wait_locked(e, &r, 1, now_s() + span, span, 0, err, errlen);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int tcp_req_test(tcp_engine *e, tcp_req *r, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    if (r->state == 0 && !e->polling && !e->closed) {
        e->polling = 1;
        poll_once(e, 0);
        e->polling = 0;
        if (e->nwaiters) pthread_cond_broadcast(&e->cv);
    }
    int st = r->state;
    if (st < 0) fmt(err, errlen, "%s", r->err);
    pthread_mutex_unlock(&e->mu);
    return st;
}

int tcp_req_source(tcp_req *r) { return r->source; }
size_t tcp_req_nbytes(tcp_req *r) { return r->nbytes; }

void tcp_req_free(tcp_engine *e, tcp_req *r)
{
    if (!r) return;
    pthread_mutex_lock(&e->mu);
    if (r->state == 0) cancel_req(e, r);
    pthread_mutex_unlock(&e->mu);
    free(r);
}

/* ------------------------------------------------------ collective plumbing */

#define TAG(step, seg) ((int32_t)(((uint32_t)(step) << 16) | (uint32_t)(seg)))

static int ensure_buf(char **p, size_t *cap, size_t need)
{
    if (need <= *cap) return 0;
    size_t n = need < 4096 ? 4096 : need;
    char *q = malloc(n);
    if (!q) return -1;
    free(*p);
    *p = q;
    *cap = n;
    return 0;
}

static int ensure_reqs(tcp_engine *e, size_t n)
{
    if (n <= e->ncreqs) return 0;
    size_t m = n < 64 ? 64 : n;
    tcp_req *rs = calloc(m, sizeof(tcp_req));
    tcp_req **ps = calloc(m, sizeof(tcp_req *));
    if (!rs || !ps) {
        free(rs);
        free(ps);
        return -1;
    }
    free(e->creqs);
    free(e->cptr);
    e->creqs = rs;
    e->cptr = ps;
    e->ncreqs = m;
    return 0;
}

static int coll_begin(tcp_engine *e, int kind, uint64_t fp, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        fmt(err, errlen, "%s: the tcp backend is shut down", KNAMES[kind]);
        return -1;
    }
    if (e->poison[0] && e->seq + 1 >= e->poison_seq) {
        if (e->seq + 1 == e->poison_seq) {
            /* a peer reported this very collective failed (a mismatch, say) before we began it */
            e->seq++;
            fmt(err, errlen, "%s", e->poison);
        } else {
            fmt(err, errlen, "%s: collectives on this group are disabled after an earlier failure: %s",
                KNAMES[kind], e->poison);
        }
        pthread_mutex_unlock(&e->mu);
        return -1;
    }
    e->seq++;
    e->coll_active = 1;
    e->cur_kind = kind;
    e->cur_fp = fp;
    e->coll_err[0] = 0;
    e->coll_span = e->timeout;
    e->coll_deadline = now_s() + e->timeout;
    e->nfp = 0;
    e->fp_on = 0;
    /* frames that arrived early for this sequence number must agree on the call */
    for (int i = 0; i < e->size && !e->coll_err[0]; i++) {
        for (tcp_msg *m = e->peers[i].uq_head; m; m = m->next) {
            if (m->h.kind != K_P2P && m->h.seq == e->seq && (m->h.kind != kind || m->h.fp != fp)) {
                report_mismatch(e, i, &m->h);
                break;
            }
        }
    }
    pthread_mutex_unlock(&e->mu);
    return 0;
}

static int coll_end(tcp_engine *e, int rc, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    if (rc == 0 && e->coll_err[0]) {
        fmt(err, errlen, "%s", e->coll_err);
        rc = -1;
    }
    if (rc < 0) {
        if (!e->poison[0] || e->seq < e->poison_seq) {
            fmt(e->poison, sizeof e->poison, "%s", err);
            e->poison_seq = e->seq;
        }
        /* tell every peer, so that ranks still waiting raise now rather than at the timeout:
         * the mismatch itself where one caused this (every rank then names the same calls) */
        unsigned char mm[MISMATCH_LEN];
        char m[ERRTEXT];
        int is_mm = e->mm_seq && e->mm_seq <= e->seq;
        if (is_mm) mismatch_encode(e, mm);
        else fmt(m, sizeof m, "%s #%llu failed on rank %d: %s", KNAMES[e->cur_kind],
                 (unsigned long long)e->seq, RN(e, e->rank), err);
        for (int i = 0; i < e->size; i++) {
            if (i == e->rank || e->peers[i].dead || e->closed) continue;
            if (is_mm) send_control(e, i, F_MISMATCH, e->mm_seq, mm, MISMATCH_LEN);
            else send_control(e, i, F_ERROR, e->seq, m, strlen(m));
        }
    }
    e->coll_active = 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static tcp_req *cset(tcp_engine *e, int i, int is_send, int peer, int32_t tag, const void *buf, size_t len)
{
    tcp_req *r = &e->creqs[i];
    memset(r, 0, sizeof *r);
    r->is_send = is_send;
    r->peer = peer;
    r->kind = e->cur_kind;
    r->tag = tag;
    r->seq = e->seq;
    r->fp = e->cur_fp;
    r->dtype = TCP_NO_DTYPE;
    r->buf = (char *)buf;
    r->len = len;
    r->source = -1;
    e->cptr[i] = r;
    return r;
}

/* Post creqs[lo..hi): receives first, so arriving data lands in place. */
static void cpost(tcp_engine *e, int lo, int hi)
{
    pthread_mutex_lock(&e->mu);
    for (int i = lo; i < hi; i++)
        if (!e->creqs[i].is_send) post_recv_locked(e, &e->creqs[i]);
    for (int i = lo; i < hi; i++)
        if (e->creqs[i].is_send) {
            fill_hdr(e, &e->creqs[i], F_DATA);
            post_send_locked(e, &e->creqs[i]);
        }
    pthread_mutex_unlock(&e->mu);
}

static int cwait(tcp_engine *e, int lo, int hi, char *err, size_t errlen)
{
    if (hi <= lo) return 0;
    pthread_mutex_lock(&e->mu);
    int rc = wait_locked(e, e->cptr + lo, hi - lo, e->coll_deadline, e->coll_span, 1, err,
                         errlen);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static void cancel_range(tcp_engine *e, int lo, int hi)
{
    pthread_mutex_lock(&e->mu);
    for (int i = lo; i < hi; i++)
        if (e->creqs[i].state == 0) {
            cancel_req(e, &e->creqs[i]);
            e->creqs[i].state = -1;
        }
    pthread_mutex_unlock(&e->mu);
}

static int cxfer(tcp_engine *e, int n, char *err, size_t errlen)
{
    cpost(e, 0, n);
    return cwait(e, 0, n, err, errlen);
}

static inline int mod(int a, int n) { return ((a % n) + n) % n; }

/* First element of block i when count elements are split into n near-equal blocks. */
static inline size_t blk(size_t count, int n, int i)
{
    size_t q = count / (size_t)n, r = count % (size_t)n;
    return q * (size_t)i + ((size_t)i < r ? (size_t)i : r);
}

/* ------------------------------------------------------ fingerprint frames */

#define TAG_FP(round) ((int32_t)(-1 - (round)))  /* data tags (TAG) are never negative */

static void fp_set(tcp_engine *e, int i, int is_send, int peer, int round)
{
    tcp_req *r = &e->fpreqs[i];
    memset(r, 0, sizeof *r);
    r->is_send = is_send;
    r->peer = peer;
    r->kind = e->cur_kind;
    r->tag = TAG_FP(round);
    r->seq = e->seq;
    r->fp = e->cur_fp;
    r->dtype = TCP_NO_DTYPE;
    r->source = -1;
    e->fpptr[i] = r;
}

/* Post fpreqs[0..n), receives first; mutex held. */
static void fp_post_locked(tcp_engine *e, int n)
{
    for (int i = 0; i < n; i++)
        if (!e->fpreqs[i].is_send) post_recv_locked(e, &e->fpreqs[i]);
    for (int i = 0; i < n; i++)
        if (e->fpreqs[i].is_send) {
            fill_hdr(e, &e->fpreqs[i], F_DATA);
            post_send_locked(e, &e->fpreqs[i]);
        }
    e->nfp = n;
}

static void links_clear(tcp_engine *e)
{
    memset(e->data_to, 0, 2 * (size_t)e->size);
}

/* The binomial tree of bcast_tree and the small reduce, rooted at root: marks this rank's
 * parent in up and its children in down. */
static void tree_links(tcp_engine *e, int root, unsigned char *up, unsigned char *down)
{
    int n = e->size, vr = ((e->rank - root) % n + n) % n, mask = 1;
    while (mask < n && !(vr & mask)) mask <<= 1;
    if (vr) up[(vr - mask + root) % n] = 1;
    for (mask >>= 1; mask > 0; mask >>= 1)
        if (vr + mask < n) down[(vr + mask + root) % n] = 1;
}

/* Rooted collectives (broadcast, the small reduce, gather, scatter) leave ranks that only
 * send, or that hear from one peer: alone, they would return before a mismatch elsewhere
 * reached them. Fingerprint frames (a header, no payload) make every rank hear, directly or
 * through a chain of checked frames, every peer's fingerprint before it returns. Up to
 * fp_direct_world ranks: one frame to each peer this rank sends no data to (data_to) and
 * one receive from each peer that sends it none (data_from), all posted now, in flight with
 * the data (one extra latency at most, no extra round); above it, the rounds of a
 * dissemination barrier (round k: to rank + 2^k, from rank - 2^k), round 0 now and the
 * others in fp_finish, so the frames grow as n log n, not n^2. */
static void fp_begin(tcp_engine *e)
{
    int n = e->size, r = e->rank, k = 0;
    pthread_mutex_lock(&e->mu);
    if (n <= e->fp_direct_world) {
        for (int q = 0; q < n; q++) {
            if (q == r) continue;
            if (!e->data_from[q]) fp_set(e, k++, 0, q, 0);
            if (!e->data_to[q]) fp_set(e, k++, 1, q, 0);
        }
    } else {
        fp_set(e, k++, 0, (r - 1 + n) % n, 0);
        fp_set(e, k++, 1, (r + 1) % n, 0);
    }
    fp_post_locked(e, k);
    e->fp_on = 1;
    pthread_mutex_unlock(&e->mu);
}

/* Wait for the fingerprint frames (rc 0), or withdraw them (the collective failed). */
static int fp_finish(tcp_engine *e, int rc, char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    if (!e->fp_on) return rc;
    pthread_mutex_lock(&e->mu);
    e->fp_on = 0;
    if (!rc && e->nfp)
        rc = wait_locked(e, e->fpptr, e->nfp, e->coll_deadline, e->coll_span, 1, err, errlen);
    if (n > e->fp_direct_world) {
        for (int d = 2, round = 1; !rc && d < n; d <<= 1, round++) {
            fp_set(e, 0, 0, ((r - d) % n + n) % n, round);
            fp_set(e, 1, 1, (r + d) % n, round);
            fp_post_locked(e, 2);
            rc = wait_locked(e, e->fpptr, 2, e->coll_deadline, e->coll_span, 1, err, errlen);
        }
    }
    for (int i = 0; i < e->nfp; i++)
        if (e->fpreqs[i].state == 0) {
            cancel_req(e, &e->fpreqs[i]);
            e->fpreqs[i].state = -1;
        }
    e->nfp = 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

static int oom(char *err, size_t errlen)
{
    fmt(err, errlen, "out of memory for the collective's scratch buffers");
    return -1;
}

/* Ring reduce-scatter on W (count elements, n blocks): at step s this rank sends block
 * r-s+shift to the next rank and reduces block r-s-1+shift from the previous one, in
 * segments so that reducing segment k overlaps receiving k+1. Afterwards this rank
 * holds the full reduction of block r+1+shift. */
static int ring_rs(tcp_engine *e, char *W, size_t count, int dtype, int op, size_t es, int shift,
                   int step0, char *err, size_t errlen)
{
    int n = e->size, r = e->rank, next = (r + 1) % n, prev = (r - 1 + n) % n;
    size_t seg_el = e->seg / es;
    if (!seg_el) seg_el = 1;
    size_t maxblk = count / (size_t)n + 1;
    if (maxblk / seg_el >= 65535) seg_el = maxblk / 65535 + 1;  /* segment index fits the tag */
    size_t maxseg = (maxblk + seg_el - 1) / seg_el;
    if (ensure_buf(&e->tmp, &e->tmp_cap, maxblk * es) || ensure_reqs(e, 2 * maxseg + 2))
        return oom(err, errlen);
    for (int s = 0; s < n - 1; s++) {
        int sb = mod(r - s + shift, n), rb = mod(r - s - 1 + shift, n);
        size_t soff = blk(count, n, sb), scnt = blk(count, n, sb + 1) - soff;
        size_t roff = blk(count, n, rb), rcnt = blk(count, n, rb + 1) - roff;
        int nrs = (int)((rcnt + seg_el - 1) / seg_el), nss = (int)((scnt + seg_el - 1) / seg_el);
        int k = 0;
        for (int j = 0; j < nrs; j++) {
            size_t o = (size_t)j * seg_el, c = rcnt - o < seg_el ? rcnt - o : seg_el;
            cset(e, k++, 0, prev, TAG(step0 + s, j), e->tmp + o * es, c * es);
        }
        for (int j = 0; j < nss; j++) {
            size_t o = (size_t)j * seg_el, c = scnt - o < seg_el ? scnt - o : seg_el;
            cset(e, k++, 1, next, TAG(step0 + s, j), W + (soff + o) * es, c * es);
        }
        cpost(e, 0, k);
        for (int j = 0; j < nrs; j++) {
            if (cwait(e, j, j + 1, err, errlen)) {
                cancel_range(e, 0, k);
                return -1;
            }
            size_t o = (size_t)j * seg_el, c = rcnt - o < seg_el ? rcnt - o : seg_el;
            coll_reduce(W + (roff + o) * es, e->tmp + o * es, c, dtype, op);
        }
        if (cwait(e, nrs, k, err, errlen)) return -1;
    }
    return 0;
}

/* Ring all-gather of blocks: this rank starts holding block r+1+shift. */
static int ring_ag(tcp_engine *e, char *W, size_t count, size_t es, int shift, int step0,
                   char *err, size_t errlen)
{
    int n = e->size, r = e->rank, next = (r + 1) % n, prev = (r - 1 + n) % n;
    if (ensure_reqs(e, 2 * (size_t)n)) return oom(err, errlen);
    /* every block arrives straight into W (posted up front); block s is forwarded once in */
    for (int s = 0; s < n - 1; s++) {
        int rb = mod(r + shift - s, n);
        size_t roff = blk(count, n, rb), rcnt = blk(count, n, rb + 1) - roff;
        cset(e, s, 0, prev, TAG(step0 + s, 0), W + roff * es, rcnt * es);
    }
    cpost(e, 0, n - 1);
    for (int s = 0; s < n - 1; s++) {
        if (s > 0 && cwait(e, s - 1, s, err, errlen)) {
            cancel_range(e, 0, n - 1 + s);
            return -1;
        }
        int sb = mod(r + 1 + shift - s, n);
        size_t soff = blk(count, n, sb), scnt = blk(count, n, sb + 1) - soff;
        cset(e, n - 1 + s, 1, next, TAG(step0 + s, 0), W + soff * es, scnt * es);
        cpost(e, n - 1 + s, n + s);
    }
    if (cwait(e, 0, 2 * n - 2, err, errlen)) {
        cancel_range(e, 0, 2 * n - 2);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------- collectives */

int tcp_barrier(tcp_engine *e, uint64_t fp, char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    if (n == 1) return 0;
    if (coll_begin(e, K_BARRIER, fp, err, errlen)) return -1;
    int rc = 0;
    if (ensure_reqs(e, 2)) rc = oom(err, errlen);
    for (int k = 1, step = 0; !rc && k < n; k <<= 1, step++) {
        cset(e, 0, 0, mod(r - k, n), TAG(step, 0), NULL, 0);
        cset(e, 1, 1, (r + k) % n, TAG(step, 0), NULL, 0);
        rc = cxfer(e, 2, err, errlen);
    }
    return coll_end(e, rc, err, errlen);
}

static int bcast_tree(tcp_engine *e, char *buf, size_t nbytes, int root, char *err, size_t errlen)
{
    int n = e->size, vr = mod(e->rank - root, n), mask = 1;
    if (ensure_reqs(e, 40)) return oom(err, errlen);
    while (mask < n) {
        if (vr & mask) {
            cset(e, 0, 0, (vr - mask + root) % n, TAG(0, 0), buf, nbytes);
            if (cxfer(e, 1, err, errlen)) return -1;
            break;
        }
        mask <<= 1;
    }
    int k = 0;
    for (mask >>= 1; mask > 0; mask >>= 1)
        if (vr + mask < n) cset(e, k++, 1, (vr + mask + root) % n, TAG(0, 0), buf, nbytes);
    return cxfer(e, k, err, errlen);
}

static int bcast_chain(tcp_engine *e, char *buf, size_t nbytes, int root, char *err, size_t errlen)
{
    int n = e->size, vr = mod(e->rank - root, n);
    int prev = (vr - 1 + root + n) % n, next = (vr + 1 + root) % n;
    size_t seg = e->seg;
    if (nbytes / seg >= 65535) seg = nbytes / 65535 + 1;
    size_t nseg = (nbytes + seg - 1) / seg;
    if (ensure_reqs(e, 2 * nseg + 2)) return oom(err, errlen);
    int k = 0;
    if (vr > 0) {
        for (size_t j = 0; j < nseg; j++) {
            size_t o = j * seg, c = nbytes - o < seg ? nbytes - o : seg;
            cset(e, k++, 0, prev, TAG(0, j), buf + o, c);
        }
        cpost(e, 0, k);
    }
    int nrecv = k;
    for (size_t j = 0; j < nseg; j++) {
        if (vr > 0 && cwait(e, (int)j, (int)j + 1, err, errlen)) {
            cancel_range(e, 0, k);
            return -1;
        }
        if (vr < n - 1) {
            size_t o = j * seg, c = nbytes - o < seg ? nbytes - o : seg;
            cset(e, k, 1, next, TAG(0, j), buf + o, c);
            cpost(e, k, k + 1);
            k++;
        }
    }
    return cwait(e, nrecv, k, err, errlen);
}

int tcp_broadcast(tcp_engine *e, void *buf, size_t nbytes, int root, uint64_t fp, char *err, size_t errlen)
{
    int n = e->size;
    if (n == 1) return 0;
    if (coll_begin(e, K_BROADCAST, fp, err, errlen)) return -1;
    int rc, tree = nbytes <= e->tree_max || n == 2;
    links_clear(e);
    if (tree) {
        tree_links(e, root, e->data_from, e->data_to);
    } else {
        int vr = mod(e->rank - root, n);
        if (vr > 0) e->data_from[(vr - 1 + root) % n] = 1;
        if (vr < n - 1) e->data_to[(vr + 1 + root) % n] = 1;
    }
    fp_begin(e);
    if (tree) rc = bcast_tree(e, buf, nbytes, root, err, errlen);
    else rc = bcast_chain(e, buf, nbytes, root, err, errlen);
    rc = fp_finish(e, rc, err, errlen);
    return coll_end(e, rc, err, errlen);
}

/* Recursive doubling; every step combines as op(lower rank's value, higher's), so all
 * ranks compute bitwise-identical results even for non-commutative NaN handling. */
static int rd_allreduce(tcp_engine *e, char *buf, size_t count, int dtype, int op, size_t es,
                        char *err, size_t errlen)
{
    int n = e->size, r = e->rank, p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    int rem = n - p2, vr;
    size_t nb = count * es;
    if (ensure_buf(&e->tmp, &e->tmp_cap, nb) || ensure_reqs(e, 4)) return oom(err, errlen);
    if (r < 2 * rem) {
        if (r % 2 == 0) {
            cset(e, 0, 1, r + 1, TAG(0, 0), buf, nb);
            cset(e, 1, 0, r + 1, TAG(100, 0), buf, nb);
            return cxfer(e, 2, err, errlen);
        }
        cset(e, 0, 0, r - 1, TAG(0, 0), e->tmp, nb);
        if (cxfer(e, 1, err, errlen)) return -1;
        coll_reduce(e->tmp, buf, count, dtype, op);
        memcpy(buf, e->tmp, nb);
        vr = r / 2;
    } else {
        vr = r - rem;
    }
    for (int mask = 1, step = 1; mask < p2; mask <<= 1, step++) {
        int vp = vr ^ mask, partner = vp < rem ? 2 * vp + 1 : vp + rem;
        cset(e, 0, 0, partner, TAG(step, 0), e->tmp, nb);
        cset(e, 1, 1, partner, TAG(step, 0), buf, nb);
        if (cxfer(e, 2, err, errlen)) return -1;
        if (vr < vp) {
            coll_reduce(buf, e->tmp, count, dtype, op);
        } else {
            coll_reduce(e->tmp, buf, count, dtype, op);
            memcpy(buf, e->tmp, nb);
        }
    }
    if (r < 2 * rem) {
        cset(e, 0, 1, r - 1, TAG(100, 0), buf, nb);
        return cxfer(e, 1, err, errlen);
    }
    return 0;
}

/* Large all_reduce in two rounds: every rank sends block j to rank j, which reduces the
 * n copies in rank order (one pass) and sends the result to everyone. Same bytes per
 * rank as a ring, but no chain of n-1 dependent steps (ranks often outnumber cores). */
static int direct_allreduce(tcp_engine *e, char *W, size_t count, int dtype, int op, size_t es,
                            char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    size_t off = blk(count, n, r), cnt = blk(count, n, r + 1) - off, nb = cnt * es;
    if (ensure_buf(&e->tmp, &e->tmp_cap, nb * (size_t)n) || ensure_reqs(e, 4 * (size_t)n))
        return oom(err, errlen);
    int k = 0;
    /* every receive is posted up front: the result blocks land in W directly (a peer
     * sends them only after it has all of our blocks, so our sends are done by then) */
    for (int s = 1; s < n; s++) {
        int from = mod(r - s, n);
        cset(e, k++, 0, from, TAG(0, 0), e->tmp + (size_t)from * nb, nb);
    }
    int ag0 = k;
    for (int s = 1; s < n; s++) {
        int from = mod(r - s, n);
        size_t o = blk(count, n, from), c = blk(count, n, from + 1) - o;
        cset(e, k++, 0, from, TAG(1, 0), W + o * es, c * es);
    }
    int sends0 = k;
    for (int s = 1; s < n; s++) {
        int to = (r + s) % n;
        size_t o = blk(count, n, to), c = blk(count, n, to + 1) - o;
        cset(e, k++, 1, to, TAG(0, 0), W + o * es, c * es);
    }
    cpost(e, 0, k);
    if (cwait(e, 0, ag0, err, errlen) || cwait(e, sends0, k, err, errlen)) {
        cancel_range(e, 0, k);
        return -1;
    }
    const void *srcs[64];
    const void **sp = n <= 64 ? srcs : malloc(sizeof(void *) * (size_t)n);
    if (!sp) {
        cancel_range(e, 0, k);
        return oom(err, errlen);
    }
    /* this rank's block is read where it is (the kernels allow dst among the sources) */
    for (int j = 0; j < n; j++) sp[j] = j == r ? (const void *)(W + off * es) : e->tmp + (size_t)j * nb;
    coll_reduce_many(W + off * es, (const void *const *)sp, n, cnt, dtype, op);
    if (sp != srcs) free(sp);
    int k2 = k;
    for (int s = 1; s < n; s++) cset(e, k++, 1, (r + s) % n, TAG(1, 0), W + off * es, nb);
    cpost(e, k2, k);
    if (cwait(e, ag0, sends0, err, errlen) || cwait(e, k2, k, err, errlen)) {
        cancel_range(e, 0, k);
        return -1;
    }
    return 0;
}

int tcp_allreduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, uint64_t fp, char *err,
                  size_t errlen)
{
    size_t es = coll_itemsize(dtype);
    if (!es) {
        fmt(err, errlen, "all_reduce: unknown dtype code %d", dtype);
        return -1;
    }
    if (e->size == 1) return 0;
    if (coll_begin(e, K_ALLREDUCE, fp, err, errlen)) return -1;
    int rc;
    if (count * es <= e->rd_max || count < (size_t)e->size)
        rc = rd_allreduce(e, buf, count, dtype, op, es, err, errlen);
    else if (e->size <= e->direct_world)
        rc = direct_allreduce(e, buf, count, dtype, op, es, err, errlen);
    else {
        rc = ring_rs(e, buf, count, dtype, op, es, 0, 0, err, errlen);
        if (!rc) rc = ring_ag(e, buf, count, es, 0, e->size, err, errlen);
    }
    return coll_end(e, rc, err, errlen);
}

int tcp_reduce(tcp_engine *e, void *buf, size_t count, int dtype, int op, int root, uint64_t fp,
               char *err, size_t errlen)
{
    size_t es = coll_itemsize(dtype);
    if (!es) {
        fmt(err, errlen, "reduce: unknown dtype code %d", dtype);
        return -1;
    }
    int n = e->size, r = e->rank;
    if (n == 1) return 0;
    if (coll_begin(e, K_REDUCE, fp, err, errlen)) return -1;
    size_t nb = count * es;
    int rc = 0;
    char *acc = buf;
    if (r != root) {
        if (ensure_buf(&e->scratch, &e->scratch_cap, nb)) rc = oom(err, errlen);
        else {
            acc = e->scratch;
            memcpy(acc, buf, nb);
        }
    }
    int tree = nb <= e->tree_max || count < (size_t)n;
    if (!rc && tree) {  /* leaves only send: fingerprint frames (the ring hears everyone) */
        links_clear(e);
        tree_links(e, root, e->data_to, e->data_from);
        fp_begin(e);
    }
    if (rc) {
    } else if (tree) {
        int vr = mod(r - root, n);
        if (ensure_buf(&e->tmp, &e->tmp_cap, nb) || ensure_reqs(e, 2)) rc = oom(err, errlen);
        for (int mask = 1, step = 0; !rc && mask < n; mask <<= 1, step++) {
            if (vr & mask) {
                cset(e, 0, 1, (vr - mask + root) % n, TAG(step, 0), acc, nb);
                rc = cxfer(e, 1, err, errlen);
                break;
            }
            if (vr + mask < n) {
                cset(e, 0, 0, (vr + mask + root) % n, TAG(step, 0), e->tmp, nb);
                rc = cxfer(e, 1, err, errlen);
                if (!rc) coll_reduce(acc, e->tmp, count, dtype, op);
            }
        }
    } else {
        rc = ring_rs(e, acc, count, dtype, op, es, 0, 0, err, errlen);
        if (!rc) {
            /* this rank holds block r+1; send it to root */
            if (ensure_reqs(e, (size_t)n + 2)) rc = oom(err, errlen);
        }
        if (!rc) {
            int k = 0;
            if (r == root) {
                for (int c = 0; c < n; c++) {
                    int owner = mod(c - 1, n);
                    if (owner == r) continue;
                    size_t off = blk(count, n, c), cnt = blk(count, n, c + 1) - off;
                    cset(e, k++, 0, owner, TAG(n, 0), (char *)buf + off * es, cnt * es);
                }
            } else {
                int c = (r + 1) % n;
                size_t off = blk(count, n, c), cnt = blk(count, n, c + 1) - off;
                cset(e, k++, 1, root, TAG(n, 0), acc + off * es, cnt * es);
            }
            rc = cxfer(e, k, err, errlen);
        }
    }
    rc = fp_finish(e, rc, err, errlen);
    return coll_end(e, rc, err, errlen);
}

int tcp_allgather(tcp_engine *e, void *out, const void *in, size_t nb, uint64_t fp, char *err,
                  size_t errlen)
{
    int n = e->size, r = e->rank;
    char *o = out;
    if ((const char *)in != o + (size_t)r * nb) memmove(o + (size_t)r * nb, in, nb);
    if (n == 1) return 0;
    if (coll_begin(e, K_ALLGATHER, fp, err, errlen)) return -1;
    int rc = 0;
    if (nb * (size_t)n <= e->direct_max) {
        if (ensure_reqs(e, 2 * (size_t)n)) rc = oom(err, errlen);
        else {
            int k = 0;
            for (int s = 1; s < n; s++) {
                int to = (r + s) % n, from = mod(r - s, n);
                cset(e, k++, 0, from, TAG(0, 0), o + (size_t)from * nb, nb);
                cset(e, k++, 1, to, TAG(0, 0), o + (size_t)r * nb, nb);
            }
            rc = cxfer(e, k, err, errlen);
        }
    } else {
        if (ensure_reqs(e, 2)) rc = oom(err, errlen);
        int next = (r + 1) % n, prev = mod(r - 1, n);
        for (int s = 0; !rc && s < n - 1; s++) {
            int sb = mod(r - s, n), rb = mod(r - s - 1, n);
            cset(e, 0, 0, prev, TAG(s, 0), o + (size_t)rb * nb, nb);
            cset(e, 1, 1, next, TAG(s, 0), o + (size_t)sb * nb, nb);
            rc = cxfer(e, 2, err, errlen);
        }
    }
    return coll_end(e, rc, err, errlen);
}

int tcp_gather(tcp_engine *e, void *out, const void *in, size_t nb, int root, uint64_t fp, char *err,
               size_t errlen)
{
    int n = e->size, r = e->rank;
    if (r == root && (const char *)in != (char *)out + (size_t)r * nb)
        memmove((char *)out + (size_t)r * nb, in, nb);
    if (n == 1) return 0;
    if (coll_begin(e, K_GATHER, fp, err, errlen)) return -1;
    int rc = 0, k = 0;
    links_clear(e);
    if (r == root) memset(e->data_from, 1, (size_t)n);
    else e->data_to[root] = 1;
    fp_begin(e);  /* the others only send */
    if (ensure_reqs(e, (size_t)n)) rc = oom(err, errlen);
    else if (r == root) {
        for (int j = 0; j < n; j++)
            if (j != r) cset(e, k++, 0, j, TAG(0, 0), (char *)out + (size_t)j * nb, nb);
    } else {
        cset(e, k++, 1, root, TAG(0, 0), in, nb);
    }
    if (!rc) rc = cxfer(e, k, err, errlen);
    rc = fp_finish(e, rc, err, errlen);
    return coll_end(e, rc, err, errlen);
}

int tcp_scatter(tcp_engine *e, void *out, const void *in, size_t nb, int root, uint64_t fp, char *err,
                size_t errlen)
{
    int n = e->size, r = e->rank;
    if (r == root && (char *)out != (const char *)in + (size_t)r * nb)
        memmove(out, (const char *)in + (size_t)r * nb, nb);
    if (n == 1) return 0;
    if (coll_begin(e, K_SCATTER, fp, err, errlen)) return -1;
    int rc = 0, k = 0;
    links_clear(e);
    if (r == root) memset(e->data_to, 1, (size_t)n);
    else e->data_from[root] = 1;
    fp_begin(e);  /* the root only sends, the others hear from it alone */
    if (ensure_reqs(e, (size_t)n)) rc = oom(err, errlen);
    else if (r == root) {
        for (int s = 1; s < n; s++) {
            int j = (r + s) % n;
            cset(e, k++, 1, j, TAG(0, 0), (const char *)in + (size_t)j * nb, nb);
        }
    } else {
        cset(e, k++, 0, root, TAG(0, 0), out, nb);
    }
    if (!rc) rc = cxfer(e, k, err, errlen);
    rc = fp_finish(e, rc, err, errlen);
    return coll_end(e, rc, err, errlen);
}

int tcp_reduce_scatter(tcp_engine *e, void *out, const void *in, size_t count, int dtype, int op,
                       uint64_t fp, char *err, size_t errlen)
{
    size_t es = coll_itemsize(dtype);
    if (!es) {
        fmt(err, errlen, "reduce_scatter: unknown dtype code %d", dtype);
        return -1;
    }
    int n = e->size, r = e->rank;
    size_t nb = count * es;
    if (n == 1) {
        if (out != in) memmove(out, in, nb);
        return 0;
    }
    if (coll_begin(e, K_REDUCE_SCATTER, fp, err, errlen)) return -1;
    int rc = 0;
    if (nb * (size_t)n <= e->direct_max) {
        /* one round: everyone sends slice j to rank j, which reduces in rank order */
        if (ensure_buf(&e->tmp, &e->tmp_cap, nb * (size_t)n) || ensure_reqs(e, 2 * (size_t)n))
            rc = oom(err, errlen);
        if (!rc) {
            int k = 0;
            for (int s = 1; s < n; s++) {
                int to = (r + s) % n, from = mod(r - s, n);
                cset(e, k++, 0, from, TAG(0, 0), e->tmp + (size_t)from * nb, nb);
                cset(e, k++, 1, to, TAG(0, 0), (const char *)in + (size_t)to * nb, nb);
            }
            rc = cxfer(e, k, err, errlen);
        }
        if (!rc) {
            const void *srcs[256];
            const void **sp = n <= 256 ? srcs : malloc(sizeof(void *) * (size_t)n);
            if (!sp) rc = oom(err, errlen);
            else {
                /* this rank's slice is read where it is, unless out overlaps it elsewhere
                 * (the kernels allow dst to be one of the sources, not to straddle one) */
                const char *mine = (const char *)in + (size_t)r * nb, *o = out;
                if (o != mine && o < mine + nb && mine < o + nb) {
                    memcpy(e->tmp + (size_t)r * nb, mine, nb);
                    mine = e->tmp + (size_t)r * nb;
                }
                for (int j = 0; j < n; j++) sp[j] = j == r ? mine : e->tmp + (size_t)j * nb;
                coll_reduce_many(out, (const void *const *)sp, n, count, dtype, op);
                if (sp != srcs) free(sp);
            }
        }
    } else {
        if (ensure_buf(&e->scratch, &e->scratch_cap, nb * (size_t)n)) rc = oom(err, errlen);
        if (!rc) {
            memcpy(e->scratch, in, nb * (size_t)n);
            rc = ring_rs(e, e->scratch, count * (size_t)n, dtype, op, es, -1, 0, err, errlen);
        }
        if (!rc) memcpy(out, e->scratch + (size_t)r * nb, nb);
    }
    return coll_end(e, rc, err, errlen);
}

int tcp_alltoall(tcp_engine *e, void *out, const void *in, const size_t *out_bytes,
                 const size_t *in_bytes, uint64_t fp, char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    size_t ooff = 0, ioff = 0, myo = 0, myi = 0;
    for (int j = 0; j < r; j++) {
        ooff += out_bytes[j];
        ioff += in_bytes[j];
    }
    myo = ooff;
    myi = ioff;
    size_t own = in_bytes[r] < out_bytes[r] ? in_bytes[r] : out_bytes[r];
    if (own && (char *)out + myo != (const char *)in + myi)
        memmove((char *)out + myo, (const char *)in + myi, own);
    if (n == 1) return 0;
    if (coll_begin(e, K_ALLTOALL, fp, err, errlen)) return -1;
    int rc = 0;
    if (ensure_reqs(e, 2 * (size_t)n)) rc = oom(err, errlen);
    if (!rc) {
        size_t *oo = malloc(sizeof(size_t) * 2 * (size_t)n);
        if (!oo) rc = oom(err, errlen);
        else {
            size_t *io = oo + n, a = 0, b = 0;
            for (int j = 0; j < n; j++) {
                oo[j] = a;
                io[j] = b;
                a += out_bytes[j];
                b += in_bytes[j];
            }
            int k = 0;
            for (int s = 1; s < n; s++) {
                int to = (r + s) % n, from = mod(r - s, n);
                cset(e, k++, 0, from, TAG(0, 0), (char *)out + oo[from], out_bytes[from]);
                cset(e, k++, 1, to, TAG(0, 0), (const char *)in + io[to], in_bytes[to]);
            }
            free(oo);
            rc = cxfer(e, k, err, errlen);
        }
    }
    return coll_end(e, rc, err, errlen);
}
