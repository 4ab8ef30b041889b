/* Elementwise reduction kernels (reduce_kernels.h), vectorised and dispatched at load time.
 *
 * The kernel body below (the #else branch) is compiled four times by including
 * this file into itself: for the baseline, AVX-512 F/BW/VL/DQ + F16C with and
 * without AVX512_BF16, and AVX2 + F16C; a constructor picks the table for this CPU.
 * Semantics, kept bit for bit equal to torch's elementwise CPU ops:
 *   - float16/bfloat16 compute in float32 and round to nearest-even on store;
 *     bfloat16 NaN is stored as 0x7FC0 (torch's scalar c10::BFloat16).
 *   - MIN/MAX: a NaN in either operand gives NaN (torch.minimum/maximum); on a
 *     tie (0.0 vs -0.0) the second operand wins, as in NumPy and torch's vector path.
 *   - integer SUM/PRODUCT wrap around (unsigned arithmetic, no UB).
 *   - bool SUM/MAX/BOR = OR, PRODUCT/MIN/BAND = AND, BXOR = XOR; results are 0/1.
 *   - complex PRODUCT is (ac - bd) + (ad + bc)i without FMA (build with -ffp-contract=off).
 */
#ifndef COLL_KERNEL_BODY

#include "reduce_kernels.h"

#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define COLL_X86 1
#endif

/* Our kernels never rely on FP exception flags; this lets MIN/MAX and the half-type
 * conversions if-convert and vectorise. Results are unchanged. fp-contract=off is
 * repeated because an optimize pragma resets it: no FMA may change a product's rounding. */
#pragma GCC optimize("no-trapping-math", "fp-contract=off")

typedef void (*coll_binop_fn)(void *dst, const void *a, const void *b, size_t n);
typedef void (*coll_scale_fn)(void *dst, size_t n, double factor);

#define COLL_NUM_OPS 8 /* SUM..BXOR */

static const size_t coll_itemsizes[COLL_NUM_DTYPES] = {2, 2, 4, 8, 8, 16, 1, 1, 2, 4, 8, 1};

static inline float coll_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t coll_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bfloat16 <-> float32: exact widening; round-to-nearest-even narrowing, NaN -> 0x7FC0. */
static inline float coll_bf16_to_f32(uint16_t h) { return coll_f32_from_bits((uint32_t)h << 16); }
static inline uint16_t coll_f32_to_bf16(float f)
{
    uint32_t u = coll_f32_to_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)r;
}

/* IEEE float16 <-> float32 in portable integer/float arithmetic (the FP16 library's
 * algorithm, which torch's c10::Half uses); exact, round-to-nearest-even, NaN -> 0x7E00|sign. */
static inline float coll_f16_to_f32(uint16_t h)
{
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = coll_f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = coll_f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? coll_f32_to_bits(denormalized)
                                                       : coll_f32_to_bits(normalized));
    return coll_f32_from_bits(result);
}

