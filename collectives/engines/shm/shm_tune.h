/* The measured choices (shm_tune.c), above the synchronisation layer. */
#ifndef COLLECTIVES_SHM_TUNE_H
#define COLLECTIVES_SHM_TUNE_H
#include "shm_sync.h"

#define ARM_TWO_PLAIN 0     /* through the segment, plain stores */
#define ARM_TWO_STREAM 1    /* through the segment, streaming stores */
#define ARM_SINGLE_COPY 2   /* between the ranks' buffers (CMA) */
#define ARM_SINGLE_WHOLE 3  /* the all_gather's single copy, each block in one write, not in pieces */
#define TUNE_ALL_REDUCE 0
#define TUNE_ALL_GATHER 1
/* The algorithm for an all_reduce of nbytes above the one-shot size (the same on every
 * rank); *t0 is set to now when the call is a timed trial, else to 0. */
SHM_HIDDEN int tune_pick(shm_comm *c, size_t nbytes, int64_t *t0);
/* The path of an all_gather of nbytes per rank: the two-copy path's stores (ARM_TWO_PLAIN
 * or _STREAM) or the single copy (ARM_SINGLE_COPY, in pieces of `piece` bytes, or
 * ARM_SINGLE_WHOLE); with `cma_only` the single copy's two forms alone. */
SHM_HIDDEN int tune_pick_gather(shm_comm *c, size_t nbytes, int cma_only, size_t piece,
                                int64_t *t0);
/* The call picked with tune_pick*(c, nbytes, &t0) for `kind` returned successfully. */
SHM_HIDDEN void tune_done(shm_comm *c, int kind, size_t nbytes, int arm, int64_t t0);
#endif
