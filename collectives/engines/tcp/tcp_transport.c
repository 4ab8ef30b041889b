/* TCP transport: framed messages over one socket per peer (little-endian headers), the
 * matching of arriving frames to posted receives (fingerprints checked first), and the
 * poll-driven full-duplex progress loop shared by every waiting thread (tcp_internal.h). */
#include "tcp_internal.h"

TCP_HIDDEN const char *const KNAMES[K_NKINDS] = {"?", "barrier", "broadcast", "all_reduce", "reduce",
                                       "all_gather", "gather", "scatter", "reduce_scatter",
                                       "all_to_all", "send/recv"};

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
    u64 = htole64(h->aux); memcpy(w + 32, &u64, 8);
    u64 = htole64(h->len); memcpy(w + 40, &u64, 8);
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
    memcpy(&u64, w + 32, 8); h->aux = le64toh(u64);
    memcpy(&u64, w + 40, 8); h->len = le64toh(u64);
}

void tcp_wire_header(unsigned char *out, int ftype, int kind, int dtype, uint32_t group,
                     int32_t tag, uint64_t seq, uint64_t fp, uint64_t aux, uint64_t len)
{
    hdr_t h = {MAGIC, TCP_WIRE_VERSION, (uint8_t)ftype, (uint8_t)kind, (uint8_t)dtype, 0,
               group, tag, seq, fp, aux, len};
    hdr_encode(&h, out);
}

void tcp_wire_header_parse(const unsigned char *in, uint64_t *fields)
{
    hdr_t h;
    hdr_decode(in, &h);
    uint64_t f[12] = {h.magic, h.version, h.ftype, h.kind, h.dtype, h.flags, h.group,
                      (uint64_t)(int64_t)h.tag, h.seq, h.fp, h.aux, h.len};
    memcpy(fields, f, sizeof f);
}
/* ------------------------------------------------------------------ helpers */




static void req_list_append(tcp_req **head, tcp_req **tail, tcp_req *r)
{
    r->next = NULL;
    r->prev = *tail;
    if (*tail) (*tail)->next = r; else *head = r;
    *tail = r;
}

