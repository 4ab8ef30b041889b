/* The reduction kernels as _tcp and _shm see them: calls through collectives.engines._core's table.
 *
 * The kernels are compiled once, into _core, so a transport's reductions run the same
 * instruction-set dispatch as _core's own (a test that forces one covers them too). The
 * module's init (_kernels_import.pxi) hands the table over with coll_kernels_set() before
 * any of these wrappers can run; they keep reduce_kernels.h's names and signatures.
 */
#ifndef COLLECTIVES_REDUCE_KERNELS_IMPORT_H
#define COLLECTIVES_REDUCE_KERNELS_IMPORT_H
#define COLL_KERNELS_IMPORTED 1
#include "reduce_kernels.h"

/* _core's table; NULL until coll_kernels_set() */
extern const struct coll_kernel_api *coll_kernels __attribute__((visibility("hidden")));

/* Take the table from a _core capsule's pointer: 0, or -1 (and nothing set) if that _core
 * was built with another COLL_KERNEL_API_VERSION or a smaller table. */
int coll_kernels_set(const void *api) __attribute__((visibility("hidden")));

static inline size_t coll_itemsize(int dtype) { return coll_kernels->itemsize(dtype); }
static inline int coll_op_valid(int dtype, int op) { return coll_kernels->op_valid(dtype, op); }
static inline int coll_reduce(void *dst, const void *src, size_t count, int dtype, int op)
{
    return coll_kernels->reduce(dst, src, count, dtype, op);
}
static inline int coll_reduce_many(void *dst, const void *const *srcs, int nsrc, size_t count,
                                   int dtype, int op)
{
    return coll_kernels->reduce_many(dst, srcs, nsrc, count, dtype, op);
}
static inline int coll_scale(void *dst, size_t count, int dtype, double factor)
{
    return coll_kernels->scale(dst, count, dtype, factor);
}
static inline int coll_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op)
{
    return coll_kernels->reduce3(dst, a, b, count, dtype, op);
}
static inline size_t coll_chunk_elems(int dtype) { return coll_kernels->chunk_elems(dtype); }
static inline void coll_copy(void *dst, const void *src, size_t nbytes)
{
    coll_kernels->copy(dst, src, nbytes);
}
static inline const char *coll_kernel_isa(void) { return coll_kernels->kernel_isa(); }

#endif
