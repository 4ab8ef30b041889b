/* The measured all_reduce choice (shm_tune.c), above the synchronisation layer. */
#ifndef COLLECTIVES_SHM_TUNE_H
#define COLLECTIVES_SHM_TUNE_H
#include "shm_sync.h"

#define ARM_TWO_PLAIN 0
#define ARM_TWO_STREAM 1
#define ARM_SINGLE_COPY 2
/* The algorithm for an all_reduce of nbytes above the one-shot size (the same on every
 * rank); *t0 is set to now when the call is a timed trial, else to 0. */
SHM_HIDDEN int tune_pick(shm_comm *c, size_t nbytes, int64_t *t0);
/* The call picked with tune_pick(c, nbytes, &t0) returned successfully. */
SHM_HIDDEN void tune_done(shm_comm *c, size_t nbytes, int arm, int64_t t0);

#endif
