/* TCP collectives: the algorithms over the engine's request sets (tcp_internal.h). */
#include "tcp_internal.h"

static int oom(char *err, size_t errlen)
{
    fmt(err, errlen, "out of memory for the collective's scratch buffers");
    return -1;
}

/* Whether [a, a + na) and [b, b + nb) share no byte: a collective whose input lies apart
 * from its output may send from the input while receives write into the output. */
static int disjoint(const void *a, size_t na, const void *b, size_t nb)
{
    const char *x = a, *y = b;
    return x + na <= y || y + nb <= x;
}

/* The segment of a pipelined step's block of `blk` bytes: the block over seg_split (an
 * eighth over links; whole on one host, where a segment buys no overlap with a link and
 * costs a wake-up), at least 64 KiB, at most the segment setting (COLLECTIVES_TCP_SEGMENT),
 * and large enough that a block has at most 64 segments (matching scans the posted requests: with the
 * tests' 256 B setting, 3,000 segments a block made all_gather time out). */
static size_t seg_bytes(const tcp_engine *e, size_t blk)
{
    size_t seg = blk / (size_t)e->seg_split;
    if (seg < 65536)
        seg = 65536;
    if (seg > e->seg)
        seg = e->seg;
    if (seg < blk / 64)
        seg = blk / 64 + 1;
    return seg ? seg : 1;
}

/* Ring reduce-scatter (T = n - 1 steps) or all_reduce (T = 2(n - 1)) as one chain,
 * pipelined by segments: at step t this rank receives block R(t) from the previous rank and
 * sends block S(t) to the next, and S(t+1) = R(t) throughout (reduce-scatter steps, then
 * all-gather steps), so segment j of step t+1 goes out as soon as segment j of step t is
 * in (and, in the reduce-scatter, reduced): the ring streams, and no step waits for its
 * slowest link. Blocks are counted from shift: step 0 sends block r + shift, and after the
 * reduce-scatter this rank holds the full reduction of block r + 1 + shift.
 * A reduce-scatter step reduces this rank's own part of the block, read from in, with
 * what came (in that order) into W, the last step into `last` when given (a buffer of that
 * block alone), so in is only read: all_reduce passes in == W, reduce and reduce_scatter
 * their input as it is, with no copy of it. Reduce-scatter steps receive into two scratch
 * halves in turn; all-gather steps straight into W. Every block has the same number of
 * segments (split evenly: none is empty). Each block is reduced once, in the same order as
 * the unsegmented ring, so the result is the same on every rank bit for bit. */