static inline uint16_t coll_f32_to_f16(float f)
{
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = coll_f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = coll_f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = coll_f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* Elements to process before d is 64-byte aligned; 0 for short or oddly aligned buffers. */
static inline size_t coll_align_head(const void *d, size_t size, size_t n)
{
    size_t mis = (size_t)((uintptr_t)d & 63);
    if (mis == 0 || n * size < 1024 || (64 - mis) % size)
        return 0;
    return (64 - mis) / size;
}

/* ---- the kernel body, once per instruction set ---------------------------------- */
#define COLL_KERNEL_BODY 1
#define COLL_CAT2(a, b) a##b
#define COLL_CAT(a, b) COLL_CAT2(a, b)
#define K(name) COLL_CAT(name, COLL_SUF)

#define COLL_SUF _base
#include "reduce_kernels.c"
#undef COLL_SUF

#ifdef COLL_X86
#define COLL_SUF _v4bf16
#define COLL_ISA_V4 1
#define COLL_ISA_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c,bmi,bmi2,popcnt")
#include "reduce_kernels.c"
#pragma GCC pop_options
#undef COLL_ISA_BF16
#undef COLL_ISA_V4
#undef COLL_SUF

#define COLL_SUF _v4
#define COLL_ISA_V4 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,bmi,bmi2,popcnt")
#include "reduce_kernels.c"
#pragma GCC pop_options
#undef COLL_ISA_V4
#undef COLL_SUF

#define COLL_SUF _v3
#define COLL_ISA_V3 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c,bmi,bmi2,popcnt")
#include "reduce_kernels.c"
#pragma GCC pop_options
#undef COLL_ISA_V3
#undef COLL_SUF
#endif

/* ---- dispatch -------------------------------------------------------------------- */
static coll_binop_fn coll_binops[COLL_NUM_DTYPES][COLL_NUM_OPS];
static coll_scale_fn coll_scales[COLL_NUM_DTYPES];
static const char *coll_isa_name = "baseline";

__attribute__((constructor)) static void coll_select_kernels(void)
{
#ifdef COLL_X86
    __builtin_cpu_init();
    if (coll_force_isa("avx512bf16") == COLL_OK || coll_force_isa("avx512") == COLL_OK
        || coll_force_isa("avx2") == COLL_OK)
        return;
#endif
    coll_force_isa("baseline");
}

const char *coll_kernel_isa(void) { return coll_isa_name; }

int coll_force_isa(const char *name)
{
    if (strcmp(name, "baseline") == 0) {
        coll_fill_tables_base(coll_binops, coll_scales);
        coll_isa_name = "baseline";
        return COLL_OK;
    }
#ifdef COLL_X86
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        coll_fill_tables_v3(coll_binops, coll_scales);
        coll_isa_name = "avx2";
        return COLL_OK;
    }
    int v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
             && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
             && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (strcmp(name, "avx512") == 0 && v4) {
        coll_fill_tables_v4(coll_binops, coll_scales);
        coll_isa_name = "avx512";
        return COLL_OK;
    }
    if (strcmp(name, "avx512bf16") == 0 && v4 && __builtin_cpu_supports("avx512bf16")) {
        coll_fill_tables_v4bf16(coll_binops, coll_scales);
        coll_isa_name = "avx512bf16";
        return COLL_OK;
    }
#endif
    return COLL_EOP;
}

size_t coll_itemsize(int dtype)
{
    return (dtype >= 0 && dtype < COLL_NUM_DTYPES) ? coll_itemsizes[dtype] : 0;
}

int coll_op_valid(int dtype, int op)
{
    if (dtype < 0 || dtype >= COLL_NUM_DTYPES)
        return 0;
    switch (op) {
    case COLL_SUM: case COLL_PRODUCT:
        return 1;
    case COLL_MIN: case COLL_MAX:
        return dtype != COLL_COMPLEX64 && dtype != COLL_COMPLEX128;
    case COLL_BAND: case COLL_BOR: case COLL_BXOR:
        return dtype >= COLL_INT8;
    default:
        return 0;
    }
}

static int coll_check(int dtype, int op)
{
    if (dtype < 0 || dtype >= COLL_NUM_DTYPES)
        return COLL_EDTYPE;
    return coll_op_valid(dtype, op) ? COLL_OK : COLL_EOP;
}

size_t coll_chunk_elems(int dtype)
{
    size_t size = coll_itemsize(dtype);
    return size ? COLL_CHUNK_BYTES / size : 0;
}

/* dst = a op b, checked; inlined into both entry points (an exported function is not
 * inlined into another under -fPIC, so neither calls the other) */
static inline int reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op)
{
    int rc = coll_check(dtype, op);
    if (rc != COLL_OK)
        return rc;
    if (count)
        coll_binops[dtype][op](dst, a, b, count);
    return COLL_OK;
}

int coll_reduce(void *dst, const void *src, size_t count, int dtype, int op)
{
    return reduce3(dst, dst, src, count, dtype, op);
}

int coll_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op)
{
    return reduce3(dst, a, b, count, dtype, op);
}

/* coll_reduce_many where dst is one of srcs[2..]: each chunk is folded in a 16 KiB stack
 * buffer (it stays in L1, and small enough for a thread with a small stack) and then copied
 * to dst; every element is still folded in source order, so the result is the same. */
