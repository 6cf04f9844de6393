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
 *   when a result is stored.
 *
 * The vector code (AVX2 + FMA) and the portable fallback perform the same operations, element
 * by element, so the results do not depend on which one was compiled.
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
static inline v8 v_load_bf16(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
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
static inline v8 v_load_bf16(const uint16_t* p) {
    v8 r; for (int i = 0; i < 8; i++) { uint32_t u = (uint32_t)p[i] << 16; memcpy(&r.l[i], &u, 4); } return r;
}
#define SD_VECTOR "portable"
#endif

const char* sd_vector(void) { return SD_VECTOR; }

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
    if (dtype == F16) return (float)(half_t)v;
#endif
    return v;
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
 */
/* The weight loads of one k step: 2 P vectors of 8 columns. */
#define LOAD_F32(w, p, k, pstride) v_load((const float*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_F32_HI(w, p, k, pstride) v_load((const float*)(w) + (p) * (pstride) + (k) * NR + 8)
#define LOAD_BF16(w, p, k, pstride) v_load_bf16((const uint16_t*)(w) + (p) * (pstride) + (k) * NR)
#define LOAD_BF16_HI(w, p, k, pstride) v_load_bf16((const uint16_t*)(w) + (p) * (pstride) + (k) * NR + 8)
static inline v8 load_f16(const void* w, long at) {
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = load1(w, at + i, F16);
    return v_load(f);
}
#define LOAD_F16(w, p, k, pstride) load_f16(w, (p) * (pstride) + (k) * NR)
#define LOAD_F16_HI(w, p, k, pstride) load_f16(w, (p) * (pstride) + (k) * NR + 8)

#define TILE(R, P, NAME, LO, HI)                                                                 \
static void tile_##NAME##_##R##_##P(const float* x, long K, const void* wp, long pstride,        \
                                    float* acc_out) {                                            \
    v8 acc[R][2 * P];                                                                            \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2 * P; c++) acc[r][c] = v_zero();          \
    for (long k = 0; k < K; k++) {                                                               \
        v8 wv[2 * P];                                                                            \
        for (int p = 0; p < P; p++) { wv[2 * p] = LO(wp, p, k, pstride); wv[2 * p + 1] = HI(wp, p, k, pstride); } \
        for (int r = 0; r < R; r++) {                                                            \
            v8 xv = v_set1(x[r * K + k]);                                                        \
            for (int c = 0; c < 2 * P; c++) acc[r][c] = v_fma(xv, wv[c], acc[r][c]);            \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2 * P; c++)                                  \
        v_store(acc_out + (long)r * 6 * NR + c * 8, acc[r][c]);                                  \
}
#define TILES(NAME, LO, HI) \
    TILE(6, 1, NAME, LO, HI) TILE(5, 1, NAME, LO, HI) TILE(4, 1, NAME, LO, HI) TILE(3, 2, NAME, LO, HI) \
    TILE(3, 1, NAME, LO, HI) TILE(2, 3, NAME, LO, HI) TILE(2, 2, NAME, LO, HI) TILE(2, 1, NAME, LO, HI) \
    TILE(1, 6, NAME, LO, HI) TILE(1, 5, NAME, LO, HI) TILE(1, 4, NAME, LO, HI) TILE(1, 3, NAME, LO, HI) \
    TILE(1, 2, NAME, LO, HI) TILE(1, 1, NAME, LO, HI)                                                 \
static tile_fn pick_##NAME(int R, int P) {                                                          \
    switch (R) {                                                                                     \
    case 6: return tile_##NAME##_6_1;                                                                \
    case 5: return tile_##NAME##_5_1;                                                                \
    case 4: return tile_##NAME##_4_1;                                                                \
    case 3: return P >= 2 ? tile_##NAME##_3_2 : tile_##NAME##_3_1;                                   \
    case 2: return P >= 3 ? tile_##NAME##_2_3 : P == 2 ? tile_##NAME##_2_2 : tile_##NAME##_2_1;      \
    default: return P >= 6 ? tile_##NAME##_1_6 : P == 5 ? tile_##NAME##_1_5 : P == 4 ? tile_##NAME##_1_4 \
                   : P == 3 ? tile_##NAME##_1_3 : P == 2 ? tile_##NAME##_1_2 : tile_##NAME##_1_1;       \
    }                                                                                                \
}
typedef void (*tile_fn)(const float*, long, const void*, long, float*);
TILES(f32, LOAD_F32, LOAD_F32_HI)
TILES(bf16, LOAD_BF16, LOAD_BF16_HI)
TILES(f16, LOAD_F16, LOAD_F16_HI)