TCP_HIDDEN void req_list_remove(tcp_req **head, tcp_req **tail, tcp_req *r)
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
        fmt(out, cap, "%s #%llu (%s rank %d)", KNAMES[r->kind], SN(e, r->seq),
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

TCP_HIDDEN void req_fail(tcp_engine *e, tcp_req *r, const char *why)
{
    char d[160];
    describe_req(e, r, d, sizeof d);
    r->where = W_NONE;
    r->state = -1;
    fmt(r->err, sizeof r->err, "%s failed: %s", d, why);
    if (r->owned) free(r);
}

static void coll_fail(tcp_engine *e, const char *msg, int verdict)
{
    if (!e->coll_err[0]) {
        fmt(e->coll_err, sizeof e->coll_err, "%s", msg);
        e->coll_verdict = verdict;
    }
    if (e->nwaiters) pthread_cond_broadcast(&e->cv);
    wake_poller(e);
}

static void coll_set_err(tcp_engine *e, const char *msg) { coll_fail(e, msg, 0); }

/* A failure of the collective worded alike on every rank that sees it (FLAG_VERDICT). */
static void coll_set_verdict(tcp_engine *e, const char *msg) { coll_fail(e, msg, 1); }
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

TCP_HIDDEN void msg_drop(tcp_engine *e, int pi, tcp_msg *m)
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

TCP_HIDDEN void peer_dead(tcp_engine *e, int pi, const char *why)
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

static void peer_eof(tcp_engine *e, int pi);

/* After a receive on pi's socket that moved nothing (k == 0: the peer closed; k < 0:
 * errno says why): 1 to try again at once (EINTR), 0 to leave the peer for now (its socket
 * is not ready, or the peer is gone, now marked so). */
static inline int io_retry(tcp_engine *e, int pi, ssize_t k)
{
    if (k == 0) {
        peer_eof(e, pi);
        return 0;
    }
    if (errno == EINTR) return 1;
    if (errno != EAGAIN && errno != EWOULDBLOCK) peer_dead_errno(e, pi, errno);
    return 0;
}

/* ------------------------------------------------------------------ sending */

static void progress_recv_inner(tcp_engine *e, int pi);

/* A send to pi failed: the peer closed or reset the connection. What it sent before (a
 * report of this collective's failure, its close frame) may still wait in the socket: take
 * it in first, so that it, not the failed send, explains the failure (bounded: 64 reads). */
static void send_failed(tcp_engine *e, int pi, int err)
{
    for (int i = 0; i < 64 && !e->peers[pi].dead; i++) progress_recv_inner(e, pi);
    peer_dead_errno(e, pi, err);  /* where the stream did not end it already */
}

/* Write as much of pi's send queue as the socket takes, at most duplex_chunk bytes per
 * call: the poller then reads before it writes more, so both directions of an exchange
 * keep flowing (one large sendmsg fills the peer's buffers while the peer does the
 * same, and each then drains the other's data alone, measured 1.5x slower at 16 MiB). */
TCP_HIDDEN void flush_peer(tcp_engine *e, int pi)
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
            if (errno != EAGAIN && errno != EWOULDBLOCK) send_failed(e, pi, errno);
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

TCP_HIDDEN void fill_hdr(tcp_engine *e, tcp_req *r, int ftype)
{
    hdr_t h = {MAGIC, TCP_WIRE_VERSION, (uint8_t)ftype, (uint8_t)r->kind, (uint8_t)r->dtype,
               (uint16_t)r->flags,
               e->group, r->tag, r->seq, r->fp, r->aux, r->len};
    hdr_encode(&h, r->hw);
}

TCP_HIDDEN void post_send_locked(tcp_engine *e, tcp_req *r)
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

/* A control frame (error, close, mismatch) to pi. fp: the header's fingerprint (a mismatch
 * frame's: the sender's own call, for mm_canonical); flags: FLAG_VERDICT for an error frame
 * whose text every receiver raises as is, else 0. */
TCP_HIDDEN void send_control(tcp_engine *e, int pi, int ftype, uint64_t seq, const void *data,
                             size_t len, uint64_t fp, int flags)
{
    if (len >= ERRTEXT) len = ERRTEXT - 1;
    tcp_req *r = malloc(sizeof(tcp_req) + len);
    if (!r) return;
    req_init(r, 1, pi, K_P2P, 0, seq, fp, TCP_NO_DTYPE, r + 1, len);
    r->owned = 1;
    r->flags = flags;
    if (len) memcpy(r->buf, data, len);
    fill_hdr(e, r, ftype);
    post_send_locked(e, r);
}

/* ---------------------------------------------------------------- receiving */


/* Keep the earliest mismatch: rank a called fp_a, rank b fp_b, as collective seq; it
 * poisons the group from that collective on. A pair is kept lower rank first, and of two
 * pairs at one collective the lower: once every rank has heard every other's record
 * (mm_settle), all of them hold, and name, the same one. */
static void record_mismatch(tcp_engine *e, uint64_t seq, int a, uint64_t fa, int b, uint64_t fb)
{
    if (b < a) {
        int t = a; a = b; b = t;
        uint64_t u = fa; fa = fb; fb = u;
    }
    if (e->mm_seq && (e->mm_seq < seq || (e->mm_seq == seq && (e->mm_a < a || (e->mm_a == a && e->mm_b <= b)))))
        return;
    e->mm_seq = seq;
    e->mm_a = a;
    e->mm_fp_a = fa;
    e->mm_b = b;
    e->mm_fp_b = fb;
    if (!e->poison[0] || seq <= e->poison_seq) {
        fmt(e->poison, sizeof e->poison, "%s", MISMATCH_TEXT);
        e->poison_seq = seq;
        e->poison_verdict = 0;
    }
}

TCP_HIDDEN void report_mismatch(tcp_engine *e, int pi, const hdr_t *h)
{
    record_mismatch(e, h->seq, e->rank, e->cur_fp, pi, h->fp);
    coll_set_err(e, MISMATCH_TEXT);
}

TCP_HIDDEN void mismatch_encode(const tcp_engine *e, unsigned char *w)
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
    if (p->h.fp) {  /* the sender's own call of that collective (mm_canonical) */
        e->peer_fp[pi] = p->h.fp;
        e->peer_fp_seq[pi] = p->h.seq;
    }
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

/* A point-to-point message must fit its receive (as in MPI and torch's gloo, a receive's
 * size is an upper bound: a longer message is refused, never truncated), with the
 * receive's dtype (a byte buffer, TCP_NO_DTYPE, takes any): else 1 and the reason in out. */
static int p2p_mismatch(tcp_engine *e, int pi, const hdr_t *h, const tcp_req *r, char *out, size_t cap)
{
    int dt_ok = h->dtype == r->dtype || h->dtype == TCP_NO_DTYPE || r->dtype == TCP_NO_DTYPE;
    if (h->len <= r->len && dt_ok) return 0;
    char a[96], b[96];
    describe_payload(a, sizeof a, h->dtype, h->len);
    describe_payload(b, sizeof b, r->dtype, r->len);
    fmt(out, cap, "rank %d sent %s; this receive takes %s (%s)", RN(e, pi), a, b,
        dt_ok ? "a message longer than its receive" : "a different dtype on the two sides");
    return 1;
}

/* A collective frame of another size than its receive, or (all_to_all) whose sender expects
 * another size back than this rank sends it: 1 and the reason in out, worded alike at both
 * ends of the pair ("rank 1 sends 4 x float32 (16 bytes) to rank 0, which expects 3 x ..."). */
static int coll_size_mismatch(tcp_engine *e, int pi, const hdr_t *h, const tcp_req *r, char *out,
                              size_t cap)
{
    uint64_t sends, expects;
    int from, to;
    if (h->len != r->len) {
        from = pi, to = e->rank, sends = h->len, expects = r->len;
    } else if (h->aux != r->aux) {
        from = e->rank, to = pi, sends = r->aux, expects = h->aux;
    } else {
        return 0;
    }
    int dtype = (int)((e->cur_fp >> 4) & 0xF);  /* the fingerprint's dtype field */
    char a[96], b[96];
    describe_payload(a, sizeof a, dtype, sends);
    describe_payload(b, sizeof b, dtype, expects);
    fmt(out, cap, "%s #%llu: rank %d sends %s to rank %d, which expects %s (different sizes on "
        "different ranks)", KNAMES[e->cur_kind], SN(e, e->seq), RN(e, from), a,
        RN(e, to), b);
    return 1;
}

/* Fail r with exactly why (no description of r in front: both ends word it alike). */
static void req_fail_as(tcp_req *r, const char *why)
{
    r->where = W_NONE;
    r->state = -1;
    fmt(r->err, sizeof r->err, "%s", why);
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
            char m[300];
            if (coll_size_mismatch(e, pi, h, r, m, sizeof m)) {
                req_fail_as(r, m);
                coll_set_verdict(e, m);
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
        if (p->h.seq > e->heard[pi]) e->heard[pi] = p->h.seq;
        if (p->h.ftype == F_MISMATCH) {
            mismatch_decode(e, pi);
        } else if (!e->poison[0] || p->h.seq < e->poison_seq) {
            e->poison_verdict = (p->h.flags & FLAG_VERDICT) != 0;
            if (e->poison_verdict)
                fmt(e->poison, sizeof e->poison, "%s", p->errtext);
            else
                fmt(e->poison, sizeof e->poison, "rank %d reported: %s", RN(e, pi), p->errtext);
            e->poison_seq = p->h.seq;
        }
        /* a failure of a later collective must not fail one this rank can still finish */
        if (e->coll_active && e->seq == e->poison_seq) {
            coll_fail(e, e->poison, e->poison_verdict);
        } else if (e->coll_active && e->seq > e->poison_seq) {
            char m[ERRTEXT + 64];
            fmt(m, sizeof m, e->poison_verdict ? "group unusable after an earlier failure: %s"
                                               : "%s", e->poison);
            coll_set_err(e, m);
        }
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
    case F_MISMATCH: {
        int error = p->h.ftype == F_ERROR;
        if (error ? p->h.len >= ERRTEXT : p->h.len != MISMATCH_LEN) {
            fmt(m, sizeof m, "received a corrupted %s frame from rank %d",
                error ? "error" : "mismatch", RN(e, pi));
            peer_dead(e, pi, m);
            return;
        }
        p->mode = M_ERR;
        p->dst = p->errtext;
        break;
    }
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
            if (io_retry(e, pi, k)) continue;
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
        if (io_retry(e, pi, k)) continue;
        return;
    }
}

/* Post a receive: take a matching unexpected message if one arrived, else queue it. */
TCP_HIDDEN void post_recv_locked(tcp_engine *e, tcp_req *r)
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
        if (r->kind == K_P2P ? p2p_mismatch(e, pi, &best->h, r, msg, sizeof msg)
                             : coll_size_mismatch(e, pi, &best->h, r, msg, sizeof msg)) {
            msg_drop(e, pi, best);
            if (r->kind != K_P2P) {
                req_fail_as(r, msg);
                coll_set_verdict(e, msg);
            } else {
                req_fail(e, r, msg);
            }
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
TCP_HIDDEN void cancel_req(tcp_engine *e, tcp_req *r)
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
TCP_HIDDEN void poll_once(tcp_engine *e, int ms)
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
TCP_HIDDEN int wait_locked(tcp_engine *e, tcp_req **rs, int n, double deadline, double span,
                       int coll, char *err, size_t errlen)
{
    double t0 = now_s();
    const char *why = NULL;
    char tmsg[400];
    for (;;) {
        int all = 1;
        /* this collective's failure, found here or reported by a peer (a mismatch, a peer's
         * error frame), explains whatever else failed since: a peer that reported it may
         * close at once, and its close can be read in the same pass as its report */
        if (coll && e->coll_err[0]) { why = e->coll_err; goto fail; }
        for (int i = 0; i < n; i++) {
            if (rs[i]->state < 0) { why = rs[i]->err; goto fail; }
            if (rs[i]->state == 0) all = 0;
        }
        if (all) return 0;
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
            int ms = 0;
            if (t - t0 >= e->spin_s) {
                double rem = deadline - t;
                if (rem > 1.0) rem = 1.0;
                ms = (int)ceil(rem * 1000.0);
                if (ms < 1) ms = 1;
            }
            poll_as_poller(e, ms);
            if (!ms) {
                /* spinning: let ranks that share our core run (they are often whom we wait for) */
                pthread_mutex_unlock(&e->mu);
                sched_yield();
                pthread_mutex_lock(&e->mu);
            }
        } else {
            sleep_while_polled(e, t, deadline);
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
