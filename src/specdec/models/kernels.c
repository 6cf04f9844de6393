/* Shape-invariant kernels for specdec's native forward pass (see kernels.py for why).
 *
 * The rule every function here keeps: an output element is computed by one fixed sequence of
 * floating-point operations that depends only on the sizes of the model (hidden size, head size,
 * vocabulary), never on how many rows a call has, where a row sits in the call, how many cache
 * columns there are or which of them are visible. So a row's result is bit for bit the same
 * alone, with drafts behind it, under a tree mask or beside other rows of a ragged batch.
 *
 * - Matrix products: each output is fma(x[0], w[0], 0), then fma(x[k], w[k], acc) for k = 1..K-1,
 *   in order, in float32. Rows and columns only choose which register holds the chain.
 * - Sums over a row (norms): eight lanes, element i into lane i % 8, lanes added as a fixed tree.
 * - Attention: scores are the same FMA chain over the head dimension; softmax and the weighted
 *   sum of values run over cache columns in order, and a column the query does not see adds an
 *   exact zero (the maximum skips it), so holes, padding and compaction change nothing.
 * - bfloat16 tensors are widened to float32 (exactly) on load and rounded to nearest even once,
 *   when a result is stored. Where the compiler targets AVX512-BF16, bfloat16 products are one
 *   chain of pair dot products instead (see the AVX512-BF16 section), and where the CPU has AMX-BF16
 *   one chain per output on the tile unit (see the AMX section): still one fixed sequence per
 *   output, but that machine's own bits.
 *
 * The vector code (AVX-512 where the compiler targets it, else AVX2 + FMA) and the portable
 * fallback perform the same operations, element by element, so the results do not depend on
 * which one was compiled (bfloat16 products with AVX512-BF16 apart): a wider register only holds
 * more chains side by side.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define F32 0
#define BF16 1
#define F16 2
#if defined(__FLT16_MAX__)
typedef _Float16 half_t;
#define SD_HALF 1
#else
#define SD_HALF 0
#endif
#define NR 16 /* columns per packed weight panel */

/* ---- eight float lanes: AVX2 when compiled for it, otherwise a plain array ------------------ */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 v8;
static inline v8 v_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v_set1(float a) { return _mm256_set1_ps(a); }
static inline v8 v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void v_store(float* p, v8 a) { _mm256_storeu_ps(p, a); }
static inline v8 v_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8 v_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
static inline v8 v_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline v8 v_div(v8 a, v8 b) { return _mm256_div_ps(a, b); }
static inline v8 v_load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* Sixteen bfloat16 values stored as pairs (even element, odd element) -> the eight even ones and the
 * eight odd ones as float32 lanes: a shift and a mask of one load instead of two widening loads. */
static inline v8 v_load_bf16_even(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)p), 16));
}
static inline v8 v_load_bf16_odd(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)p),
                                                _mm256_set1_epi32((int)0xffff0000u)));
}
#define SD_VECTOR "avx2"
#else
typedef struct { float l[8]; } v8;
static inline v8 v_zero(void) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = 0.f; return r; }
static inline v8 v_set1(float a) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = a; return r; }
static inline v8 v_load(const float* p) { v8 r; memcpy(r.l, p, 32); return r; }
static inline void v_store(float* p, v8 a) { memcpy(p, a.l, 32); }
static inline v8 v_fma(v8 a, v8 b, v8 c) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = fmaf(a.l[i], b.l[i], c.l[i]); return r; }
static inline v8 v_mul(v8 a, v8 b) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = a.l[i] * b.l[i]; return r; }
static inline v8 v_add(v8 a, v8 b) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = a.l[i] + b.l[i]; return r; }
static inline v8 v_div(v8 a, v8 b) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = a.l[i] / b.l[i]; return r; }
static inline v8 v_load_bf16(const uint16_t* p) {
    v8 r; for (int i = 0; i < 8; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&r.l[i], &u, 4); } return r;
}
static inline v8 v_load_bf16_even(const uint16_t* p) {
    v8 r; for (int i = 0; i < 8; i++) { uint32_t u = (uint32_t)p[2 * i] << 16; memcpy(&r.l[i], &u, 4); } return r;
}
static inline v8 v_load_bf16_odd(const uint16_t* p) {
    v8 r; for (int i = 0; i < 8; i++) { uint32_t u = (uint32_t)p[2 * i + 1] << 16; memcpy(&r.l[i], &u, 4); } return r;
}
#define SD_VECTOR "portable"
#endif


static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
int sd_has_half(void) { return SD_HALF; }
static inline float load1(const void* p, long i, int dtype) {
    if (dtype == BF16) return from_bf16(((const uint16_t*)p)[i]);
#if SD_HALF
    if (dtype == F16) return (float)((const half_t*)p)[i];
#endif
    return ((const float*)p)[i];
}
static inline void store1(void* p, long i, float v, int dtype) {
    if (dtype == BF16) ((uint16_t*)p)[i] = to_bf16(v);
#if SD_HALF
    else if (dtype == F16) ((half_t*)p)[i] = (half_t)v;
#endif
    else ((float*)p)[i] = v;
}
/* The value a float becomes when the model stores it in its dtype. */
static inline float stored(float v, int dtype) {
    if (dtype == BF16) return from_bf16(to_bf16(v));
#if SD_HALF
    if (dtype == F16) {
        /* The half goes through memory: GCC 12 with AVX512-FP16 vectorised (float)(half)v in a loop
           into nothing at all, which silently kept the float's extra bits. */
        half_t h = (half_t)v;
        __asm__ volatile("" : "+m"(h));
        return (float)h;
    }
#endif
    return v;
}
/* stored() on eight lanes; bfloat16 in registers with to_bf16's integer steps (lane by lane through
   memory, a 16-row pass's SiLU took 5% of its time on a Zen 4). */
static inline v8 v_stored(v8 v, int dtype) {
    if (dtype == F32) return v;
#if defined(__AVX2__) && defined(__FMA__)
    if (dtype == BF16) {
        __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), high);
        __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), high);
        return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan));
    }
#endif
    float lane[8];
    v_store(lane, v);
    for (int l = 0; l < 8; l++) lane[l] = stored(lane[l], dtype);
    return v_load(lane);
}
/* A row of n elements as float32 into dst (a copy for float32, a widening for bfloat16). */
static void widen(const void* src, long n, int dtype, float* dst) {
    if (dtype == F32) memcpy(dst, src, n * sizeof(float));
    else for (long i = 0; i < n; i++) dst[i] = load1(src, i, dtype);
}
static size_t esize(int dtype) { return dtype == F32 ? 4 : 2; }

/* Sum of squares of x[0..n) in the fixed lane order. */
static float sum_squares(const float* x, long n) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long i = 0;
    for (; i + 8 <= n; i += 8) for (int l = 0; l < 8; l++) lane[l] = fmaf(x[i + l], x[i + l], lane[l]);
    for (; i < n; i++) lane[i % 8] = fmaf(x[i], x[i], lane[i % 8]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
static inline float inverse_rms(const float* x, long n, float eps) {
    return 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
}

/* ---- matrix products ------------------------------------------------------------------------
 * Weights are packed once at load time into panels of NR columns, [panels][K][NR], the last
 * panel padded with zeros, in the model's dtype. A tile is R rows x P panels of accumulators.
 * bfloat16 panels may be packed with each k-row's halves interleaved (HALVES: column j at 2j,
 * column 8 + j at 2j + 1), which the eight-lane builds widen with a shift and a mask; the values
 * and every chain of operations are those of the plain layout, so the bits are too.
 */
#define HALVES 6 /* the layout code of such panels (beside the quantized types 3-5) */
#define PAIRS 7  /* bfloat16 panels as pairs, [panels][K/2][16][2] (sd_bf16_pairs) */
static inline v8 load_f16(const void* w, long at) {
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = load1(w, at + i, F16);
    return v_load(f);
}

/* Eight consecutive elements of a tensor in its dtype, as float32 lanes, and back (rounded once). */
static inline v8 load8(const void* p, long at, int dtype) {
    if (dtype == F32) return v_load((const float*)p + at);
    if (dtype == BF16) return v_load_bf16((const uint16_t*)p + at);
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = load1(p, at + i, dtype);
    return v_load(f);
}
static inline void store8(void* p, long at, v8 v, int dtype) {
    if (dtype == F32) { v_store((float*)p + at, v); return; }
#if defined(__AVX2__) && defined(__FMA__)
    if (dtype == BF16) { /* to_bf16 on eight lanes: the rounded values' high halves */
        __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v_stored(v, BF16)), 16); /* eight values below 0x10000 */
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i*)((uint16_t*)p + at), packed);
        return;
    }
#endif
    float f[8];
    v_store(f, v);
    for (int i = 0; i < 8; i++) store1(p, at + i, f[i], dtype);
}

/* What a product adds to its chains and where it stores them: the norm's scale, bias, residual. */
struct linear_out {
    const void *bias, *residual; void* y;
    long N, ldr, ldy; int dtype; const float* scale;
};

#if defined(__AVX512F__)
/* Sixteen consecutive float32 or bfloat16 elements as float32 lanes, and back (rounded as to_bf16).
   The AVX-512 tiles store their chains sixteen lanes at a time; reading such a store back in halves
   misses store-to-load forwarding and stalls: measured on a Zen 4, a quarter of a 16-row Q8_0 tile. */
static inline __m512 load16(const void* p, long at, int dtype) {
    if (dtype == F32) return _mm512_loadu_ps((const float*)p + at);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + at)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline void store16(void* p, long at, __m512 v, int dtype) {
    if (dtype == F32) { _mm512_storeu_ps((float*)p + at, v); return; }
    store8(p, at, _mm512_castps512_ps256(v), dtype);
    store8(p, at + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), dtype);
}
#endif

/* Whole groups of LANES columns from c on, in vectors of type V with these operations: the same IEEE
   operations in the same order as finish_tile's scalar tail, so an element's bits do not depend on which
   path stored it. */
#define FINISH_GROUPS(LANES, V, LOAD, MUL, SET1, ADD, LOAD_T, STORE_T)                           \
    for (; c + LANES <= width && col0 + c + LANES <= o->N; c += LANES) {                          \
        long col = col0 + c;                                                                       \
        V v = LOAD(acc + r * ldacc + c);                                                           \
        if (o->scale) v = MUL(v, SET1(o->scale[row]));                                             \
        if (o->bias) v = ADD(v, LOAD_T(o->bias, col, dtype));                                      \
        if (o->residual) v = ADD(v, LOAD_T(o->residual, row * o->ldr + col, dtype));               \
        STORE_T(o->y, row * o->ldy + col, v, dtype);                                               \
    }

/* Stores the finished chains of rows [m, m + R) x columns [col0, col0 + width), acc[r * ldacc + c]. */
static void finish_tile(const struct linear_out* o, const float* acc, long ldacc, long m, int R, long col0,
                        int width) {
    int dtype = o->dtype;
    for (int r = 0; r < R; r++) {
        long row = m + r;
        int c = 0;
#if defined(__AVX512F__)
        if (dtype == F32 || dtype == BF16)
            FINISH_GROUPS(16, __m512, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_add_ps, load16, store16)
#endif
        FINISH_GROUPS(8, v8, v_load, v_mul, v_set1, v_add, load8, store8)
        for (; c < width; c++) {
            long col = col0 + c;
            if (col >= o->N) break;
            float v = acc[r * ldacc + c];
            if (o->scale) v = v * o->scale[row];
            if (o->bias) v = v + load1(o->bias, col, dtype);
            if (o->residual) v = v + load1(o->residual, row * o->ldr + col, dtype);
            store1(o->y, row * o->ldy + col, v, dtype);
        }
    }
}

#if defined(__AVX512F__)
/* ---- AVX-512: a panel's k-row of 16 columns is one register ----------------------------------
 * Rows come in blocks of at most 16, each block's inputs stored k-major ([K][R], so one step's
 * broadcasts share a cache line); a tile of R rows x P panels keeps R x P chains in registers and
 * reads each weight once per block, so up to 16 rows stream the weights once. The chains are the
 * same fma(x[k], w[k], acc) over k = 0..K-1 as in the eight-lane code below, one lane per column,
 * so both compute the same bits.
 */
#define SD_WIDE 1
#define WIDE_ROWS 16        /* rows per block */
#define WIDE_PREFETCH 4096  /* bytes ahead in each panel, into L2: the weights stream from memory */
static inline __m512 wide_f32(const void* w, long at) { return _mm512_loadu_ps((const float*)w + at); }
static inline __m512 wide_bf16(const void* w, long at) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + at)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 wide_f16(const void* w, long at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)w + at)));
}
#define WSIZE_f32 4
#define WSIZE_bf16 2
#define WSIZE_f16 2
typedef void (*wide_fn)(const float* xt, long K, const void* wp, long pstride, float* acc_out);
#define WIDE_TILE(R, P, NAME)                                                                      \
static void wide_##NAME##_##R##_##P(const float* xt, long K, const void* wp, long pstride, float* acc_out) { \
    __m512 acc[R][P];                                                                              \
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();      \
    for (long k = 0; k < K; k++) {                                                                 \
        __m512 w[P];                                                                               \
        for (int p = 0; p < P; p++) w[p] = wide_##NAME(wp, p * pstride + k * NR);                  \
        for (int p = 0; p < P; p++)                                                                \
            _mm_prefetch((const char*)wp + (p * pstride + k * NR) * WSIZE_##NAME + WIDE_PREFETCH, _MM_HINT_T1); \
        for (int r = 0; r < R; r++) {                                                              \
            __m512 xv = _mm512_set1_ps(xt[k * R + r]);                                             \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);          \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++)                                        \
        _mm512_storeu_ps(acc_out + r * 8 * NR + p * NR, acc[r][p]);                                \
}
#if defined(__AVX512BF16__)
/* ---- AVX512-BF16: bfloat16 products as dot products of pairs ----------------------------------
 * A bfloat16 model's inputs and weights are bfloat16 already, so vdpbf16ps can take them as they
 * are: one instruction adds x[k] w[k] and x[k+1] w[k+1] (each product exact in float32) to a
 * column's float32 chain, 32 multiply-adds where an FMA does 16. The chain is over input pairs
 * (k, k+1) = (0, 1), (2, 3), ... in order (odd K: the last pair's second half is zero), the same for
 * every row count and tile, so a row's bits still never depend on the block; they are not the bits
 * of the FMA chain the other builds compute (bfloat16 on an AVX512-BF16 CPU is its own arithmetic).
 * With K even the weights are packed as pairs (sd_bf16_pairs: [panels][K/2][16][2], the two k-rows of a
 * panel's cache line interleaved at load time); an odd K's panels keep the plain layout, interleaved in a
 * register by one vpermw per line. (SmolLM2-135M's products alone, Zen 4, two threads, best of four
 * processes each: 1 / 8 / 16 rows 9.16 / 9.95 / 13.27 ms with the vpermw, 8.52 / 9.68 / 13.11 as pairs.)
 * Inputs come packed as pairs, [K/2][R] 32-bit words per row block. */
#define SD_BF16_DOT 1
typedef void (*pair_fn)(const uint32_t* xt, long K, const void* wp, long pstride, float* acc_out);
static inline __m512i pair_order(void) {  /* lane c of the result: (row k col c, row k+1 col c) */
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}
/* One pair of k-rows (k, k + 1) into each of the tile's chains; LOAD(p): panel p's 32 weights, as pairs
   already (PLAIN 0) or as two k-rows (PLAIN 1). */
#define PAIR_STEP(R, P, LOAD, PLAIN)                                                               \
    {                                                                                              \
        __m512bh w[P];                                                                             \
        for (int p = 0; p < P; p++) w[p] = (__m512bh)(PLAIN ? _mm512_permutexvar_epi16(order, LOAD) : LOAD); \
        for (int r = 0; r < R; r++) {                                                              \
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[(k / 2) * R + r]);                   \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, w[p]);        \
        }                                                                                          \
    }
/* Whole pairs with plain loads; an odd K's last input alone, its weight pair's second half zero by a
 * masked load (kept out of the loop: a masked load in it made 16-row products twice as slow). */
