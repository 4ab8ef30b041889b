/* Same-host collectives over one shared-memory segment (see shm_coll.h): each one
 * checks the ranks' fingerprints, then moves data through the ranks' data slots or, where
 * the ranks may read each other's memory, in one copy (CMA); see shm_sync.h. */
#include "shm_copy.h"
#include "shm_mapped.h"
#include "shm_tune.h"

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
 * Each byte crosses between the cores once, where the two-copy path moves it twice; with
 * many readers at once the kernel's pinning of the same pages serialises them, so it runs
 * only where c->cma_bcast allows (figures: docs/design-shm.md, "Single copy (CMA)"). */
#define CMA_SPLIT (256 * 1024)
static int broadcast_cma(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
{
    int n = c->n, me = c->me;
    size_t head = nbytes;  /* bytes each reader reads; the root writes the rest */
    if (nbytes >= CMA_SPLIT)
        head = (nbytes / (size_t)n * (size_t)(n - 1)) & ~(size_t)4095;
    thp_prepare(c, buf, nbytes);
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)buf, memory_order_relaxed);
    TRY(c, fp_publish(c, fp));
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

/* ---- small calls under the caller's lock ----------------------------------------------
 * (shm_*_try in shm_coll.h.) A bounded spin with the GIL held stands in for a wait; where it
 * runs out, the call stops at a point where shm_finish can take it up with a wait, and
 * says what is left in c->pend. The Python threads of the process wait at most that spin. */
enum { PEND_NONE, PEND_BARRIER, PEND_BROADCAST, PEND_ALL_REDUCE, /* left whole */
       PEND_CHECK_ALL, PEND_BC_READ, PEND_BC_DEFER, PEND_AR_REST }; /* begun */

/* polls of a held spin */
static inline int held_spin(const shm_comm *c) { return c->spin / 8; }

/* Whether peer q's post (ack = 0) or ack (ack = 1) reaches s within *spins more polls (a
 * budget shared by the caller's checks); kept as wait_seen keeps it. */
static int reached(shm_comm *c, int q, int ack, uint32_t s, int *spins)
{
    uint32_t *seen = &c->seen[2 * q + ack];
    const _Atomic uint32_t *v = ack ? &c->ctl[q].ack.v : &c->ctl[q].post.v;
    while (!ge(*seen, s)) {
        uint32_t now = atomic_load_explicit(v, memory_order_acquire);
        if (ge(now, s)) {
            *seen = now;
            break;
        }
        if (*spins <= 0)
            return 0;
        --*spins;
        cpu_relax();
    }
    return 1;
}

/* ... every peer's */
static int all_reached(shm_comm *c, int ack, uint32_t s, int *spins)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me && !reached(c, q, ack, s, spins))
            return 0;
    return 1;
}

/* Leave the call whole to shm_finish. */
static int pend(shm_comm *c, int what, void *buf, size_t n, int root, int dtype, int op,
                uint64_t fp)
{
    c->pend.what = what;
    c->pend.buf = buf;
    c->pend.n = n;
    c->pend.root = root;
    c->pend.dtype = dtype;
    c->pend.op = op;
    c->pend.fp = fp;
    return SHM_PENDING;
}

int shm_barrier_try(shm_comm *c, uint64_t fp)
{
    CHECK(c);
    if (c->n == 1)
        return SHM_OK;
    if (c->ahead)  /* fp_publish may wait */
        return pend(c, PEND_BARRIER, NULL, 0, -1, -1, -1, fp);
    int rc = fp_publish(c, fp);
    if (rc)
        return fail(c, rc);
    uint32_t s = ++c->seq;
    post(c, s);
    int spins = held_spin(c);
    if (all_reached(c, 0, s, &spins))  /* fp_check_all finds every post it waits for */
        return fail(c, fp_check_all(c, s));
    c->pend.what = PEND_CHECK_ALL;
    c->pend.s = s;
    return SHM_PENDING;
}

/* A small broadcast's reader, after its copy: it has compared only the root's fingerprint,
 * and leaves the other peers' to its next synchronising wait, as a one-block root does
 * (fp_defer; fp_settle): a reader whose root agreed, where a third rank called something
 * else, raises at its next call instead of returning silently from that one too. Under the
 * caller's lock, a wait that fp_defer would make (two comparisons due already) is left to
 * shm_finish. */