static tile_fn pick_tile(int R, int P, int dtype) {
    return dtype == BF16 ? pick_bf16(R, P) : dtype == F16 ? pick_f16(R, P) : pick_f32(R, P);
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
    float f[8];
    v_store(f, v);
    for (int i = 0; i < 8; i++) store1(p, at + i, f[i], dtype);
}

static void linear_panels(long M, long K, const void* wp, long N, const void* bias, const void* residual, long ldr,
                          void* y, long ldy, int dtype, const float* xf, const float* scale, long p0, long p1) {
    float acc[6 * 6 * NR];
    long pstride = K * NR;
    size_t wsize = esize(dtype);
    /* Panels outer, rows inner: a group of panels stays in L1 while every row block uses it. */
    for (long p = p0; p < p1;) {
        int group = (int)(p1 - p < 6 ? p1 - p : 6);
        for (long m = 0; m < M;) {
            int R = M - m >= 6 ? 6 : (int)(M - m);
            for (long q = p; q < p + group;) {
                int P = R >= 4 ? 1 : R == 3 ? 2 : R == 2 ? 3 : 6;
                if (P > p + group - q) P = (int)(p + group - q);
                pick_tile(R, P, dtype)(xf + m * K, K, (const char*)wp + q * pstride * wsize, pstride, acc);
                for (int r = 0; r < R; r++) {
                    long row = m + r;
                    int c = 0;
                    /* Whole groups of 8 columns in vectors: the same IEEE operations in the same order as
                       the scalar tail below, so an element's bits do not depend on which path stored it. */
                    for (; c + 8 <= P * NR && q * NR + c + 8 <= N; c += 8) {
                        long col = q * NR + c;
                        v8 v = v_load(acc + r * 6 * NR + c);
                        if (scale) v = v_mul(v, v_set1(scale[row]));
                        if (bias) v = v_add(v, load8(bias, col, dtype));
                        if (residual) v = v_add(v, load8(residual, row * ldr + col, dtype));
                        store8(y, row * ldy + col, v, dtype);
                    }
                    for (; c < P * NR; c++) {
                        long col = q * NR + c;
                        if (col >= N) break;
                        float v = acc[r * 6 * NR + c];
                        if (scale) v = v * scale[row];
                        if (bias) v = v + load1(bias, col, dtype);
                        if (residual) v = v + load1(residual, row * ldr + col, dtype);
                        store1(y, row * ldy + col, v, dtype);
                    }
                }
                q += P;
            }
            m += R;
        }
        p += group;
    }
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

struct linear_job {
    const void *wp, *bias, *residual; void* y;
    long M, K, N, ldr, ldy; int dtype; const float *xf, *scale;  /* xf: x widened, [M, K] */
};
static void linear_part(void* arg, int part, int parts) {
    struct linear_job* j = arg;
    long panels = (j->N + NR - 1) / NR;
    long p0 = panels * part / parts, p1 = panels * (part + 1) / parts;
    if (p0 < p1)
        linear_panels(j->M, j->K, j->wp, j->N, j->bias, j->residual, j->ldr, j->y, j->ldy, j->dtype, j->xf, j->scale,
                      p0, p1);
}

/* Work below this many multiply-adds runs on the calling thread only: waking a worker costs tens
 * of microseconds, and torch's own threads compete for the same cores between kernel calls. */
static long parallel_threshold = 1L << 22;
void sd_set_parallel_threshold(long fmas) { parallel_threshold = fmas; }

int sd_linear(const void* x, long M, long K, long ldx, const void* wp, long N, const void* bias,
              const void* residual, long ldr, void* y, long ldy, float norm_eps, int dtype) {
    float* xf = malloc(sizeof(float) * (size_t)(M * K + M + 1));
    if (!xf) return 1;
    float* scale = NULL;
    for (long m = 0; m < M; m++) widen((const char*)x + m * ldx * esize(dtype), K, dtype, xf + m * K);
    if (norm_eps >= 0) {
        scale = xf + M * K;
        for (long m = 0; m < M; m++) scale[m] = inverse_rms(xf + m * K, K, norm_eps);
    }
    struct linear_job job = {wp, bias, residual, y, M, K, N, ldr, ldy, dtype, xf, scale};
    long panels = (N + NR - 1) / NR;
    int parts = M * K * N >= parallel_threshold ? active_threads : 1;
    if (parts > panels) parts = (int)panels;
    run_parallel(linear_part, &job, parts);
    free(xf);
    return 0;
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
            long at = r * ld_row + h * D;
            for (long i = 0; i < half; i++) {
                float a = load1(x, at + 2 * i, dtype), b = load1(x, at + 2 * i + 1, dtype);
                float c = rot[2 * i], s = rot[2 * i + 1];
                store1(x, at + 2 * i, a * c - b * s, dtype);
                store1(x, at + 2 * i + 1, a * s + b * c, dtype);
            }
        }
    }
}