#define PAIR_TILE_AS(R, P, FN, PLAIN)                                                              \
static void FN(const uint32_t* xt, long K, const void* wp, long pstride, float* acc_out) {        \
    __m512 acc[R][P];                                                                              \
    const __m512i order = pair_order();                                                            \
    const uint16_t* w16 = (const uint16_t*)wp;                                                     \
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();      \
    long k = 0;                                                                                    \
    for (; k + 2 <= K; k += 2) {                                                                   \
        for (int p = 0; p < P; p++)                                                                \
            _mm_prefetch((const char*)(w16 + p * pstride + k * NR) + WIDE_PREFETCH, _MM_HINT_T1);  \
        PAIR_STEP(R, P, _mm512_loadu_si512(w16 + p * pstride + k * NR), PLAIN)                    \
    }                                                                                              \
    if (k < K) PAIR_STEP(R, P, _mm512_maskz_loadu_epi16(0xffffu, w16 + p * pstride + k * NR), PLAIN) \
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++)                                        \
        _mm512_storeu_ps(acc_out + r * 8 * NR + p * NR, acc[r][p]);                                \
}
#define PAIR_TILE(R, P, NAME) PAIR_TILE_AS(R, P, pair_##R##_##P, 0) PAIR_TILE_AS(R, P, plain_pair_##R##_##P, 1)
#define PAIR_ENTRY(R, P, NAME) [R][P] = pair_##R##_##P,
#define PLAIN_PAIR_ENTRY(R, P, NAME) [R][P] = plain_pair_##R##_##P,
#endif
/* Panels per tile for a block of R rows: R x P chains and P weights within the 32 registers, at
 * least 8 chains in flight (15 or 16 rows: one panel, one weight load per 15 or 16 FMAs). Tried
 * on a Zen 4 core (one 512-bit FMA a cycle) with SmolLM2-135M's matrices: fewer panels per tile
 * for 1-8 rows (4 for 1-6) was as fast or slower. */
static const int wide_panels[WIDE_ROWS + 1] = {0, 8, 8, 6, 6, 5, 4, 3, 3, 3, 2, 2, 2, 2, 2, 1, 1};
#define WIDE_SHAPES(X, NAME)                                                                       \
    X(1, 1, NAME) X(1, 2, NAME) X(1, 3, NAME) X(1, 4, NAME) X(1, 5, NAME) X(1, 6, NAME) X(1, 7, NAME) X(1, 8, NAME) \
    X(2, 1, NAME) X(2, 2, NAME) X(2, 3, NAME) X(2, 4, NAME) X(2, 5, NAME) X(2, 6, NAME) X(2, 7, NAME) X(2, 8, NAME) \
    X(3, 1, NAME) X(3, 2, NAME) X(3, 3, NAME) X(3, 4, NAME) X(3, 5, NAME) X(3, 6, NAME)                \
    X(4, 1, NAME) X(4, 2, NAME) X(4, 3, NAME) X(4, 4, NAME) X(4, 5, NAME) X(4, 6, NAME)                \
    X(5, 1, NAME) X(5, 2, NAME) X(5, 3, NAME) X(5, 4, NAME) X(5, 5, NAME)                              \
    X(6, 1, NAME) X(6, 2, NAME) X(6, 3, NAME) X(6, 4, NAME)                                            \
    X(7, 1, NAME) X(7, 2, NAME) X(7, 3, NAME) X(8, 1, NAME) X(8, 2, NAME) X(8, 3, NAME)               \
    X(9, 1, NAME) X(9, 2, NAME) X(9, 3, NAME) X(10, 1, NAME) X(10, 2, NAME) X(11, 1, NAME) X(11, 2, NAME) \
    X(12, 1, NAME) X(12, 2, NAME) X(13, 1, NAME) X(13, 2, NAME) X(14, 1, NAME) X(14, 2, NAME)         \
    X(15, 1, NAME) X(16, 1, NAME)
#define WIDE_ENTRY(R, P, NAME) [R][P] = wide_##NAME##_##R##_##P,
#define WIDE_TABLE(NAME)                                                                           \
    WIDE_SHAPES(WIDE_TILE, NAME)                                                                   \
    static const wide_fn wide_tiles_##NAME[WIDE_ROWS + 1][9] = {WIDE_SHAPES(WIDE_ENTRY, NAME)};
WIDE_TABLE(f32)
WIDE_TABLE(bf16)
WIDE_TABLE(f16)
#if defined(SD_BF16_DOT)
WIDE_SHAPES(PAIR_TILE, pair)
static const pair_fn pair_tiles[WIDE_ROWS + 1][9] = {WIDE_SHAPES(PAIR_ENTRY, pair)};
static const pair_fn plain_pair_tiles[WIDE_ROWS + 1][9] = {WIDE_SHAPES(PLAIN_PAIR_ENTRY, pair)};
#endif

/* Rows in blocks of at most WIDE_ROWS, as even as can be: block b of `blocks` starts at row_start. */
static inline long wide_blocks(long M) { return (M + WIDE_ROWS - 1) / WIDE_ROWS; }
static inline long row_start(long M, long blocks, long b) { return M * b / blocks; }

/* x [M, K] (dtype, row stride ldx) widened -> xt, block by block, each block [K][R]; inputs [k0, k1) only. */
static void pack_rows(const void* x, long ldx, int dtype, long M, long K, long k0, long k1, float* xt) {
    long blocks = wide_blocks(M);
    for (long b = 0; b < blocks; b++) {
        long m0 = row_start(M, blocks, b), R = row_start(M, blocks, b + 1) - m0;
        float* block = xt + m0 * K;
        for (long r = 0; r < R; r++)
            for (long k = k0; k < k1; k++) block[k * R + r] = load1(x, (m0 + r) * ldx + k, dtype);
    }
}

#if defined(SD_BF16_DOT)
/* x [M, K] bfloat16 (row stride ldx) -> pairs, block by block, each block [ceil(K/2)][R], words [w0, w1) only: the word
 * of (k, k + 1) holds x[k]'s bits low, x[k + 1]'s high (0 past the end); a NaN quieted as to_bf16
 * quiets it, so the words are what rounding the widened row would give. */
static inline uint32_t quiet_pair(uint32_t w) {
    if ((w & 0x7fffu) > 0x7f80u) w |= 0x40u;
    if ((w & 0x7fff0000u) > 0x7f800000u) w |= 0x400000u;
    return w;
}
static void pack_pairs(const uint16_t* x, long ldx, long M, long K, long w0, long w1, uint32_t* xt) {
    long blocks = wide_blocks(M), K2 = (K + 1) / 2, whole = K / 2, end = w1 < whole ? w1 : whole;
    for (long b = 0; b < blocks; b++) {
        long m0 = row_start(M, blocks, b), R = row_start(M, blocks, b + 1) - m0;
        uint32_t* block = xt + m0 * K2;
        for (long r = 0; r < R; r++) {
            const uint16_t* row = x + (m0 + r) * ldx;
            for (long k = w0; k < end; k++) {
                uint32_t w;
                memcpy(&w, row + 2 * k, 4);
                block[k * R + r] = quiet_pair(w);
            }
            if (whole < K2 && w0 <= whole && whole < w1) block[whole * R + r] = quiet_pair(row[K - 1]);
        }
    }
}
#endif
static int bf16_dot(int dtype) {
#if defined(SD_BF16_DOT)
    return dtype == BF16;
#else
    (void)dtype;
    return 0;
#endif
}

static void linear_panels(long M, long K, const void* wp, const struct linear_out* o, const float* xt,
                          long p0, long p1, int layout) {
    (void)layout; /* 0 or PAIRS (sd_linear refuses HALVES panels here) */
    float acc[WIDE_ROWS * 8 * NR];
    long pstride = K * NR, blocks = wide_blocks(M);
    size_t wsize = esize(o->dtype);
    int pairs = bf16_dot(o->dtype);
    long xrow = pairs ? (K + 1) / 2 : K;  /* 32-bit words per input row in xt */
    const wide_fn(*tiles)[9] = o->dtype == BF16 ? wide_tiles_bf16 : o->dtype == F16 ? wide_tiles_f16 : wide_tiles_f32;
    /* Panels outer, row blocks inner: a group of panels (about 256 KiB) stays in L2 while every
       block uses it; a single block takes the whole range at once. */
    long group = blocks == 1 ? p1 - p0 : (long)(262144 / (pstride * wsize));
    if (group < 8) group = 8;
    for (long p = p0; p < p1; p += group) {
        long end = p + group < p1 ? p + group : p1;
        for (long b = 0; b < blocks; b++) {
            long m0 = row_start(M, blocks, b);
            int R = (int)(row_start(M, blocks, b + 1) - m0);
            for (long q = p; q < end;) {
                int P = wide_panels[R];
                if (P > end - q) P = (int)(end - q);
#if defined(SD_BF16_DOT)
                if (pairs)
                    (layout == PAIRS ? pair_tiles : plain_pair_tiles)[R][P]((const uint32_t*)xt + m0 * xrow, K,
                                                                   (const char*)wp + q * pstride * wsize, pstride, acc);
                else
#endif
                    tiles[R][P](xt + m0 * xrow, K, (const char*)wp + q * pstride * wsize, pstride, acc);
                finish_tile(o, acc, 8 * NR, m0, R, q * NR, P * NR);
                q += P;
            }
        }
    }
}
#define SD_VECTOR_PRODUCTS "avx512"
#else
/* ---- eight lanes: a panel's k-row is two vectors --------------------------------------------- */
#define LOAD_F32(w, p, k, pstride) v_load((const float*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_F32_HI(w, p, k, pstride) v_load((const float*)(w) + (p) * (pstride) + (k) * NR + 8)
#define LOAD_BF16(w, p, k, pstride) v_load_bf16((const uint16_t*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_BF16_HI(w, p, k, pstride) v_load_bf16((const uint16_t*)(w) + (p) * (pstride) + (k) * NR + 8)
#define LOAD_BF16H(w, p, k, pstride) v_load_bf16_even((const uint16_t*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_BF16H_HI(w, p, k, pstride) v_load_bf16_odd((const uint16_t*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_F16(w, p, k, pstride) load_f16(w, (p) * (pstride) + (k) * NR)
#define LOAD_F16_HI(w, p, k, pstride) load_f16(w, (p) * (pstride) + (k) * NR + 8)

/* A tile with prefetching (PF) also asks, into L2, for `pf_lines` cache lines from `pf` on, spread
 * over its steps: its share of the next group's weights, read from memory while this group's work
 * runs from L2. */
#define TILE_PF(R, P, NAME, LO, HI, PF, FN)                                                      \
static void FN(const float* x, long K, const void* wp, long pstride, float* acc_out, const char* pf, \
               long pf_lines) {                                                                  \
    v8 acc[R][2 * P];                                                                            \
    long owed = 0;                                                                               \
    (void)pf; (void)owed;                                                                        \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2 * P; c++) acc[r][c] = v_zero();          \
    for (long k = 0; k < K; k++) {                                                               \
        v8 wv[2 * P];                                                                            \
        for (int p = 0; p < P; p++) { wv[2 * p] = LO(wp, p, k, pstride); wv[2 * p + 1] = HI(wp, p, k, pstride); } \
        if (PF) for (owed += pf_lines; owed >= K; owed -= K, pf += 64) PREFETCH_LINE(pf);         \
        for (int r = 0; r < R; r++) {                                                            \
            v8 xv = v_set1(x[r * K + k]);                                                        \
            for (int c = 0; c < 2 * P; c++) acc[r][c] = v_fma(xv, wv[c], acc[r][c]);            \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2 * P; c++)                                  \
        v_store(acc_out + (long)r * 6 * NR + c * 8, acc[r][c]);                                  \
}
/* Each tile twice: plain (one or two rows, which read every weight once, from memory), and asking
 * for its share of the next group's weights (more rows: every row block reads the group from L2). */
#define TILE2(R, P, NAME, LO, HI)                                                                \
    TILE_PF(R, P, NAME, LO, HI, 0, tile_##NAME##_##R##_##P) TILE_PF(R, P, NAME, LO, HI, 1, tilepf_##NAME##_##R##_##P)
#if defined(__AVX2__)
#define PREFETCH_LINE(at) _mm_prefetch((at), _MM_HINT_T1)
#else
#define PREFETCH_LINE(at) ((void)(at))
#endif
#define PICK(NAME, R, P) (pf ? tilepf_##NAME##_##R##_##P : tile_##NAME##_##R##_##P)
#define TILES(NAME, LO, HI) \
    TILE2(6, 1, NAME, LO, HI) TILE2(5, 1, NAME, LO, HI) TILE2(4, 1, NAME, LO, HI) TILE2(3, 2, NAME, LO, HI) \
    TILE2(3, 1, NAME, LO, HI) TILE2(2, 3, NAME, LO, HI) TILE2(2, 2, NAME, LO, HI) TILE2(2, 1, NAME, LO, HI) \
    TILE2(1, 6, NAME, LO, HI) TILE2(1, 5, NAME, LO, HI) TILE2(1, 4, NAME, LO, HI) TILE2(1, 3, NAME, LO, HI) \
    TILE2(1, 2, NAME, LO, HI) TILE2(1, 1, NAME, LO, HI)                                                 \
static tile_fn pick_##NAME(int R, int P, int pf) {                                                  \
    switch (R) {                                                                                     \
    case 6: return PICK(NAME, 6, 1);                                                                 \
    case 5: return PICK(NAME, 5, 1);                                                                 \
    case 4: return PICK(NAME, 4, 1);                                                                 \
    case 3: return P >= 2 ? PICK(NAME, 3, 2) : PICK(NAME, 3, 1);                                     \
    case 2: return P >= 3 ? PICK(NAME, 2, 3) : P == 2 ? PICK(NAME, 2, 2) : PICK(NAME, 2, 1);         \
    default: return P >= 6 ? PICK(NAME, 1, 6) : P == 5 ? PICK(NAME, 1, 5) : P == 4 ? PICK(NAME, 1, 4)   \
                   : P == 3 ? PICK(NAME, 1, 3) : P == 2 ? PICK(NAME, 1, 2) : PICK(NAME, 1, 1);          \
    }                                                                                                \
}
typedef void (*tile_fn)(const float*, long, const void*, long, float*, const char*, long);
TILES(f32, LOAD_F32, LOAD_F32_HI)
TILES(bf16, LOAD_BF16, LOAD_BF16_HI)
TILES(bf16h, LOAD_BF16H, LOAD_BF16H_HI)
TILES(f16, LOAD_F16, LOAD_F16_HI)

static tile_fn pick_tile(int R, int P, int dtype, int pf, int layout) {
    if (layout == HALVES) return pick_bf16h(R, P, pf);
    return dtype == BF16 ? pick_bf16(R, P, pf) : dtype == F16 ? pick_f16(R, P, pf) : pick_f32(R, P, pf);
}

/* Rows: more than 6 go in ceil(M / 6) blocks of even size (they read the weights from L2, so every
   block pays in multiply-adds only: float32 products of 9, 11, 15 and 17 rows 0.79-0.87x the time of
   blocks of 6 and a rest; bfloat16 0.93-1.0x; on a Zen 3). Up to 6 rows: float32 as 2 + 2 for 4 and
   3 + 2 for 5 (one pass streams the weights from memory), 3-row tiles two panels wide; two-byte
   weights, whose widening costs more than their bytes, in one block (4 and 5 rows 0.6-0.7x the time of
   2 + 2 and 3 + 2 there). Tiles of 3-6 rows are one panel wide otherwise, so the chains and weights
   fit the 16 registers, and 2-row tiles two or three. */
#define STREAM_AHEAD 16384  /* bytes: how far ahead a single row block of two-byte weights asks for them */
#define GROUP_BYTES 262144  /* the most weight bytes of a group of panels that row blocks share from L2 */
static int block_rows(long M, long m, int wide_weights) {
    if (M > 6) {
        long blocks = (M + 5) / 6, b = 0;
        while (M * (b + 1) / blocks <= m) b++;
        return (int)(M * (b + 1) / blocks - m);
    }
    long left = M - m;
    return !wide_weights ? (int)left : left == 4 ? 2 : left == 5 ? 3 : (int)left;
}
static int tile_panels(int R, long M, int wide_weights) {
    return R >= 4 ? 1 : R == 3 ? (wide_weights && M <= 6 ? 2 : 1) : R == 2 ? (wide_weights || M == 2 ? 3 : 2) : 6;
}
static void linear_panels(long M, long K, const void* wp, const struct linear_out* o, const float* xf,
                          long p0, long p1, int layout) {
    float acc[6 * 6 * NR];
    long pstride = K * NR, pbytes = pstride * (long)esize(o->dtype);  /* a panel's elements and bytes */
    int wide_weights = o->dtype == F32; /* four bytes a weight: the row blocks differ */
    /* Panels outer, rows inner: a group of panels stays in L2 while every row block uses it. With more
       than two rows every tile asks for an equal share of the next group's weights as it works, so
       the stream from memory runs beside all of the group's work, not only its first row block's. */
    long most = M > 2 ? GROUP_BYTES / pbytes : 6;
    if (most > 6) most = 6;
    if (most < 1) most = 1;
    for (long p = p0; p < p1;) {
        int group = (int)(p1 - p < most ? p1 - p : most);
        long next = M > 2 ? (p1 - p - group < most ? p1 - p - group : most) : 0;
        const char* pf = (const char*)wp + (next ? p + group : p) * pbytes;
        long lines = (next * pbytes + 63) / 64, calls = 0, call = 0;
        if (!wide_weights && M > 2 && block_rows(M, 0, wide_weights) == M) {
            /* Two-byte weights in one row block read every weight once: ask for the weights a fixed
               distance ahead of where the tiles read instead (3-6 bfloat16 rows 0.89-0.97x the time on a
               Zen 3; float32 within the spread, so it keeps the next group). */
            long at = p * pbytes + STREAM_AHEAD, end = p1 * pbytes, span = group * pbytes;
            pf = (const char*)wp + (at < end ? at : 0);
            lines = at < end ? ((end - at < span ? end - at : span) + 63) / 64 : 0;
        }
        for (long m = 0; m < M && lines; m += block_rows(M, m, wide_weights)) {
            long P = tile_panels(block_rows(M, m, wide_weights), M, wide_weights);
            calls += (group + P - 1) / P;
        }
        for (long m = 0; m < M;) {
            int R = block_rows(M, m, wide_weights);
            for (long q = p; q < p + group; call++) {
                int P = tile_panels(R, M, wide_weights);
                if (P > p + group - q) P = (int)(p + group - q);
                long from = calls ? lines * call / calls : 0, to = calls ? lines * (call + 1) / calls : 0;
                pick_tile(R, P, o->dtype, lines > 0, layout)(xf + m * K, K, (const char*)wp + q * pbytes,
                                                            pstride, acc, pf + from * 64, to - from);
                finish_tile(o, acc, 6 * NR, m, R, q * NR, P * NR);
                q += P;
            }
            m += R;
        }
        p += group;
    }
}
#define SD_VECTOR_PRODUCTS SD_VECTOR
#endif

