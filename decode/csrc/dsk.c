/* draftsmith's few-row CPU kernels: y (T, N) = x (T, K) @ W (N, K)^T for T = 1..MAX_T rows, W float32 or int8 with
 * one float scale per output row (the int8 draft's weights), streamed once with software prefetch, 2 threads of the
 * OpenMP runtime torch already loaded. Every output is one vector accumulator summed over K in order and reduced
 * the same way whatever T is, so a row's result does not depend on the rows beside it (bit for bit). T rows share
 * each weight vector loaded (T multiply-adds a weight: past 8 rows the multiply-adds, not the reads, set the pace).
 * decode/native.py compiles it on first use (gcc -O3 -march=native) and calls it through ctypes. K must be a
 * multiple of LANES. Built for AVX-512F or AVX2 + FMA; anything else gets no kernels. */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vload8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vload8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

#define MAX_T 12 /* rows a call */
#define AHEAD_ROWS 16 /* prefetch the weight rows this far ahead: short rows (K = 896) defeat the hardware prefetcher */
#define PF_HINT 1 /* prefetcht2, into L2: an L1 hint is evicted by the input rows once 4-12 of them fill L1 */

int dsk_lanes(void) {
#ifdef LANES
    return LANES;
#else
    return 0;
#endif
}

int dsk_max_rows(void) { return MAX_T; }

#ifdef LANES
/* One block of RR output rows [n0, n0 + RR) over T input rows (both compile-time: T * RR accumulators stay in
 * registers); E bytes a weight. */
#define BLOCK(NAME, WT, LOADW, E, T, RR)                                                                 \
    static void NAME(const float *x, const WT *w, const float *scale, const float *b, float *y,           \
                     int N, int K, int n0, const char *end) {                                              \
        vf a[T][RR];                                                                                       \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                                               \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) a[t][r] = vzero();                       \
        const char *pf = (const char *)(w + (size_t)(n0 + AHEAD_ROWS) * K);                                \
        for (int k = 0; k < K; k += LANES) {                                                               \
            const char *p = pf + (size_t)RR * E * k;  /* RR * E * LANES bytes of the rows ahead a step */  \
            for (int c = 0; c < RR * E * LANES; c += 64)                                                   \
                if (p + c < end) __builtin_prefetch(p + c, 0, PF_HINT);                                   \
            vf wv[RR];  /* the block's weights for these K, then each input row once against all of them */ \
            _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) wv[r] = LOADW(w + (size_t)(n0 + r) * K + k); \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {                                         \
                vf xv = vload(x + (size_t)t * K + k);                                                      \
                _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) a[t][r] = vfma(wv[r], xv, a[t][r]);  \
            }                                                                                              \
        }                                                                                                  \
        _Pragma("GCC unroll 16") for (int r = 0; r < RR; r++) {                                            \
            float s = scale ? scale[n0 + r] : 1.0f, c = b ? b[n0 + r] : 0.0f;                              \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++)                                           \
                y[(size_t)t * N + n0 + r] = vsum(a[t][r]) * s + c;                                         \
        }                                                                                                  \
    }

/* y for T rows: blocks of RR output rows shared among the threads, then the last N % RR rows one at a time. */
#define ROWS_FN(NAME, WT, BLK, TL, RR)                                                                     \
    static void NAME(const float *x, const WT *w, const float *s, const float *b, float *y, int N, int K) {  \
        const char *end = (const char *)(w + (size_t)N * K);                                               \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int i = 0; i < N / RR; i++) BLK(x, w, s, b, y, N, K, i * RR, end);                            \
        for (int n = N / RR * RR; n < N; n++) TL(x, w, s, b, y, N, K, n, end);                             \
    }

#define LINEAR_T(T, RR)                                                                                    \
    BLOCK(block_f32_##T, float, vload, 4, T, RR)                                                           \
    BLOCK(block_q8_##T, int8_t, vload8, 1, T, RR)                                                          \
    BLOCK(tail_f32_##T, float, vload, 4, T, 1)                                                             \
    BLOCK(tail_q8_##T, int8_t, vload8, 1, T, 1)                                                            \
    ROWS_FN(f32_##T, float, block_f32_##T, tail_f32_##T, RR)                                               \
    ROWS_FN(q8_##T, int8_t, block_q8_##T, tail_q8_##T, RR)

/* Output rows a block by input rows: T * RR accumulators plus a weight vector within the register file (32 vector
 * registers with AVX-512, 16 with AVX2). */
#if LANES == 16
LINEAR_T(1, 8) LINEAR_T(2, 8) LINEAR_T(3, 8) LINEAR_T(4, 6) LINEAR_T(5, 4) LINEAR_T(6, 4)
LINEAR_T(7, 3) LINEAR_T(8, 3) LINEAR_T(9, 2) LINEAR_T(10, 2) LINEAR_T(11, 2) LINEAR_T(12, 2)
#else
LINEAR_T(1, 8) LINEAR_T(2, 4) LINEAR_T(3, 4) LINEAR_T(4, 3) LINEAR_T(5, 2) LINEAR_T(6, 2)
LINEAR_T(7, 1) LINEAR_T(8, 1) LINEAR_T(9, 1) LINEAR_T(10, 1) LINEAR_T(11, 1) LINEAR_T(12, 1)
#endif

typedef void (*f32_fn)(const float *, const float *, const float *, const float *, float *, int, int);
typedef void (*q8_fn)(const float *, const int8_t *, const float *, const float *, float *, int, int);
static const f32_fn F32[MAX_T] = {f32_1, f32_2, f32_3, f32_4,  f32_5,  f32_6,
                                  f32_7, f32_8, f32_9, f32_10, f32_11, f32_12};
static const q8_fn Q8[MAX_T] = {q8_1, q8_2, q8_3, q8_4, q8_5, q8_6, q8_7, q8_8, q8_9, q8_10, q8_11, q8_12};

void dsk_f32_linear(const float *x, const float *w, const float *s, const float *b, float *y, int T, int N, int K) {
    if (T >= 1 && T <= MAX_T) F32[T - 1](x, w, s, b, y, N, K);
}

void dsk_q8_linear(const float *x, const int8_t *w, const float *s, const float *b, float *y, int T, int N, int K) {
    if (T >= 1 && T <= MAX_T) Q8[T - 1](x, w, s, b, y, N, K);
}
#endif