/* ---- silu(gate) * up: gate_up [M, 2I] (gate first) -> out [M, I] ---------------------------- */
void sd_silu_mul(const void* gate_up, long M, long I, long ld_in, void* out, long ld_out, int dtype) {
    for (long m = 0; m < M; m++)
        for (long i = 0; i < I; i++) {
            float g = load1(gate_up, m * ld_in + i, dtype), u = load1(gate_up, m * ld_in + I + i, dtype);
            float silu = stored(g / (1.0f + expf(-g)), dtype); /* as the model would store it */
            store1(out, m * ld_out + i, silu * u, dtype);
        }
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

/* Scores of one query row against eight consecutive keys, the same numbers dot_key gives (D % 8 == 0). */
static inline v8 dot_8_keys(const float* q, const char* keys, long D, size_t row_bytes, int dtype) {
    v8 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = v_zero();
    for (long d = 0; d < D; d += 8) {
        v8 qv = v_load(q + d);
        for (int c = 0; c < 8; c++) acc[c] = v_fma(qv, load_key(keys + c * row_bytes, d, dtype), acc[c]);
    }
    return tree_sums(acc);
}

static void attention_one(const struct attention_job* j, long b, long kvh, float* work) {
    long g = j->heads / j->kv, rows = j->n * g, D = j->D, T = j->T;
    int dtype = j->dtype;
    float* qf = work;                  /* [rows, D] */
    float* score = qf + rows * D;      /* [rows, T] */
    float* acc = score + rows * T;     /* [rows, D] */
    float* vrow = acc + rows * D;      /* [D] */
    float* total = vrow + D;           /* [rows] */
    size_t es = esize(dtype);
    for (long i = 0; i < j->n; i++)
        for (long jj = 0; jj < g; jj++) {
            long h = jj * j->kv + kvh;
            widen((const char*)j->q + ((b * j->n + i) * j->ld_q + h * D) * es, D, dtype, qf + (i * g + jj) * D);
        }
    const char* kbase = (const char*)j->keys + (b * j->ld_b + kvh * j->ld_h) * es;
    const char* vbase = (const char*)j->values + (b * j->ld_b + kvh * j->ld_h) * es;
    const uint8_t* vis = j->visible ? j->visible + b * j->n * T : NULL;
    /* Scores of the columns each row sees; the softmax over them in column order. */
    long t8 = D % 8 == 0 ? T / 8 * 8 : 0;  /* keys scored eight at a time */
    for (long t = 0; t < t8; t += 8)
        for (long r = 0; r < rows; r++) {
            float s8[8];
            v_store(s8, dot_8_keys(qf + r * D, kbase + t * D * es, D, D * es, dtype));
            for (int c = 0; c < 8; c++) score[r * T + t + c] = s8[c] * j->scale;
        }
    for (long t = t8; t < T; t++) {
        const void* key = kbase + t * D * es;
        for (long r = 0; r < rows; r++)
            if (!vis || vis[(r / g) * T + t]) score[r * T + t] = dot_key(qf + r * D, key, D, dtype) * j->scale;
    }
    for (long r = 0; r < rows; r++) {
        const uint8_t* seen = vis ? vis + (r / g) * T : NULL;
        float* s = score + r * T;
        float m = -INFINITY, sum = 0.f;
        for (long t = 0; t < T; t++) if ((!seen || seen[t]) && s[t] > m) m = s[t];
        for (long t = 0; t < T; t++) {
            float p = (!seen || seen[t]) ? expf(s[t] - m) : 0.f;
            s[t] = p;
            sum = sum + p;
        }
        total[r] = sum;
    }
    /* Outputs: acc[r, d] = fma(p[r, t], v[t, d], acc) over t = 0..T-1 in order. A column the row
     * does not see has p = 0, and fma(0, v, acc) == acc, so every column can run through. */
    size_t vbytes = D * es;
    long r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float* p = score + r * T;
        long d = 0;
        for (; d + 16 <= D; d += 16) {
            v8 a[4][2];
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = v_zero();
            for (long t = 0; t < T; t++) {
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
    long D8 = D / 8 * 8;
    for (; r < rows; r++) {
        float* a = acc + r * D;
        for (long i = 0; i < D; i++) a[i] = 0.f;
        for (long t = 0; t < T; t++) {
            float p = score[r * T + t];
            const float* v = (const float*)(vbase + t * vbytes);
            if (dtype != F32) { widen(vbase + t * vbytes, D, dtype, vrow); v = vrow; }
            v8 pv = v_set1(p);
            long d = 0;
            for (; d < D8; d += 8) v_store(a + d, v_fma(pv, v_load(v + d), v_load(a + d)));
            for (; d < D; d++) a[d] = fmaf(p, v[d], a[d]);
        }
    }
    for (long i = 0; i < j->n; i++)
        for (long jj = 0; jj < g; jj++) {
            long r = i * g + jj, h = jj * j->kv + kvh;
            float sum = total[r];
            for (long d = 0; d < D; d++)
                store1(j->out, (b * j->n + i) * j->ld_out + h * D + d, sum > 0.f ? acc[r * D + d] / sum : 0.f, dtype);
        }
}

static size_t attention_work(const struct attention_job* j) {
    long rows = j->n * (j->heads / j->kv);
    return sizeof(float) * (size_t)(rows * j->D * 2 + rows * j->T + j->D + rows + 8);
}

static void attention_part(void* arg, int part, int parts) {
    struct attention_job* j = arg;
    long pairs = j->B * j->kv, p0 = pairs * part / parts, p1 = pairs * (part + 1) / parts;
    if (p0 >= p1) return;
    float* work = malloc(attention_work(j));
    if (!work) { atomic_store(&j->failed, 1); return; }
    for (long p = p0; p < p1; p++) attention_one(j, p / j->kv, p % j->kv, work);
    free(work);
}

int sd_attention(const void* q, long ld_q, const void* keys, const void* values, long ld_b, long ld_h,
                 long B, long n, long heads, long kv, long D, long T, const uint8_t* visible, float scale,
                 void* out, long ld_out, int dtype) {
    struct attention_job job = {q, keys, values, visible, out, ld_q, ld_b, ld_h, B, n, heads, kv, D, T, ld_out,
                                scale, dtype, 0};
    long pairs = B * kv;
    int parts = n * heads * T * D * 2 >= parallel_threshold / 2 ? active_threads : 1;
    if (parts > pairs) parts = (int)pairs;
    run_parallel(attention_part, &job, parts);
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
};
struct sd_block {
    long batch, n, past;
    const int64_t* positions;  /* [B * n] */
    const uint8_t* visible;    /* [B, n, past + n] or NULL */
    void *keys, *values;       /* this layer's [B, kv, capacity, D] */
    long ld_b, ld_h;
    const float* rope;         /* [P, D/2, 2] cos, sin */
    void *qkv, *attn, *gate_up, *act;  /* work buffers, contiguous rows */
};

/* A decoder layer whose attention reads x_attn [M, K] (RMS-normed first when attn_eps >= 0) and whose
   attention output is added to residual [M, H]: drafter layers (EAGLE's fused inputs) use it as is,
   sd_decoder_layer is the standard case (x_attn = residual = x_in, K = H). */
int sd_decoder_layer_from(const struct sd_layer* w, const struct sd_block* b, const void* x_attn, long K,
                          float attn_eps, const void* residual, void* x_out) {
    long M = b->batch * b->n, H = w->hidden, D = w->head_dim, width = (w->heads + 2 * w->kv) * D;
    size_t es = esize(w->dtype);
    int dtype = w->dtype;
    if (sd_linear(x_attn, M, K, K, w->qkv, width, w->qkv_bias, NULL, 0, b->qkv, width, attn_eps, dtype)) return 1;
    if (w->q_norm) {
        if (sd_rms_norm(b->qkv, b->qkv, M, w->heads, D, width, D, w->q_norm, w->head_eps, dtype)) return 1;
        if (sd_rms_norm((char*)b->qkv + w->heads * D * es, (char*)b->qkv + w->heads * D * es, M, w->kv, D, width, D,
                        w->k_norm, w->head_eps, dtype)) return 1;
    }
    sd_rope(b->qkv, M, w->heads + w->kv, D, width, b->rope, b->positions, dtype);
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
    if (sd_attention(b->qkv, width, b->keys, b->values, b->ld_b, b->ld_h, b->batch, b->n, w->heads, w->kv, D,
                     b->past + b->n, b->visible, w->scale, b->attn, w->heads * D, dtype)) return 1;
    if (sd_linear(b->attn, M, w->heads * D, w->heads * D, w->o, H, w->o_bias, residual, H, x_out, H, -1.0f, dtype))
        return 1;
    if (sd_linear(x_out, M, H, H, w->gate_up, 2 * w->inner, w->gate_up_bias, NULL, 0, b->gate_up, 2 * w->inner,
                  w->eps, dtype)) return 1;
    sd_silu_mul(b->gate_up, M, w->inner, 2 * w->inner, b->act, w->inner, dtype);
    return sd_linear(b->act, M, w->inner, w->inner, w->down, H, w->down_bias, x_out, H, x_out, H, -1.0f, dtype);
}

int sd_decoder_layer(const struct sd_layer* w, const struct sd_block* b, const void* x_in, void* x_out) {
    return sd_decoder_layer_from(w, b, x_in, w->hidden, w->eps, x_in, x_out);
}

/* ---- greedy verification: argmax positions and the accepted prefix, in one call ------------- */
/* The index of the largest of n floats: the first one on ties, the first NaN if there is one (as
 * torch.argmax). Comparisons only, so no order of operations to fix. */
static long argmax_row(const float* x, long n) {
    long best = 0;
    float top = x[0];
    if (isnan(top)) return 0;
    for (long j = 1; j < n; j++) {
        float v = x[j];
        if (isnan(v)) return j;
        if (v > top) { top = v; best = j; }
    }
    return best;
}

/* logits [B, W, V] float32 (row b at b * ld_b, position j at j * ld_w); drafts [B, W - 1] int64 (row
 * stride ld_d); lengths [B]: a row accepts drafts while they equal the argmax at their position,
 * up to its length; accepted[b] counts them and next[b] is the argmax after the last accepted one.
 * Only the positions a row reaches are scanned. */
void sd_greedy_accept(const float* logits, long B, long W, long V, long ld_b, long ld_w, const int64_t* drafts,
                      long ld_d, const int64_t* lengths, int64_t* accepted, int64_t* next) {
    for (long b = 0; b < B; b++) {
        const float* row = logits + b * ld_b;
        long limit = lengths[b] < W - 1 ? lengths[b] : W - 1, a = 0;
        long token = argmax_row(row, V);
        while (a < limit && token == drafts[b * ld_d + a]) {
            a++;
            token = argmax_row(row + a * ld_w, V);
        }
        accepted[b] = a;
        next[b] = token;
    }
}