const char* sd_vector(void) { return SD_VECTOR_PRODUCTS; }
/* 1 where bfloat16 panels are best packed with interleaved halves (the eight-lane AVX2 products), 0
 * where the plain layout is (the portable code reads both), -1 where HALVES panels are not read (AVX-512). */
int sd_bf16_halves(void) {
#if defined(SD_WIDE)
    return -1;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
/* 1 where bfloat16 products are dot products of pairs (AVX512-BF16), 0 where they are FMA chains. */
int sd_bf16_dot(void) {
#if defined(SD_BF16_DOT)
    return 1;
#else
    return 0;
#endif
}

/* ---- a small thread pool: workers take column ranges, so each output keeps its one chain ---- */
#include <pthread.h>
#include <time.h>
#include <stdatomic.h>
#define MAX_THREADS 64
typedef void (*job_fn)(void* arg, int part, int parts);
static struct {
    int workers;                 /* threads besides the caller */
    pthread_t thread[MAX_THREADS];
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_long generation;      /* bumped per job */
    atomic_int remaining;        /* workers still running the current job */
    job_fn fn;
    void* arg;
    int parts;
    int sleeping;
} pool = {0, {0}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long created_generation;
static long spin_ns = 100000; /* how long an idle worker spins before it sleeps */
void sd_set_spin(long nanoseconds) { spin_ns = nanoseconds; }

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void* worker_main(void* index_ptr) {
    int index = (int)(intptr_t)index_ptr;
    long seen = created_generation;
    for (;;) {
        long spins = 0, start = now_ns();
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            if ((++spins & 63) || now_ns() - start < spin_ns) { cpu_relax(); continue; }
            pthread_mutex_lock(&pool.lock);
            pool.sleeping++;
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pool.sleeping--;
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        if (index + 1 < pool.parts) pool.fn(pool.arg, index + 1, pool.parts);
        atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
    }
    return NULL;
}

static int active_threads = 1;

/* Threads jobs use (the caller included); starts workers as needed (they never exit, idle ones sleep). */
int sd_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    created_generation = atomic_load(&pool.generation);
    while (pool.workers < threads - 1) {
        if (pthread_create(&pool.thread[pool.workers], NULL, worker_main, (void*)(intptr_t)pool.workers) != 0) break;
        pthread_detach(pool.thread[pool.workers]);
        pool.workers++;
    }
    active_threads = threads < pool.workers + 1 ? threads : pool.workers + 1;
    return active_threads;
}

static void run_parallel(job_fn fn, void* arg, int parts) {
    if (parts > active_threads) parts = active_threads;
    if (parts <= 1) { fn(arg, 0, 1); return; }
    pool.fn = fn; pool.arg = arg; pool.parts = parts;
    atomic_store(&pool.remaining, pool.workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg, 0, parts);
    while (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0) cpu_relax();
}

/* Work memory kept per thread between calls, grown as needed (up to SCRATCH_KEEP bytes; larger
 * requests, a long prefill's, are allocated and freed per call). Allocating and freeing a product's
 * buffers on every call let the allocator return the pages to the system and fault them in again:
 * page clearing showed in profiles of 16-row blocks. Freed when the thread exits. */
enum { SCRATCH_PRODUCT, SCRATCH_ATTENTION, SCRATCH_SLOTS };
#define SCRATCH_KEEP (8L << 20)
struct scratch { void* p[SCRATCH_SLOTS]; size_t n[SCRATCH_SLOTS]; };
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_ready;
static void scratch_release(void* held) {
    struct scratch* sc = held;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(sc->p[i]);
    free(sc);
}
static void scratch_init(void) { scratch_ready = pthread_key_create(&scratch_key, scratch_release) == 0; }
/* `bytes` of work memory for `slot`, or NULL; *owned set when the caller must free it. */
static void* scratch_get(int slot, size_t bytes, int* owned) {
    *owned = 0;
    pthread_once(&scratch_once, scratch_init);
    struct scratch* sc = scratch_ready ? pthread_getspecific(scratch_key) : NULL;
    if (scratch_ready && !sc && (sc = calloc(1, sizeof *sc)) != NULL && pthread_setspecific(scratch_key, sc)) {
        free(sc);
        sc = NULL;
    }
    if (!sc || bytes > (size_t)SCRATCH_KEEP) {
        *owned = 1;
        return malloc(bytes);
    }
    if (sc->n[slot] < bytes) {
        free(sc->p[slot]);
        sc->p[slot] = malloc(bytes);
        sc->n[slot] = sc->p[slot] ? bytes : 0;
    }
    return sc->p[slot];
}
static void scratch_put(void* p, int owned) { if (owned) free(p); }

/* A product's input made ready by its parts together, when `shared`: each part does its share, then waits
   for the others (the parts of a job run at once, one per thread). Done by the caller alone, it left the
   other thread idle for 4-7% of a 16-row pass (Zen 4, two threads). */
struct shared_input { int shared; atomic_int done; };
#define SHARED_INPUT_ROWS 4 /* blocks of at least this many rows share it */
static void shared_input_done(struct shared_input* in, int parts) {
    atomic_fetch_add_explicit(&in->done, 1, memory_order_release);
    while (atomic_load_explicit(&in->done, memory_order_acquire) < parts) cpu_relax();
}

/* The input of a float product: x's rows widened where a norm or the tiles need them (xf), their norms'
   scales, and (AVX-512) the rows packed by row blocks for the tiles (xs). */
struct linear_input {
    const void* x; long ldx, M, K; int dtype; float norm_eps;
    float *xf, *scale, *xs;
    struct shared_input share;
};
/* Part `part` of `parts` of the input: its share of the rows widened and normed, and of the inputs packed. */
static void prepare_input(struct linear_input* in, int part, int parts) {
    long M = in->M, K = in->K, m0 = M * part / parts, m1 = M * (part + 1) / parts;
#if defined(SD_WIDE)
    int widened = in->norm_eps >= 0; /* the tiles read the packed rows */
#else
    int widened = 1;
#endif
    for (long m = m0; m < m1; m++) {
        if (widened) widen((const char*)in->x + m * in->ldx * esize(in->dtype), K, in->dtype, in->xf + m * K);
        if (in->norm_eps >= 0) in->scale[m] = inverse_rms(in->xf + m * K, K, in->norm_eps);
    }
#if defined(SD_WIDE)
#if defined(SD_BF16_DOT)
    long K2 = (K + 1) / 2;
    if (bf16_dot(in->dtype)) {
        pack_pairs((const uint16_t*)in->x, in->ldx, M, K, K2 * part / parts, K2 * (part + 1) / parts, (uint32_t*)in->xs);
        return;
    }
#endif
    pack_rows(in->x, in->ldx, in->dtype, M, K, K * part / parts, K * (part + 1) / parts, in->xs);
#endif
}

struct linear_job {
    const void* wp; long M, K, N; const float* xs;  /* xs: x widened, in the layout linear_panels reads */
    struct linear_out out;
    int layout;  /* 0, HALVES (bfloat16 panels with interleaved halves) or PAIRS */
    struct linear_input* in;
};
static void linear_part(void* arg, int part, int parts) {
    struct linear_job* j = arg;
    if (j->in->share.shared) {
        prepare_input(j->in, part, parts);
        shared_input_done(&j->in->share, parts);
    }
    long panels = (j->N + NR - 1) / NR;
    long p0 = panels * part / parts, p1 = panels * (part + 1) / parts;
    if (p0 < p1) linear_panels(j->M, j->K, j->wp, &j->out, j->xs, p0, p1, j->layout);
}

/* Work below this many multiply-adds runs on the calling thread only: waking a worker costs tens
 * of microseconds, and torch's own threads compete for the same cores between kernel calls. A
 * worker spins a while after each job, so within a forward pass the next job finds it awake: from
 * about 2^18 multiply-adds (SmolLM2's 576 x 576 product of one bfloat16 row, 0.6 ms for its 30
 * layers on one Zen 4 core) two threads finish sooner than one (measured: 0.51 ms). */
static long parallel_threshold = 1L << 18;
/* Split a product whose weights are at least this many bytes (quantized; float ones twice as many):
 * below that they come from the caches (a small model), where a second thread costs more than it saves.
 * Measured on a Zen 3 at two threads: SmolLM2-135M's Q4_1 and Q8_0 passes of 1-2 tokens 0.86-0.95x the
 * time at 128 KiB than at 512 KiB (its 576 x 576 and 576 x 960 products split as well); 32-64 KiB no
 * faster. */
static long parallel_bytes = 1L << 17;
void sd_set_parallel_threshold(long fmas) { parallel_threshold = fmas; }
long sd_parallel_threshold(void) { return parallel_threshold; }
void sd_set_parallel_bytes(long bytes) { parallel_bytes = bytes; }

/* Parts for a product over `panels` panels: every thread when there are enough multiply-adds (in
   float32 FMAs' worth), or enough weight bytes that even one row's pass is a stream from memory, which
   two cores read faster than one; one otherwise. */
static int product_parts(long fmas, long weight_bytes, long split_bytes, long panels) {
    int parts = fmas >= parallel_threshold || weight_bytes >= split_bytes ? active_threads : 1;
    return parts > panels ? (int)panels : parts;  /* at most active_threads: run_parallel runs them all at once */
}

/* ---- AMX: bfloat16 products on the tile unit -------------------------------------------------
 * Where the CPU has AMX-BF16 (and the OS grants the tile state), a bfloat16 product whose input size
 * K is a multiple of 32 runs on tiles: its weights packed at load as pairs, [panels][K/2][16][2] (the
 * pair (k, k + 1) of a column in one 32-bit word, the layout tdpbf16ps reads), its input rows read as
 * they are. A tile of up to 16 rows x 16 columns keeps one float32 chain per output; tdpbf16ps adds
 * 32 inputs' products to each chain per step, steps in input order. The unit computes every row of a
 * tile by the same circuit, so a row's result depends on its own inputs and the weights only: the
 * same bits alone, in a block of 17, in a tree or beside other rows (tested for 1-64 rows and both
 * thread counts). They are the tile unit's own bits: not those of the AVX512-BF16 pair chains or of the
 * FMA chains (measured: 39-43 of 64 outputs differ in the last place from either sequential order), and
 * which path a matrix takes depends on K and the machine only, never on the rows of a call.
 * SPECDEC_AMX=0 in the environment keeps the AVX-512 code (to compare the two). */
#if defined(SD_WIDE) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define SD_AMX 1
static int amx_state = -1;
static int amx_usable(void) {
    if (amx_state < 0) {
        const char* env = getenv("SPECDEC_AMX");
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux hands out the tile state
           per process on request. */
        amx_state = !(env && env[0] == '0') && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx_state;
}
static int amx_pairs(long K, int dtype) { return dtype == BF16 && K % 32 == 0 && amx_usable(); }
struct amx_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
/* Tiles 0-7 shaped rows[t] x colsb[t] bytes, on this thread (tile configuration is per thread). */
static void amx_load_config(const int rows[8], const int colsb[8]) {
    struct amx_config c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = (uint8_t)rows[t]; c.colsb[t] = (uint16_t)colsb[t]; }
    __asm__ volatile("" : : "r"(&c) : "memory");  /* the stores above happen before the load */
    _tile_loadconfig(&c);
}
static const int amx_wide[8] = {64, 64, 64, 64, 64, 64, 64, 64};
/* Tiles 0-3: R rows x 16 float32 chains (four panels); 4: R rows x 32 bfloat16 inputs; 5-7: 16 rows of
   16 weight pairs. */
static void amx_configure(int R) {
    const int rows[8] = {R, R, R, R, R, 16, 16, 16};
    amx_load_config(rows, amx_wide);
}
#define AMX_PANEL(B, p)                                                                            \
    {                                                                                              \
        _tile_loadd(B, w + ((p) * K2 + kc * 16) * 32, 64);                                         \
        _tile_dpbf16ps(p, 4, B);                                                                   \
    }
/* Rows [x, x + R rows) (row stride ld bytes) times P <= 4 panels from w: chains into acc [R][8 * NR]. */
static void amx_tile(const uint16_t* x, long ld, long K, const uint16_t* w, int P, float* acc) {
    long K2 = K / 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (long kc = 0; kc < K / 32; kc++) {
        _tile_loadd(4, x + kc * 32, ld);
        AMX_PANEL(5, 0)
        if (P > 1) AMX_PANEL(6, 1)
        if (P > 2) AMX_PANEL(7, 2)
        if (P > 3) AMX_PANEL(5, 3)
    }
    long lda = 8 * NR * sizeof(float);
    _tile_stored(0, acc, lda);
    if (P > 1) _tile_stored(1, acc + NR, lda);
    if (P > 2) _tile_stored(2, acc + 2 * NR, lda);
    if (P > 3) _tile_stored(3, acc + 3 * NR, lda);
}
/* Two row blocks at once (R0 and R1 rows), P <= 2 panels: each weight tile meets both blocks' inputs, so a
   block of 17-32 rows reads the weights once. Tiles 0-1: block 0's chains, 2-3: block 1's; 4, 5: their
   inputs; 6, 7: the panels' weights. Each chain takes the same steps as in amx_tile: the same bits. */
static void amx_configure2(int R0, int R1) {
    const int rows[8] = {R0, R0, R1, R1, R0, R1, 16, 16};
    amx_load_config(rows, amx_wide);
}
static void amx_tile2(const uint16_t* x0, const uint16_t* x1, long ld, long K, const uint16_t* w, int P,
                      float* acc0, float* acc1) {
    long K2 = K / 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (long kc = 0; kc < K / 32; kc++) {
        _tile_loadd(4, x0 + kc * 32, ld);
        _tile_loadd(5, x1 + kc * 32, ld);
        _tile_loadd(6, w + kc * 16 * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (P > 1) {
            _tile_loadd(7, w + (K2 + kc * 16) * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    long lda = 8 * NR * sizeof(float);
    _tile_stored(0, acc0, lda);
    _tile_stored(2, acc1, lda);
    if (P > 1) { _tile_stored(1, acc0 + NR, lda); _tile_stored(3, acc1 + NR, lda); }
}
struct amx_job {
    const uint16_t* x; long ld; const uint16_t* wp; long M, K, N;
    struct linear_out out;
};
static void amx_part(void* arg, int part, int parts) {
    struct amx_job* j = arg;
    long panels = (j->N + NR - 1) / NR, p0 = panels * part / parts, p1 = panels * (part + 1) / parts;
    long pstride = j->K * NR, blocks = wide_blocks(j->M);
    float acc[WIDE_ROWS * 8 * NR], acc1[WIDE_ROWS * 8 * NR];
    /* As linear_panels: panel groups of about 256 KiB outer (they stay in L2 while every row block
       uses them), row blocks inner, two at a time; one or two blocks take their whole range at once. */
    long group = blocks <= 2 ? p1 - p0 : 262144 / (pstride * 2);
    if (group < 4) group = 4;
    int configured = 0;  /* the rows the tiles are configured for: R, or 100 R0 + R1 for two blocks */
    for (long p = p0; p < p1; p += group) {
        long end = p + group < p1 ? p + group : p1;
        for (long b = 0; b < blocks; b++) {
            long m0 = row_start(j->M, blocks, b), m1 = row_start(j->M, blocks, b + 1);
            int R = (int)(m1 - m0);
            if (b + 1 < blocks) {  /* blocks b and b + 1 together */
                int R1 = (int)(row_start(j->M, blocks, b + 2) - m1);
                if (100 * R + R1 != configured) { amx_configure2(R, R1); configured = 100 * R + R1; }
                for (long q = p; q < end; q += 2) {
                    int P = end - q < 2 ? (int)(end - q) : 2;
                    amx_tile2(j->x + m0 * (j->ld / 2), j->x + m1 * (j->ld / 2), j->ld, j->K, j->wp + q * pstride, P,
                              acc, acc1);
                    finish_tile(&j->out, acc, 8 * NR, m0, R, q * NR, P * NR);
                    finish_tile(&j->out, acc1, 8 * NR, m1, R1, q * NR, P * NR);
                }
                b++;
                continue;
            }
            if (R != configured) { amx_configure(R); configured = R; }
            for (long q = p; q < end; q += 4) {
                int P = end - q < 4 ? (int)(end - q) : 4;
                amx_tile(j->x + m0 * (j->ld / 2), j->ld, j->K, j->wp + q * pstride, P, acc);
                finish_tile(&j->out, acc, 8 * NR, m0, R, q * NR, P * NR);
            }
        }
    }
    if (configured) _tile_release();
}
static int linear_amx(const void* x, long M, long K, long ldx, const void* wp, long N, const void* bias,
                      const void* residual, long ldr, void* y, long ldy, float norm_eps, int dtype) {
    int owned = 0;
    float *scale = NULL, *work = NULL;
    if (norm_eps >= 0) {  /* the norm's 1 / rms per row, applied to the finished chains */
        work = scratch_get(SCRATCH_PRODUCT, sizeof(float) * (size_t)(K + M), &owned);
        if (!work) return 1;
        scale = work + K;
        for (long m = 0; m < M; m++) {
            widen((const uint16_t*)x + m * ldx, K, dtype, work);
            scale[m] = inverse_rms(work, K, norm_eps);
        }
    }
    struct amx_job job = {x, ldx * 2, wp, M, K, N, {bias, residual, y, N, ldr, ldy, dtype, scale}};
    long panels = (N + NR - 1) / NR;
    run_parallel(amx_part, &job, product_parts(M * K * N, panels * NR * K * 2, 2 * parallel_bytes, panels));
    if (work) scratch_put(work, owned);
    return 0;
}
#endif
/* 1 where bfloat16 weights with input size K are packed as pairs, [panels][K/2][16][2]: for the tile
   unit, or for AVX512-BF16's pair products when K is even. */
int sd_bf16_pairs(long K) {
#if defined(SD_AMX)
    if (amx_pairs(K, BF16)) return 1;
#endif
    return sd_bf16_dot() && K % 2 == 0;
}
/* 1 where a bfloat16 product with input size K runs on the tile unit (its weights packed as pairs). */
int sd_amx_pairs(long K) {
#if defined(SD_AMX)
    return amx_pairs(K, BF16);
#else
    (void)K;
    return 0;
#endif
}

int sd_linear(const void* x, long M, long K, long ldx, const void* wp, long N, const void* bias,
              const void* residual, long ldr, void* y, long ldy, float norm_eps, int dtype, int layout) {
    if (layout && (dtype != BF16 || (layout == HALVES ? sd_bf16_halves() < 0 : layout != PAIRS || !sd_bf16_pairs(K))))
        return 3;
#if defined(SD_AMX)
    if (layout == PAIRS && amx_pairs(K, dtype)) return linear_amx(x, M, K, ldx, wp, N, bias, residual, ldr, y, ldy, norm_eps, dtype);
#endif
#if defined(SD_WIDE)
    size_t copies = 2;  /* row-major for the norm, then packed by row blocks */
#else
    size_t copies = 1;
#endif
    int owned;
    float* xf = scratch_get(SCRATCH_PRODUCT, sizeof(float) * (size_t)(copies * M * K + M + 1), &owned);
    if (!xf) return 1;
    float *scale = norm_eps >= 0 ? xf + copies * M * K : NULL, *xs = copies == 2 ? xf + M * K : xf;
    long panels = (N + NR - 1) / NR;
    int parts = product_parts(M * K * N, panels * NR * K * (long)esize(dtype), 2 * parallel_bytes, panels);
    struct linear_input in = {x, ldx, M, K, dtype, norm_eps, xf, scale, xs, {parts > 1 && M >= SHARED_INPUT_ROWS, 0}};
    if (!in.share.shared) prepare_input(&in, 0, 1);
    struct linear_job job = {wp, M, K, N, xs, {bias, residual, y, N, ldr, ldy, dtype, scale}, layout, &in};
    run_parallel(linear_part, &job, parts);
    scratch_put(xf, owned);
    return 0;
}

/* ---- quantized weights: GGUF's Q8_0, Q4_0 and Q4_1, run with int8 activations ----------------
 * A weight block is 32 consecutive inputs of one output column: codes c (Q8_0: c = q + 128 of the
 * int8 q; Q4_0 and Q4_1: the 4-bit q) and float16 scales, w = d (c - z) (+ m for Q4_1), z = 128, 8, 0.
 * An input row is quantized per block of 32 (after the norm's weight, when given, multiplies it):
 * s = max |x| / 127, a = nearest(x / s) in [-127, 127] (llama.cpp's Q8 activations, the scale in
 * float32), A = the block's sum of a. Then each block adds to the column's chain
 *
 *     acc = fma(d * s, (float)(sum c a - z A), acc)       (Q4_1 also: acc = fma(m, s * (float)A, acc))
 *
 * in block order, in float32. The integer sum is exact in any order and any width, so the vector
 * paths (AVX-512 VNNI, AVX2) and the portable loop give the same bits, and a row's result does not
 * depend on the other rows of the call.
 *
 * Packed (kernels.py, QMatrix): panels of 16 columns, each [blocks][...] contiguous. One block of a
 * panel: d[16] float16, (Q4_1: m[16] float16), then the codes in 4-input groups, 16 columns x 4
 * bytes per group, so one 32-bit broadcast of 4 activations meets 16 columns: Q8_0: 8 groups (512
 * bytes); Q4: 256 bytes, byte (v, column j, t) holding input 4v + t in its low nibble and 16 + 4v + t
 * in its high one. */
#define Q8_0 3
#define Q4_0 4
#define Q4_1 5
static long qblock_bytes(int wtype) { return wtype == Q8_0 ? 32 + 512 : wtype == Q4_1 ? 64 + 256 : 32 + 256; }
static int qzero(int wtype) { return wtype == Q8_0 ? 128 : wtype == Q4_0 ? 8 : 0; }
long sd_qblock_bytes(int wtype) { return wtype == Q8_0 || wtype == Q4_0 || wtype == Q4_1 ? qblock_bytes(wtype) : 0; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000 | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f; memcpy(&f, &u, 4); return f;
}

/* One row: x [K] (times gain) -> a [K] int8, s [K/32] float, A [K/32] int32 and sA [K/32] = s * (float)A.
 * The vector versions do the same IEEE operations (a product, |.|, max, a division, a product rounded
 * to nearest even), so every build quantizes a row to the same integers. */
static void quantize_row(const float* x, const float* gain, long K, int8_t* a, float* s, int32_t* A, float* sA) {
    for (long b = 0; b < K / 32; b++) {
        float v[32], amax = 0.f;
#if defined(__AVX512F__)
        __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
        if (gain) {
            lo = _mm512_mul_ps(lo, _mm512_loadu_ps(gain + b * 32));
            hi = _mm512_mul_ps(hi, _mm512_loadu_ps(gain + b * 32 + 16));
        }
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i*)(a + b * 32), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i*)(a + b * 32 + 16), _mm512_cvtepi32_epi8(qhi));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        (void)v;
#else
        for (int i = 0; i < 32; i++) {
            v[i] = gain ? x[b * 32 + i] * gain[b * 32 + i] : x[b * 32 + i];
            float m = fabsf(v[i]);
            if (m > amax) amax = m;
        }
        float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)nearbyintf(v[i] * id);
            a[b * 32 + i] = (int8_t)q;
            sum += q;
        }
#endif
        s[b] = d;
        A[b] = sum;
        sA[b] = d * (float)sum;
    }
}

