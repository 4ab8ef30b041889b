/* TCP engine: lifecycle, point to point, and the collective plumbing every algorithm uses
 * (sequence numbers, request sets, fingerprint frames, abort frames); see tcp_internal.h. */
#include "tcp_internal.h"

/* --------------------------------------------------------------- lifecycle */

/* The engine's memory: every block it owns (NULL where not allocated yet) and itself. */
static void engine_free_memory(tcp_engine *e)
{
    if (e->peers)
        for (int i = 0; i < e->size; i++) free(e->peers[i].stage);
    for (int i = 0; i < 4; i++) free(e->spare[i]);
    void *blocks[] = {e->peers, e->pfds, e->pidx, e->names, e->creqs, e->cptr, e->fpreqs,
                      e->fpptr, e->data_to, e->heard, e->scratch, e->tmp, e};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

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
    e->heard = calloc(3 * (size_t)size, sizeof(uint64_t));
    if (!e->peers || !e->pfds || !e->pidx || !e->fpreqs || !e->fpptr || !e->data_to || !e->heard || pipe2(e->wake, O_NONBLOCK | O_CLOEXEC) != 0) goto bad;
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
    e->peer_fp = e->heard + size;
    e->peer_fp_seq = e->heard + 2 * (size_t)size;
    e->use_lowat = 1;
    e->fp_direct_world = 8;
    e->seg_split = 8;
    e->duplex_chunk = 1024 * 1024;
    e->direct_world = 8;
    e->rd_max = 64 * 1024;
    e->hd_max = 0;
    e->tree_max = 64 * 1024;
    e->seg = 1024 * 1024;
    e->direct_max = 64 * 1024;
    return e;
bad:
    engine_free_memory(e);
    return NULL;
}

void tcp_set_tuning(tcp_engine *e, int key, int64_t v)
{
    pthread_mutex_lock(&e->mu);
    switch (key) {
    case TCP_TUNE_SPIN_US: e->spin_s = v * 1e-6; break;
    case TCP_TUNE_ALLREDUCE_RD_MAX: e->rd_max = (size_t)v; break;
    case TCP_TUNE_ALLREDUCE_HD_MAX: e->hd_max = (size_t)v; break;
    case TCP_TUNE_BCAST_TREE_MAX: e->tree_max = (size_t)v; break;
    case TCP_TUNE_SEGMENT: e->seg = v > 0 ? (size_t)v : 1; break;
    case TCP_TUNE_GATHER_DIRECT_MAX: e->direct_max = (size_t)v; break;
    case TCP_TUNE_ALLREDUCE_DIRECT_WORLD: e->direct_world = (int)v; break;
    case TCP_TUNE_DUPLEX_CHUNK: e->duplex_chunk = v > 0 ? (size_t)v : 0; break;
    case TCP_TUNE_LOWAT: e->use_lowat = v != 0; break;
    case TCP_TUNE_FP_DIRECT_WORLD: e->fp_direct_world = (int)v; break;
    case TCP_TUNE_SEG_SPLIT: e->seg_split = v > 0 ? (int)v : 1; break;
    default: break;
    }
    pthread_mutex_unlock(&e->mu);
}

int64_t tcp_get_tuning(tcp_engine *e, int key)
{
    switch (key) {
    case TCP_TUNE_SPIN_US: return (int64_t)llround(e->spin_s * 1e6);
    case TCP_TUNE_ALLREDUCE_RD_MAX: return (int64_t)e->rd_max;
    case TCP_TUNE_ALLREDUCE_HD_MAX: return (int64_t)e->hd_max;
    case TCP_TUNE_BCAST_TREE_MAX: return (int64_t)e->tree_max;
    case TCP_TUNE_SEGMENT: return (int64_t)e->seg;
    case TCP_TUNE_GATHER_DIRECT_MAX: return (int64_t)e->direct_max;
    case TCP_TUNE_ALLREDUCE_DIRECT_WORLD: return e->direct_world;
    case TCP_TUNE_DUPLEX_CHUNK: return (int64_t)e->duplex_chunk;
    case TCP_TUNE_LOWAT: return e->use_lowat;
    case TCP_TUNE_FP_DIRECT_WORLD: return e->fp_direct_world;
    case TCP_TUNE_SEG_SPLIT: return e->seg_split;
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
        *seq = SN(e, e->mm_seq);
        *a = e->mm_a;
        *fp_a = e->mm_fp_a;
        *b = e->mm_b;
        *fp_b = e->mm_fp_b;
    }
    pthread_mutex_unlock(&e->mu);
    return found;
}

void tcp_set_seq_shift(tcp_engine *e, int shift)
{
    pthread_mutex_lock(&e->mu);
    e->seq_shift = shift;
    pthread_mutex_unlock(&e->mu);
}

