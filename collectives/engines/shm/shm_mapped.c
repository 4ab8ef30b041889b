/* The mapped all_reduce (see shm_mapped.h). */
#include <stdlib.h>
#include <string.h>

#include "shm_mapped.h"

/* bytes a rank reduces and copies out at a time (the finished chunk stays in cache) */
#define MAPPED_CHUNK (256 * 1024)

/* Mapped all_reduce: every rank's buffer is in memory every rank maps (registered with
 * shm_map_register; collectives/torch_bridge/mapped.py moves DDP's gradient buckets there).
 * Rank r owns slice r: chunk by chunk it reduces slice r of every rank's buffer into its
 * own and copies the finished chunk, still in cache, into every other rank's buffer. No
 * copy through the segment and no system call: each rank reads its buffer's slice and the
 * others' (G in all) and writes its slice and the others' (G), an all_reduce's least
 * traffic. A slice sums as two-shot's does (the owner's values first, then the others in
 * rank order), so both give the same bytes. Step s1 (fingerprinted) publishes which
 * registered buffer and offset each rank calls on; where they differ, or a rank's buffer
 * is not registered, every rank sees it at once and returns SHM_DECLINED with the
 * collective unpublished (the caller's algorithm publishes it again). Step s2: every rank
 * has written everything it will; a rank returns once every other has posted it. */
static const struct mapped_buf *mapped_find(const shm_comm *c, const void *buf, size_t nbytes)
{
    uintptr_t p = (uintptr_t)buf;
    for (int i = 0; i < c->n_mapped; i++) {
        const struct mapped_buf *e = &c->mapped[i];
        if (atomic_load_explicit(&e->live, memory_order_acquire) && p >= e->lo
            && p - e->lo < e->len && nbytes <= e->len - (p - e->lo))
            return e;
    }
    return NULL;
}

SHM_HIDDEN int all_reduce_mapped(shm_comm *c, void *buf, size_t count, int dtype, int op,
                                 size_t isz, const void **srcs, uint64_t fp)
{
    int n = c->n, me = c->me;
    const struct mapped_buf *e = mapped_find(c, buf, count * isz);
    size_t off = e ? (uintptr_t)buf - e->lo : 0;
    uint64_t word = e && off < MAPPED_OFF_MAX ? MAPPED_WORD(e->id, off) : 0;
    atomic_store_explicit(&c->ctl[me].xfer.mapped, word, memory_order_relaxed);
    int rc = fp_publish(c, fp);
    if (rc)
        return rc;
    uint32_t s1 = ++c->seq;
    post(c, s1);
    if ((rc = fp_check_all(c, s1)))
        return rc;
    int agree = word != 0;
    for (int q = 0; q < n && agree; q++)
        agree = atomic_load_explicit(&c->ctl[q].xfer.mapped, memory_order_relaxed) == word;
    if (!agree) {  /* every rank saw the same words: all decline */
        c->coll--;
        return SHM_DECLINED;
    }
    char *ubuf = buf;
    size_t st, len;
    slice_of(count, n, me, &st, &len);
    size_t ce = MAPPED_CHUNK / isz;
    for (size_t o = 0; o < len; o += ce) {
        size_t cnt = len - o < ce ? len - o : ce;
        size_t at = off + (st + o) * isz;
        srcs[0] = ubuf + (st + o) * isz;  /* its own, then the others in rank order */
        for (int q = 0, k = 1; q < n; q++)
            if (q != me)
                srcs[k++] = (const char *)e->peer[q] + at;
        if ((rc = coll_reduce_many(ubuf + (st + o) * isz, srcs, n, cnt, dtype, op)))
            return rc;
        for (int q = 0; q < n; q++)
            if (q != me)
                memcpy((char *)e->peer[q] + at, ubuf + (st + o) * isz, cnt * isz);
    }
    uint32_t s2 = ++c->seq;
    post(c, s2);
    c->mapped_calls++;
    return wait_posts(c, s2);
}

int shm_map_register(shm_comm *c, uint32_t id, const void *lo, size_t len, const uintptr_t *peer)
{
    c->mapped_on = 1;  /* every rank calls it at the same call, whatever it returns */
    int i = 0;
    while (i < c->n_mapped && atomic_load_explicit(&c->mapped[i].live, memory_order_acquire))
        i++;  /* the first dead entry, else a new one */
    if (i == MAPPED_MAX)
        return SHM_ESYS;
    struct mapped_buf *e = &c->mapped[i];
    uintptr_t *p = i < c->n_mapped ? e->peer : malloc(sizeof(uintptr_t) * (size_t)c->n);
    if (!p)
        return SHM_ESYS;
    memcpy(p, peer, sizeof(uintptr_t) * (size_t)c->n);
    e->peer = p;
    e->id = id;
    e->lo = (uintptr_t)lo;
    e->len = len;
    if (i == c->n_mapped)
        c->n_mapped++;
    atomic_store_explicit(&e->live, 1, memory_order_release);
    return SHM_OK;
}

void shm_map_unregister(shm_comm *c, uint32_t id)
{
    for (int i = 0; i < c->n_mapped; i++)
        if (c->mapped[i].id == id)
            atomic_store_explicit(&c->mapped[i].live, 0, memory_order_release);
}

uint64_t shm_map_calls(const shm_comm *c) { return c->mapped_calls; }