struct qrows { const int8_t* a; const float* s; const int32_t* A; const float* sA; long K; };

/* Integer sums of one block: out[j] = sum over the block's 32 inputs of c[j] a, columns j < 16. */
static inline void qsums_portable(const uint8_t* codes, int wtype, const int8_t* a, int32_t* out) {
    for (int j = 0; j < 16; j++) out[j] = 0;
    if (wtype == Q8_0) {
        for (int g = 0; g < 8; g++)
            for (int j = 0; j < 16; j++)
                for (int t = 0; t < 4; t++) out[j] += (int32_t)codes[g * 64 + j * 4 + t] * a[g * 4 + t];
    } else {
        for (int v = 0; v < 4; v++)
            for (int j = 0; j < 16; j++)
                for (int t = 0; t < 4; t++) {
                    uint8_t byte = codes[v * 64 + j * 4 + t];
                    out[j] += (int32_t)(byte & 15) * a[v * 4 + t] + (int32_t)(byte >> 4) * a[16 + v * 4 + t];
                }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SD_QVECTOR "avx512-vnni"
#define QROWS 16
#define QPREFETCH_AT (P * pbytes) /* the same block of the next tile's panels, into L2 */
#define QHINT _MM_HINT_T1
/* R rows x P panels, every block: each panel's block is unpacked once and meets each row. Inlined
 * into one function per (R, P, type), so the row and panel loops unroll and the type's branches go. */
static inline __attribute__((always_inline)) void qtile_body(const struct qrows* x, long m0, const uint8_t* panel,
                                                             long pbytes, int wtype, float* acc_out, const int R,
                                                             const int P) {
    __m512 acc[QROWS][2];
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    long nb = x->K / 32, bytes = qblock_bytes(wtype);
    int z = qzero(wtype), q4 = wtype != Q8_0, has_m = wtype == Q4_1;
    for (long b = 0; b < nb; b++) {
        __m512 d[2], m[2];
        __m512i w[2][8];
        for (int p = 0; p < P; p++) {
            const uint8_t* blk = panel + p * pbytes + b * bytes;
            /* The panels stream from memory: ask for the next tile's block while this one is used. */
            for (long line = 0; line < bytes; line += 64) _mm_prefetch((const char*)blk + QPREFETCH_AT + line, QHINT);
            d[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
            m[p] = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))) : d[p];
            const uint8_t* codes = blk + (has_m ? 64 : 32);
            if (q4) {
                __m512i lo = _mm512_set1_epi8(15);
                for (int v = 0; v < 4; v++) {
                    __m512i raw = _mm512_loadu_si512((const void*)(codes + v * 64));
                    w[p][v] = _mm512_and_si512(raw, lo);
                    w[p][4 + v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo);
                }
            } else {
                for (int g = 0; g < 8; g++) w[p][g] = _mm512_loadu_si512((const void*)(codes + g * 64));
            }
        }
        for (int r = 0; r < R; r++) {
            const int32_t* quad = (const int32_t*)(x->a + (m0 + r) * x->K + b * 32);
            long at = (m0 + r) * nb + b;
            __m512 s = _mm512_set1_ps(x->s[at]);
            __m512i zA = _mm512_set1_epi32(-z * x->A[at]);  /* the codes' zero, taken off before any sum */
            __m512 sA = _mm512_set1_ps(x->sA[at]);
            for (int p = 0; p < P; p++) {
                __m512i s0 = zA, s1 = _mm512_setzero_si512();
                for (int g = 0; g < 8; g += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, w[p][g], _mm512_set1_epi32(quad[g]));
                    s1 = _mm512_dpbusd_epi32(s1, w[p][g + 1], _mm512_set1_epi32(quad[g + 1]));
                }
                __m512i sum = _mm512_add_epi32(s0, s1);  /* integers: the same sum in any order */
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(d[p], s), _mm512_cvtepi32_ps(sum), acc[r][p]);
                if (has_m) acc[r][p] = _mm512_fmadd_ps(m[p], sA, acc[r][p]);
            }
        }
    }
    for (int r = 0; r < R; r++) for (int p = 0; p < P; p++) _mm512_storeu_ps(acc_out + r * 2 * NR + p * NR, acc[r][p]);
}
#define QPANELS(R) ((R) <= 4 ? 2 : 1)
#define QTILE_TYPE(R, NAME, TYPE)                                                                  \
static void qtile_##NAME##_##R##_1(const struct qrows* x, long m0, const uint8_t* panel, long pbytes, float* acc) { \
    qtile_body(x, m0, panel, pbytes, TYPE, acc, R, 1);                                             \
}                                                                                                  \
static void qtile_##NAME##_##R##_2(const struct qrows* x, long m0, const uint8_t* panel, long pbytes, float* acc) { \
    qtile_body(x, m0, panel, pbytes, TYPE, acc, R, 2);                                             \
}
#define QTILE(R) QTILE_TYPE(R, q8_0, Q8_0) QTILE_TYPE(R, q4_0, Q4_0) QTILE_TYPE(R, q4_1, Q4_1)
#define QENTRY(R) {{qtile_q8_0_##R##_1, qtile_q4_0_##R##_1, qtile_q4_1_##R##_1},                        \
                   {qtile_q8_0_##R##_2, qtile_q4_0_##R##_2, qtile_q4_1_##R##_2}},
#define QROWS_Q4 8 /* the 4-bit types unpack into more registers: at most 8 rows per block */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SD_QVECTOR "avx2"
#define QROWS 6
#define QROWS_Q4 6
#define QAHEAD 4        /* blocks ahead that a tile asks for */
/* Eight lanes: a block's 16 columns are two halves of 8. Products in int16 pairs by vpmaddubsw: the
 * 4-bit types' eight pair sums of a half add up in int16 (|c a| <= 15 * 127, sixteen products per lane
 * < 2^15) before one vpmaddwd; Q8_0 as |q| times a with q's sign (q = c - 128; |q| <= 128, |a| <= 127,
 * a pair fits int16), each pair sum widened at once. Q8_0's sums are then sum q a, which is exactly
 * sum c a - 128 A: the same integer the other builds form, so the same bits after it.
 * Each 64-byte piece of a block (both halves) is unpacked and meets every row of the tile (up to 6) at
 * once, in registers, each broadcast of a row's four inputs serving both halves, and the block QAHEAD
 * blocks on is asked for meanwhile. More rows go in blocks of up to 6 that share the panels from L2.
 * The empty asm after each row's update keeps that row's running sums in registers: integer adds are
 * exact in any order, so the compiler is free to re-associate a block's 16 products per row into a tree,
 * and did (gcc 12), storing every product to the stack first (measured on a Zen 4 core without its
 * AVX-512, the real model's quantized products at two threads: 2-5 rows 0.78-0.91x the time; blocks of
 * up to 6 rows against the 7-16-row tiles of 8-lane halves that this replaced, 7-16 rows 0.77-0.92x). */
static inline __attribute__((always_inline)) __m256 qblock_add(__m256 acc, __m256i sum, __m256 d, __m256 m,
                                                                const struct qrows* x, long at, int z, int has_m) {
    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(z * x->A[at]));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x->s[at])), _mm256_cvtepi32_ps(sum), acc);
    return has_m ? _mm256_fmadd_ps(m, _mm256_set1_ps(x->sA[at]), acc) : acc;
}
static inline __attribute__((always_inline)) void qtile_body(const struct qrows* x, long m0, const uint8_t* panel,
                                                             int wtype, float* acc_out, const int R) {
    __m256 acc[QROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    long nb = x->K / 32, bytes = qblock_bytes(wtype);
    int z = wtype == Q8_0 ? 0 : qzero(wtype), q4 = wtype != Q8_0, has_m = wtype == Q4_1;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    for (long b = 0; b < nb; b++) {
        const uint8_t* blk = panel + b * bytes;
        const uint8_t* codes = blk + (has_m ? 64 : 32);
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * h)));
            m[h] = has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * h))) : d[h];
        }
        for (long line = 0; line < bytes; line += 64)
            _mm_prefetch((const char*)blk + QAHEAD * bytes + line, _MM_HINT_T0);
        const int32_t* quad[QROWS];
        for (int r = 0; r < R; r++) quad[r] = (const int32_t*)(x->a + (m0 + r) * x->K + b * 32);
        __m256i sum[QROWS][2];
        for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
        for (int v = 0; v < (q4 ? 4 : 8); v++) {  /* both halves of a piece meet each row's broadcast */
            __m256i raw0 = _mm256_loadu_si256((const __m256i*)(codes + v * 64));
            __m256i raw1 = _mm256_loadu_si256((const __m256i*)(codes + v * 64 + 32));
            if (q4) {
                __m256i lo0 = _mm256_and_si256(raw0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
                __m256i lo1 = _mm256_and_si256(raw1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
                for (int r = 0; r < R; r++) {  /* int16 pair sums, widened after v = 3 */
                    __m256i alo = _mm256_set1_epi32(quad[r][v]), ahi = _mm256_set1_epi32(quad[r][4 + v]);
                    sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, alo),
                                                                             _mm256_maddubs_epi16(hi0, ahi)));
                    sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, alo),
                                                                             _mm256_maddubs_epi16(hi1, ahi)));
                    __asm__("" : "+x"(sum[r][0]), "+x"(sum[r][1]));
                }
            } else {
                __m256i q0 = _mm256_xor_si256(raw0, flip), mag0 = _mm256_abs_epi8(q0);
                __m256i q1 = _mm256_xor_si256(raw1, flip), mag1 = _mm256_abs_epi8(q1);
                for (int r = 0; r < R; r++) {
                    __m256i a = _mm256_set1_epi32(quad[r][v]);
                    sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(mag0, _mm256_sign_epi8(a, q0)), ones));
                    sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(mag1, _mm256_sign_epi8(a, q1)), ones));
                    __asm__("" : "+x"(sum[r][0]), "+x"(sum[r][1]));
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                acc[r][h] = qblock_add(acc[r][h], q4 ? _mm256_madd_epi16(sum[r][h], ones) : sum[r][h], d[h], m[h],
                                       x, (m0 + r) * nb + b, z, has_m);
    }
    for (int r = 0; r < R; r++) for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc_out + r * 2 * NR + 8 * h, acc[r][h]);
}
#define QTILE_TYPE(R, NAME, TYPE)                                                                  \
static void qtile_##NAME##_##R##_1(const struct qrows* x, long m0, const uint8_t* panel, long pbytes, float* acc) { \
    (void)pbytes; qtile_body(x, m0, panel, TYPE, acc, R);                                          \
}
#define QTILE(R) QTILE_TYPE(R, q8_0, Q8_0) QTILE_TYPE(R, q4_0, Q4_0) QTILE_TYPE(R, q4_1, Q4_1)
#define QPANELS(R) 1
#define QENTRY(R) {{qtile_q8_0_##R##_1, qtile_q4_0_##R##_1, qtile_q4_1_##R##_1}, {0, 0, 0}},
#else
#define SD_QVECTOR "portable"
#define QROWS 4
#define QROWS_Q4 4
#define QPANELS(R) 1
#define QTILE_TYPE(R, NAME, WTYPE)                                                                 \
static void qtile_##NAME##_##R##_1(const struct qrows* x, long m0, const uint8_t* panel, long pbytes,     \
                                   float* acc_out) {                                               \
    const int wtype = WTYPE; (void)pbytes;                                                         \
    float acc[R][16];                                                                              \
    memset(acc, 0, sizeof(acc));                                                                   \
    long nb = x->K / 32, bytes = qblock_bytes(wtype);                                              \
    int z = qzero(wtype), has_m = wtype == Q4_1;                                                   \
    for (long b = 0; b < nb; b++) {                                                                \
        const uint8_t* blk = panel + b * bytes;                                                    \
        float d[16], m[16];                                                                        \
        for (int j = 0; j < 16; j++) {                                                             \
            d[j] = half_to_float((uint16_t)(blk[2 * j] | blk[2 * j + 1] << 8));                    \
            m[j] = has_m ? half_to_float((uint16_t)(blk[32 + 2 * j] | blk[33 + 2 * j] << 8)) : 0.f; \
        }                                                                                          \
        const uint8_t* codes = blk + (has_m ? 64 : 32);                                            \
        for (int r = 0; r < R; r++) {                                                              \
            long at = (m0 + r) * nb + b;                                                           \
            int32_t sums[16];                                                                      \
            qsums_portable(codes, wtype, x->a + (m0 + r) * x->K + b * 32, sums);                   \
            float s = x->s[at], sA = x->sA[at];                                                    \
            for (int j = 0; j < 16; j++) {                                                         \
                acc[r][j] = fmaf(d[j] * s, (float)(sums[j] - z * x->A[at]), acc[r][j]);            \
                if (has_m) acc[r][j] = fmaf(m[j], sA, acc[r][j]);                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++) memcpy(acc_out + r * 2 * NR, acc[r], sizeof(acc[r]));              \
}
#define QTILE(R) QTILE_TYPE(R, q8_0, Q8_0) QTILE_TYPE(R, q4_0, Q4_0) QTILE_TYPE(R, q4_1, Q4_1)
#define QENTRY(R) {{qtile_q8_0_##R##_1, qtile_q4_0_##R##_1, qtile_q4_1_##R##_1}, {0, 0, 0}},
#endif
typedef void (*qtile_fn)(const struct qrows*, long, const uint8_t*, long, float*);
QTILE(1) QTILE(2) QTILE(3) QTILE(4)
#if QROWS >= 6
QTILE(5) QTILE(6)
#endif
#if QROWS == 16
QTILE(7) QTILE(8) QTILE(9) QTILE(10) QTILE(11) QTILE(12) QTILE(13) QTILE(14) QTILE(15) QTILE(16)
static const qtile_fn qtiles[17][2][3] = {{{0}}, QENTRY(1) QENTRY(2) QENTRY(3) QENTRY(4) QENTRY(5) QENTRY(6)
    QENTRY(7) QENTRY(8) QENTRY(9) QENTRY(10) QENTRY(11) QENTRY(12) QENTRY(13) QENTRY(14) QENTRY(15) QENTRY(16)};
#elif QROWS == 6
static const qtile_fn qtiles[7][2][3] = {{{0}}, QENTRY(1) QENTRY(2) QENTRY(3) QENTRY(4) QENTRY(5) QENTRY(6)};
#else
static const qtile_fn qtiles[5][2][3] = {{{0}}, QENTRY(1) QENTRY(2) QENTRY(3) QENTRY(4)};
#endif
const char* sd_qvector(void) { return SD_QVECTOR; }

/* The input of a quantized product: rows of x (dtype, row stride ldx) widened where needed (xf), normed
   (scale) and quantized into a, s, A, sA (struct qrows); by the parts together when shared. */
struct qinput {
    const void* x; long ldx; int dtype; const float* gain; float norm_eps;
    float* xf; float* scale; int8_t* a; float* s; int32_t* A; float* sA;
    struct shared_input share;
};
struct qlinear_job { const uint8_t* wp; int wtype; long M, N; struct qrows x; struct linear_out out; struct qinput* in; };
static void quantize_rows(struct qinput* in, long K, long m0, long m1) {
    long nb = K / 32;
    for (long m = m0; m < m1; m++) {
        const float* row = (const float*)in->x + m * in->ldx;
        if (in->dtype != F32) {
            widen((const char*)in->x + m * in->ldx * esize(in->dtype), K, in->dtype, in->xf + m * K);
            row = in->xf + m * K;
        }
        if (in->norm_eps >= 0) in->scale[m] = inverse_rms(row, K, in->norm_eps);
        quantize_row(row, in->gain, K, in->a + m * K, in->s + m * nb, in->A + m * nb, in->sA + m * nb);
    }
}
/* A part's share of the rows when the parts quantize them together, then its wait for the others. */
static void quantize_share(const struct qlinear_job* j, int part, int parts) {
    if (!j->in->share.shared) return;
    quantize_rows(j->in, j->x.K, j->M * part / parts, j->M * (part + 1) / parts);
    shared_input_done(&j->in->share, parts);
}
/* Rows [m0, m0 + M) x panels [p, end) by the vector tiles: row blocks of up to QROWS (the 4-bit types
   unpack into more registers, so at most QROWS_Q4 there). acc: room for QROWS x 2 NR floats. */
static void qlinear_rows(const struct qlinear_job* j, long m0, long M, long p, long end, long pbytes, float* acc) {
    long rows = j->wtype == Q8_0 ? QROWS : QROWS_Q4;
    long blocks = (M + rows - 1) / rows;
    for (long b = 0; b < blocks; b++) {
        long r0 = m0 + M * b / blocks;
        int R = (int)(m0 + M * (b + 1) / blocks - r0);
        for (long q = p; q < end;) {
            int P = QPANELS(R) < end - q ? QPANELS(R) : (int)(end - q);
            qtiles[R][P - 1][j->wtype - Q8_0](&j->x, r0, j->wp + q * pbytes, pbytes, acc);
            finish_tile(&j->out, acc, 2 * NR, r0, R, q * NR, P * NR);
            q += P;
        }
    }
}
static void qlinear_part(void* arg, int part, int parts) {
    struct qlinear_job* j = arg;
    quantize_share(j, part, parts);
    long panels = (j->N + NR - 1) / NR, pbytes = (j->x.K / 32) * qblock_bytes(j->wtype);
    long p0 = panels * part / parts, p1 = panels * (part + 1) / parts;
    float acc[QROWS * 2 * NR];
    /* Groups of 8 panels (a few KiB each) stay in L2 while every row block uses them. */
    for (long p = p0; p < p1; p += 8) qlinear_rows(j, 0, j->M, p, p + 8 < p1 ? p + 8 : p1, pbytes, acc);
}

#if defined(SD_AMX) && defined(__AMX_INT8__)
/* ---- AMX-INT8: the quantized products' integer sums on the tile unit ---------------------------
 * The same arithmetic as above, the block's integer sums formed by tdpbsud (signed activations times
 * unsigned codes, int32 sums, exact in any order) for up to 16 rows x 4 panels at once; the sums go
 * through memory into the same float operations per block, in block order, as the vector code. So
 * the result is the same bits as the AVX-512 VNNI, AVX2 and portable code (tested side by side). A
 * panel's block is already the unit's weight layout (8 groups of 16 columns x 4 inputs: Q8_0's codes
 * as they are; Q4's nibbles unpacked into 512 bytes first). Tiles 0-3: R rows x 16 int32 sums; 4: R
 * rows x 32 activations; 5-7: 8 groups of 16 columns x 4 codes. */
#define SD_AMX_Q 1
static void amx_configure_q(int R) {
    const int rows[8] = {R, R, R, R, R, 8, 8, 8}, colsb[8] = {64, 64, 64, 64, 32, 64, 64, 64};
    amx_load_config(rows, colsb);
}
/* A Q4 block's 256 bytes of nibbles -> 512 bytes of codes, the unit's weight layout. */
static inline void amx_unpack(const uint8_t* blk, int wtype, uint8_t* unpacked) {
    const uint8_t* codes = blk + (wtype == Q4_1 ? 64 : 32);
    const __m512i low = _mm512_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m512i raw = _mm512_loadu_si512((const void*)(codes + v * 64));
        _mm512_storeu_si512((void*)(unpacked + v * 64), _mm512_and_si512(raw, low));
        _mm512_storeu_si512((void*)(unpacked + (4 + v) * 64), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
}
#define AMX_QPANEL(T, p)                                                                           \
    if (P > (p)) {                                                                                 \
        const uint8_t* blk = panel + (p) * pbytes + b * bytes;                                     \
        _mm_prefetch((const char*)blk + 4 * pbytes, _MM_HINT_T1);                                  \
        _tile_loadd(T, q4 ? unpacked[b & 1][p] : blk + 32, 64);                                    \
        _tile_zero(p);                                                                             \
        _tile_dpbsud(p, 4, T);                                                                     \
    }
/* Rows [m0, m0 + R) x panels [panel, panel + P), P <= 4: the finished chains into acc [R][4 * NR].
 * The 4-bit codes are unpacked one block ahead (two buffers), so the tile unit never loads what the
 * vector stores have only just written. */
static void amx_qtile(const struct qrows* x, long m0, int R, const uint8_t* panel, long pbytes, int P, int wtype,
                      float* acc) {
    long nb = x->K / 32, bytes = qblock_bytes(wtype);
    int z = qzero(wtype), has_m = wtype == Q4_1, q4 = wtype != Q8_0;
    int32_t sums[WIDE_ROWS][4 * NR];
    uint8_t unpacked[2][4][512] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) for (int c = 0; c < 4 * NR; c++) acc[r * 4 * NR + c] = 0.f;
    if (q4) for (int p = 0; p < P; p++) amx_unpack(panel + p * pbytes, wtype, unpacked[0][p]);
    for (long b = 0; b < nb; b++) {
        _tile_loadd(4, x->a + m0 * x->K + b * 32, x->K);
        AMX_QPANEL(5, 0)
        AMX_QPANEL(6, 1)
        AMX_QPANEL(7, 2)
        AMX_QPANEL(5, 3)
        if (q4 && b + 1 < nb)
            for (int p = 0; p < P; p++) amx_unpack(panel + p * pbytes + (b + 1) * bytes, wtype, unpacked[(b + 1) & 1][p]);
        _tile_stored(0, sums[0], sizeof sums[0]);
        if (P > 1) _tile_stored(1, sums[0] + NR, sizeof sums[0]);
        if (P > 2) _tile_stored(2, sums[0] + 2 * NR, sizeof sums[0]);
        if (P > 3) _tile_stored(3, sums[0] + 3 * NR, sizeof sums[0]);
        __m512 d[4], m[4];
        for (int p = 0; p < P; p++) {
            const uint8_t* blk = panel + p * pbytes + b * bytes;
            d[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
            m[p] = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))) : d[p];
        }
        for (int r = 0; r < R; r++) {
            long at = (m0 + r) * nb + b;
            __m512 s = _mm512_set1_ps(x->s[at]), sA = _mm512_set1_ps(x->sA[at]);
            __m512i zA = _mm512_set1_epi32(z * x->A[at]);
            for (int p = 0; p < P; p++) {
                float* chain = acc + r * 4 * NR + p * NR;
                __m512i sum = _mm512_sub_epi32(_mm512_loadu_si512((const void*)(sums[r] + p * NR)), zA);
                __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(d[p], s), _mm512_cvtepi32_ps(sum), _mm512_loadu_ps(chain));
                if (has_m) v = _mm512_fmadd_ps(m[p], sA, v);
                _mm512_storeu_ps(chain, v);
            }
        }
    }
}
/* Row blocks of at least this many rows take the tile unit (per type: Q8_0, Q4_0, Q4_1); smaller ones
   the VNNI code, which computes the same bits and streams a few rows' weights faster. Measured on
   SmolLM2-135M (1 and 2 threads, a Xeon with AMX): Q8_0 gains from 8 rows (T(16) 24.6 -> 22.0 ms on one
   thread), the 4-bit types, whose nibbles the tile unit needs unpacked, from 12 (T(16) 22.8 -> 20.4). */
