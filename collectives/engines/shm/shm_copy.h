/* The copy policy (shm_copy.c), above the synchronisation layer: streaming stores, the
 * near/far latency probes that choose them, huge pages for buffers that peers copy, and
 * single copies between the ranks' memories (CMA). */
#ifndef COLLECTIVES_SHM_COPY_H
#define COLLECTIVES_SHM_COPY_H
#include "shm_sync.h"

static inline void copy(void *dst, const void *src, size_t n)
{
    if (dst != src && n)
        memmove(dst, src, n);
}

SHM_HIDDEN void copy_stream(void *dst, const void *src, size_t n);

/* Whether the outputs of all ranks, `total` bytes together, fill the last-level cache:
 * the all_gather copies into them then stream, whatever the probes say, and so does the
 * two-copy all_gather/gather's copy into the segment: the blocks would not stay in the
 * cache for the readers anyway (figures: docs/design-shm.md, "Near and far peers"). */
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

SHM_HIDDEN int mostly_far(const shm_comm *c);
SHM_HIDDEN void probe_peer(shm_comm *c);

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

/* Write n bytes into this rank's part of the segment, for other ranks to read, with
 * streaming stores or plain ones. */
static inline void seg_write(void *dst, const void *src, size_t n, int stream)
{
    if (stream)
        copy_stream(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* ... with the stores the probes chose */
static inline void seg_put(const shm_comm *c, void *dst, const void *src, size_t n)
{
    seg_write(dst, src, n, c->far);
}

SHM_HIDDEN void thp_prepare(shm_comm *c, const void *p, size_t len);
SHM_HIDDEN int cma_read(shm_comm *c, int q, void *dst, uint64_t remote, size_t nbytes);
SHM_HIDDEN int cma_write(shm_comm *c, int q, uint64_t remote, const void *src, size_t nbytes);


#endif