static int __attribute__((noinline)) reduce_many_via_chunk(void *dst, const void *const *srcs,
                                                          int nsrc, size_t count, size_t size,
                                                          coll_binop_fn fn)
{
    _Alignas(64) char acc[16 * 1024];
    const size_t step = sizeof acc / size;
    for (size_t start = 0; start < count; start += step) {
        size_t n = count - start < step ? count - start : step;
        size_t off = start * size;
        fn(acc, (const char *)srcs[0] + off, (const char *)srcs[1] + off, n);
        for (int j = 2; j < nsrc; j++)
            fn(acc, acc, (const char *)srcs[j] + off, n);
        memcpy((char *)dst + off, acc, n * size);
    }
    return COLL_OK;
}

int coll_reduce_many(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int op)
{
    int rc = coll_check(dtype, op);
    if (rc != COLL_OK)
        return rc;
    if (nsrc < 1)
        return COLL_EOP;
    const size_t size = coll_itemsizes[dtype];
    const coll_binop_fn fn = coll_binops[dtype][op];
    if (nsrc == 1) {
        if (dst != srcs[0] && count)
            memmove(dst, srcs[0], count * size);
        return COLL_OK;
    }
    for (int j = 2; j < nsrc; j++)
        if (srcs[j] == dst && count)  /* folding into dst would overwrite that source */
            return reduce_many_via_chunk(dst, srcs, nsrc, count, size, fn);
    /* one chunk at a time, all sources, so the partial result stays in cache */
    const size_t step = COLL_CHUNK_BYTES / size;
    for (size_t start = 0; start < count; start += step) {
        size_t n = count - start < step ? count - start : step;
        size_t off = start * size;
        char *d = (char *)dst + off;
        fn(d, (const char *)srcs[0] + off, (const char *)srcs[1] + off, n);
        for (int j = 2; j < nsrc; j++)
            fn(d, d, (const char *)srcs[j] + off, n);
    }
    return COLL_OK;
}

int coll_scale(void *dst, size_t count, int dtype, double factor)
{
    if (dtype < 0 || dtype >= COLL_NUM_DTYPES)
        return COLL_EDTYPE;
    if (!coll_scales[dtype])
        return COLL_EOP;
    if (count)
        coll_scales[dtype](dst, count, factor);
    return COLL_OK;
}

void coll_copy(void *dst, const void *src, size_t nbytes)
{
    if (nbytes && dst != src)
        memmove(dst, src, nbytes);
}

static const struct coll_kernel_api coll_kernel_table = {
    COLL_KERNEL_API_VERSION, sizeof(struct coll_kernel_api),
    coll_itemsize, coll_op_valid, coll_reduce, coll_reduce_many, coll_scale, coll_reduce3,
    coll_chunk_elems, coll_copy, coll_kernel_isa,
};

const struct coll_kernel_api *coll_kernel_api_get(void) { return &coll_kernel_table; }

#else /* COLL_KERNEL_BODY: compiled once per instruction set, names suffixed by COLL_SUF */

/* d[i] = EXPR(a[i], b[i]); d may equal a or b exactly (no loop-carried dependence).
 * A few scalar steps first align d to 64 bytes: unaligned vector stores cost up to 1.5x. */
#define DEF_BIN(NAME, T, EXPR)                                                        \
    static void K(NAME)(void *dv, const void *av, const void *bv, size_t n)           \
    {                                                                                 \
        T *d = (T *)dv;                                                               \
        const T *pa = (const T *)av, *pb = (const T *)bv;                             \
        size_t i = 0, head = coll_align_head(d, sizeof(T), n);                        \
        for (; i < head; i++) {                                                       \
            T a = pa[i], b = pb[i];                                                   \
            d[i] = (EXPR);                                                            \
        }                                                                             \
        _Pragma("GCC ivdep") for (; i < n; i++)                                       \
        {                                                                             \
            T a = pa[i], b = pb[i];                                                   \
            d[i] = (EXPR);                                                            \
        }                                                                             \
    }

#define F_SUM(a, b) ((a) + (b))
#define F_PROD(a, b) ((a) * (b))
/* branch-free so the loops if-convert: the NaN sum is computed unconditionally */
static inline float K(minf)(float a, float b) { float s = a + b, m = a < b ? a : b; return (a != a) | (b != b) ? s : m; }
static inline float K(maxf)(float a, float b) { float s = a + b, m = a > b ? a : b; return (a != a) | (b != b) ? s : m; }
static inline double K(mind)(double a, double b) { double s = a + b, m = a < b ? a : b; return (a != a) | (b != b) ? s : m; }
static inline double K(maxd)(double a, double b) { double s = a + b, m = a > b ? a : b; return (a != a) | (b != b) ? s : m; }
#define F_MIN(a, b) K(minf)(a, b)
#define F_MAX(a, b) K(maxf)(a, b)