static int amx_q_rows[3] = {8, 12, 12};
int sd_set_amx_q_rows(int wtype, int rows) {  /* returns the count it replaces */
    if (wtype < Q8_0 || wtype > Q4_1) return 0;
    int before = amx_q_rows[wtype - Q8_0];
    amx_q_rows[wtype - Q8_0] = rows;
    return before;
}
static void amx_qlinear_part(void* arg, int part, int parts) {
    struct qlinear_job* j = arg;
    quantize_share(j, part, parts);
    long panels = (j->N + NR - 1) / NR, pbytes = (j->x.K / 32) * qblock_bytes(j->wtype);
    long p0 = panels * part / parts, p1 = panels * (part + 1) / parts;
    long blocks = wide_blocks(j->M);
    float acc[WIDE_ROWS * 4 * NR];
    int configured = 0;
    /* Groups of 8 panels (a few KiB each) stay in L2 while every row block uses them. */
    for (long p = p0; p < p1; p += 8) {
        long end = p + 8 < p1 ? p + 8 : p1;
        for (long b = 0; b < blocks; b++) {
            long m0 = row_start(j->M, blocks, b);
            int R = (int)(row_start(j->M, blocks, b + 1) - m0);
            if (R < amx_q_rows[j->wtype - Q8_0]) {
                qlinear_rows(j, m0, R, p, end, pbytes, acc);
                continue;
            }
            if (R != configured) { amx_configure_q(R); configured = R; }
            for (long q = p; q < end; q += 4) {
                int P = end - q < 4 ? (int)(end - q) : 4;
                amx_qtile(&j->x, m0, R, j->wp + q * pbytes, pbytes, P, j->wtype, acc);
                finish_tile(&j->out, acc, 4 * NR, m0, R, q * NR, P * NR);
            }
        }
    }
    if (configured) _tile_release();
}
#else
int sd_set_amx_q_rows(int wtype, int rows) { (void)wtype; (void)rows; return 0; }
#endif

/* sd_linear with quantized weights: x [M, K] (K a multiple of 32) times the packed wq -> y [M, N];
 * gain [K] float32 (the norm's weight, not folded into quantized weights) or NULL. */
int sd_linear_q(const void* x, long M, long K, long ldx, const void* wq, int wtype, long N, const float* gain,
                const void* bias, const void* residual, long ldr, void* y, long ldy, float norm_eps, int dtype) {
    if (K % 32 || !sd_qblock_bytes(wtype)) return 2;
    long nb = K / 32;
    size_t bytes = sizeof(float) * (size_t)(M * K + M + 2 * M * nb) + sizeof(int32_t) * (size_t)(M * nb) + (size_t)(M * K);
    int owned;
    char* work = scratch_get(SCRATCH_PRODUCT, bytes + 64, &owned);
    if (!work) return 1;
    float* xf = (float*)work;
    float* scale = xf + M * K;
    float* s = scale + M;
    float* sA = s + M * nb;
    int32_t* A = (int32_t*)(sA + M * nb);
    int8_t* a = (int8_t*)(A + M * nb);
    long panels = (N + NR - 1) / NR;
    /* int8 multiply-adds are about 4x cheaper than float32 FMAs */
    int parts = product_parts(M * K * N / 4, panels * nb * qblock_bytes(wtype), parallel_bytes, panels);
    struct qinput in = {x, ldx, dtype, gain, norm_eps, xf, scale, a, s, A, sA, {parts > 1 && M >= SHARED_INPUT_ROWS, 0}};
    if (!in.share.shared) quantize_rows(&in, K, 0, M);
    struct qlinear_job job = {wq, wtype, M, N, {a, s, A, sA, K}, {bias, residual, y, N, ldr, ldy, dtype,
                                                                 norm_eps >= 0 ? scale : NULL}, &in};
    job_fn part = qlinear_part;
#if defined(SD_AMX_Q)
    if (amx_usable()) part = amx_qlinear_part;  /* the same bits, the integer sums on the tile unit */
#endif
    run_parallel(part, &job, parts);
    scratch_put(work, owned);
    return 0;
}