void tcp_number_next(tcp_engine *e, uint64_t seq)
{
    pthread_mutex_lock(&e->mu);
    uint64_t first = seq << e->seq_shift;  /* the next collective's number is first */
    if (first > e->seq + 1) e->seq = first - 1;
    pthread_mutex_unlock(&e->mu);
}

void tcp_fail_next(tcp_engine *e, const char *text)
{
    pthread_mutex_lock(&e->mu);
    e->seq++;
    if (!e->poison[0] || e->seq < e->poison_seq) {
        fmt(e->poison, sizeof e->poison, "%s", text);
        e->poison_seq = e->seq;
        e->poison_verdict = 0;
    }
    for (int i = 0; i < e->size; i++)
        if (i != e->rank && !e->peers[i].dead && !e->closed)
            send_control(e, i, F_ERROR, e->seq, text, strlen(text), 0, 0);
    pthread_mutex_unlock(&e->mu);
}

void tcp_engine_close(tcp_engine *e)
{
    pthread_mutex_lock(&e->mu);
    if (e->closed) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    for (int i = 0; i < e->size; i++)
        if (i != e->rank && !e->peers[i].dead) send_control(e, i, F_CLOSE, e->seq, NULL, 0, 0, 0);
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
    }
    close(e->wake[0]);
    close(e->wake[1]);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    engine_free_memory(e);
}

/* ----------------------------------------------------------- point to point */

static tcp_req *p2p_new(tcp_engine *e, int is_send, void *buf, size_t len, int dtype, int peer,
                        int32_t tag, char *err, size_t errlen)
{
    tcp_req *r = malloc(sizeof *r);
    if (!r) {
        fmt(err, errlen, "out of memory");
        return NULL;
    }
    req_init(r, is_send, peer, K_P2P, tag, 0, 0, dtype, buf, len);
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
    if (r->state == 0 && !e->polling && !e->closed)
        poll_as_poller(e, 0);
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


TCP_HIDDEN int ensure_buf(char **p, size_t *cap, size_t need)
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

TCP_HIDDEN int ensure_reqs(tcp_engine *e, size_t n)
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

/* Once every live peer has reported the failed collective: the pair to name, from every
 * rank's own call (the fingerprints its mismatch frame carried), the same on every rank
 * that heard them all: the lowest rank, and the lowest rank whose call differs from it.
 * The lowest pair any rank happened to detect is not enough: a rank may detect a lower
 * pair after it sent its record, and a peer that heard that record first would name
 * another pair (seen under load: 'rank 2 called ...; rank 1 called ...' on one rank,
 * 'rank 1 ...; rank 0 ...' on the others). A peer that failed otherwise (no fingerprint
 * heard for this collective) leaves the record as it is. Mutex held. */
static void mm_canonical(tcp_engine *e)
{
    uint64_t seq = e->mm_seq;
    if (seq != e->seq) return;
    int a = -1, b = -1;
    uint64_t fa = 0, fb = 0;
    for (int i = 0; i < e->size; i++) {
        uint64_t f;
        if (i == e->rank) {
            f = e->cur_fp;
        } else if (e->peer_fp_seq[i] == seq) {
            f = e->peer_fp[i];  /* also from a peer that has closed since: it raised already */
        } else if (e->peers[i].dead) {
            continue;
        } else {
            return;
        }
        if (a < 0) {
            a = i;
            fa = f;
        } else if (f != fa) {
            b = i;
            fb = f;
            break;
        }
    }
    if (b < 0) return;
    e->mm_a = a;
    e->mm_fp_a = fa;
    e->mm_b = b;
    e->mm_fp_b = fb;
}

/* After a mismatch failed collective seq here: send this rank's record and its own call to
 * every peer, then wait (until deadline) for every live peer's report of that collective,
 * so that every rank names the same pair (mm_canonical) and raises the same words. Only
 * failing ranks wait, and only for ranks that fail too. Mutex held. */
static void mm_settle(tcp_engine *e, double deadline)
{
    unsigned char mm[MISMATCH_LEN];
    mismatch_encode(e, mm);
    uint64_t mine = e->mm_seq == e->seq ? e->cur_fp : 0;  /* this rank's call (mm_canonical) */
    for (int i = 0; i < e->size; i++)
        if (i != e->rank && !e->peers[i].dead && !e->closed)
            send_control(e, i, F_MISMATCH, e->mm_seq, mm, MISMATCH_LEN, mine, 0);
    for (;;) {
        int all = 1;
        for (int i = 0; i < e->size && all; i++)
            if (i != e->rank && !e->peers[i].dead && e->heard[i] < e->seq) all = 0;
        double t = now_s();
        if (all) mm_canonical(e);
        if (all || e->closed || t >= deadline) return;
        if (!e->polling)
            poll_as_poller(e, 20);
        else
            sleep_while_polled(e, t, deadline);
    }
}

TCP_HIDDEN int coll_begin(tcp_engine *e, int kind, uint64_t fp, char *err, size_t errlen)
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
            e->cur_fp = fp;  /* this rank's call, for the others' choice of the pair to name */
            fmt(err, errlen, "%s", e->poison);
            if (e->mm_seq == e->seq) mm_settle(e, now_s() + e->timeout);
        } else {
            fmt(err, errlen, "%s: group unusable after an earlier failure: %s", KNAMES[kind],
                e->poison);
        }
        pthread_mutex_unlock(&e->mu);
        return -1;
    }
    e->seq++;
    e->coll_active = 1;
    e->cur_kind = kind;
    e->cur_fp = fp;
    e->coll_err[0] = 0;
    e->coll_verdict = 0;
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