DEF_BIN(f32_sum, float, F_SUM(a, b))
DEF_BIN(f32_prod, float, F_PROD(a, b))
DEF_BIN(f32_min, float, F_MIN(a, b))
DEF_BIN(f32_max, float, F_MAX(a, b))
DEF_BIN(f64_sum, double, F_SUM(a, b))
DEF_BIN(f64_prod, double, F_PROD(a, b))
DEF_BIN(f64_min, double, K(mind)(a, b))
DEF_BIN(f64_max, double, K(maxd)(a, b))

/* integers: SUM/PRODUCT in unsigned arithmetic at least 32 bits wide (wrap, no UB) */
#define DEF_INT(SUF, T, UW)                                                           \
    DEF_BIN(SUF##_sum, T, (T)((UW)a + (UW)b))                                         \
    DEF_BIN(SUF##_prod, T, (T)((UW)a * (UW)b))                                        \
    DEF_BIN(SUF##_min, T, (a < b ? a : b))                                            \
    DEF_BIN(SUF##_max, T, (a > b ? a : b))                                            \
    DEF_BIN(SUF##_band, T, (T)(a & b))                                                \
    DEF_BIN(SUF##_bor, T, (T)(a | b))                                                 \
    DEF_BIN(SUF##_bxor, T, (T)(a ^ b))

DEF_INT(i8, int8_t, uint32_t)
DEF_INT(u8, uint8_t, uint32_t)
DEF_INT(i16, int16_t, uint32_t)
DEF_INT(i32, int32_t, uint32_t)
DEF_INT(i64, int64_t, uint64_t)

DEF_BIN(b8_or, uint8_t, (uint8_t)((a | b) != 0))
DEF_BIN(b8_and, uint8_t, (uint8_t)((a != 0) & (b != 0)))
DEF_BIN(b8_xor, uint8_t, (uint8_t)((a != 0) ^ (b != 0)))

/* complex: interleaved (re, im) pairs */
#define DEF_CPLX(SUF, T)                                                              \
    static void K(SUF##_sum)(void *dv, const void *av, const void *bv, size_t n)      \
    {                                                                                 \
        K(SUF##_sum_real)(dv, av, bv, 2 * n);                                         \
    }                                                                                 \
    COLL_CPLX_PROD(SUF, T)

#if !defined(COLL_ISA_V4) && !defined(COLL_ISA_V3)
#define COLL_CPLX_PROD(SUF, T)                                                        \
    static void K(SUF##_prod)(void *dv, const void *av, const void *bv, size_t n)     \
    {                                                                                 \
        T *d = (T *)dv;                                                               \
        const T *pa = (const T *)av, *pb = (const T *)bv;                             \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++)                           \
        {                                                                             \
            T ar = pa[2 * i], ai = pa[2 * i + 1], br = pb[2 * i], bi = pb[2 * i + 1]; \
            d[2 * i] = ar * br - ai * bi;                                             \
            d[2 * i + 1] = ar * bi + ai * br;                                         \
        }                                                                             \
    }
#else
#define COLL_CPLX_PROD(SUF, T)
#endif

#define c64_sum_real f32_sum
#define c128_sum_real f64_sum
DEF_CPLX(c64, float)
DEF_CPLX(c128, double)
#undef c64_sum_real
#undef c128_sum_real

/* half types: widen to float32, compute, round to nearest-even */
#define DEF_HALF_PORTABLE(NAME, LOAD, STORE, EXPR)                                    \
    static void K(NAME)(void *dv, const void *av, const void *bv, size_t n)           \
    {                                                                                 \
        uint16_t *d = (uint16_t *)dv;                                                 \
        const uint16_t *pa = (const uint16_t *)av, *pb = (const uint16_t *)bv;        \
        _Pragma("GCC ivdep") for (size_t i = 0; i < n; i++)                           \
        {                                                                             \
            float a = LOAD(pa[i]), b = LOAD(pb[i]);                                   \
            d[i] = STORE(EXPR);                                                       \
        }                                                                             \
    }

#if defined(COLL_ISA_V4)
/* Main loops: bfloat16 widens with in-lane unpacks and narrows with one packus per 32
 * elements; float16 uses 256-bit F16C conversions (faster than 512-bit ones on Zen 4).
 * The tail (< 32 or < 16 elements) uses masked 16-lane loads/stores. All paths round
 * identically (exact round-to-nearest-even). */
static inline __m512 K(bf16_load)(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
/* float32 -> bfloat16 bits in the low half of each 32-bit lane; NaN -> 0x7FC0 */
static inline __m512i K(bf16_round)(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
static inline __m256i K(bf16_pack)(__m512 f) { return _mm512_cvtepi32_epi16(K(bf16_round)(f)); }
static inline __m512 K(f16_load)(__m256i h) { return _mm512_cvtph_ps(h); }
static inline __m256i K(f16_pack)(__m512 f) { return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

static inline __m512 K(v_sum)(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 K(v_prod)(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
/* min (CMP _CMP_LT_OQ) and max (_CMP_GT_OQ) on W (__m512 or __m256, intrinsics prefix PS):
 * a where a CMP b, else b (the second operand wins ties); then NaN if either is NaN */
#define DEF_V_PICK(NAME, W, PS, CMP)                                                  \
    static inline W K(NAME)(W a, W b)                                                 \
    {                                                                                 \
        W r = PS##_mask_blend_ps(PS##_cmp_ps_mask(a, b, CMP), b, a);                  \
        return PS##_mask_add_ps(r, PS##_cmp_ps_mask(a, b, _CMP_UNORD_Q), a, b);       \
    }
DEF_V_PICK(v_min, __m512, _mm512, _CMP_LT_OQ)
DEF_V_PICK(v_max, __m512, _mm512, _CMP_GT_OQ)
static inline __m256 K(v_sum8)(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 K(v_prod8)(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
DEF_V_PICK(v_min8, __m256, _mm256, _CMP_LT_OQ)
DEF_V_PICK(v_max8, __m256, _mm256, _CMP_GT_OQ)
#undef DEF_V_PICK

/* the 32 bfloat16 at pa + i and pb + i widened (zeros below, in-lane unpacks), as lo and
 * hi halves, and combined by OPV */
#define BF16_LOHI(OPV)                                                                \
    __m512i va = _mm512_loadu_si512(pa + i), vb = _mm512_loadu_si512(pb + i);         \
    __m512 lo = K(OPV)(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, va)),             \
                       _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, vb)));            \
    __m512 hi = K(OPV)(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, va)),             \
                       _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, vb)));
#ifdef COLL_ISA_BF16
/* AVX512_BF16's vcvtne2ps2bf16 rounds to nearest-even like bf16_round, except that it
 * treats denormals as zero and keeps NaN payloads: a vector holding a denormal or NaN
 * result takes the integer path instead, so the bits never differ. */
#define BF16_MAIN(OPV)                                                                \
    {                                                                                 \
        const __m512i z = _mm512_setzero_si512();                                     \
        const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, \
                                               11, 10, 9, 8, 23, 22, 21, 20, 7, 6, 5, 4, \
                                               19, 18, 17, 16, 3, 2, 1, 0);           \
        for (; i + 32 <= n; i += 32) {                                                \
            BF16_LOHI(OPV)                                                            \
            __mmask16 odd = _mm512_fpclass_ps_mask(lo, 0xA1) | _mm512_fpclass_ps_mask(hi, 0xA1); \
            __m512i r;                                                                \
            if (__builtin_expect(odd != 0, 0))                                        \
                r = _mm512_packus_epi32(K(bf16_round)(lo), K(bf16_round)(hi));        \
            else                                                                      \
                r = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); \
            _mm512_storeu_si512(d + i, r);                                            \
        }                                                                             \
    }
#else
#define BF16_MAIN(OPV)                                                                \
    {                                                                                 \
        const __m512i z = _mm512_setzero_si512();                                     \
        for (; i + 32 <= n; i += 32) {                                                \
            BF16_LOHI(OPV)                                                            \
            _mm512_storeu_si512(d + i, _mm512_packus_epi32(K(bf16_round)(lo), K(bf16_round)(hi))); \
        }                                                                             \
    }
#endif
#define F16_RND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define F16_MAIN(OPV)                                                                 \
    for (; i + 16 <= n; i += 16) {                                                    \
        __m256 a0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pa + i)));       \
        __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + i)));       \
        __m256 a1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pa + i + 8)));   \
        __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + i + 8)));   \
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(K(OPV##8)(a0, b0), F16_RND)); \
        _mm_storeu_si128((__m128i *)(d + i + 8), _mm256_cvtps_ph(K(OPV##8)(a1, b1), F16_RND)); \
    }

#define DEF_HALF(NAME, TY, MAIN, OPV)                                                 \
    static void K(NAME)(void *dv, const void *av, const void *bv, size_t n)           \
    {                                                                                 \
        uint16_t *d = (uint16_t *)dv;                                                 \
        const uint16_t *pa = (const uint16_t *)av, *pb = (const uint16_t *)bv;        \
        size_t i = 0;                                                                 \
        MAIN(OPV)                                                                     \
        for (; i < n; i += 16) {                                                      \
            size_t left = n - i;                                                      \
            __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); \
            __m512 a = K(TY##_load)(_mm256_maskz_loadu_epi16(m, pa + i));             \
            __m512 b = K(TY##_load)(_mm256_maskz_loadu_epi16(m, pb + i));             \
            _mm256_mask_storeu_epi16(d + i, m, K(TY##_pack)(K(OPV)(a, b)));           \
        }                                                                             \
    }

DEF_HALF(bf16_sum, bf16, BF16_MAIN, v_sum)
DEF_HALF(bf16_prod, bf16, BF16_MAIN, v_prod)
DEF_HALF(bf16_min, bf16, BF16_MAIN, v_min)
DEF_HALF(bf16_max, bf16, BF16_MAIN, v_max)
DEF_HALF(f16_sum, f16, F16_MAIN, v_sum)
DEF_HALF(f16_prod, f16, F16_MAIN, v_prod)
DEF_HALF(f16_min, f16, F16_MAIN, v_min)
DEF_HALF(f16_max, f16, F16_MAIN, v_max)
#undef BF16_MAIN
#undef BF16_LOHI
#undef F16_MAIN
#undef F16_RND

#define K_F16_SCALE_LOAD(x) _cvtsh_ss(x)
#define K_F16_SCALE_STORE(x) _cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#elif defined(COLL_ISA_V3)
/* bfloat16 widening/narrowing vectorises from the portable code; float16 uses F16C */
DEF_HALF_PORTABLE(bf16_sum, coll_bf16_to_f32, coll_f32_to_bf16, F_SUM(a, b))
DEF_HALF_PORTABLE(bf16_prod, coll_bf16_to_f32, coll_f32_to_bf16, F_PROD(a, b))
DEF_HALF_PORTABLE(bf16_min, coll_bf16_to_f32, coll_f32_to_bf16, F_MIN(a, b))
DEF_HALF_PORTABLE(bf16_max, coll_bf16_to_f32, coll_f32_to_bf16, F_MAX(a, b))

static inline __m256 K(v_sum)(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 K(v_prod)(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
/* min (CMP _CMP_LT_OQ) and max (_CMP_GT_OQ): a where a CMP b, else b; NaN if either is */
#define DEF_V_PICK(NAME, CMP)                                                         \
    static inline __m256 K(NAME)(__m256 a, __m256 b)                                  \
    {                                                                                 \
        __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, CMP));                  \
        __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);                               \
        return _mm256_blendv_ps(r, _mm256_add_ps(a, b), nan);                         \
    }
DEF_V_PICK(v_min, _CMP_LT_OQ)
DEF_V_PICK(v_max, _CMP_GT_OQ)
#undef DEF_V_PICK
#define F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define DEF_F16(NAME, OPV, EXPR)                                                      \
    static void K(NAME)(void *dv, const void *av, const void *bv, size_t n)           \
    {                                                                                 \
        uint16_t *d = (uint16_t *)dv;                                                 \
        const uint16_t *pa = (const uint16_t *)av, *pb = (const uint16_t *)bv;        \
        size_t i = 0;                                                                 \
        for (; i + 8 <= n; i += 8) {                                                  \
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pa + i)));   \
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + i)));   \
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(K(OPV)(a, b), F16_ROUND)); \
        }                                                                             \
        for (; i < n; i++) {                                                          \
            float a = _cvtsh_ss(pa[i]), b = _cvtsh_ss(pb[i]);                         \
            d[i] = _cvtss_sh((EXPR), F16_ROUND);                                      \
        }                                                                             \
    }