/* ---- the vector units' peak: independent multiply-add chains, no memory ------------------------
 * `integer` 0: float32 FMAs of the width the products use; 1: the int8 dot products of the quantized
 * products (VNNI, or AVX2's pair sums); 2: the bfloat16 pair dot products where the bfloat16 products
 * use them (AVX512-BF16), else as 0. Runs `iters` rounds of 12 chains on every active thread and
 * returns a checksum (so the work is not optimised away); *macs receives the multiply-adds done. */
struct peak_job { int integer; long iters; double sums[MAX_THREADS]; };
static void peak_part(void* arg, int part, int parts) {
    struct peak_job* j = arg;
    double sum = 0;
    (void)parts;
#if defined(SD_AMX)
    if (j->integer == 3) {  /* the tile unit's bfloat16 products: 16 x 16 x 32 multiply-adds per instruction */
        if (!amx_usable()) { j->sums[part] = 0; return; }
        uint16_t ones[16 * 32];
        float out[16 * 16];
        for (int i = 0; i < 16 * 32; i++) ones[i] = 0x3f80;  /* 1.0 */
        amx_configure(16);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64);
        for (long t = 0; t < j->iters; t++) {
            _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 6);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 5); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(3, 4, 5);
            _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 5); _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, out, 64);
        _tile_release();
        j->sums[part] = out[0];
        return;
    }
#endif
#if defined(SD_BF16_DOT)
    if (j->integer == 2) {
        __m512 acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(1e-3f * (float)(i + part));
        __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f), b = (__m512bh)_mm512_set1_epi32(0x38d138d1);
        for (long t = 0; t < j->iters; t++)
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
        j->sums[part] = sum;
        return;
    }
#endif
#if defined(__AVX512F__)
    if (j->integer != 1) {
        __m512 acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(1e-3f * (float)(i + part));
        __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
        for (long t = 0; t < j->iters; t++)
            for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
        j->sums[part] = sum;
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (j->integer != 1) {
        __m256 acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps(1e-3f * (float)(i + part));
        __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
        for (long t = 0; t < j->iters; t++)
            for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        float f[8];
        for (int i = 0; i < 12; i++) { _mm256_storeu_ps(f, acc[i]); for (int l = 0; l < 8; l++) sum += f[l]; }
        j->sums[part] = sum;
        return;
    }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (j->integer == 1) {
        __m512i acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i + part);
        __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (long t = 0; t < j->iters; t++)
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        for (int i = 0; i < 12; i++) sum += (double)_mm512_reduce_add_epi32(acc[i]);
        j->sums[part] = sum;
        return;
    }
#elif defined(__AVX2__)
    if (j->integer == 1) {
        __m256i acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_epi32(i + part);
        __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
        for (long t = 0; t < j->iters; t++)
            for (int i = 0; i < 12; i++)
                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
        int32_t v[8];
        for (int i = 0; i < 12; i++) { _mm256_storeu_si256((__m256i*)v, acc[i]); for (int l = 0; l < 8; l++) sum += v[l]; }
        j->sums[part] = sum;
        return;
    }
#endif
    float acc[12];
    for (int i = 0; i < 12; i++) acc[i] = 1e-3f * (float)(i + part);
    for (long t = 0; t < j->iters; t++)
        for (int i = 0; i < 12; i++) acc[i] = fmaf(acc[i], 0.999f, 1e-4f);
    for (int i = 0; i < 12; i++) sum += acc[i];
    j->sums[part] = sum;
}
static long peak_lanes(int integer) {
    if (integer == 3) return 16 * 16 * 32;
#if defined(SD_BF16_DOT)
    if (integer == 2) return 32;
#endif
    if (integer == 2) integer = 0;
#if defined(__AVX512F__)
    if (!integer) return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    if (!integer) return 8;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (integer) return 64;
#elif defined(__AVX2__)
    if (integer) return 32;
#endif
    return 1;
}
double sd_peak(int integer, long iters, double* macs) {
    struct peak_job job = {integer, iters, {0}};
    int parts = active_threads;
    run_parallel(peak_part, &job, parts);
    double sum = 0;
    for (int p = 0; p < parts; p++) sum += job.sums[p];
    *macs = (double)parts * (double)iters * 12.0 * (double)peak_lanes(integer);
    return sum;
}

/* ---- RMSNorm with a weight, over rows of S elements (final norm, q/k norms) ----------------
 * rows x groups vectors: vector (r, g) starts at r * ld_row + g * ld_group, in x and in y.
 * y = (x * inv_rms) * weight. y may be x.
 */
int sd_rms_norm(const void* x, void* y, long rows, long groups, long S, long ld_row, long ld_group,
                const void* weight, float eps, int dtype) {
    float* buf = malloc(sizeof(float) * (size_t)S);
    if (!buf) return 1;
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < groups; g++) {
            long at = r * ld_row + g * ld_group;
            widen((const char*)x + at * esize(dtype), S, dtype, buf);
            float inv = inverse_rms(buf, S, eps);
            for (long i = 0; i < S; i++) {
                float v = buf[i] * inv;
                if (weight) v = v * load1(weight, i, dtype);
                store1(y, at + i, v, dtype);
            }
        }
    free(buf);
    return 0;
}

/* ---- RoPE in place, pair order: (x[2i], x[2i+1]) rotated by angle position * inv_freq[i] ------
 * rows x heads vectors of D elements, vector (r, h) at r * ld_row + h * D; table [P, D/2, 2]
 * float32 (cos, sin) by position; positions [rows] int64.
 */
void sd_rope(void* x, long rows, long heads, long D, long ld_row, const float* table, const int64_t* positions,
             int dtype) {
    long half = D / 2;
    for (long r = 0; r < rows; r++) {
        const float* rot = table + positions[r] * half * 2;
        for (long h = 0; h < heads; h++) {
            long at = r * ld_row + h * D, i = 0;
#if defined(__AVX512F__)
            /* Eight pairs at a time, the same products, difference and sum as the scalar loop:
               lanes (a c, b c) and (b s, a s); even lanes subtract, odd lanes add (b c + a s). */
            if (dtype != F16)
                for (; i + 8 <= half; i += 8) {
                    __m512 v = dtype == F32 ? _mm512_loadu_ps((const float*)x + at + 2 * i) : wide_bf16(x, at + 2 * i);
                    __m512 cs = _mm512_loadu_ps(rot + 2 * i);
                    __m512 p = _mm512_mul_ps(v, _mm512_moveldup_ps(cs));
                    __m512 q = _mm512_mul_ps(_mm512_permute_ps(v, 0xB1), _mm512_movehdup_ps(cs));
                    __m512 out = _mm512_mask_add_ps(_mm512_sub_ps(p, q), 0xAAAA, p, q);
                    if (dtype == F32) _mm512_storeu_ps((float*)x + at + 2 * i, out);
                    else {
                        store8(x, at + 2 * i, _mm512_castps512_ps256(out), dtype);
                        store8(x, at + 2 * i + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(out), 1)), dtype);
                    }
                }
#elif defined(__AVX2__) && defined(__FMA__)
            if (dtype != F16) /* four pairs at a time, the same way */
                for (; i + 4 <= half; i += 4) {
                    __m256 v = load8(x, at + 2 * i, dtype), cs = _mm256_loadu_ps(rot + 2 * i);
                    __m256 p = _mm256_mul_ps(v, _mm256_moveldup_ps(cs));
                    __m256 q = _mm256_mul_ps(_mm256_permute_ps(v, 0xB1), _mm256_movehdup_ps(cs));
                    store8(x, at + 2 * i, _mm256_blend_ps(_mm256_sub_ps(p, q), _mm256_add_ps(p, q), 0xAA), dtype);
                }
#endif
            for (; i < half; i++) {
                float a = load1(x, at + 2 * i, dtype), b = load1(x, at + 2 * i + 1, dtype);
                float c = rot[2 * i], s = rot[2 * i + 1];
                store1(x, at + 2 * i, a * c - b * s, dtype);
                store1(x, at + 2 * i + 1, a * s + b * c, dtype);
            }
        }
    }
}

/* ---- e^x: one fixed sequence of float operations, the same in every build ---------------------
 * x = n ln2 + r (n = x log2(e) rounded to nearest even, r by two FMAs), e^r by a degree-7 Taylor
 * polynomial in Horner form (FMAs), times 2^n built from its bits. Relative error about 1e-7; below
 * -87 it is 0, above 88 infinity, NaN stays NaN. The eight-lane version performs the same IEEE
 * operations lane by lane, so a value's bits never depend on which path or build computed it. */
#define EXP_LOW -87.0f
#define EXP_HIGH 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.42860682030941723212e-6f
static const float exp_taylor[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
static inline float sd_expf(float x) {
    if (x != x) return x;
    if (x < EXP_LOW) return 0.f;
    if (x > EXP_HIGH) return INFINITY;
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = exp_taylor[0];
    for (int i = 1; i < 8; i++) p = fmaf(p, r, exp_taylor[i]);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
static inline v8 v_exp(v8 x) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 low = _mm256_set1_ps(EXP_LOW), high = _mm256_set1_ps(EXP_HIGH);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, low), high);  /* in range: x itself */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(exp_taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_taylor[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, low, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, high, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
#else
    v8 y;
    for (int i = 0; i < 8; i++) y.l[i] = sd_expf(x.l[i]);
    return y;
#endif
}

/* p with the lanes of columns not seen (seen[0..7] zero) set to +0. */
static inline v8 v_seen(v8 p, const uint8_t* seen) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)seen));
    return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bytes, _mm256_setzero_si256())), p);
#else
    for (int i = 0; i < 8; i++) if (!seen[i]) p.l[i] = 0.f;
    return p;
#endif
}

/* s[t] = e^(s[t] - max) over the columns seen (seen[t] nonzero, or all when seen is NULL), 0 elsewhere.
 * The maximum is of a set, the same whatever order finds it (a NaN score is never taken, as in the
 * scalar comparison; +0 and -0 may tie, and e^(s - (+0)) and e^(s - (-0)) are the same number). */
static void exp_row(float* s, const uint8_t* seen, long T) {
    float m = -INFINITY;
    long t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* Eight lanes of "s > m" maxima, then the lanes; visibility as a lane mask, never a branch. */
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= T; t += 8) {
        __m256 v = _mm256_loadu_ps(s + t), take = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);
        if (seen) take = v_seen(take, seen + t);
        mv = _mm256_blendv_ps(mv, v, take);
    }
    float lane[8];
    _mm256_storeu_ps(lane, mv);
    for (int i = 0; i < 8; i++) if (lane[i] > m) m = lane[i];
#endif
    for (; t < T; t++) if ((!seen || seen[t]) && s[t] > m) m = s[t];
    t = 0;
    for (; t + 8 <= T; t += 8) {
        v8 p = v_exp(v_add(v_load(s + t), v_set1(-m)));
        v_store(s + t, seen ? v_seen(p, seen + t) : p);
    }
    for (; t < T; t++) s[t] = (!seen || seen[t]) ? sd_expf(s[t] + -m) : 0.f;
}

/* ---- silu(gate) * up: gate_up [M, 2I] (gate first) -> out [M, I] ---------------------------- */
static void silu_rows(const void* gate_up, long m0, long m1, long I, long ld_in, void* out, long ld_out, int dtype) {
    for (long m = m0; m < m1; m++) {
        long i = 0;
        /* Eight at a time, the same operations as the scalar tail. */
        for (; i + 8 <= I; i += 8) {
            v8 g = load8(gate_up, m * ld_in + i, dtype), u = load8(gate_up, m * ld_in + I + i, dtype);
            v8 silu = v_stored(v_div(g, v_add(v_set1(1.0f), v_exp(v_mul(g, v_set1(-1.0f))))), dtype);
            store8(out, m * ld_out + i, v_mul(silu, u), dtype);
        }
        for (; i < I; i++) {
            float g = load1(gate_up, m * ld_in + i, dtype), u = load1(gate_up, m * ld_in + I + i, dtype);
            float silu = stored(g / (1.0f + sd_expf(g * -1.0f)), dtype); /* as the model would store it */
            store1(out, m * ld_out + i, silu * u, dtype);
        }
    }
}

struct silu_job { const void* gate_up; long M, I, ld_in; void* out; long ld_out; int dtype; };
static void silu_part(void* arg, int part, int parts) {
    struct silu_job* j = arg;
    silu_rows(j->gate_up, j->M * part / parts, j->M * (part + 1) / parts, j->I, j->ld_in, j->out, j->ld_out, j->dtype);
}
/* Rows split between the threads from a few rows on (each element is its own computation). */
void sd_silu_mul(const void* gate_up, long M, long I, long ld_in, void* out, long ld_out, int dtype) {
    struct silu_job job = {gate_up, M, I, ld_in, out, ld_out, dtype};
    run_parallel(silu_part, &job, M * I >= parallel_threshold / 32 ? (int)(M < active_threads ? M : active_threads) : 1);
}

/* ---- attention over the cache --------------------------------------------------------------
 * q: [B, n, heads, D] rows of ld_q elements (token (b, i) at (b * n + i) * ld_q), head h uses
 * key head h % kv. keys/values: element (b, kvh, t, d) at b * ld_b + kvh * ld_h + t * D + d.
 * visible: [B, n, T] bytes (nonzero: the query sees column t), or NULL (every query sees every
 * column). out: [B * n, heads * D], rows of ld_out elements. A query that sees nothing gets 0.
 */
struct attention_job {
    const void *q, *keys, *values; const uint8_t* visible; void* out;
    long ld_q, ld_b, ld_h, B, n, heads, kv, D, T, ld_out; float scale; int dtype;
    atomic_int failed;  /* a part could not allocate its work memory */
    long slices;        /* each key head's query rows in this many slices (work items) */
    const int32_t* reach;  /* [B, n]: 1 + the last column each position sees (NULL: no mask, every column) */
    const int64_t* cost;   /* [B, n + 1]: the positions' reaches summed, where slices split the work evenly */
};

/* A query row dotted with a key: lane l = d % 8 is the FMA chain over d = l, l + 8, ... in order
 * (the vector part, then the tail in the same lanes), lanes added as a fixed tree. */
static inline float dot_key(const float* q, const void* key, long D, int dtype) {
    long D8 = D / 8 * 8, d = 0;
    v8 acc = v_zero();
    if (dtype == F32) for (; d < D8; d += 8) acc = v_fma(v_load(q + d), v_load((const float*)key + d), acc);
    else if (dtype == BF16) for (; d < D8; d += 8) acc = v_fma(v_load(q + d), v_load_bf16((const uint16_t*)key + d), acc);
    else for (; d < D8; d += 8) acc = v_fma(v_load(q + d), load_f16(key, d), acc);
    float lane[8];
    v_store(lane, acc);
    for (; d < D; d++) lane[d - D8] = fmaf(q[d], load1(key, d, dtype), lane[d - D8]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* Eight lane-blocked dot products finished at once: out[c] is acc[c]'s lanes added in dot_key's
 * tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline v8 tree_sums(const v8* acc) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(g1, g2, 0x20), _mm256_permute2f128_ps(g1, g2, 0x31));
#else
    float out[8], lane[8];
    for (int c = 0; c < 8; c++) {
        v_store(lane, acc[c]);
        out[c] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
    return v_load(out);
#endif
}

static inline v8 load_key(const void* key, long d, int dtype) {
    return dtype == F32 ? v_load((const float*)key + d) : dtype == BF16 ? v_load_bf16((const uint16_t*)key + d)
                                                                        : load_f16(key, d);
}

/* Scores of R query rows (float32 rows of D) against eight consecutive keys (rows of D in the
 * cache's dtype, widened as they are loaded, which is exact): out[r * ldo + c] = scale * what
 * dot_key gives (D % 8 == 0). Rows only share the key loads. */
#define SCORE_TILE(R)                                                                              \
static inline __attribute__((always_inline)) void score_tile_##R(const float* q, const void* keys, int dtype, long D, \
                                                                  float scale, float* out, long ldo) { \
    v8 acc[R][8];                                                                                  \
    size_t kstride = D * esize(dtype);                                                             \
    for (int r = 0; r < R; r++) for (int c = 0; c < 8; c++) acc[r][c] = v_zero();                \
    for (long d = 0; d < D; d += 8) {                                                              \
        v8 qv[R];                                                                                  \
        for (int r = 0; r < R; r++) qv[r] = v_load(q + r * D + d);                                \
        for (int c = 0; c < 8; c++) {                                                              \
            v8 kv = load_key((const char*)keys + c * kstride, d, dtype);                           \
            for (int r = 0; r < R; r++) acc[r][c] = v_fma(qv[r], kv, acc[r][c]);                   \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++) v_store(out + r * ldo, v_mul(tree_sums(acc[r]), v_set1(scale)));  \
}
SCORE_TILE(1)
#if defined(SD_WIDE)
SCORE_TILE(3) /* 24 chains: needs AVX-512's 32 registers */
#define SCORE_ROWS 3
/* Six rows at once on AVX-512: two keys per register (key 2j in the low eight lanes, 2j + 1 in the
 * high), the query's eight values in both halves. Each lane runs the chain score_tile_1's lane runs,
 * and the halves finish through the same tree_sums, so the scores are the same bits. */
static inline __attribute__((always_inline)) void score_tile_wide6(const float* q, const void* keys, int dtype,
                                                                   long D, float scale, float* out, long ldo) {
    __m512 acc[6][4];
    size_t kstride = D * esize(dtype);
    for (int r = 0; r < 6; r++) for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 8) {
        __m512 qv[6];
        for (int r = 0; r < 6; r++) qv[r] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + r * D + d))));
        for (int c = 0; c < 4; c++) {
            __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(load_key((const char*)keys + 2 * c * kstride, d, dtype)));
            __m512 kv = _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(load_key((const char*)keys + (2 * c + 1) * kstride, d, dtype)), 1));
            for (int r = 0; r < 6; r++) acc[r][c] = _mm512_fmadd_ps(qv[r], kv, acc[r][c]);
        }
    }
    for (int r = 0; r < 6; r++) {
        v8 halves[8];
        for (int c = 0; c < 4; c++) {
            halves[2 * c] = _mm512_castps512_ps256(acc[r][c]);
            halves[2 * c + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
        }
        v_store(out + r * ldo, v_mul(tree_sums(halves), v_set1(scale)));
    }
}
#else
#define SCORE_ROWS 1
#endif

