/* Point to point: a byte ring per ordered pair of ranks in the group's segment; a rank's
 * bell counter rings whenever a ring to or from it moves. See shm_sync.h. */
#include "shm_sync.h"

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

/* Wait until the bell passes b (a ring to or from peer moved), by the deadline, which the
 * first wait sets (the timeout runs from the last progress). */
static int bell_wait(shm_comm *c, ctr_t *bell, uint32_t b, int peer, int64_t *deadline)
{
    if (*deadline < 0)
        *deadline = now_ns() + c->timeout_ns;
    return wait_ctr(c, bell, b + 1, peer, *deadline);
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
            int rc = bell_wait(c, bell, b, dst, &deadline);
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

int shm_p2p_poll(shm_comm *c, size_t need, double wait_s, int background, uint32_t since,
                 int *src)
{
    *src = -1;
    CHECK(c);
    ctr_t *bell = &c->ctl[c->me].bell;
    int64_t deadline = now_ns() + (int64_t)(wait_s * 1e9);
    static __thread int start = 0;
    for (;;) {
        if (atomic_load(&c->aborted))
            return SHM_ECLOSED;
        if (background && atomic_load(&c->direct) > 0) {
            /* a thread reads the rings for its own receive: stay out of its way (the bell
             * would wake both) until shm_p2p_direct wakes us, or for 10 ms at most (it
             * leaves us asleep where no receive is posted: the next waiter, or we after
             * that, take what arrives meanwhile) */
            int64_t left = deadline - now_ns();
            if (left <= 0)
                return SHM_OK;
            uint32_t w = atomic_load(&c->direct_word);
            atomic_store(&c->bg_sleeping, 1);
            if (atomic_load(&c->direct) > 0)
                futex_wait(&c->direct_word, w, left < 10000000LL ? left : 10000000LL);
            atomic_store(&c->bg_sleeping, 0);
            continue;
        }
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
        if (!background && atomic_load(&c->kicks) != since)
            return SHM_OK;  /* another thread may have completed the caller's request */
        int64_t t = now_ns();
        if (t >= deadline)
            return SHM_OK;
        if (background) {
            /* it sleeps at once: the threads waiting on their receives spend the group's
             * spin and yield budget; this one serves the receives nobody waits on */
            if (atomic_load_explicit(&seg_hdr(c)->fail_state, memory_order_relaxed))
                return SHM_EFAILED;
            atomic_fetch_add_explicit(&bell->waiters, 1, memory_order_seq_cst);
            if (atomic_load_explicit(&bell->v, memory_order_seq_cst) == b)
                futex_wait(&bell->v, b, deadline - t < 10000000LL ? deadline - t : 10000000LL);
            atomic_fetch_sub_explicit(&bell->waiters, 1, memory_order_seq_cst);
            continue;
        }
        int rc = wait_ctr(c, bell, b + 1, -1, deadline);
        if (rc == SHM_ETIMEDOUT)
            return SHM_OK;
        if (rc)
            return rc;
    }
}

uint32_t shm_p2p_kicks(const shm_comm *c)
{
    return atomic_load(&c->kicks);
}

void shm_p2p_direct(shm_comm *c, int delta, int wake)
{
    if (atomic_fetch_add(&c->direct, delta) + delta == 0 && wake) {
        atomic_fetch_add(&c->direct_word, 1);
        if (atomic_load(&c->bg_sleeping))
            futex_wake(&c->direct_word);
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
            int rc = bell_wait(c, bell, b, src, &deadline);
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

void shm_p2p_attach(shm_comm *c) { c->abort_hook = shm_p2p_kick; }

void shm_p2p_kick(shm_comm *c)
{
    atomic_fetch_add(&c->kicks, 1);
    ctr_bump(&c->ctl[c->me].bell);
    atomic_fetch_add(&c->direct_word, 1);
    futex_wake(&c->direct_word);
}
