/* Elementwise reduction and copy kernels: the C ABI of _core, which _tcp and _shm call through its table.
 *
 * Dtype and op codes equal those in collectives/core/dtypes.py. Every function is
 * thread-safe, never touches Python and is called with the GIL released.
 */
#ifndef COLLECTIVES_REDUCE_KERNELS_H
#define COLLECTIVES_REDUCE_KERNELS_H
#include <stddef.h>
#include <stdint.h>

enum coll_dtype {
    COLL_FLOAT16 = 0, COLL_BFLOAT16 = 1, COLL_FLOAT32 = 2, COLL_FLOAT64 = 3,
    COLL_COMPLEX64 = 4, COLL_COMPLEX128 = 5, COLL_INT8 = 6, COLL_UINT8 = 7,
    COLL_INT16 = 8, COLL_INT32 = 9, COLL_INT64 = 10, COLL_BOOL = 11,
    COLL_NUM_DTYPES = 12
};

enum coll_op {
    COLL_SUM = 0, COLL_AVG = 1, COLL_PRODUCT = 2, COLL_MIN = 3, COLL_MAX = 4,
    COLL_BAND = 5, COLL_BOR = 6, COLL_BXOR = 7, COLL_PREMUL_SUM = 8
};

/* Bytes processed per step by the chunked entry points; a transport can
 * receive chunk k+1 while reducing chunk k. */
#define COLL_CHUNK_BYTES (64 * 1024)

/* error codes */
#define COLL_OK 0
#define COLL_EDTYPE (-1)   /* unknown dtype */
#define COLL_EOP (-2)      /* op not defined for dtype (e.g. BAND on float, MAX on complex) */

/* The kernels are compiled once, into collectives.engines._core; _tcp and _shm call _core's copy through
 * the table below (reduce_kernels_import.h defines COLL_KERNELS_IMPORTED and, in place of these
 * prototypes, inline wrappers of the same names), so one instruction-set dispatch serves all. */
#ifndef COLL_KERNELS_IMPORTED
size_t coll_itemsize(int dtype);          /* 0 for an unknown dtype */
int coll_op_valid(int dtype, int op);     /* 1 if reduce kernels implement op (SUM..BXOR) on dtype */

/* dst[i] = op(dst[i], src[i]) for i < count. dst and src may be equal, not partially overlapping. */
int coll_reduce(void *dst, const void *src, size_t count, int dtype, int op);

/* dst[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]), folded in source order; nsrc >= 1; dst may
 * equal any one source (not partially overlap one). */
int coll_reduce_many(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int op);

/* dst[i] *= factor for floating and complex dtypes (AVG, PREMUL_SUM); half types round to nearest-even. */
int coll_scale(void *dst, size_t count, int dtype, double factor);

/* ---- additions (after the first ABI; existing codes and signatures unchanged) ---- */

/* dst[i] = op(a[i], b[i]); dst may equal a or b, not partially overlap them. */
int coll_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op);

/* Elements of dtype in one COLL_CHUNK_BYTES chunk (0 for an unknown dtype). */
size_t coll_chunk_elems(int dtype);

/* memmove, skipped when nbytes == 0 or dst == src. */
void coll_copy(void *dst, const void *src, size_t nbytes);

/* The instruction set the kernels were dispatched to:
 * "avx512bf16", "avx512", "avx2" or "baseline". */
const char *coll_kernel_isa(void);

/* For tests and benchmarks: switch every kernel to one of those names;
 * COLL_EOP if this CPU lacks it. Not thread-safe against running kernels. */
int coll_force_isa(const char *name);

#endif /* COLL_KERNELS_IMPORTED */

/* ---- the kernels as a table, for the other extensions ---------------------------------
 * collectives.engines._core exports coll_kernel_api_get() in the capsule collectives.engines._core._C_API.
 * Append new members at the end and bump the version; never reorder. Forcing an
 * instruction set stays _core's (coll_force_isa): it switches every user of the table. */
#define COLL_KERNEL_API_VERSION 1
struct coll_kernel_api {
    unsigned version;                     /* COLL_KERNEL_API_VERSION of the _core that filled it */
    size_t size;                          /* sizeof(struct coll_kernel_api) there */
    size_t (*itemsize)(int dtype);
    int (*op_valid)(int dtype, int op);
    int (*reduce)(void *dst, const void *src, size_t count, int dtype, int op);
    int (*reduce_many)(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int op);
    int (*scale)(void *dst, size_t count, int dtype, double factor);
    int (*reduce3)(void *dst, const void *a, const void *b, size_t count, int dtype, int op);
    size_t (*chunk_elems)(int dtype);
    void (*copy)(void *dst, const void *src, size_t nbytes);
    const char *(*kernel_isa)(void);
};

#ifndef COLL_KERNELS_IMPORTED
const struct coll_kernel_api *coll_kernel_api_get(void);
#endif

#endif