DEF_F16(f16_sum, v_sum, F_SUM(a, b))
DEF_F16(f16_prod, v_prod, F_PROD(a, b))
DEF_F16(f16_min, v_min, F_MIN(a, b))
DEF_F16(f16_max, v_max, F_MAX(a, b))
#undef DEF_F16
#undef F16_ROUND
#define K_F16_SCALE_LOAD(x) _cvtsh_ss(x)
#define K_F16_SCALE_STORE(x) _cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#else
DEF_HALF_PORTABLE(bf16_sum, coll_bf16_to_f32, coll_f32_to_bf16, F_SUM(a, b))
DEF_HALF_PORTABLE(bf16_prod, coll_bf16_to_f32, coll_f32_to_bf16, F_PROD(a, b))
DEF_HALF_PORTABLE(bf16_min, coll_bf16_to_f32, coll_f32_to_bf16, F_MIN(a, b))
DEF_HALF_PORTABLE(bf16_max, coll_bf16_to_f32, coll_f32_to_bf16, F_MAX(a, b))
DEF_HALF_PORTABLE(f16_sum, coll_f16_to_f32, coll_f32_to_f16, F_SUM(a, b))
DEF_HALF_PORTABLE(f16_prod, coll_f16_to_f32, coll_f32_to_f16, F_PROD(a, b))
DEF_HALF_PORTABLE(f16_min, coll_f16_to_f32, coll_f32_to_f16, F_MIN(a, b))
DEF_HALF_PORTABLE(f16_max, coll_f16_to_f32, coll_f32_to_f16, F_MAX(a, b))
#define K_F16_SCALE_LOAD(x) coll_f16_to_f32(x)
#define K_F16_SCALE_STORE(x) coll_f32_to_f16(x)
#endif

