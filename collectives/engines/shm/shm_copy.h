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
 * the all_gather copies into them then stream (measured with 2 cores sharing 32 MiB:
 * single copy, 2 ranks, streaming 305 -> 373 us at 4 MiB per rank, 1207 -> 1118 at 8 MiB,
 * 2298 -> 2082 at 16 MiB; two-copy, 4 ranks: 614 -> 739 us at 1 MiB, 3824 -> 3360 at
 * 4 MiB, 13654 -> 12915 at 16 MiB; a two-copy broadcast was slower streamed). Since
 * the single copy writes into the readers' outputs (2 ranks, samples alternating in one
 * run, streamed/plain): 8 MiB, whose outputs are exactly the cache's size, 0.92-0.99;
 * 16 MiB 0.78-0.82; 4 MiB 1.04-1.13; 2 MiB 1.33-1.5. 4 ranks at 2 MiB: unchanged.
 * Past it, the two-copy all_gather/gather streams its copy into the segment too, whatever
 * the probes say: the blocks would not stay in the cache for the readers anyway. 4 ranks
 * on 2 cores, streamed/plain copy-in (samples alternating in one run): 2 MiB 0.99x,
 * 4 MiB 0.99x, 16 MiB 0.99x while the cores are close; 0.48-0.56x while far, where the
 * probes of 4 ranks on 2 cores often get no verdict (a partner is descheduled) and a
 * 16 MiB all_gather took 22.4 ms plain against 10.8 ms streamed (MPICH: 13.6-22 ms
 * in this session's runs). */
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
