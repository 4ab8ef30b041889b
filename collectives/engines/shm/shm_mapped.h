/* The mapped all_reduce (shm_mapped.c): buffers every rank of the group maps. */
#ifndef COLLECTIVES_SHM_MAPPED_H
#define COLLECTIVES_SHM_MAPPED_H
#include "shm_sync.h"

/* The all_reduce above the one-shot size where every rank's buffer is a mapped one:
 * SHM_DECLINED (the collective unpublished) where one rank's is not. srcs: n entries. */
SHM_HIDDEN int all_reduce_mapped(shm_comm *c, void *buf, size_t count, int dtype, int op,
                                 size_t isz, const void **srcs, uint64_t fp);
#endif