static int ring_chain(tcp_engine *e, char *W, const char *in, char *last, size_t count,
                      int dtype, int op, size_t es, int shift, int T, char *err, size_t errlen)
{
    int n = e->size, r = e->rank, next = (r + 1) % n, prev = (r - 1 + n) % n;
    size_t minblk = count / (size_t)n, maxblk = minblk + 1;
    size_t segb = seg_bytes(e, maxblk * es);
    size_t S = (maxblk * es + segb - 1) / segb;
    if (S > minblk) S = minblk;
    if (!S) S = 1;
    if (ensure_buf(&e->tmp, &e->tmp_cap, 2 * maxblk * es) ||
        ensure_reqs(e, 2 * (size_t)T * S + 2))
        return oom(err, errlen);
#define RB(t) mod(((t) < n - 1 ? r - (t) - 1 : r - ((t) - (n - 1))) + shift, n)
#define SEG(b, j, off, c) do { size_t b0_ = blk(count, n, (b)), bc_ = blk(count, n, (b) + 1) - b0_; \
        (off) = b0_ + blk(bc_, (int)S, (int)(j)); (c) = b0_ + blk(bc_, (int)S, (int)(j) + 1) - (off); } while (0)
    int RECV0 = 0, SEND0 = T * (int)S;
    for (int i = 0; i < 2 * T * (int)S; i++)  /* not set yet: nothing for a cancel to undo */
        e->creqs[i].state = -1;
    /* receives of reduce-scatter step t (into scratch half t & 1, at the segment's place
     * within its block) */
    for (int t = 0; t < 2 && t < n - 1; t++) {
        int b = RB(t);
        for (size_t j = 0; j < S; j++) {
            size_t off, c;
            SEG(b, j, off, c);
            size_t at = off - blk(count, n, b);
            cset(e, RECV0 + t * (int)S + (int)j, 0, prev, TAG(t, j),
                 e->tmp + ((size_t)(t & 1) * maxblk + at) * es, c * es);
        }
        cpost(e, RECV0 + t * (int)S, RECV0 + (t + 1) * (int)S);
    }
    {   /* step 0 sends this rank's own block r + shift */
        int b = mod(r + shift, n);
        for (size_t j = 0; j < S; j++) {
            size_t off, c;
            SEG(b, j, off, c);
            cset(e, SEND0 + (int)j, 1, next, TAG(0, j), (char *)in + off * es, c * es);
        }
        cpost(e, SEND0, SEND0 + (int)S);
    }
    int rc = 0;
    for (int t = 0; t < T && !rc; t++) {
        int b = RB(t);
        for (size_t j = 0; j < S; j++) {
            int w = RECV0 + t * (int)S + (int)j;
            if ((rc = cwait(e, w, w + 1, err, errlen)))
                break;
            size_t off, c;
            SEG(b, j, off, c);
            size_t at = off - blk(count, n, b);
            char *dst = last && t == n - 2 ? last + at * es : W + off * es;
            if (t < n - 1)
                coll_reduce3(dst, in + off * es, e->tmp + ((size_t)(t & 1) * maxblk + at) * es,
                             c, dtype, op);
            if (t + 1 < T) {
                int k = SEND0 + (t + 1) * (int)S + (int)j;
                cset(e, k, 1, next, TAG(t + 1, j), dst, c * es);
                cpost(e, k, k + 1);
            }
        }
        if (rc || t >= n - 1)
            continue;
        if (t + 2 < n - 1) {  /* scratch half t & 1 is free again */
            int b2 = RB(t + 2);
            for (size_t j = 0; j < S; j++) {
                size_t off, c;
                SEG(b2, j, off, c);
                cset(e, RECV0 + (t + 2) * (int)S + (int)j, 0, prev, TAG(t + 2, j),
                     e->tmp + ((size_t)(t & 1) * maxblk + off - blk(count, n, b2)) * es, c * es);
            }
            cpost(e, RECV0 + (t + 2) * (int)S, RECV0 + (t + 3) * (int)S);
        }
        if (t == n - 2) {  /* the all-gather's receives land in W */
            for (int u = n - 1; u < T; u++) {
                int bu = RB(u);
                for (size_t j = 0; j < S; j++) {
                    size_t off, c;
                    SEG(bu, j, off, c);
                    cset(e, RECV0 + u * (int)S + (int)j, 0, prev, TAG(u, j), W + off * es, c * es);
                }
            }
            cpost(e, RECV0 + (n - 1) * (int)S, RECV0 + T * (int)S);
        }
    }