#if !defined(SD_WIDE) && defined(__AVX2__) && defined(__FMA__)
/* Three rows against four keys at once on AVX2 (12 chains, three query vectors and a key: 16
 * registers), so each key is loaded and widened once for three rows instead of once per row. Each
 * chain is the one score_tile_1 runs (lane l over d = l, l + 8, ... in order) and its lanes are added
 * by the same tree_sums, so the scores are the same bits. Two-byte keys only: measured on a Zen 3 (30
 * layers' attention, 9 query heads over 3 key heads, context 200 + n, 2 threads), bfloat16 n = 4 / 16 /
 * 64 0.87-0.90 / 0.79-0.85 / 0.78-0.85x the time; float32 keys, which need no widening, 1.2x, so they
 * keep one row per tile. */
#define SCORE_ROWS_AVX2 3
static inline __attribute__((always_inline)) void score_tile_3x4(const float* q, const void* keys, int dtype, long D,
                                                                 float scale, float* out, long ldo) {
    __m256 acc[3][4];
    size_t kstride = D * esize(dtype);
    for (int r = 0; r < 3; r++) for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (long d = 0; d < D; d += 8) {
        __m256 qv[3];
        for (int r = 0; r < 3; r++) qv[r] = _mm256_loadu_ps(q + r * D + d);
        for (int c = 0; c < 4; c++) {
            __m256 kv = load_key((const char*)keys + c * kstride, d, dtype);
            for (int r = 0; r < 3; r++) acc[r][c] = _mm256_fmadd_ps(qv[r], kv, acc[r][c]);
        }
    }
    for (int r = 0; r < 3; r++) {  /* tree_sums of the four keys (twice): its first four lanes */
        v8 four[8] = {acc[r][0], acc[r][1], acc[r][2], acc[r][3], acc[r][0], acc[r][1], acc[r][2], acc[r][3]};
        _mm_storeu_ps(out + r * ldo, _mm_mul_ps(_mm256_castps256_ps128(tree_sums(four)), _mm_set1_ps(scale)));
    }
}
#endif

#if defined(SD_WIDE)
/* Attention outputs of R rows x 16 C columns: acc[r, d] = fma(p[r, t], v[t, d], acc) over t < len in order,
 * the chain the eight-lane loops below compute (p: rows of T; every row's p is 0 from len on). v: the head's
 * values (element t * D + d). */
typedef void (*value_fn)(const float* p, long T, long len, const void* v, long D, long d, float* out, long ldo);
#define VALUE_TILE(R, C, NAME)                                                                     \
static void value_##NAME##_##R##_##C(const float* p, long T, long len, const void* v, long D, long d, float* out, \
                                     long ldo) {                                                   \
    __m512 acc[R][C];                                                                              \
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();      \
    for (long t = 0; t < len; t++) {                                                               \
        __m512 w[C];                                                                               \
        for (int c = 0; c < C; c++) w[c] = wide_##NAME(v, t * D + d + 16 * c);                     \
        for (int r = 0; r < R; r++) {                                                              \
            __m512 pv = _mm512_set1_ps(p[r * T + t]);                                              \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(pv, w[c], acc[r][c]);          \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++) for (int c = 0; c < C; c++) _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]); \
}
#define VALUE_SHAPES(X, NAME) X(1, 1, NAME) X(2, 1, NAME) X(3, 1, NAME) X(4, 1, NAME) X(5, 1, NAME) X(6, 1, NAME) \
    X(1, 4, NAME) X(2, 4, NAME) X(3, 4, NAME) X(4, 4, NAME) X(5, 4, NAME) X(6, 4, NAME)
#define VALUE_ENTRY(R, C, NAME) [R][C] = value_##NAME##_##R##_##C,
#define VALUE_TABLE(NAME) VALUE_SHAPES(VALUE_TILE, NAME) \
    static const value_fn value_tiles_##NAME[7][5] = {VALUE_SHAPES(VALUE_ENTRY, NAME)};
VALUE_TABLE(f32)
VALUE_TABLE(bf16)
VALUE_TABLE(f16)
#endif

/* score[r, t] for rows [0, rows) and keys [t0, t8) (multiples of 8), the tiles specialised per dtype. */
static inline __attribute__((always_inline)) void score_columns_as(const float* qf, long rows, const char* kbase,
                                                                   int dtype, long D, long t0, long t8, float scale,
                                                                   float* score, long T) {
    size_t es = esize(dtype);
    for (long t = t0; t < t8; t += 8) {
        long r = 0;
        const char* keys = kbase + t * D * es;
#if SCORE_ROWS > 1
        for (; r + 6 <= rows; r += 6) score_tile_wide6(qf + r * D, keys, dtype, D, scale, score + r * T + t, T);
        for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS)
            score_tile_3(qf + r * D, keys, dtype, D, scale, score + r * T + t, T);
#elif defined(SCORE_ROWS_AVX2)
        for (; dtype != F32 && r + SCORE_ROWS_AVX2 <= rows; r += SCORE_ROWS_AVX2) {
            score_tile_3x4(qf + r * D, keys, dtype, D, scale, score + r * T + t, T);
            score_tile_3x4(qf + r * D, keys + 4 * D * es, dtype, D, scale, score + r * T + t + 4, T);
        }
#endif
        for (; r < rows; r++) score_tile_1(qf + r * D, keys, dtype, D, scale, score + r * T + t, T);
    }
}
static void score_columns(const float* qf, long rows, const char* kbase, int dtype, long D, long t0, long t8,
                          float scale, float* score, long T) {
    if (dtype == BF16) score_columns_as(qf, rows, kbase, BF16, D, t0, t8, scale, score, T);
    else if (dtype == F16) score_columns_as(qf, rows, kbase, F16, D, t0, t8, scale, score, T);
    else score_columns_as(qf, rows, kbase, F32, D, t0, t8, scale, score, T);
}

/* Outputs of R <= 3 rows (probabilities p, rows of T) over 32 columns from d: four chains per row held
 * in registers, acc[i, c] = fma(p[i, t], v[t, c], acc) for t = 0..T-1 in order, as every other path. */
static inline __attribute__((always_inline)) void value_few(const float* p, long T, long len, const char* vbase,
                                                            size_t vbytes, long d, int dtype, float* acc, long D,
                                                            const int R) {
    v8 a[3][4];
    for (int i = 0; i < R; i++) for (int c = 0; c < 4; c++) a[i][c] = v_zero();
    for (long t = 0; t < len; t++) {
        const char* v = vbase + t * vbytes;
        v8 w[4];
        for (int c = 0; c < 4; c++) w[c] = load_key(v, d + 8 * c, dtype);
        for (int i = 0; i < R; i++) {
            v8 pv = v_set1(p[i * T + t]);
            for (int c = 0; c < 4; c++) a[i][c] = v_fma(pv, w[c], a[i][c]);
        }
    }
    for (int i = 0; i < R; i++) for (int c = 0; c < 4; c++) v_store(acc + i * D + d + 8 * c, a[i][c]);
}

/* total[i] = p[i, 0] + p[i, 1] + ... over t < len, in column order, for R rows of p (rows of T): the
 * rows' chains side by side in registers. */
static inline __attribute__((always_inline)) void row_totals(const float* p, long T, long len, float* total,
                                                             const int R) {
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (long t = 0; t < len; t++)
        for (int i = 0; i < R; i++) sum[i] = sum[i] + p[i * T + t];
    for (int i = 0; i < R; i++) total[i] = sum[i];
}

/* Rows [r0, r1) of one key head's n x g query rows (row i * g + jj: position i, group member jj).
 * A row's result depends on nothing but its own query, so the rows may be split between threads.
 * Columns past a row's last visible one are neither scored nor read for its output: its p is 0 there,
 * and fma(0, v, acc) == acc for the finite values a cache holds, so stopping early is the same chain
 * (a prompt's causal block reads half the columns it did; decoding, which sees every column, reads all). */
static void attention_one(const struct attention_job* j, long b, long kvh, long r0, long r1, float* work) {
    long g = j->heads / j->kv, rows = r1 - r0, D = j->D, T = j->T;
    int dtype = j->dtype;
    float* qf = work;                  /* [rows, D] */
    float* score = qf + rows * D;      /* [rows, T] */
    float* acc = score + rows * T;     /* [rows, D] */
    float* vrow = acc + rows * D;      /* [D] */
    float* total = vrow + D;           /* [rows] */
    int32_t* upto = (int32_t*)(total + rows);  /* [rows]: 1 + the last column rows 0..r see */
    size_t es = esize(dtype);
    for (long r = 0; r < rows; r++) {
        long i = (r0 + r) / g, h = ((r0 + r) % g) * j->kv + kvh;
        widen((const char*)j->q + ((b * j->n + i) * j->ld_q + h * D) * es, D, dtype, qf + r * D);
    }
    const char* kbase = (const char*)j->keys + (b * j->ld_b + kvh * j->ld_h) * es;
    const char* vbase = (const char*)j->values + (b * j->ld_b + kvh * j->ld_h) * es;
    const uint8_t* vis = j->visible ? j->visible + b * j->n * T : NULL;
    for (long r = 0, most = 0; r < rows; r++) {
        long reach = j->reach ? j->reach[b * j->n + (r0 + r) / g] : T;
        most = reach > most ? reach : most;
        upto[r] = (int32_t)most;
    }
    /* Scores of the columns each row sees; the softmax over them in column order. */
    long t8 = D % 8 == 0 ? T / 8 * 8 : 0;  /* keys scored eight at a time */
    /* Tiles of keys [t, end) for the rows from ``first`` on, the rows before it seeing no column from t on
     * (every tile gives a row the same bits, wherever the tiling starts): one run when all see every column. */
    for (long t = 0, first = 0; t < t8;) {
        while (first < rows && upto[first] <= t) first++;
        if (first == rows) break;
        long end = (upto[first] + 7) / 8 * 8;
        end = end < t8 ? end : t8;
        score_columns(qf + first * D, rows - first, kbase, dtype, D, t, end, j->scale, score + first * T, T);
        t = end;
    }
    for (long t = t8; t < T; t++) {
        const char* key = kbase + t * D * es;
        for (long r = 0; r < rows; r++)
            if (!vis || vis[((r0 + r) / g) * T + t]) score[r * T + t] = dot_key(qf + r * D, key, D, dtype) * j->scale;
    }
    /* The exponentials up to the row's reach (the columns past it are unseen, out of the maximum too), zeros
     * from there to the widest reach, which the totals and the tiles of several rows run to. */
    for (long r = 0; r < rows; r++) {
        exp_row(score + r * T, vis ? vis + ((r0 + r) / g) * T : NULL, upto[r]);
        for (long t = upto[r]; t < upto[rows - 1]; t++) score[r * T + t] = 0.f;
    }
    /* Each row's total in column order; eight rows' chains side by side. */
    for (long r = 0; r < rows;) {  /* eight rows at a time, then four, then one (zeros past a reach add +0) */
        int R = rows - r >= 8 ? 8 : rows - r >= 4 ? 4 : 1;
        if (R == 8) row_totals(score + r * T, T, upto[r + 7], total + r, 8);
        else if (R == 4) row_totals(score + r * T, T, upto[r + 3], total + r, 4);
        else row_totals(score + r * T, T, upto[r], total + r, 1);
        r += R;
    }
    /* Outputs: acc[r, d] = fma(p[r, t], v[t, d], acc) over t in order. A column the row does not see has
     * p = 0, and fma(0, v, acc) == acc, so every column up to the widest reach of a tile's rows can run through. */
    size_t vbytes = D * es;
    long r = 0;
#if defined(SD_WIDE)
    if (D % 16 == 0) {
        const value_fn(*tiles)[5] = dtype == BF16 ? value_tiles_bf16 : dtype == F16 ? value_tiles_f16 : value_tiles_f32;
        for (; r < rows; r += 6) {
            int R = rows - r < 6 ? (int)(rows - r) : 6;
            for (long d = 0; d < D;) {
                int C = D - d >= 64 ? 4 : 1;
                tiles[R][C](score + r * T, T, upto[r + R - 1], vbase, D, d, acc + r * D + d, D);
                d += 16 * C;
            }
        }
    }
#endif
    for (; r + 4 <= rows; r += 4) {
        const float* p = score + r * T;
        long d = 0;
        for (; d + 16 <= D; d += 16) {
            v8 a[4][2];
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = v_zero();
            for (long t = 0; t < upto[r + 3]; t++) {
                const char* v = vbase + t * vbytes;
                v8 v0 = load_key(v, d, dtype), v1 = load_key(v, d + 8, dtype);
                for (int i = 0; i < 4; i++) {
                    v8 pv = v_set1(p[i * T + t]);
                    a[i][0] = v_fma(pv, v0, a[i][0]);
                    a[i][1] = v_fma(pv, v1, a[i][1]);
                }
            }
            for (int i = 0; i < 4; i++) { v_store(acc + (r + i) * D + d, a[i][0]); v_store(acc + (r + i) * D + d + 8, a[i][1]); }
        }
        for (; d < D; d++)
            for (int i = 0; i < 4; i++) {
                float a = 0.f;
                for (long t = 0; t < T; t++) a = fmaf(p[i * T + t], load1(vbase + t * vbytes, d, dtype), a);
                acc[(r + i) * D + d] = a;
            }
    }
    if (D % 32 == 0 && r < rows) {  /* the last 1-3 rows: their chains in registers (one row per call in decoding) */
        int R = (int)(rows - r);
        for (long d = 0; d < D; d += 32) {
            long len = upto[rows - 1];
            if (R == 1) value_few(score + r * T, T, len, vbase, vbytes, d, dtype, acc + r * D, D, 1);
            else if (R == 2) value_few(score + r * T, T, len, vbase, vbytes, d, dtype, acc + r * D, D, 2);
            else value_few(score + r * T, T, len, vbase, vbytes, d, dtype, acc + r * D, D, 3);
        }
        r = rows;
    }
    long D8 = D / 8 * 8;
    for (; r < rows; r++) {
        float* a = acc + r * D;
        for (long i = 0; i < D; i++) a[i] = 0.f;
        for (long t = 0; t < upto[r]; t++) {
            float p = score[r * T + t];
            const float* v = (const float*)(vbase + t * vbytes);
            if (dtype != F32) { widen(vbase + t * vbytes, D, dtype, vrow); v = vrow; }
            v8 pv = v_set1(p);
            long d = 0;
            for (; d < D8; d += 8) v_store(a + d, v_fma(pv, v_load(v + d), v_load(a + d)));
            for (; d < D; d++) a[d] = fmaf(p, v[d], a[d]);
        }
    }
    for (long r = 0; r < rows; r++) {
        long i = (r0 + r) / g, h = ((r0 + r) % g) * j->kv + kvh, at = (b * j->n + i) * j->ld_out + h * D, d = 0;
        float sum = total[r];
        if (sum > 0.f)  /* a division per element, as the tail's (IEEE: the same quotient in any width) */
            for (; d + 8 <= D; d += 8) store8(j->out, at + d, v_div(v_load(acc + r * D + d), v_set1(sum)), dtype);
        for (; d < D; d++) store1(j->out, at + d, sum > 0.f ? acc[r * D + d] / sum : 0.f, dtype);
    }
}

