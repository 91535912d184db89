/* draftsmith's few-row CPU kernels: y (T, N) = x (T, K) @ W (N, K)^T for T = 1 or 2 rows, W float32 or int8 with
 * one float scale per output row (the int8 draft's weights), streamed once with software prefetch, 2 threads of the
 * OpenMP runtime torch already loaded. decode/native.py compiles it on first use (gcc -O3 -march=native) and calls
 * it through ctypes. K must be a multiple of LANES. Built for AVX-512F or AVX2 + FMA; anything else gets no kernels. */
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

#define R 8   /* output rows a block: 8 (or 16 with 2 input rows) accumulators in registers */
#define AHEAD 2 /* prefetch the block this many blocks ahead: short rows (K = 896) defeat the hardware prefetcher */

int dsk_lanes(void) {
#ifdef LANES
    return LANES;
#else
    return 0;
#endif
}

#ifdef LANES
/* One block of R output rows [n0, n0 + R) over U (1 or 2) input rows; E bytes a weight. */
#define BLOCK(NAME, WT, LOADW, E)                                                                   \
    static void NAME(const float *x, const WT *w, const float *scale, const float *b, float *y,       \
                     int T, int N, int K, int n0, const char *end) {                                   \
        vf a0[R], a1[R];                                                                               \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = vzero();                                           \
        const char *pf = (const char *)(w + (size_t)(n0 + AHEAD * R) * K);                             \
        for (int k = 0; k < K; k += LANES) {                                                           \
            const char *p = pf + (size_t)R * E * k;  /* R * E * LANES bytes of the block ahead a step */ \
            for (int c = 0; c < R * E * LANES; c += 64)                                                \
                if (p + c < end) __builtin_prefetch(p + c, 0, 0);                                      \
            vf x0 = vload(x + k);                                                                      \
            if (T == 1) {                                                                              \
                for (int r = 0; r < R; r++) a0[r] = vfma(LOADW(w + (size_t)(n0 + r) * K + k), x0, a0[r]); \
            } else {                                                                                   \
                vf x1 = vload(x + K + k);                                                              \
                for (int r = 0; r < R; r++) {                                                          \
                    vf wv = LOADW(w + (size_t)(n0 + r) * K + k);                                       \
                    a0[r] = vfma(wv, x0, a0[r]);                                                       \
                    a1[r] = vfma(wv, x1, a1[r]);                                                       \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            float s = scale ? scale[n0 + r] : 1.0f, c = b ? b[n0 + r] : 0.0f;                          \
            y[n0 + r] = vsum(a0[r]) * s + c;                                                           \
            if (T == 2) y[N + n0 + r] = vsum(a1[r]) * s + c;                                           \
        }                                                                                              \
    }

#define TAIL(NAME, WT, LOADW)                                                                          \
    static void NAME(const float *x, const WT *w, const float *scale, const float *b, float *y,        \
                     int T, int N, int K, int n) {                                                     \
        for (int t = 0; t < T; t++) {                                                                  \
            vf a = vzero();                                                                            \
            for (int k = 0; k < K; k += LANES) a = vfma(LOADW(w + (size_t)n * K + k), vload(x + (size_t)t * K + k), a); \
            y[(size_t)t * N + n] = vsum(a) * (scale ? scale[n] : 1.0f) + (b ? b[n] : 0.0f);            \
        }                                                                                              \
    }

BLOCK(block_f32, float, vload, 4)
BLOCK(block_q8, int8_t, vload8, 1)
TAIL(tail_f32, float, vload)
TAIL(tail_q8, int8_t, vload8)

#define LINEAR(NAME, WT, BLK, TL)                                                                      \
    void NAME(const float *x, const WT *w, const float *scale, const float *b, float *y, int T, int N, int K) { \
        const char *end = (const char *)(w + (size_t)N * K);                                           \
        int blocks = N / R;                                                                            \
        _Pragma("omp parallel for schedule(static)")                                                   \
        for (int i = 0; i < blocks; i++) BLK(x, w, scale, b, y, T, N, K, i * R, end);                  \
        for (int n = blocks * R; n < N; n++) TL(x, w, scale, b, y, T, N, K, n);                        \
    }

LINEAR(dsk_f32_linear, float, block_f32, tail_f32)
LINEAR(dsk_q8_linear, int8_t, block_q8, tail_q8)
#endif