#undef RB
#undef SEG
    if (rc || cwait(e, SEND0, SEND0 + T * (int)S, err, errlen)) {
        cancel_range(e, 0, 2 * T * (int)S);
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

static int largest_pow2(int n)
{
    int p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    return p2;
}

/* The small broadcast as a hypercube exchange from the root: round m pairs vr with vr ^ m;
 * a rank that holds the data (vr < m) sends it and hears a fingerprint frame (a header, no
 * payload) back, and two ranks that both lack it trade fingerprint frames. Every rank
 * sends and receives one frame per round, log2(p2) rounds, and hears every peer's
 * fingerprint, directly or through a chain of checked frames, before it returns: the
 * binomial tree's data and the rooted collectives' fingerprint frames (fp_begin) in one
 * exchange (4 ranks: 8 frames instead of 12; 8 ranks: 24 instead of 56). A rank past the
 * largest power of two p2 (vr >= p2) trades fingerprints with vr - p2 first and gets the
 * data from it last.
 *
 * Every wait here goes with a frame to the rank waited on, posted before the wait: where
 * the ranks name different roots, a rank waiting for a peer that follows another schedule
 * has sent that peer a frame, whose fingerprint fails the peer's check, so the mismatch is
 * found instead of a cycle of waits (3 ranks, roots 0, 1, 1: rank 0 waited for rank 2's
 * frame, rank 2 for rank 1's, rank 1 for rank 0's, until the timeout). */
static int bcast_cube(tcp_engine *e, char *buf, size_t nbytes, int root, char *err, size_t errlen)
{
    int n = e->size, vr = mod(e->rank - root, n), p2 = largest_pow2(n), rem = n - p2;
#define RK(v) (((v) + root) % n)
    if (ensure_reqs(e, 3)) return oom(err, errlen);
    if (vr >= p2) {
        cset(e, 0, 1, RK(vr - p2), TAG(0, 0), NULL, 0);
        cset(e, 1, 0, RK(vr - p2), TAG(0, 0), NULL, 0);
        cset(e, 2, 0, RK(vr - p2), TAG(100, 0), buf, nbytes);
        return cxfer(e, 3, err, errlen);
    }
    if (vr < rem) {
        cset(e, 0, 0, RK(vr + p2), TAG(0, 0), NULL, 0);
        cset(e, 1, 1, RK(vr + p2), TAG(0, 0), NULL, 0);
        if (cxfer(e, 2, err, errlen)) return -1;
    }
    for (int m = 1, step = 1; m < p2; m <<= 1, step++) {
        int have = vr < m, gets = !have && vr < 2 * m;
        cset(e, 0, 0, RK(vr ^ m), TAG(step, 0), gets ? buf : NULL, gets ? nbytes : 0);
        cset(e, 1, 1, RK(vr ^ m), TAG(step, 0), have ? buf : NULL, have ? nbytes : 0);
        if (cxfer(e, 2, err, errlen)) return -1;
    }
    if (vr < rem) {
        cset(e, 0, 1, RK(vr + p2), TAG(100, 0), buf, nbytes);
        return cxfer(e, 1, err, errlen);
    }
#undef RK
    return 0;
}

#define CHAIN_SEG_MIN (64 * 1024)
static int bcast_chain(tcp_engine *e, char *buf, size_t nbytes, int root, char *err, size_t errlen)
{
    int n = e->size, vr = mod(e->rank - root, n);
    int prev = (vr - 1 + root + n) % n, next = (vr + 1 + root) % n;
    /* The chain fills in n - 2 segment times, which the last rank waits out: segments of
     * at most 1/(32 (n - 1)) of the buffer keep that under ~3% of the transfer, so a
     * broadcast over links stays near the link bound (4 hosts, 16 MiB: 1 MiB segments
     * cap it at 16/18 of the link, these at 96/98); never under CHAIN_SEG_MIN, so loopback
     * is not swamped with small frames, nor over the segment setting. On one host
     * (seg_split 1) segments of the segment setting, as for the other pipelined steps. */
    size_t seg = e->seg_split > 1 ? nbytes / (32 * (size_t)(n - 1)) : e->seg;
    if (seg < CHAIN_SEG_MIN) seg = CHAIN_SEG_MIN;
    if (seg > e->seg) seg = e->seg;
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
    int rc;
    if (nbytes <= e->tree_max || n == 2) {
        rc = bcast_cube(e, buf, nbytes, root, err, errlen);  /* checks fingerprints itself */
    } else {
        int vr = mod(e->rank - root, n);
        links_clear(e);
        if (vr > 0) e->data_from[(vr - 1 + root) % n] = 1;
        if (vr < n - 1) e->data_to[(vr + 1 + root) % n] = 1;
        fp_begin(e);
        rc = bcast_chain(e, buf, nbytes, root, err, errlen);
        rc = fp_finish(e, rc, err, errlen);
    }
    return coll_end(e, rc, err, errlen);
}

/* Ranks past the largest power of two p2 fold into a neighbour: an even r < 2*rem hands its
 * buffer to r + 1 and waits for the result (returns 1: this rank is done), an odd one
 * reduces it in (the lower rank's value first). *p2: the largest power of two <= size; *vr:
 * this rank's index among the p2 that go on; fold_peer gives the rank of index vp. Sizes
 * e->tmp to the buffer. */
static int fold_in(tcp_engine *e, char *buf, size_t count, int dtype, int op, size_t es, int *p2,
                   int *vr, char *err, size_t errlen)
{
    *p2 = largest_pow2(e->size);
    int r = e->rank, rem = e->size - *p2;
    size_t nb = count * es;
    if (ensure_buf(&e->tmp, &e->tmp_cap, nb) || ensure_reqs(e, 4)) return oom(err, errlen);
    if (r >= 2 * rem) {
        *vr = r - rem;
        return 0;
    }
    if (r % 2 == 0) {
        cset(e, 0, 1, r + 1, TAG(0, 0), buf, nb);
        cset(e, 1, 0, r + 1, TAG(100, 0), buf, nb);
        return cxfer(e, 2, err, errlen) ? -1 : 1;
    }
    cset(e, 0, 0, r - 1, TAG(0, 0), e->tmp, nb);
    if (cxfer(e, 1, err, errlen)) return -1;
    coll_reduce(e->tmp, buf, count, dtype, op);
    memcpy(buf, e->tmp, nb);
    *vr = r / 2;
    return 0;
}

static inline int fold_peer(int vp, int rem)
{
    return vp < rem ? 2 * vp + 1 : vp + rem;
}

/* mine = op(mine, theirs) where this rank's value comes first (mine_lower), else
 * op(theirs, mine): the lower rank's value first, as every rank computes it. */
static void reduce_in_order(char *mine, char *theirs, size_t count, int dtype, int op, size_t es,
                            int mine_lower)
{
    if (mine_lower) {
        coll_reduce(mine, theirs, count, dtype, op);
    } else {
        coll_reduce(theirs, mine, count, dtype, op);
        memcpy(mine, theirs, count * es);
    }
}

/* The folded-in neighbour (fold_in) gets the result. */
static int fold_out(tcp_engine *e, char *buf, size_t nb, int p2, char *err, size_t errlen)
{
    int r = e->rank;
    if (r >= 2 * (e->size - p2)) return 0;
    cset(e, 0, 1, r - 1, TAG(100, 0), buf, nb);
    return cxfer(e, 1, err, errlen);
}

/* all_reduce over the largest power of two p2 of ranks (the others fold in, fold_in):
 *
 * - recursive doubling (halving 0): log2(p2) exchanges of the whole buffer;
 * - recursive halving-doubling (Rabenseifner, halving 1): halve the buffer log2(p2) times
 *   (each step sends the half the partner keeps and reduces the half it keeps: a
 *   reduce-scatter), then double it back in the reverse order (an all-gather). The same
 *   bytes over each link as the ring, in 2 log2(p2) rounds instead of 2(n-1): the choice
 *   between them over many hosts (docs/between-hosts.md).
 *
 * Every step combines as op(lower rank's value, higher's), and in halving-doubling each
 * element is reduced on one rank and copied to the others, so all ranks compute
 * bitwise-identical results even for non-commutative NaN handling. */
static int pow2_allreduce(tcp_engine *e, char *buf, size_t count, int dtype, int op, size_t es,
                          int halving, char *err, size_t errlen)
{
    int p2, vr, f = fold_in(e, buf, count, dtype, op, es, &p2, &vr, err, errlen);
    if (f) return f < 0 ? -1 : 0;
    int rem = e->size - p2;
    size_t nb = count * es;
    if (!halving) {
        for (int mask = 1, step = 1; mask < p2; mask <<= 1, step++) {
            int vp = vr ^ mask, partner = fold_peer(vp, rem);
            cset(e, 0, 0, partner, TAG(step, 0), e->tmp, nb);
            cset(e, 1, 1, partner, TAG(step, 0), buf, nb);
            if (cxfer(e, 2, err, errlen)) return -1;
            reduce_in_order(buf, e->tmp, count, dtype, op, es, vr < vp);
        }
        return fold_out(e, buf, nb, p2, err, errlen);
    }
    /* elements [AT(b), AT(b + 1)) form block b of p2; the first count % p2 have one more */
    size_t per = count / (size_t)p2, more = count % (size_t)p2;
#define AT(b) ((size_t)(b) * per + ((size_t)(b) < more ? (size_t)(b) : more))
    int lo = 0, hi = p2, los[32], his[32], k = 0;
    for (int mask = 1, step = 1; mask < p2; mask <<= 1, step++, k++) {
        int vp = vr ^ mask, partner = fold_peer(vp, rem), mid = (lo + hi) / 2;
        int klo = (vr & mask) ? mid : lo, khi = (vr & mask) ? hi : mid;  /* the half kept */
        int slo = (vr & mask) ? lo : mid, shi = (vr & mask) ? mid : hi;  /* the half sent */
        size_t kc = AT(khi) - AT(klo);
        los[k] = lo;
        his[k] = hi;
        cset(e, 0, 0, partner, TAG(step, 0), e->tmp, kc * es);
        cset(e, 1, 1, partner, TAG(step, 0), buf + AT(slo) * es, (AT(shi) - AT(slo)) * es);
        if (cxfer(e, 2, err, errlen)) return -1;
        reduce_in_order(buf + AT(klo) * es, e->tmp, kc, dtype, op, es, vr < vp);
        lo = klo;
        hi = khi;
    }
    for (int mask = p2 >> 1, step = 50; mask >= 1; mask >>= 1, step++) {
        int vp = vr ^ mask, partner = fold_peer(vp, rem);
        k--;
        int plo = lo == los[k] ? hi : los[k], phi = lo == los[k] ? his[k] : lo;  /* the partner's */
        cset(e, 0, 0, partner, TAG(step, 0), buf + AT(plo) * es, (AT(phi) - AT(plo)) * es);
        cset(e, 1, 1, partner, TAG(step, 0), buf + AT(lo) * es, (AT(hi) - AT(lo)) * es);
        if (cxfer(e, 2, err, errlen)) return -1;
        lo = los[k];
        hi = his[k];
    }
#undef AT
    return fold_out(e, buf, nb, p2, err, errlen);
}

/* Large all_reduce in two rounds: every rank sends block j to rank j, which reduces the
 * n copies in rank order and sends the result to everyone. Same bytes per rank as a
 * ring, but no chain of n-1 dependent steps (ranks often outnumber cores). Pipelined by
 * segments: as soon as segment k of this rank's block has arrived from every peer, it is
 * reduced and its sends of the second round are posted, behind the first round's on each
 * socket, so that a link never idles while a block is reduced (the unsegmented form left
 * every link idle for the whole reduction and waited for the slowest first-round block:
 * 0.82-0.89 of the link bound on emulated 1 Gbit/s links). Each segment is reduced over
 * the same sources in the same order, so the result is the unsegmented one, bit for bit. */
static int direct_allreduce(tcp_engine *e, char *W, size_t count, int dtype, int op, size_t es,
                            char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    size_t off = blk(count, n, r), cnt = blk(count, n, r + 1) - off, nb = cnt * es;
    size_t maxblk = count / (size_t)n + 1;
    size_t seg_el = (seg_bytes(e, maxblk * es) + es - 1) / es;  /* whole elements */
    size_t maxseg = (maxblk + seg_el - 1) / seg_el, myseg = (cnt + seg_el - 1) / seg_el;
    if (ensure_buf(&e->tmp, &e->tmp_cap, nb * (size_t)n) ||
        ensure_reqs(e, 4 * (size_t)n * (maxseg + 1)))
        return oom(err, errlen);
    int k = 0;
    /* first-round receives, segment by segment: requests [k*(n-1), (k+1)*(n-1)) are
     * segment k of this rank's block from every peer */
    for (size_t j = 0; j < myseg; j++) {
        size_t o = j * seg_el, c = cnt - o < seg_el ? cnt - o : seg_el;
        for (int s = 1; s < n; s++) {
            int from = mod(r - s, n);
            cset(e, k++, 0, from, TAG(0, j), e->tmp + (size_t)from * nb + o * es, c * es);
        }
    }
    int ag0 = k;  /* second-round receives: the peers' reduced blocks land in W directly */
    for (int s = 1; s < n; s++) {
        int from = mod(r - s, n);
        size_t po = blk(count, n, from), pc = blk(count, n, from + 1) - po;
        for (size_t j = 0; j * seg_el < pc; j++) {
            size_t o = j * seg_el, c = pc - o < seg_el ? pc - o : seg_el;
            cset(e, k++, 0, from, TAG(1, j), W + (po + o) * es, c * es);
        }
    }
    /* first-round sends: peer `to`'s block, in its segments */
    for (int s = 1; s < n; s++) {
        int to = (r + s) % n;
        size_t po = blk(count, n, to), pc = blk(count, n, to + 1) - po;
        for (size_t j = 0; j * seg_el < pc; j++) {
            size_t o = j * seg_el, c = pc - o < seg_el ? pc - o : seg_el;
            cset(e, k++, 1, to, TAG(0, j), W + (po + o) * es, c * es);
        }
    }
    cpost(e, 0, k);
    const void *srcs[64];
    const void **sp = n <= 64 ? srcs : malloc(sizeof(void *) * (size_t)n);
    if (!sp) {
        cancel_range(e, 0, k);
        return oom(err, errlen);
    }
    int rc = 0;
    for (size_t j = 0; j < myseg && !rc; j++) {
        size_t o = j * seg_el, c = cnt - o < seg_el ? cnt - o : seg_el;
        int w0 = (int)j * (n - 1);
        if ((rc = cwait(e, w0, w0 + n - 1, err, errlen)))
            break;
        /* this rank's block is read where it is (the kernels allow dst among the sources) */
        for (int q = 0; q < n; q++)
            sp[q] = q == r ? (const void *)(W + (off + o) * es) : e->tmp + (size_t)q * nb + o * es;
        coll_reduce_many(W + (off + o) * es, (const void *const *)sp, n, c, dtype, op);
        int k2 = k;
        for (int s = 1; s < n; s++)
            cset(e, k++, 1, (r + s) % n, TAG(1, j), W + (off + o) * es, c * es);
        cpost(e, k2, k);
    }
    if (sp != srcs) free(sp);
    if (rc || cwait(e, ag0, k, err, errlen)) {
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
        rc = pow2_allreduce(e, buf, count, dtype, op, es, 0, err, errlen);
    else if (e->size > 2 && count * es <= e->hd_max)
        rc = pow2_allreduce(e, buf, count, dtype, op, es, 1, err, errlen);
    else if (e->size <= e->direct_world)
        rc = direct_allreduce(e, buf, count, dtype, op, es, err, errlen);
    else {
        rc = ring_chain(e, buf, buf, NULL, count, dtype, op, es, 0, 2 * (e->size - 1), err,
                        errlen);
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
    /* a rank other than root reduces into scratch, leaving buf as it was (the tree from a
     * copy of it; the ring reads it where it is) */
    int tree = nb <= e->tree_max || count < (size_t)n;
    char *acc = buf;
    if (r != root) {
        if (ensure_buf(&e->scratch, &e->scratch_cap, nb)) rc = oom(err, errlen);
        else {
            acc = e->scratch;
            if (tree) memcpy(acc, buf, nb);
        }
    }
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
        rc = ring_chain(e, acc, buf, NULL, count, dtype, op, es, 0, n - 1, err, errlen);
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

/* Ring all_gather, pipelined by segments: at step s this rank receives block r-s-1 from
 * the previous rank and forwards each segment of it to the next rank as soon as that
 * segment is in, so the ring streams instead of waiting out each step for its slowest
 * link (whole-block steps reached 0.87-0.89 of the link bound on emulated links). Every
 * receive is posted up front, straight into its place in out. */
static int ring_allgather(tcp_engine *e, char *o, const char *in, size_t nb, char *err,
                          size_t errlen)
{
    int n = e->size, r = e->rank, next = (r + 1) % n, prev = mod(r - 1, n);
    size_t seg = seg_bytes(e, nb);
    size_t nseg = nb ? (nb + seg - 1) / seg : 1;
    if (ensure_reqs(e, 2 * (size_t)n * nseg + 2)) return oom(err, errlen);
    int k = 0;
    for (int s = 0; s < n - 1; s++) {  /* request s * nseg + j: segment j of step s's block */
        size_t rb = (size_t)mod(r - s - 1, n);
        for (size_t j = 0; j < nseg; j++) {
            size_t off = j * seg, c = nb - off < seg ? nb - off : seg;
            cset(e, k++, 0, prev, TAG(s, j), o + rb * nb + off, c);
        }
    }
    for (size_t j = 0; j < nseg; j++) {  /* step 0 sends this rank's own block, from in */
        size_t off = j * seg, c = nb - off < seg ? nb - off : seg;
        cset(e, k++, 1, next, TAG(0, j), (char *)in + off, c);
    }
    cpost(e, 0, k);
    /* The copy of this rank's block into out overlaps the first segments on the wire (16
     * MiB: ~2 ms, which ahead of the transfer cost 2 hosts 1.5% of the link bound). */
    if (in != o + (size_t)r * nb) memcpy(o + (size_t)r * nb, in, nb);
    for (int s = 0; s < n - 2; s++) {  /* forward what step s brought in as step s + 1 */
        size_t rb = (size_t)mod(r - s - 1, n);
        for (size_t j = 0; j < nseg; j++) {
            int w = s * (int)nseg + (int)j;
            if (cwait(e, w, w + 1, err, errlen)) {
                cancel_range(e, 0, k);
                return -1;
            }
            size_t off = j * seg, c = nb - off < seg ? nb - off : seg;
            cset(e, k, 1, next, TAG(s + 1, j), o + rb * nb + off, c);
            cpost(e, k, k + 1);
            k++;
        }
    }
    if (cwait(e, 0, k, err, errlen)) {
        cancel_range(e, 0, k);
        return -1;
    }
    return 0;
}

int tcp_allgather(tcp_engine *e, void *out, const void *in, size_t nb, uint64_t fp, char *err,
                  size_t errlen)
{
    int n = e->size, r = e->rank;
    char *o = out;
    const char *mine = in;
    /* Copied ahead unless the ring can copy it while sending (in apart from out, which
     * the transfer writes into). */
    int apart = disjoint(mine, nb, o, (size_t)n * nb);
    int ring = n > 1 && nb * (size_t)n > e->direct_max;
    if (!(ring && apart) && mine != o + (size_t)r * nb) memmove(o + (size_t)r * nb, in, nb);
    if (n == 1) return 0;
    if (coll_begin(e, K_ALLGATHER, fp, err, errlen)) return -1;
    int rc = 0;
    if (!ring) {
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
        rc = ring_allgather(e, o, apart ? mine : o + (size_t)r * nb, nb, err, errlen);
    }
    return coll_end(e, rc, err, errlen);
}

/* gather (to_root: every rank's block goes to the root) and scatter (the root's blocks go
 * out): the root holds n blocks of nb bytes at blocks, every rank its own block at mine.
 * Only the root's links carry data, so the fingerprints travel there alone (the side away
 * from the root only sends, or hears from the root alone). */
static int rooted(tcp_engine *e, int kind, int to_root, char *blocks, char *mine, size_t nb,
                  int root, uint64_t fp, char *err, size_t errlen)
{
    int n = e->size, r = e->rank;
    if (r == root && mine != blocks + (size_t)r * nb) {
        if (to_root) memmove(blocks + (size_t)r * nb, mine, nb);
        else memmove(mine, blocks + (size_t)r * nb, nb);
    }
    if (n == 1) return 0;
    if (coll_begin(e, kind, fp, err, errlen)) return -1;
    int rc = 0, k = 0;
    links_clear(e);
    unsigned char *at_root = to_root ? e->data_from : e->data_to;
    unsigned char *at_other = to_root ? e->data_to : e->data_from;
    if (r == root) memset(at_root, 1, (size_t)n);
    else at_other[root] = 1;
    fp_begin(e);
    if (ensure_reqs(e, (size_t)n)) rc = oom(err, errlen);
    else if (r == root) {
        for (int s = 1; s < n; s++) {
            int j = (r + s) % n;
            cset(e, k++, !to_root, j, TAG(0, 0), blocks + (size_t)j * nb, nb);
        }
    } else {
        cset(e, k++, to_root, root, TAG(0, 0), mine, nb);
    }
    if (!rc) rc = cxfer(e, k, err, errlen);
    rc = fp_finish(e, rc, err, errlen);
    return coll_end(e, rc, err, errlen);
}

int tcp_gather(tcp_engine *e, void *out, const void *in, size_t nb, int root, uint64_t fp, char *err,
               size_t errlen)
{
    return rooted(e, K_GATHER, 1, (char *)out, (char *)in, nb, root, fp, err, errlen);
}

int tcp_scatter(tcp_engine *e, void *out, const void *in, size_t nb, int root, uint64_t fp, char *err,
                size_t errlen)
{
    return rooted(e, K_SCATTER, 0, (char *)in, (char *)out, nb, root, fp, err, errlen);
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
        /* the ring reads in where it is and reduces this rank's block straight into out,
         * unless out overlaps in other than as exactly that block: then from a copy.
         * Scratch holds the blocks reduced on the way (none at 2 ranks), or the copy. */
        const char *src = in, *o = out;
        int apart = disjoint(o, nb, src, nb * (size_t)n) || o == src + (size_t)r * nb;
        if ((n > 2 || !apart) && ensure_buf(&e->scratch, &e->scratch_cap, nb * (size_t)n))
            rc = oom(err, errlen);
        if (!rc && !apart) {
            memcpy(e->scratch, in, nb * (size_t)n);
            src = e->scratch;
        }
        if (!rc)
            rc = ring_chain(e, e->scratch, src, out, count * (size_t)n, dtype, op, es, -1, n - 1,
                            err, errlen);
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
    size_t otot = 0, itot = 0;
    for (int j = 0; j < n; j++) {
        otot += out_bytes[j];
        itot += in_bytes[j];
    }
    /* this rank's own block is copied while the exchange runs when in and out lie apart
     * (the receives write into out), else ahead of it */
    int later = n > 1 && disjoint(out, otot, in, itot);
    if (own && !later && (char *)out + myo != (const char *)in + myi)
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
                /* aux: each frame says what its sender expects back, so that both ends of a
                 * pair see a split that differs (the fingerprint names kind and dtype only) */
                cset(e, k++, 0, from, TAG(0, 0), (char *)out + oo[from], out_bytes[from])->aux = in_bytes[from];
                cset(e, k++, 1, to, TAG(0, 0), (const char *)in + io[to], in_bytes[to])->aux = out_bytes[to];
            }
            free(oo);
            cpost(e, 0, k);
            if (own && later) memcpy((char *)out + myo, (const char *)in + myi, own);
            rc = cwait(e, 0, k, err, errlen);
        }
    }
    if (!rc && n > 2) {
        /* a split that differs is seen only by the pair it concerns, and the other ranks
         * would return with their (correct) data: a closing round of fingerprint frames,
         * sent once this rank's receives are checked, makes every rank hear every peer's
         * verdict before it returns (one more latency; a failed rank's mismatch record
         * reaches the others instead of its frame) */
        links_clear(e);
        fp_begin(e);
        rc = fp_finish(e, rc, err, errlen);
    }
    return coll_end(e, rc, err, errlen);
}