TCP_HIDDEN int coll_end(tcp_engine *e, int rc, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    if (rc == 0 && e->coll_err[0]) {
        fmt(err, errlen, "%s", e->coll_err);
        rc = -1;
    }
    if (rc < 0) {
        /* a verdict (a size mismatch, worded alike by both ends of its pair) goes on as is */
        int verdict = e->coll_verdict && !strcmp(err, e->coll_err);
        if (!e->poison[0] || e->seq < e->poison_seq) {
            fmt(e->poison, sizeof e->poison, "%s", err);
            e->poison_seq = e->seq;
            e->poison_verdict = verdict;
        }
        /* tell every peer, so that ranks still waiting raise now rather than at the timeout:
         * the mismatch itself where one caused this (every rank then names the same calls) */
        if (e->mm_seq && e->mm_seq <= e->seq) {
            mm_settle(e, e->coll_deadline);
        } else {
            char m[ERRTEXT];
            if (verdict)
                fmt(m, sizeof m, "%s", err);
            else
                fmt(m, sizeof m, "%s #%llu failed on rank %d: %s", KNAMES[e->cur_kind],
                    SN(e, e->seq), RN(e, e->rank), err);
            for (int i = 0; i < e->size; i++)
                if (i != e->rank && !e->peers[i].dead && !e->closed)
                    send_control(e, i, F_ERROR, e->seq, m, strlen(m), 0,
                                 verdict ? FLAG_VERDICT : 0);
        }
    }
    e->coll_active = 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

TCP_HIDDEN tcp_req *cset(tcp_engine *e, int i, int is_send, int peer, int32_t tag, const void *buf, size_t len)
{
    tcp_req *r = &e->creqs[i];
    req_init(r, is_send, peer, e->cur_kind, tag, e->seq, e->cur_fp, TCP_NO_DTYPE, buf, len);
    e->cptr[i] = r;
    return r;
}

/* Post creqs[lo..hi): receives first, so arriving data lands in place. */
TCP_HIDDEN void cpost(tcp_engine *e, int lo, int hi)
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

TCP_HIDDEN int cwait(tcp_engine *e, int lo, int hi, char *err, size_t errlen)
{
    if (hi <= lo) return 0;
    pthread_mutex_lock(&e->mu);
    int rc = wait_locked(e, e->cptr + lo, hi - lo, e->coll_deadline, e->coll_span, 1, err,
                         errlen);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

TCP_HIDDEN void cancel_range(tcp_engine *e, int lo, int hi)
{
    pthread_mutex_lock(&e->mu);
    for (int i = lo; i < hi; i++)
        if (e->creqs[i].state == 0) {
            cancel_req(e, &e->creqs[i]);
            e->creqs[i].state = -1;
        }
    pthread_mutex_unlock(&e->mu);
}

TCP_HIDDEN int cxfer(tcp_engine *e, int n, char *err, size_t errlen)
{
    cpost(e, 0, n);
    return cwait(e, 0, n, err, errlen);
}



/* ------------------------------------------------------ fingerprint frames */


static void fp_set(tcp_engine *e, int i, int is_send, int peer, int round)
{
    tcp_req *r = &e->fpreqs[i];
    req_init(r, is_send, peer, e->cur_kind, TAG_FP(round), e->seq, e->cur_fp, TCP_NO_DTYPE, NULL, 0);
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

TCP_HIDDEN void links_clear(tcp_engine *e)
{
    memset(e->data_to, 0, 2 * (size_t)e->size);
}

/* The binomial tree of the small reduce, rooted at root: marks this rank's
 * parent in up and its children in down. */
TCP_HIDDEN void tree_links(tcp_engine *e, int root, unsigned char *up, unsigned char *down)
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
TCP_HIDDEN void fp_begin(tcp_engine *e)
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
TCP_HIDDEN int fp_finish(tcp_engine *e, int rc, char *err, size_t errlen)
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