static int bc_defer(shm_comm *c, uint32_t s, int held, int *spins)
{
    if (held && c->n_due == 2 && !all_reached(c, 0, c->fp_due[0].s0, spins)) {
        c->pend.what = PEND_BC_DEFER;
        c->pend.s = s;
        return SHM_PENDING;
    }
    int rc = fp_defer(c, s);
    if (rc != SHM_OK && failed_later(c))
        return SHM_OK;  /* this call's data is whole: the next call raises the failure */
    return fail(c, rc);
}

/* A small broadcast's reader, once it has posted step s (ring record s % BC_RING): the
 * root's data, after its fingerprint. */
static int bc_read(shm_comm *c, void *buf, size_t nbytes, int root, uint32_t s)
{
    TRY(c, wait_post(c, root, s));
    TRY(c, fp_check(c, root));  /* before copying the root's data into buf */
    memcpy(buf, c->ctl[root].bc[s % BC_RING].data, nbytes);
    ack(c, s);
    return bc_defer(c, s, 0, NULL);
}

/* Wait until every other rank has acked the step this rank was last the root of in ring
 * record i (has read that data). */
static int bc_all_read(shm_comm *c, int i)
{
    for (int q = 0; q < c->n; q++)
        if (q != c->me)
            TRY(c, wait_seen(c, q, 1, c->bc_due[i].s));
    return SHM_OK;
}

/* A broadcast of at most BC_INLINE bytes, through the ranks' ring records (bc_rec_t): the
 * root writes the data and its fingerprint into record s % BC_RING, posts s and returns;
 * each reader writes its fingerprint into its own record, posts s (its arrival), waits for
 * the root's record to hold this call (or for its post), compares the root's fingerprint
 * and copies; it compares the other readers' at its next synchronising wait (bc_defer).
 * Nobody waits for the readers: the root compares theirs when it reuses the record (after
 * every rank acked the step that last used it, BC_RING broadcasts later) or at its next
 * fp_check_all.
 * spins >= 0: under the caller's lock, with that many polls (shm_broadcast_try). */
static int broadcast_inline(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp,
                            int spins)
{
    const uint32_t k = c->coll + 1, s = c->seq + 1;
    const int i = (int)(s % BC_RING), me = c->me, held = spins >= 0;
    bc_rec_t *mine = &c->ctl[me].bc[i];
    if (me == root) {
        /* under the lock, only where the record's last use is settled and read: bc_settle
         * and the acks' waits below then return at once */
        if (held && !(all_reached(c, 0, c->bc_due[i].s, &spins)
                      && all_reached(c, 1, c->bc_due[i].s, &spins)))
            return pend(c, PEND_BROADCAST, buf, nbytes, root, -1, -1, fp);
        if (c->bc_due[i].due)
            TRY(c, bc_settle(c, i));
        TRY(c, bc_all_read(c, i));
        memcpy(mine->data, buf, nbytes);
    } else if (c->bc_due[i].unread) {
        /* the record holds this rank's data as the root of step bc_due[i].s (it ran ahead as
         * the root, now it reads): the fingerprint below rewrites its k, and a reader of that
         * step that has not looked yet would find it gone; so every rank has read it first */
        if (held && !all_reached(c, 1, c->bc_due[i].s, &spins))
            return pend(c, PEND_BROADCAST, buf, nbytes, root, -1, -1, fp);
        TRY(c, bc_all_read(c, i));
        c->bc_due[i].unread = 0;
    }
    fp_store(&mine->k, &mine->word, k, fp);
    c->coll = k;
    c->seq = s;
    c->fp = fp;
    c->s0_of[k % FP_SLOTS] = s;
    c->ahead = 1;
    c->bc_last = s;
    post(c, s);
    if (me == root) {
        ack(c, s);
        c->bc_due[i].k = k;
        c->bc_due[i].s = s;
        c->bc_due[i].word = fp;
        c->bc_due[i].due = 1;
        c->bc_due[i].unread = 1;
        c->bc_n_due++;
        return SHM_OK;
    }
    /* A reader looks at the root's record itself: once it holds this call's k with this
     * call's word, its data is there too (the root writes them before k), so one line
     * crosses between the cores, not the post's and then the record's. (The root rewrites
     * the record only after this rank's ack of s.) Not there within the spin (one look
     * where the caller may wait), or another word: bc_read waits for the post and compares. */
    const bc_rec_t *rec = &c->ctl[root].bc[i];
    uint64_t w;
    for (;;) {
        if (rec_find(rec, k, &w) && w == fp) {
            memcpy(buf, rec->data, nbytes);
            ack(c, s);
            return bc_defer(c, s, held, &spins);
        }
        if (spins-- <= 0)
            break;
        cpu_relax();
    }
    if (held) {
        pend(c, PEND_BC_READ, buf, nbytes, root, -1, -1, fp);
        c->pend.s = s;
        return SHM_PENDING;
    }
    return bc_read(c, buf, nbytes, root, s);
}