static size_t attention_work(const struct attention_job* j) {
    long rows = j->n * (j->heads / j->kv);
    return sizeof(float) * (size_t)(rows * j->D * 2 + rows * j->T + j->D + rows + 8) + sizeof(int32_t) * rows;
}

/* Work items: (batch row, key head, slice of its query rows); a part takes a contiguous range of them.
 * Slices hold equal rows, or with a mask equal work: whole positions, split where the reaches summed so
 * far come nearest an equal share (a prompt's causal rows cost more the later they come). */
static long slice_start(const struct attention_job* j, long b, long slice) {
    long g = j->heads / j->kv;
    if (!j->cost) return j->n * g * slice / j->slices;
    const int64_t* cost = j->cost + b * (j->n + 1);
    int64_t share = cost[j->n] * slice / j->slices;
    long low = 0, high = j->n;  /* the first position whose reaches before it reach the share */
    while (low < high) {
        long mid = (low + high) / 2;
        if (cost[mid] < share) low = mid + 1;
        else high = mid;
    }
    if (low > 0 && share - cost[low - 1] < cost[low] - share) low--;  /* the nearer of the two boundaries */
    return low * g;
}

static long attention_slices(const struct attention_job* j, int parts) {
    long pairs = j->B * j->kv, rows = j->n * (j->heads / j->kv);
    long slices = (2L * parts + pairs - 1) / pairs;  /* about two items per thread at least */
    return parts <= 1 ? 1 : slices < rows ? slices : rows;
}

static void attention_part(void* arg, int part, int parts) {
    struct attention_job* j = arg;
    long rows = j->n * (j->heads / j->kv), slices = j->slices;
    long items = j->B * j->kv * slices, p0 = items * part / parts, p1 = items * (part + 1) / parts;
    if (p0 >= p1) return;
    int owned;
    float* work = scratch_get(SCRATCH_ATTENTION, attention_work(j), &owned);
    if (!work) { atomic_store(&j->failed, 1); return; }
    for (long p = p0; p < p1; p++) {
        long pair = p / slices, slice = p % slices, b = pair / j->kv;
        long r0 = slice_start(j, b, slice), r1 = slice + 1 < slices ? slice_start(j, b, slice + 1) : rows;
        if (r0 < r1) attention_one(j, b, pair % j->kv, r0, r1, work);
    }
    scratch_put(work, owned);
}

int sd_attention(const void* q, long ld_q, const void* keys, const void* values, long ld_b, long ld_h,
                 long B, long n, long heads, long kv, long D, long T, const uint8_t* visible, float scale,
                 void* out, long ld_out, int dtype) {
    struct attention_job job = {q, keys, values, visible, out, ld_q, ld_b, ld_h, B, n, heads, kv, D, T, ld_out,
                                scale, dtype, 0};
    /* Parallel from a few hundred thousand multiply-adds: a block of 2 tokens over 200 columns. */
    int parts = n * heads * T * D * 2 >= parallel_threshold / 2 ? active_threads : 1;
    job.slices = attention_slices(&job, parts);
    void* held = NULL;
    if (visible) {  /* each position's reach, and where it pays (more than one position) their running sums */
        size_t at = (sizeof(int32_t) * B * n + 7) & ~(size_t)7;
        held = malloc(at + (n > 1 ? sizeof(int64_t) * B * (n + 1) : 0));
        if (!held) return 1;
        int32_t* reach = held;
        int64_t* cost = n > 1 ? (int64_t*)((char*)held + at) : NULL;
        for (long b = 0; b < B; b++) {
            if (cost) cost[b * (n + 1)] = 0;
            for (long i = 0; i < n; i++) {
                const uint8_t* seen = visible + (b * n + i) * T;
                long t = T;
                while (t > 0 && !seen[t - 1]) t--;
                reach[b * n + i] = (int32_t)t;
                if (cost) cost[b * (n + 1) + i + 1] = cost[b * (n + 1) + i] + t + 16;  /* 16: a row's own work */
            }
        }
        job.reach = reach;
        job.cost = cost;
    }
    long items = B * kv * job.slices;
    if (parts > items) parts = (int)items;
    run_parallel(attention_part, &job, parts);
    free(held);
    return atomic_load(&job.failed);
}

/* ---- one decoder layer of the Llama family, on a block of B x n new tokens ------------------
 * x_in [B * n, H] -> x_out [B * n, H] (x_out may not be x_in); writes the block's keys and values
 * into the cache at columns [past, past + n). Norm weights are folded into qkv and gate_up.
 */
struct sd_layer {
    const void *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    long hidden, heads, kv, head_dim, inner;
    float eps, head_eps, scale;
    int dtype;
    int qkv_type, o_type, gate_up_type, down_type;  /* 0: float panels in dtype; HALVES; PAIRS; else Q8_0, Q4_0, Q4_1 */
    const float *qkv_gain, *gate_up_gain;          /* the norms' weights where not folded (quantized) */
};

static int product(const void* x, long M, long K, long ldx, const void* wp, int wtype, const float* gain, long N,
                   const void* bias, const void* residual, long ldr, void* y, long ldy, float norm_eps, int dtype) {
    if (wtype && wtype != HALVES && wtype != PAIRS)
        return sd_linear_q(x, M, K, ldx, wp, wtype, N, gain, bias, residual, ldr, y, ldy, norm_eps, dtype);
    return sd_linear(x, M, K, ldx, wp, N, bias, residual, ldr, y, ldy, norm_eps, dtype, wtype);
}
struct sd_block {
    long batch, n, past;
    const int64_t* positions;  /* [B * n] */
    const uint8_t* visible;    /* [B, n, past + n] or NULL */
    void *keys, *values;       /* this layer's [B, kv, capacity, D] */
    long ld_b, ld_h;
    const float* rope;         /* [P, D/2, 2] cos, sin */
    void *qkv, *attn, *gate_up, *act;  /* work buffers, contiguous rows */
};

/* A layer's first half on a block: the q/k/v product of x_attn (RMS-normed first unless attn_eps < 0),
 * the heads' norms and RoPE (the queries' only with ``queries``), and the keys and values written to the
 * cache. Each head is normed and rotated on its own, so a key's bits do not depend on ``queries``. */
static int layer_keys_values(const struct sd_layer* w, const struct sd_block* b, const void* x_attn, long K,
                             float attn_eps, int queries) {
    long M = b->batch * b->n, D = w->head_dim, width = (w->heads + 2 * w->kv) * D;
    size_t es = esize(w->dtype);
    int dtype = w->dtype;
    char* keys_at = (char*)b->qkv + w->heads * D * es;
    if (product(x_attn, M, K, K, w->qkv, w->qkv_type, w->qkv_gain, width, w->qkv_bias, NULL, 0, b->qkv, width,
                attn_eps, dtype)) return 1;
    if (w->q_norm) {
        if (queries && sd_rms_norm(b->qkv, b->qkv, M, w->heads, D, width, D, w->q_norm, w->head_eps, dtype)) return 1;
        if (sd_rms_norm(keys_at, keys_at, M, w->kv, D, width, D, w->k_norm, w->head_eps, dtype)) return 1;
    }
    if (queries) sd_rope(b->qkv, M, w->heads + w->kv, D, width, b->rope, b->positions, dtype);
    else sd_rope(keys_at, M, w->kv, D, width, b->rope, b->positions, dtype);
    for (long r = 0; r < M; r++) {
        long row = r / b->n, column = b->past + r % b->n;
        const char* k = (const char*)b->qkv + (r * width + w->heads * D) * es;
        const char* v = k + w->kv * D * es;
        for (long h = 0; h < w->kv; h++) {
            long at = (row * b->ld_b + h * b->ld_h + column * D) * es;
            memcpy((char*)b->keys + at, k + h * D * es, D * es);
            memcpy((char*)b->values + at, v + h * D * es, D * es);
        }
    }
    return 0;
}

/* Keys and values only: context columns whose own outputs nobody reads (a block drafter's context). */
int sd_layer_keys_values(const struct sd_layer* w, const struct sd_block* b, const void* x_attn, long K,
                         float attn_eps) {
    return layer_keys_values(w, b, x_attn, K, attn_eps, 0);
}

/* A decoder layer whose attention reads x_attn [M, K] (RMS-normed first when attn_eps >= 0) and whose
   attention output is added to residual [M, H]: drafter layers (EAGLE's fused inputs) use it as is,
   sd_decoder_layer is the standard case (x_attn = residual = x_in, K = H). */
int sd_decoder_layer_from(const struct sd_layer* w, const struct sd_block* b, const void* x_attn, long K,
                          float attn_eps, const void* residual, void* x_out) {
    long M = b->batch * b->n, H = w->hidden, D = w->head_dim, width = (w->heads + 2 * w->kv) * D;
    int dtype = w->dtype;
    if (layer_keys_values(w, b, x_attn, K, attn_eps, 1)) return 1;
    if (sd_attention(b->qkv, width, b->keys, b->values, b->ld_b, b->ld_h, b->batch, b->n, w->heads, w->kv, D,
                     b->past + b->n, b->visible, w->scale, b->attn, w->heads * D, dtype)) return 1;
    if (product(b->attn, M, w->heads * D, w->heads * D, w->o, w->o_type, NULL, H, w->o_bias, residual, H, x_out, H,
                -1.0f, dtype)) return 1;
    if (product(x_out, M, H, H, w->gate_up, w->gate_up_type, w->gate_up_gain, 2 * w->inner, w->gate_up_bias, NULL, 0,
                b->gate_up, 2 * w->inner, w->eps, dtype)) return 1;
    sd_silu_mul(b->gate_up, M, w->inner, 2 * w->inner, b->act, w->inner, dtype);
    return product(b->act, M, w->inner, w->inner, w->down, w->down_type, NULL, H, w->down_bias, x_out, H, x_out, H,
                   -1.0f, dtype);
}

int sd_decoder_layer(const struct sd_layer* w, const struct sd_block* b, const void* x_in, void* x_out) {
    return sd_decoder_layer_from(w, b, x_in, w->hidden, w->eps, x_in, x_out);
}

/* Layers w[0..count) on a block one after another, as sd_decoder_layer layer by layer: layer i's keys at
 * keys + i * layer_bytes (its values half_bytes further), its mask visible[i] (NULL: every column). x_in ->
 * x_out, the layers in between writing x_out and spare in turn so that the last one writes x_out. One
 * call for a model's layers: from Python each layer's call, its buffer and its pointers cost about 8 us
 * (a tenth of a Q4_1 SmolLM2-135M pass, Zen 4). taps (or NULL): taps[i], where not NULL, receives a copy of
 * layer i's output (tap_bytes), the hidden states a feature drafter reads, so tapped layers stay in the call. */
int sd_decoder_layers(const struct sd_layer* const* w, long count, struct sd_block* b, char* keys, long layer_bytes,
                      long half_bytes, const uint8_t* const* visible, const void* x_in, void* x_out, void* spare,
                      void* const* taps, long tap_bytes) {
    const void* x = x_in;
    for (long i = 0; i < count; i++) {
        void* y = (count - 1 - i) % 2 ? spare : x_out;
        b->keys = keys + i * layer_bytes;
        b->values = keys + i * layer_bytes + half_bytes;
        b->visible = visible[i];
        int status = sd_decoder_layer(w[i], b, x, y);
        if (status) return status;
        if (taps && taps[i]) memcpy(taps[i], y, (size_t)tap_bytes);
        x = y;
    }
    return 0;
}

/* ---- greedy verification: argmax positions and the accepted prefix, in one call ------------- */
/* The index of the largest of n elements (float32, bfloat16 or float16): the first one on ties, the
 * first NaN if there is one (as torch.argmax). Comparisons only, so no order of operations to fix:
 * one pass for the largest value (and whether a NaN is there), one for its first position. */
static long argmax_row(const void* x, long n, int dtype) {
#if defined(__AVX2__) && defined(__FMA__)
    if (dtype != F16 && n >= 8) {
        __m256 top = load8(x, 0, dtype), nan = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        long j = 8;
        for (; j + 8 <= n; j += 8) {
            __m256 v = load8(x, j, dtype);
            top = _mm256_max_ps(top, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8], m;
        _mm256_storeu_ps(lanes, top);
        m = lanes[0];
        for (int l = 1; l < 8; l++) if (lanes[l] > m) m = lanes[l];
        int has_nan = _mm256_movemask_ps(nan);
        for (; j < n; j++) {
            float v = load1(x, j, dtype);
            if (isnan(v)) has_nan = 1;
            else if (v > m) m = v;
        }
        if (!has_nan) {
            __m256 want = _mm256_set1_ps(m);
            for (j = 0; j + 8 <= n; j += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x, j, dtype), want, _CMP_EQ_OQ));
                if (hit) return j + __builtin_ctz(hit);
            }
            for (; j < n; j++) if (load1(x, j, dtype) == m) return j;
        }
    }
#endif
    long best = 0;
    float top = load1(x, 0, dtype);
    if (isnan(top)) return 0;
    for (long j = 1; j < n; j++) {
        float v = load1(x, j, dtype);
        if (isnan(v)) return j;
        if (v > top) { top = v; best = j; }
    }
    return best;
}

/* out[r] = argmax of row r of x [rows, n] (row stride ld elements). */
void sd_argmax(const void* x, long rows, long n, long ld, int dtype, int64_t* out) {
    for (long r = 0; r < rows; r++) out[r] = argmax_row((const char*)x + r * ld * (long)esize(dtype), n, dtype);
}

/* logits [B, W, V] in dtype (row b at b * ld_b, position j at j * ld_w elements); drafts [B, W - 1] int64 (row
 * stride ld_d); lengths [B]: a row accepts drafts while they equal the argmax at their position,
 * up to its length; accepted[b] counts them and next[b] is the argmax after the last accepted one.
 * Only the positions a row reaches are scanned. */
void sd_greedy_accept(const void* logits, long B, long W, long V, long ld_b, long ld_w, const int64_t* drafts,
                      long ld_d, const int64_t* lengths, int64_t* accepted, int64_t* next, int dtype) {
    long size = (long)esize(dtype);
    for (long b = 0; b < B; b++) {
        const char* row = (const char*)logits + b * ld_b * size;
        long limit = lengths[b] < W - 1 ? lengths[b] : W - 1, a = 0;
        long token = argmax_row(row, V, dtype);
        while (a < limit && token == drafts[b * ld_d + a]) {
            a++;
            token = argmax_row(row + a * ld_w * size, V, dtype);
        }
        accepted[b] = a;
        next[b] = token;
    }
}

/* ---- DSpark's greedy chain: the Markov term of each previous draft, then the first largest ---- */
/* head [B, S, V] in dtype (row b at b * ld_b, slot j at j * ld_s elements): the head's logits of S slots;
 * w1 [vocab, r] float32: the Markov head's codes; w2p: its r -> V product packed for sd_linear (layout);
 * ids [V] (NULL: the identity): the target id of each head row; anchors [B]: each row's pending token.
 * Slot j of row b: code = w1[previous] (rounded to dtype), term = code . w2 (sd_linear, all B rows in one
 * product, whose rows keep their bits whatever the block), the draft = the first largest of
 * float(head[b, j]) + float(term[b]) (argmax_row's rule), its target id the next slot's previous.
 * tokens [B, S] int64 (target ids), codes [B, S, r] float32 (the unrounded codes, as the confidence
 * head reads them). Work: x [B, r] and term [B, V] in dtype, sum [V] float32. Returns sd_linear's status. */
int sd_markov_greedy(const void* head, long B, long S, long V, long ld_b, long ld_s, const float* w1, long r,
                     const void* w2p, int layout, const int64_t* ids, const int64_t* anchors, int dtype,
                     int64_t* tokens, float* codes, void* x, void* term, float* sum) {
    if (dtype != F32 && dtype != BF16) return 2;
    long size = (long)esize(dtype);
    for (long j = 0; j < S; j++) {
        for (long b = 0; b < B; b++) {
            int64_t previous = j ? tokens[b * S + j - 1] : anchors[b];
            const float* code = w1 + previous * r;
            memcpy(codes + (b * S + j) * r, code, sizeof(float) * (size_t)r);
            if (dtype == F32) memcpy((float*)x + b * r, code, sizeof(float) * (size_t)r);
            else for (long i = 0; i < r; i++) ((uint16_t*)x)[b * r + i] = to_bf16(code[i]);
        }
        int status = sd_linear(x, B, r, r, w2p, V, NULL, NULL, 0, term, V, -1.0f, dtype, layout);
        if (status) return status;
        for (long b = 0; b < B; b++) {
            const char* logits = (const char*)head + (b * ld_b + j * ld_s) * size;
            const char* extra = (const char*)term + b * V * size;
            for (long v = 0; v < V; v++) sum[v] = load1(logits, v, dtype) + load1(extra, v, dtype);
            long slot = argmax_row(sum, V, F32);
            tokens[b * S + j] = ids ? ids[slot] : slot;
        }
    }
    return 0;
}