/* scale: multiply by factor converted to the compute type (as torch's tensor.mul_(float)) */
static void K(scale_f32)(void *dv, size_t n, double factor)
{
    float *d = (float *)dv;
    const float g = (float)factor;
    for (size_t i = 0; i < n; i++)
        d[i] = d[i] * g;
}
static void K(scale_f64)(void *dv, size_t n, double factor)
{
    double *d = (double *)dv;
    for (size_t i = 0; i < n; i++)
        d[i] = d[i] * factor;
}
static void K(scale_bf16)(void *dv, size_t n, double factor)
{
    uint16_t *d = (uint16_t *)dv;
    const float g = (float)factor;
    for (size_t i = 0; i < n; i++)
        d[i] = coll_f32_to_bf16(coll_bf16_to_f32(d[i]) * g);
}
#if defined(COLL_ISA_V4) || defined(COLL_ISA_V3)
static void K(scale_f16)(void *dv, size_t n, double factor)
{
    uint16_t *d = (uint16_t *)dv;
    const float g = (float)factor;
    const __m256 vg = _mm256_set1_ps(g);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + i)));
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_mul_ps(x, vg), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++)
        d[i] = K_F16_SCALE_STORE(K_F16_SCALE_LOAD(d[i]) * g);
}
#else
static void K(scale_f16)(void *dv, size_t n, double factor)
{
    uint16_t *d = (uint16_t *)dv;
    const float g = (float)factor;
    for (size_t i = 0; i < n; i++)
        d[i] = K_F16_SCALE_STORE(K_F16_SCALE_LOAD(d[i]) * g);
}
#endif
/* complex times (g + 0i), as torch multiplies a complex tensor by a real scalar */
#define DEF_CSCALE(NAME, T)                                                           \
    static void K(NAME)(void *dv, size_t n, double factor)                            \
    {                                                                                 \
        T *d = (T *)dv;                                                               \
        const T g = (T)factor, z = (T)0;                                              \
        for (size_t i = 0; i < n; i++) {                                              \
            T re = d[2 * i], im = d[2 * i + 1];                                       \
            d[2 * i] = re * g - im * z;                                               \
            d[2 * i + 1] = re * z + im * g;                                           \
        }                                                                             \
    }