int shm_broadcast_try(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
{
    CHECK(c);
    if (c->n == 1)
        return SHM_OK;
    if (nbytes == 0 || nbytes > BC_INLINE)
        return pend(c, PEND_BROADCAST, buf, nbytes, root, -1, -1, fp);
    return broadcast_inline(c, buf, nbytes, root, fp, held_spin(c));
}

int shm_broadcast(shm_comm *c, void *buf, size_t nbytes, int root, uint64_t fp)
{
    CHECK(c);
    if (c->n == 1)
        return SHM_OK;
    if (nbytes == 0)
        return fp_sync(c, fp);
    if (nbytes <= BC_INLINE)
        return broadcast_inline(c, buf, nbytes, root, fp, -1);
    if (c->cma_bcast && c->cma_bcast_min && nbytes >= c->cma_bcast_min)
        return broadcast_cma(c, buf, nbytes, root, fp);
    tick(c, nbytes);
    uint32_t s0 = c->seq + 1;  /* the first step: every rank posts it */
    /* one block: the root returns once it is in the segment, without waiting for the
     * readers to arrive (they compare its fingerprint before they copy; see shm_sync.h) */
    const int lead = nbytes <= c->half;
    TRY(c, fp_publish(c, fp));
    /* whole halves: measured as fast as 1 MiB blocks or faster (4 ranks, 2 cores) */
    for (size_t off = 0; off < nbytes;) {
        size_t len = nbytes - off < c->half ? nbytes - off : c->half;
        int h = (int)(c->blk & 1);
        uint32_t s;
        if (c->me == root) {
            TRY(c, half_acquire(c, &h));
            if (c->n_due)  /* every rank acked the step that last used h: it arrived there */
                TRY(c, fp_settle(c, c->free_after[h]));
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
    if (lead && c->me == root)
        TRY(c, fp_defer(c, s0));
    else
        TRY(c, fp_check_all(c, s0));
    return SHM_OK;
}

/* Single-copy all_reduce: rank r owns slice r of the buffer. Chunk by chunk, it reads the
 * other ranks' slice r straight from their buffers (into a private scratch), reduces them
 * into its own buffer (its own values first, then the others in rank order) and writes
 * the finished chunk, still in cache, straight into every other rank's slice r. Each
 * element is computed once, by its owner, so every rank holds the same bytes. Slice r of
 * a buffer is read and written by its owner r alone (and read before written), so the
 * owners need no step between reducing and writing. Steps: s1 = addresses published;
 * s2 = this rank has read and written everything it will (a rank returns once every
 * other's s2 is posted: nothing touches its buffer after that). Against reading the
 * finished slices back, the write from cache saves a pass over half the buffer through
 * memory and one round of steps. */
#define CMA_AR_CHUNK (256 * 1024)

/* The single-copy reductions' first step: the scratch allocated, this rank's buffer
 * (``len`` bytes at ``addr``) published for the others to read, and every rank's
 * fingerprint checked (step s1). */
static int cma_open(shm_comm *c, const void *addr, size_t len, uint64_t fp)
{
    if (!c->cma_tmp && !(c->cma_tmp = malloc((size_t)(c->n - 1) * CMA_AR_CHUNK)))
        return SHM_ESYS;
    thp_prepare(c, addr, len);
    atomic_store_explicit(&c->ctl[c->me].xfer.addr, (uint64_t)(uintptr_t)addr,
                          memory_order_relaxed);
    int rc = fp_publish(c, fp);
    if (rc)
        return rc;
    uint32_t s1 = ++c->seq;
    post(c, s1);
    return fp_check_all(c, s1);
}
static int all_reduce_cma(shm_comm *c, void *buf, size_t count, int dtype, int op, size_t isz,
                          const void **srcs /* n entries, the caller's */, uint64_t fp)
{
    int n = c->n, me = c->me;
    char *ubuf = buf;
    int rc = cma_open(c, buf, count * isz, fp);
    if (rc)
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
        for (int q = 0; q < n; q++) {
            if (q == me)
                continue;
            uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
            if ((rc = cma_write(c, q, addr + at, ubuf + at, cnt * isz)))
                return rc;
        }
    }
    uint32_t s2 = ++c->seq;
    post(c, s2);
    return wait_posts(c, s2);
}

/* A reduction's entry: the group still usable, the dtype known (its item size in *isz)
 * and the op defined for it. */
static int reduction_entry(shm_comm *c, int dtype, int op, size_t *isz)
{
    CHECK(c);
    if (!(*isz = coll_itemsize(dtype)))
        return COLL_EDTYPE;
    return coll_op_valid(dtype, op) ? SHM_OK : COLL_EOP;
}

/* One-shot (every reader reduces all inputs in rank order: bitwise identical), up to the
 * post of its step *s with the data in half *h. */
static int oneshot_post(shm_comm *c, const void *buf, size_t nbytes, uint64_t fp, uint32_t *s,
                        int *h)
{
    int rc = half_acquire(c, h);
    if (rc)
        return rc;
    seg_put(c, HALF(c, c->me, *h), buf, nbytes);
    if ((rc = fp_publish(c, fp)))
        return rc;
    *s = ++c->seq;
    post(c, *s);
    c->free_after[*h] = *s;
    return SHM_OK;
}

/* ... and the rest: compare, reduce (on every rank where root < 0), ack. srcs: n entries. */
static int oneshot_rest(shm_comm *c, void *buf, size_t count, int dtype, int op, int root,
                        uint32_t s, int h, const void **srcs)
{
    int rc = fp_check_all(c, s);  /* a reduce's non-roots too, before they return */
    if (rc)
        return rc;
    if (root < 0 || root == c->me) {
        for (int q = 0; q < c->n; q++)
            srcs[q] = HALF(c, q, h);
        rc = coll_reduce_many(buf, srcs, c->n, count, dtype, op);
    }
    ack(c, s);
    tick(c, count * coll_itemsize(dtype));
    return rc;
}

/* Reduce to every rank (root < 0) or to root only. */
static int reduce_impl(shm_comm *c, void *buf, size_t count, int dtype, int op, int root,
                       uint64_t fp)
{
    size_t isz;
    int rc = reduction_entry(c, dtype, op, &isz);
    if (rc)
        return rc;
    if (c->n == 1)
        return SHM_OK;
    if (count == 0)
        return fp_sync(c, fp);
    int n = c->n, me = c->me;
    const void *stack_srcs[MAX_STACK_SRCS];
    const void **srcs = n <= MAX_STACK_SRCS ? stack_srcs : malloc(sizeof(void *) * (size_t)n);
    if (!srcs)
        return SHM_ESYS;
    size_t nbytes = count * isz;
    if (nbytes <= c->oneshot_max) {
        uint32_t s;
        int h;
        if (!(rc = oneshot_post(c, buf, nbytes, fp, &s, &h)))
            rc = oneshot_rest(c, buf, count, dtype, op, root, s, h, srcs);
        goto out;
    }
    if (root < 0 && c->mapped_on) {  /* every rank's buffer mapped by the others */
        rc = all_reduce_mapped(c, buf, count, dtype, op, isz, srcs, fp);
        if (rc != SHM_DECLINED) {
            if (!rc)
                tick(c, nbytes);
            goto out;
        }
    }
    /* an all_reduce takes the algorithm its size class measured fastest (shm_tune.c); a
     * reduce two-shot, with the stores the probes chose */
    int64_t t0 = 0;
    const int arm = root < 0 ? tune_pick(c, nbytes, &t0) : c->far ? ARM_TWO_STREAM : ARM_TWO_PLAIN;
    if (arm == ARM_SINGLE_COPY) {
        if (!(rc = all_reduce_cma(c, buf, count, dtype, op, isz, srcs, fp))) {
            tune_done(c, TUNE_ALL_REDUCE, nbytes, arm, t0);
            tick(c, nbytes);  /* the probes go on for the other collectives' stores */
        }
        goto out;
    }
    const int stream = arm == ARM_TWO_STREAM;
    if ((rc = fp_publish(c, fp)))
        goto out;
    const uint32_t s0 = c->seq + 1;  /* the first chunk's first step */
    /* two-shot: each rank reduces its own slice of the chunk (from its own buffer and
     * the others' copies) into its half, then every rank copies the other slices out.
     * Each element is computed once, by its owner, so all ranks get the same bytes. */
    size_t ce = c->chunk / isz;
    /* streaming: reduce in place, then stream the result into the segment (not on a
     * reduce's non-roots, whose buffers stay as they were) */
    const int far = stream && (root < 0 || root == me);
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
                seg_write(mine + st * isz, ubuf + st * isz, len * isz, stream);
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
                seg_write(mine + st * isz, ubuf + st * isz, len * isz, 1);
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
    if (root < 0)  /* before a probe: the trial times the algorithm alone */
        tune_done(c, TUNE_ALL_REDUCE, nbytes, arm, t0);
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

int shm_all_reduce_try(shm_comm *c, void *buf, size_t count, int dtype, int op, uint64_t fp)
{
    size_t isz;
    int rc = reduction_entry(c, dtype, op, &isz);
    if (rc || c->n == 1)
        return rc;
    int spins = held_spin(c);
    /* one-shot, too small to probe (tick), and nothing to wait for before the post: the
     * acks of the half's last use (half_acquire), the peers' run-ahead (fp_publish) */
    if (count == 0 || count * isz > c->oneshot_max || count * isz >= PROBE_SMALL_MIN
        || c->n > MAX_STACK_SRCS || c->ahead
        || !all_reached(c, 1, c->free_after[c->blk & 1], &spins))
        return pend(c, PEND_ALL_REDUCE, buf, count, -1, dtype, op, fp);
    uint32_t s;
    int h;
    if ((rc = oneshot_post(c, buf, count * isz, fp, &s, &h)))
        return fail(c, rc);
    if (!all_reached(c, 0, s, &spins)) {
        pend(c, PEND_AR_REST, buf, count, -1, dtype, op, fp);
        c->pend.s = s;
        c->pend.h = h;
        return SHM_PENDING;
    }
    const void *srcs[MAX_STACK_SRCS];
    return fail(c, oneshot_rest(c, buf, count, dtype, op, -1, s, h, srcs));
}

int shm_finish(shm_comm *c)
{
    const void *srcs[MAX_STACK_SRCS];
    int what = c->pend.what;
    c->pend.what = PEND_NONE;
    switch (what) {
    case PEND_BARRIER:
        return shm_barrier(c, c->pend.fp);
    case PEND_BROADCAST:
        return shm_broadcast(c, c->pend.buf, c->pend.n, c->pend.root, c->pend.fp);
    case PEND_ALL_REDUCE:
        return shm_all_reduce(c, c->pend.buf, c->pend.n, c->pend.dtype, c->pend.op, c->pend.fp);
    case PEND_CHECK_ALL:
        return fail(c, fp_check_all(c, c->pend.s));
    case PEND_BC_READ:
        return bc_read(c, c->pend.buf, c->pend.n, c->pend.root, c->pend.s);
    case PEND_BC_DEFER:
        return bc_defer(c, c->pend.s, 0, NULL);
    case PEND_AR_REST:
        return fail(c, oneshot_rest(c, c->pend.buf, c->pend.n, c->pend.dtype, c->pend.op, -1,
                                    c->pend.s, c->pend.h, srcs));
    }
    return SHM_EINVAL;
}

/* Rank q's block of a gather's output: contiguous blocks of `out`, or outs[q]. */
#define GATHER_BLOCK(out, outs, q, nbytes) \
    ((outs) ? (char *)(outs)[q] : (char *)(out) + (size_t)(q) * (nbytes))
/* torch's in-place form (FSDP2's): the input is rank q's own block of the output, so the
 * rank's own copy is skipped */
#define GATHER_IN_PLACE(out, outs, q, nbytes, in) \
    (GATHER_BLOCK(out, outs, q, nbytes) == (const char *)(in))

/* Single-copy gather. A reader whose output is one buffer posts its address, and every
 * rank writes its block straight into it (process_vm_writev), 256 KiB at a time so the
 * block is read from the cache for every reader after the first (and for the local
 * copy). A reader whose output is a list of separate blocks (outs, all_gather only) posts
 * none and reads every other rank's input into its blocks instead (each rank posts its
 * input's address too), so the ranks of one call may mix the two forms. A writer returns
 * as soon as its writes are done; a reader once every rank has acked (for an all_gather:
 * every rank, since a list reader reads the others' inputs until it acks).
 * Writing rather than reading: the kernel pins the remote side page by page, and a
 * reader's output, n blocks long, is the buffer likelier to hold 2 MiB pages (numpy's
 * from 4 MiB, or thp_prepare's); pushing was measured as fast as pulling or faster.
 * It runs with more ranks than cores too (c->cma_readable; the all_reduce's single copy
 * does not): each rank's writes are its own, and a rank that waits for the cores does
 * not hold up a peer's copy as a reader of the two-copy path does. The writes go in pieces
 * of `piece` bytes: CMA_PUSH_CHUNK, the fastest chunk measured (128 KiB to 1 MiB), or, where
 * an all_gather's measured choice takes it (ARM_SINGLE_WHOLE), the whole block. Figures:
 * docs/design-shm.md, "Single copy (CMA)" and "Measured figures behind the engine's
 * constants". */
#define CMA_PUSH_CHUNK (256 * 1024)
static int gather_cma(shm_comm *c, void *out, void *const *outs, const void *in, size_t nbytes,
                      int root, uint64_t fp, size_t piece)
{
    int n = c->n, me = c->me;
    int reader = root < 0 || root == me;
    int pull = outs != NULL;
    if (reader)
        thp_prepare(c, pull ? in : out, pull ? nbytes : (size_t)n * nbytes);
    atomic_store_explicit(&c->ctl[me].xfer.addr, (uint64_t)(uintptr_t)(reader && !pull ? out : NULL),
                          memory_order_relaxed);
    atomic_store_explicit(&c->ctl[me].xfer.src, (uint64_t)(uintptr_t)in, memory_order_relaxed);
    TRY(c, fp_publish(c, fp));
    uint32_t s = ++c->seq;
    post(c, s);
    /* every writer and reader compares with every peer before a byte moves: a gather's
     * writers may write only into a root that called the same */
    TRY(c, fp_check_all(c, s));
    int stream = !pull && outputs_past_llc(c, (size_t)(root < 0 ? n : 1) * (size_t)n * nbytes);
    const int in_place = reader && GATHER_IN_PLACE(out, outs, me, nbytes, in);
    for (size_t off = 0; off < nbytes; off += piece) {
        size_t len = nbytes - off < piece ? nbytes - off : piece;
        for (int k = 0; k < n; k++) {
            int q = (me + k) % n;
            if (!(root < 0 || q == root))
                continue;
            if (q == me) {
                if (!in_place)
                    copy_out(GATHER_BLOCK(out, outs, me, nbytes) + off, (const char *)in + off,
                             len, stream);
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

/* Everyone publishes in; readers (all, or root only) copy every rank's block into `out`
 * (blocks back to back) or, for a list all_gather, into outs[q]. */
static int gather_impl(shm_comm *c, void *out, void *const *outs, const void *in, size_t nbytes,
                       int root, uint64_t fp)
{
    CHECK(c);
    int n = c->n, me = c->me;
    int reader = root < 0 || root == me;
    if (n == 1) {
        if (reader && !GATHER_IN_PLACE(out, outs, 0, nbytes, in))
            copy(GATHER_BLOCK(out, outs, 0, nbytes), in, nbytes);
        return SHM_OK;
    }
    if (nbytes == 0)
        return fp_sync(c, fp);
    /* from c->cma_min the single copy, always for a gather; for an all_gather where every
     * rank has a core (c->cma), its block in pieces or whole as measured. With more ranks
     * than cores the all_gather's two-copy path was measured faster from 256 KiB to 16 MiB
     * on some hosts and slower on others, so there it is timed against the single copy at
     * every size (tune_pick_gather). */
    int cma_only = c->cma_readable && c->cma_min && nbytes >= c->cma_min && (root >= 0 || c->cma);
    if (cma_only && root >= 0)
        return gather_cma(c, out, outs, in, nbytes, root, fp, CMA_PUSH_CHUNK);
    /* an all_gather's path is timed (shm_tune.c); a gather's stores follow the probes */
    int64_t t0 = 0;
    const int arm = root < 0 ? tune_pick_gather(c, nbytes, cma_only, CMA_PUSH_CHUNK, &t0)
                             : c->far ? ARM_TWO_STREAM : ARM_TWO_PLAIN;
    if (arm == ARM_SINGLE_COPY || arm == ARM_SINGLE_WHOLE) {
        int rc = gather_cma(c, out, outs, in, nbytes, root, fp,
                            arm == ARM_SINGLE_WHOLE ? nbytes : CMA_PUSH_CHUNK);
        if (!rc)
            tune_done(c, TUNE_ALL_GATHER, nbytes, arm, t0);
        return rc;
    }
    TRY(c, fp_publish(c, fp));
    const uint32_t s0 = c->seq + 1;
    int stream = outputs_past_llc(c, (size_t)(root < 0 ? n : 1) * (size_t)n * nbytes);
    for (size_t off = 0; off < nbytes;) {
        size_t len = nbytes - off < c->half ? nbytes - off : c->half;
        int h;
        TRY(c, half_acquire(c, &h));
        seg_write(HALF(c, me, h), (const char *)in + off, len, stream || arm == ARM_TWO_STREAM);
        uint32_t s = ++c->seq;
        post(c, s);
        c->free_after[h] = s;
        if (s == s0)  /* every rank, before a reader copies anything */
            TRY(c, fp_check_all(c, s));
        if (reader) {
            TRY(c, wait_posts(c, s));
            for (int q = 0; q < n; q++)
                if (q != me || !GATHER_IN_PLACE(out, outs, me, nbytes, in))
                    copy_out(GATHER_BLOCK(out, outs, q, nbytes) + off, HALF(c, q, h), len, stream);
        }
        ack(c, s);
        off += len;
    }
    if (root < 0)
        tune_done(c, TUNE_ALL_GATHER, nbytes, arm, t0);
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

/* Single-copy scatter (blocks from c->cma_min, where the ranks may read each other's
 * memory): the root posts its input's address, every other rank reads its own block
 * straight from it (process_vm_readv; each reader its own pages, all at once), and the root
 * copies its own block and returns once every reader has acked. A reader compares the
 * root's fingerprint before it reads, and every rank every other's at the end (so a
 * mismatch raises on every rank, as in the two-copy path). The two-copy path
 * below has the root write every block into its slot, alone, before the readers copy them
 * out, which is slower than this (figures: docs/design-shm.md, "Single copy (CMA)"). */
static int scatter_cma(shm_comm *c, void *out, const void *in, size_t nbytes, int root,
                       uint64_t fp)
{
    int n = c->n, me = c->me;
    if (me == root)
        thp_prepare(c, in, (size_t)n * nbytes);
    atomic_store_explicit(&c->ctl[me].xfer.src, (uint64_t)(uintptr_t)(me == root ? in : NULL),
                          memory_order_relaxed);
    TRY(c, fp_publish(c, fp));
    uint32_t s = ++c->seq;
    post(c, s);
    if (me == root) {
        copy(out, (const char *)in + (size_t)me * nbytes, nbytes);
        ack(c, s);
        for (int q = 0; q < n; q++)  /* every reader is done with my input */
            if (q != me)
                TRY(c, wait_ctr(c, &c->ctl[q].ack, s, q, -1));
    } else {
        /* a reader needs only the root's word before it reads: it reads, never writes */
        TRY(c, wait_post(c, root, s));
        TRY(c, fp_check(c, root));
        uint64_t addr = atomic_load_explicit(&c->ctl[root].xfer.src, memory_order_relaxed);
        TRY(c, cma_read(c, root, out, addr + (uint64_t)me * nbytes, nbytes));
        ack(c, s);
    }
    TRY(c, fp_check_all(c, s));  /* a rank that called something else: every rank raises */
    return SHM_OK;
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
    if (c->cma_readable && c->cma_min && nbytes >= c->cma_min)
        return scatter_cma(c, out, in, nbytes, root, fp);
    tick(c, nbytes);
    TRY(c, fp_publish(c, fp));
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

/* Single-copy reduce_scatter (blocks from RS_CMA_FACTOR * c->cma_min, 4 MiB by default,
 * where the ranks may read each other's memory): rank r reads block r of every other rank's input straight from its
 * buffer (in chunks, into the private scratch) and reduces the blocks in rank order into
 * its output, as the two-copy path does (the same bytes). Through the segment every block
 * is copied twice (its owner writes it in, its reader reads it out) and each chunk of
 * half / n bytes a block takes a synchronisation; here once, and two in all: s1 = the
 * inputs' addresses published; s2 = every rank has read what it needs (no one returns, and
 * lets its input change, while a peer still reads it). The output must not overlap the
 * input but as this rank's own block (which no peer reads): the caller sees to it.
 * It is faster than the segment from 4 MiB a block and slower at 1 MiB, hence the
 * factor over COLLECTIVES_SHM_CMA_MIN (figures: docs/design-shm.md). */
#define RS_CMA_FACTOR 16
static int reduce_scatter_cma(shm_comm *c, void *out, const void *in, size_t count, int dtype,
                              int op, size_t isz, const void **srcs, uint64_t fp)
{
    int n = c->n, me = c->me;
    const char *uin = in;
    int rc = cma_open(c, in, (size_t)n * count * isz, fp);
    if (rc)
        return rc;
    size_t ce = CMA_AR_CHUNK / isz;
    for (size_t off = 0; off < count; off += ce) {
        size_t cnt = count - off < ce ? count - off : ce;
        size_t at = ((size_t)me * count + off) * isz;
        for (int q = 0, k = 0; q < n; q++) {
            if (q == me) {
                srcs[q] = uin + at;
                continue;
            }
            char *tmp = c->cma_tmp + (size_t)k++ * CMA_AR_CHUNK;
            uint64_t addr = atomic_load_explicit(&c->ctl[q].xfer.addr, memory_order_relaxed);
            if ((rc = cma_read(c, q, tmp, addr + at, cnt * isz)))
                return rc;
            srcs[q] = tmp;
        }
        if ((rc = coll_reduce_many((char *)out + off * isz, srcs, n, cnt, dtype, op)))
            return rc;
    }
    uint32_t s2 = ++c->seq;
    post(c, s2);
    if ((rc = wait_posts(c, s2)))
        return rc;
    ack(c, s2);
    return SHM_OK;
}

int shm_reduce_scatter(shm_comm *c, void *out, const void *in, size_t count, int dtype, int op,
                       uint64_t fp)
{
    size_t isz;
    int rc = reduction_entry(c, dtype, op, &isz);
    if (rc)
        return rc;
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
    size_t ce = c->half / ((size_t)n * isz);
    uintptr_t o0 = (uintptr_t)out, i0 = (uintptr_t)in;
    /* my own slice is reduced straight from my input unless the output overlaps the input
     * otherwise than as exactly that slice (coll_reduce_many may write over one source) */
    const int direct = o0 + count * isz <= i0 || i0 + (size_t)n * count * isz <= o0
                       || o0 == i0 + (size_t)me * count * isz;
    if (c->cma_readable && c->cma_min && count * isz >= RS_CMA_FACTOR * c->cma_min) {
        /* (every rank takes this path, whatever its buffers: an output that overlaps
         * the input otherwise than as this rank's block gets a private copy of the input
         * for the peers to read) */
        void *copy = NULL;
        if (!direct) {
            if (!(copy = malloc((size_t)n * count * isz))) {
                rc = SHM_ESYS;
                goto out;
            }
            memcpy(copy, in, (size_t)n * count * isz);
        }
        if (!(rc = reduce_scatter_cma(c, out, copy ? copy : in, count, dtype, op, isz, srcs, fp)))
            tick(c, count * isz);
        free(copy);
        goto out;
    }
    if ((rc = fp_publish(c, fp)))
        goto out;
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
    if ((rc = fp_publish(c, fp))) {
        free(in_off);
        return fail(c, rc);
    }
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
