/* draftsmith's few-row CPU kernels: y (T, N) = x (T, K) @ W (N, K)^T for T = 1..MAX_T rows in one pass over W
 * (more rows, a draft's prefill: a block of output rows at a time over every MAX_T rows, its weights then read
 * from cache), W float32, int8 with one float scale per output row (the int8 draft's weights) or int4 in groups of
 * 32 (the int4 draft's, below), streamed once with software prefetch, 2 threads of the OpenMP runtime torch
 * already loaded. Every output is one vector accumulator summed over K in order and reduced the same way whatever
 * T is, so a row's result does not
 * depend on the rows beside it (bit for bit). T rows share each weight vector loaded (T multiply-adds a weight:
 * past 8 rows the multiply-adds, not the reads, set the pace). decode/runtime/native.py builds it on first use
 * through torch.utils.cpp_extension (the C++ compiler, -O3 -march=native -fopenmp; no torch header: a plain C ABI,
 * `extern "C"` when compiled as C++) and calls it through ctypes. K must be a multiple of LANES. Built for AVX-512F
 * or AVX2 + FMA; anything else gets no kernels. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <immintrin.h>

#ifdef __cplusplus /* cpp_extension compiles it as C++: the entry points keep their C names */
extern "C" {
#endif

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
    BLOCK(many_f32_##T, float, vload, 4, T, RR_MANY)                                                       \
    BLOCK(many_q8_##T, int8_t, vload8, 1, T, RR_MANY)                                                      \
    ROWS_FN(f32_##T, float, block_f32_##T, tail_f32_##T, RR)                                               \
    ROWS_FN(q8_##T, int8_t, block_q8_##T, tail_q8_##T, RR)

/* More than MAX_T rows (a prompt's prefill): blocks of RR_MANY output rows shared among the threads, each block's
 * weights read from memory once and then from cache for every MAX_T input rows in turn (the same per-row sums:
 * the same bits as a call over those rows alone). */
#define MANY_FN(NAME, WT, BLKS, TAILS)                                                                     \
    static void NAME(const float *x, const WT *w, const float *s, const float *b, float *y, int T, int N, int K) { \
        const char *end = (const char *)(w + (size_t)N * K);                                               \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int i = 0; i < N / RR_MANY; i++)                                                              \
            for (int t0 = 0; t0 < T; t0 += MAX_T) {                                                        \
                int n = T - t0 < MAX_T ? T - t0 : MAX_T;                                                   \
                BLKS[n - 1](x + (size_t)t0 * K, w, s, b, y + (size_t)t0 * N, N, K, i * RR_MANY, end);      \
            }                                                                                              \
        for (int r = N / RR_MANY * RR_MANY; r < N; r++)                                                    \
            for (int t0 = 0; t0 < T; t0 += MAX_T) {                                                        \
                int n = T - t0 < MAX_T ? T - t0 : MAX_T;                                                   \
                TAILS[n - 1](x + (size_t)t0 * K, w, s, b, y + (size_t)t0 * N, N, K, r, end);               \
            }                                                                                              \
    }

/* int4 weights, int8 inputs. A weight row is kept in groups of 32 along K, each with a float scale and minimum
 * (w = q * scale + min, q in 0..15, the pair as float16), the rows interleaved 16 at a time (`BLOCK4`): a lane of
 * the integer dot products is one output row, so a group's 32 products sum in int32 in that lane and take its
 * scale once, and no lane sums need reducing at the end. Each input row is quantised to int8 with one scale
 * (max |x| / 127): w . x = sum over groups of scale * (q . xq) + min * (sum of the group's xq), times the row's
 * scale. Needs AVX-512BW (VNNI where present) or AVX2. */
#if LANES == 16 && defined(__AVX512BW__)
#define Q4
static inline vf vmaxabs(vf m, vf v) { return _mm512_max_ps(m, _mm512_abs_ps(v)); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline void vquant(const float *x, float inv, int8_t *q) {
    __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(vload(x), _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(i));
}
typedef __m512i vi;
static inline vi viload(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vilo(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline vi vihi(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline vf vicvt(vi v) { return _mm512_cvtepi32_ps(v); }
#elif LANES == 8
#define Q4
static inline vf vmaxabs(vf m, vf v) { return _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)); }
static inline float vhmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline void vquant(const float *x, float inv, int8_t *q) {
    __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(vload(x), _mm256_set1_ps(inv)));
    __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(h, h));
}
typedef __m256i vi;
static inline vi viload(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vilo(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline vi vihi(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
static inline vf vicvt(vi v) { return _mm256_cvtepi32_ps(v); }
#endif

#ifdef Q4
#define GROUP 32 /* weights a (scale, minimum) pair covers along K */
#define RB 16 /* output rows a block: the weights of 16 rows interleaved, one int32 lane each (LANES == 16) */
#define HALVES (RB / LANES) /* AVX2 runs a block as two halves of 8 rows */
#ifndef AHEAD4
#define AHEAD4 1024 /* bytes ahead of the block's stream to prefetch, until dsk_set_q4_ahead sets another */
#endif
static int ahead4 = AHEAD4; /* decode/runtime/native.py times a few distances once per machine and sets the fastest */
/* The integer dot product of 4 unsigned nibbles by 4 signed int8 inputs a lane, added to acc. */
#if LANES == 16
static inline vi q4dot(vi acc, vi w, vi x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}
static inline vi vbcast(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vi vizero(void) { return _mm512_setzero_si512(); }
static inline vf vhalf(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline void vstore_n(float *y, vf v, int n) { _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), v); }
static inline vf vload_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
#else
static inline vi q4dot(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline vi vbcast(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline vi vizero(void) { return _mm256_setzero_si256(); }
static inline vf vhalf(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void vstore_n(float *y, vf v, int n) {
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < n; i++) y[i] = t[i];
}
static inline vf vload_n(const float *p, int n) {
    float t[8] = {0};
    for (int i = 0; i < n; i++) t[i] = p[i];
    return _mm256_loadu_ps(t);
}
#endif

/* Output rows [16 blk + LANES h, + LANES) over T input rows. The block's weights: for each group g of K, 4 steps of
 * 64 bytes, byte 4 j + i of step s holding row j's weight 32 g + 8 s + i (low nibble) and + 4 (high nibble), i < 4;
 * sm: for each group 16 scales then 16 minimums (float16). Each lane sums its row's group in int32 (exact), then
 * a = a + float(sum) * scale + min * (the group's sum of xq): the same operations in the same order whatever T. */
#define BLOCK4(T)                                                                                          \
    static void block_q4_##T(const int8_t *xq, const float *xg, const float *sx, const uint8_t *w,          \
                             const uint16_t *sm, const float *b, float *y, int N, int K, int blk, int h) {  \
        const int G = K / GROUP;                                                                           \
        const uint8_t *wb = w + (size_t)blk * G * 4 * 64 + h * LANES * 4;                                  \
        const uint16_t *sb = sm + (size_t)blk * G * 2 * RB + h * LANES;                                    \
        const char *end = (const char *)(w + (size_t)((N + RB - 1) / RB) * G * 4 * 64);                      \
        vf a[T];                                                                                           \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) a[t] = vzero();                               \
        for (int g = 0; g < G; g++) {                                                                      \
            const uint8_t *p = wb + (size_t)g * 4 * 64;                                                    \
            const char *pf = (const char *)p + ahead4;                                                     \
            _Pragma("GCC unroll 4") for (int o = 0; o < 4 * 64; o += 64)                                  \
                if (pf + o < end) __builtin_prefetch(pf + o, 0, PF_HINT);                                  \
            vi lo[T], hi[T];                                                                               \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) lo[t] = hi[t] = vizero();                 \
            _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {                                          \
                vi v = viload(p + 64 * s);                                                                 \
                vi wl = vilo(v), wh = vihi(v);                                                             \
                _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {                                     \
                    const int8_t *xp = xq + (size_t)t * K + (size_t)g * GROUP + 8 * s;                     \
                    lo[t] = q4dot(lo[t], wl, vbcast(xp));                                                  \
                    hi[t] = q4dot(hi[t], wh, vbcast(xp + 4));                                              \
                }                                                                                          \
            }                                                                                              \
            vf sc = vhalf(sb + (size_t)g * 2 * RB), mn = vhalf(sb + (size_t)g * 2 * RB + RB);              \
            _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {                                         \
                a[t] = vfma(vicvt(VIADD(lo[t], hi[t])), sc, a[t]);                                         \
                a[t] = vfma(mn, VSET1(xg[(size_t)t * G + g]), a[t]);                                       \
            }                                                                                              \
        }                                                                                                  \
        const int n0 = blk * RB + h * LANES, n = N - n0 < LANES ? N - n0 : LANES;                          \
        if (n <= 0) return;                                                                                \
        vf bias = b ? vload_n(b + n0, n) : vzero();                                                        \
        _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {                                             \
            vf r = vfma(a[t], VSET1(sx[t]), bias);                                                          \
            if (n == LANES) vstore(y + (size_t)t * N + n0, r); else vstore_n(y + (size_t)t * N + n0, r, n); \
        }                                                                                                  \
    }                                                                                                      \
    static void q4_##T(const int8_t *xq, const float *xg, const float *sx, const uint8_t *w,                \
                       const uint16_t *sm, const float *b, float *y, int N, int K) {                       \
        const int blocks = (N + RB - 1) / RB;                                                              \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int i = 0; i < blocks * HALVES; i++) block_q4_##T(xq, xg, sx, w, sm, b, y, N, K, i / HALVES, i % HALVES); \
    }
#if LANES == 16
#define VIADD(a, b) _mm512_add_epi32(a, b)
#define VSET1(x) _mm512_set1_ps(x)
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
#else
#define VIADD(a, b) _mm256_add_epi32(a, b)
#define VSET1(x) _mm256_set1_ps(x)
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
#endif
BLOCK4(1) BLOCK4(2) BLOCK4(3) BLOCK4(4) BLOCK4(5) BLOCK4(6)
BLOCK4(7) BLOCK4(8) BLOCK4(9) BLOCK4(10) BLOCK4(11) BLOCK4(12)
#endif

/* Output rows a block by input rows: T * RR accumulators plus a weight vector within the register file (32 vector
 * registers with AVX-512, 16 with AVX2). */
#if LANES == 16
#define RR_MANY 2 /* output rows a block over more than MAX_T rows: MAX_T * RR_MANY accumulators */
#else
#define RR_MANY 1
#endif
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
typedef void (*f32_blk)(const float *, const float *, const float *, const float *, float *, int, int, int,
                        const char *);
typedef void (*q8_blk)(const float *, const int8_t *, const float *, const float *, float *, int, int, int,
                       const char *);
#define BLOCKS(P) {P##1, P##2, P##3, P##4, P##5, P##6, P##7, P##8, P##9, P##10, P##11, P##12}
static const f32_blk F32_MANY[MAX_T] = BLOCKS(many_f32_), F32_TAIL[MAX_T] = BLOCKS(tail_f32_);
static const q8_blk Q8_MANY[MAX_T] = BLOCKS(many_q8_), Q8_TAIL[MAX_T] = BLOCKS(tail_q8_);
MANY_FN(f32_many, float, F32_MANY, F32_TAIL)
MANY_FN(q8_many, int8_t, Q8_MANY, Q8_TAIL)

/* T >= 1 rows: up to MAX_T in one pass over the weight, more a block of RR_MANY output rows at a time. */
void dsk_f32_linear(const float *x, const float *w, const float *s, const float *b, float *y, int T, int N, int K) {
    if (T >= 1 && T <= MAX_T) F32[T - 1](x, w, s, b, y, N, K);
    else if (T > MAX_T) f32_many(x, w, s, b, y, T, N, K);
}

void dsk_q8_linear(const float *x, const int8_t *w, const float *s, const float *b, float *y, int T, int N, int K) {
    if (T >= 1 && T <= MAX_T) Q8[T - 1](x, w, s, b, y, N, K);
    else if (T > MAX_T) q8_many(x, w, s, b, y, T, N, K);
}

#ifdef Q4
/* x (K) -> xq = round(x / scale) in -127..127, xg = the sums of each group's xq; returns scale = max |x| / 127
 * (1 for a row of zeros). Rounds to nearest even (the default mode), multiplying by 127 / max |x|. */
static float quant_row(const float *x, int8_t *xq, float *xg, int K) {
    vf m = vzero();
    for (int k = 0; k < K; k += LANES) m = vmaxabs(m, vload(x + k));
    float amax = vhmax(m), scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = amax > 0.0f ? 127.0f / amax : 1.0f;
    for (int k = 0; k < K; k += LANES) vquant(x + k, inv, xq + k);
    for (int g = 0; g < K / GROUP; g++) {
        int sum = 0;
        for (int i = 0; i < GROUP; i++) sum += xq[g * GROUP + i];
        xg[g] = (float)sum;
    }
    return scale;
}

typedef void (*q4_fn)(const int8_t *, const float *, const float *, const uint8_t *, const uint16_t *, const float *,
                      float *, int, int);
static const q4_fn Q4S[MAX_T] = {q4_1, q4_2, q4_3, q4_4, q4_5, q4_6, q4_7, q4_8, q4_9, q4_10, q4_11, q4_12};
typedef void (*q4_blk)(const int8_t *, const float *, const float *, const uint8_t *, const uint16_t *,
                       const float *, float *, int, int, int, int);
static const q4_blk Q4_BLOCKS[MAX_T] = BLOCKS(block_q4_);

/* More than MAX_T rows: each block of output rows over every MAX_T input rows in turn, its weights read from memory
 * once and then from cache (the same per-row sums: the same bits as a call over those rows alone). */
static void q4_many(const int8_t *xq, const float *xg, const float *sx, const uint8_t *w, const uint16_t *sm,
                    const float *b, float *y, int T, int N, int K) {
    const int blocks = (N + RB - 1) / RB, G = K / GROUP;
    _Pragma("omp parallel for schedule(static)")
    for (int i = 0; i < blocks * HALVES; i++)
        for (int t0 = 0; t0 < T; t0 += MAX_T) {
            int n = T - t0 < MAX_T ? T - t0 : MAX_T;
            Q4_BLOCKS[n - 1](xq + (size_t)t0 * K, xg + (size_t)t0 * G, sx + t0, w, sm, b, y + (size_t)t0 * N, N, K,
                             i / HALVES, i % HALVES);
        }
}

/* w: ceil(N / 16) blocks of 16 rows (`BLOCK4`'s layout; decode.runtime.quant.pack_int4), N the rows written. Scratch for
 * the int8 inputs: xq (T, K) int8, xg (T, K / GROUP) group sums, sx (T) scales; returns 0 or -1. */
int dsk_q4_linear(const float *x, const uint8_t *w, const uint16_t *sm, const float *b, float *y, int T, int N, int K) {
    if (T < 1 || K % GROUP || K % LANES) return -1;
    int8_t *xq = (int8_t *)aligned_alloc(64, ((size_t)T * K + 63) / 64 * 64);
    float *xg = (float *)aligned_alloc(64, ((size_t)T * (K / GROUP) * 4 + 63) / 64 * 64);
    float *sx = (float *)aligned_alloc(64, ((size_t)T * 4 + 63) / 64 * 64);
    if (!xq || !xg || !sx) { free(xq); free(xg); free(sx); return -1; }
    for (int t = 0; t < T; t++)
        sx[t] = quant_row(x + (size_t)t * K, xq + (size_t)t * K, xg + (size_t)t * (K / GROUP), K);
    if (T <= MAX_T) Q4S[T - 1](xq, xg, sx, w, sm, b, y, N, K);
    else q4_many(xq, xg, sx, w, sm, b, y, T, N, K);
    free(xq);
    free(xg);
    free(sx);
    return 0;
}

int dsk_q4_chunk(void) { return GROUP; } /* a row's length must be a multiple of this */
/* The int4 kernel's prefetch distance in bytes (0..1 << 20; anything else leaves it): returns the one in force. */
int dsk_q4_ahead(int bytes) {
    if (bytes >= 0 && bytes <= (1 << 20)) ahead4 = bytes;
    return ahead4;
}
#endif
#endif

#ifndef Q4 /* no int4 kernel on this CPU (neither AVX-512BW nor AVX2) */
int dsk_q4_linear(const float *x, const uint8_t *w, const uint16_t *sm, const float *b, float *y, int T, int N, int K) {
    return -1;
}
int dsk_q4_chunk(void) { return 0; }
int dsk_q4_ahead(int bytes) { return 0; }
#endif

#ifdef __cplusplus
} /* extern "C" */
#endif