#if !defined(COLL_ISA_V4) && !defined(COLL_ISA_V3)
DEF_CSCALE(scale_c64, float)
DEF_CSCALE(scale_c128, double)
#endif
#undef DEF_CSCALE
#undef K_F16_SCALE_LOAD
#undef K_F16_SCALE_STORE

static void K(coll_fill_tables)(coll_binop_fn t[COLL_NUM_DTYPES][COLL_NUM_OPS], coll_scale_fn s[COLL_NUM_DTYPES])
{
    memset(t, 0, sizeof(coll_binop_fn) * COLL_NUM_DTYPES * COLL_NUM_OPS);
    memset(s, 0, sizeof(coll_scale_fn) * COLL_NUM_DTYPES);
#define SET4(DT, P)                                                                   \
    t[DT][COLL_SUM] = K(P##_sum); t[DT][COLL_PRODUCT] = K(P##_prod);                  \
    t[DT][COLL_MIN] = K(P##_min); t[DT][COLL_MAX] = K(P##_max);
#define SET7(DT, P)                                                                   \
    SET4(DT, P) t[DT][COLL_BAND] = K(P##_band); t[DT][COLL_BOR] = K(P##_bor);         \
    t[DT][COLL_BXOR] = K(P##_bxor);
    SET4(COLL_FLOAT16, f16)
    SET4(COLL_BFLOAT16, bf16)
    SET4(COLL_FLOAT32, f32)
    SET4(COLL_FLOAT64, f64)
    t[COLL_COMPLEX64][COLL_SUM] = K(c64_sum); t[COLL_COMPLEX128][COLL_SUM] = K(c128_sum);
#if defined(COLL_ISA_V4) || defined(COLL_ISA_V3)
    /* GCC 12 fuses the vectorised complex product into vfmaddsub despite
     * -ffp-contract=off; the baseline (SSE2, no FMA) versions round each product. */
    t[COLL_COMPLEX64][COLL_PRODUCT] = c64_prod_base; t[COLL_COMPLEX128][COLL_PRODUCT] = c128_prod_base;
#else
    t[COLL_COMPLEX64][COLL_PRODUCT] = K(c64_prod); t[COLL_COMPLEX128][COLL_PRODUCT] = K(c128_prod);
#endif
    SET7(COLL_INT8, i8)
    SET7(COLL_UINT8, u8)
    SET7(COLL_INT16, i16)
    SET7(COLL_INT32, i32)
    SET7(COLL_INT64, i64)
    t[COLL_BOOL][COLL_SUM] = K(b8_or); t[COLL_BOOL][COLL_MAX] = K(b8_or); t[COLL_BOOL][COLL_BOR] = K(b8_or);
    t[COLL_BOOL][COLL_PRODUCT] = K(b8_and); t[COLL_BOOL][COLL_MIN] = K(b8_and);
    t[COLL_BOOL][COLL_BAND] = K(b8_and);
    t[COLL_BOOL][COLL_BXOR] = K(b8_xor);
#undef SET4
#undef SET7
    s[COLL_FLOAT16] = K(scale_f16);
    s[COLL_BFLOAT16] = K(scale_bf16);
    s[COLL_FLOAT32] = K(scale_f32);
    s[COLL_FLOAT64] = K(scale_f64);
#if defined(COLL_ISA_V4) || defined(COLL_ISA_V3)
    s[COLL_COMPLEX64] = scale_c64_base;
    s[COLL_COMPLEX128] = scale_c128_base;
#else
    s[COLL_COMPLEX64] = K(scale_c64);
    s[COLL_COMPLEX128] = K(scale_c128);
#endif
}

#undef DEF_BIN
#undef DEF_INT
#undef DEF_CPLX
#undef COLL_CPLX_PROD
#undef DEF_HALF
#undef DEF_HALF_PORTABLE
#undef F_SUM
#undef F_PROD
#undef F_MIN
#undef F_MAX

#endif /* COLL_KERNEL_BODY */
