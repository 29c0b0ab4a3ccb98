/* The packed matrix products (linear_vnni_bf16, linear_int4_bf16 in cpu_matmul.c) on CPUs with AVX2 and
 * FMA but no AVX512-BF16 (Zen 2 / Zen 3, Intel before Cooper Lake). linear_vnni: the same packed layout as
 * the AVX512 form, each bf16 weight widened to fp32 exactly (the top half of its fp32), x converted to fp32
 * once per call, fp32 FMAs. linear_int4: integer dot products on the code bytes with x rounded per 32 to
 * 15-bit integers, in its own packed order (see int4_rows_avx2). Every output column has one accumulation
 * order whatever the block, so a row's result is bitwise the same alone or in a batch. Built and loaded by
 * cpu_ops.py with the other kernels; these functions trust their input.
 */
#include "cpu_decode.h"

#if ASERVE_PACKED_AVX2
#include <immintrin.h>

/* y[row, col0 + 8 v + l] = acc[v] lane l (+ bias) for v < nv. */
static inline void store_vectors(void *y, int64_t at, const __m256 *acc, int64_t nv, const bf16 *bias,
                                 int64_t y_f32) {
    for (int64_t v = 0; v < nv; v++) {
        float out[8];
        _mm256_storeu_ps(out, acc[v]);
        store_outputs(y, at + 8 * v, out, bias ? bias + 8 * v : NULL, 8, y_f32);
    }
}

/* Rows [0, MB) of xf (fp32, row stride K) against NV vectors of 8 columns (NV / 2 groups of 16) of a
 * pack_vnni weight starting at wp: acc[i][v]. One pair row of a group holds (w[c][k], w[c][k + 1]) per
 * 32-bit lane, so the even k is the lane shifted left by 16 and the odd k the lane's top half. */
static inline __attribute__((always_inline)) void vnni_block_avx2(const float *xf, int64_t K, const bf16 *wp,
                                                                  const int64_t MB, const int64_t NV,
                                                                  __m256 acc[4][8]) {
    const int64_t pairs = K / 2, group_stride = pairs * 32;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t i = 0; i < MB; i++)
        for (int64_t v = 0; v < NV; v++) acc[i][v] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
        for (int64_t v = 0; v < NV; v++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + (v / 2) * group_stride + kp * 32 + (v % 2) * 16));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
            for (int64_t i = 0; i < MB; i++) {
                const float *xr = xf + i * K + 2 * kp;
                acc[i][v] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr + 1),
                                            _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr), acc[i][v]));
            }
        }
    }
}

/* Lines ahead the one-row product prefetches in each of its column groups' streams: a few lines cover the
 * hardware prefetcher's ramp at each group's start (a group is one stream of K * 32 bytes); far ahead the
 * prefetches only compete with the demand loads (measured on Zen 3, in the decode step: 2 and 48 lose, 4-6
 * win). */
#define ROW_PREFETCH_LINES 5

/* One row of xf against NV vectors of 8 columns: vnni_block_avx2's sums in its order (so a row's result does
 * not depend on M), accumulated in a local array, which the compiler keeps in registers for the one-row
 * case (the decode step's weight stream); for the batched blocks it schedules acc itself better. */
static inline __attribute__((always_inline)) void vnni_row_avx2(const float *xf, int64_t K, const bf16 *wp,
                                                                const int64_t NV, __m256 acc[4][8]) {
    const int64_t pairs = K / 2, group_stride = pairs * 32;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 sum[8];
    for (int64_t v = 0; v < NV; v++) sum[v] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
        if (kp + ROW_PREFETCH_LINES < pairs) /* (a pair row of a group is one 64-byte line) */
            for (int64_t v = 0; v < NV; v += 2)
                _mm_prefetch((const char *)(wp + (v / 2) * group_stride + (kp + ROW_PREFETCH_LINES) * 32), _MM_HINT_T0);
        for (int64_t v = 0; v < NV; v++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + (v / 2) * group_stride + kp * 32 + (v % 2) * 16));
            sum[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)), _mm256_broadcast_ss(xf + 2 * kp + 1),
                                     _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                                                     _mm256_broadcast_ss(xf + 2 * kp), sum[v]));
        }
    }
    for (int64_t v = 0; v < NV; v++) acc[0][v] = sum[v];
}

#define AVX2_ROW_VECTORS 8 /* a one-row chunk: 4 groups of 16 columns */
#define AVX2_BLOCK_ROWS 4  /* a batch's register block: 4 rows x 2 vectors (one group of 16 columns) */

int64_t vnni_avx2_chunk_groups(int64_t M) { return M == 1 ? AVX2_ROW_VECTORS / 2 : 1; }

void vnni_avx2_chunk(const float *xf, const bf16 *w_packed, const bf16 *bias, void *y, int64_t y_stride, int64_t M,
                     int64_t K, int64_t y_f32, int64_t g0, int64_t ng, chunk_commit *commit) {
    const bf16 *wp = w_packed + g0 * (K / 2) * 32;
    const bf16 *b = bias ? bias + g0 * 16 : NULL;
    const int deferred = commit && commit->state;
    const int64_t nv = 2 * ng;
    __m256 kept[deferred ? M * nv : 1]; /* the results until the chunk may store them */
    for (int64_t m0 = 0; m0 < M; m0 += AVX2_BLOCK_ROWS) {
        const int64_t mb = (M - m0) < AVX2_BLOCK_ROWS ? (M - m0) : AVX2_BLOCK_ROWS;
        const float *xb = xf + m0 * K;
        __m256 acc[4][8];
        if (M == 1 && ng == AVX2_ROW_VECTORS / 2) vnni_row_avx2(xb, K, wp, AVX2_ROW_VECTORS, acc);
        else if (M == 1) vnni_row_avx2(xb, K, wp, 2 * ng, acc);
        else if (mb == 4) vnni_block_avx2(xb, K, wp, 4, 2, acc); /* (M > 1: chunks of one group) */
        else if (mb == 3) vnni_block_avx2(xb, K, wp, 3, 2, acc);
        else if (mb == 2) vnni_block_avx2(xb, K, wp, 2, 2, acc);
        else vnni_block_avx2(xb, K, wp, 1, 2, acc);
        for (int64_t i = 0; i < mb; i++) {
            if (deferred) memcpy(kept + (m0 + i) * nv, acc[i], (size_t)nv * sizeof(__m256));
            else store_vectors(y, (m0 + i) * y_stride + g0 * 16, acc[i], nv, b, y_f32);
        }
    }
    if (!deferred || !chunk_commit_begin(commit)) return;
    for (int64_t i = 0; i < M; i++) store_vectors(y, i * y_stride + g0 * 16, kept + i * nv, nv, b, y_f32);
    chunk_commit_end(commit);
}

float *vnni_avx2_rows(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, float *xf) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) xf[i * K + k] = bf16_to_f32(x[i * x_stride + k]);
    return xf;
}

int64_t linear_vnni_avx2(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32) {
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return -2;
    vnni_avx2_rows(x, x_stride, M, K, xf);
    shared_chunks work;
    shared_chunks_init(&work, N / 16, vnni_avx2_chunk_groups(M));
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, g0, ng;
        while (shared_chunks_next(&work, &cursor, &g0, &ng))
            vnni_avx2_chunk(xf, w_packed, bias, y, y_stride, M, K, y_f32, g0, ng, NULL);
    }
    free(xf);
    return 0;
}

/* The 4-bit product in integer dot products. x is rounded per 32 to 15-bit integers (scale max|x| / 16383,
 * nearest even; finer than bf16 where it matters, near each group's largest |x|) held as two bytes, xq =
 * 128 xh + xl with xh in [-128, 127] and xl in [0, 127], and each code byte (0..15) multiplies them in
 * _mm256_maddubs_epi16 (u8 x s8 pairs: at most 2 x 15 x 128 a lane, 8 steps of 4 k a sum: no saturation).
 * pack_int4's AVX2 order puts, for step t (k = 4t .. 4t + 3) of a group of 16 columns, byte 4c + j =
 * code(4t + j, column c) | code(4t + j, column c + 8) << 4, so the low nibbles are columns 0-7 and the high
 * ones 8-15, each column's 4 codes side by side: maddubs then _mm256_madd_epi16 by ones sum them per column,
 * in column order. Per group: d * (sum over its 32s of xs * integer dot) + m * (sum of x), in fp32. x's
 * rounded form is an int4_rows (cpu_decode.h: the team form of the decode step keeps one in its scratch). */
static void int4_rows_free(int4_rows *r) {
    free(r->xh);
    free(r->xl);
    free(r->xs);
    free(r->xsum);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* 32 values of x (bf16) as 15-bit integers xq = round(x * (16383 / max|x|)) (nearest even) split into xh, xl;
 * returns their sum (fp32, for the offset term) and sets *scale = max|x| / 16383. */
static inline float quantize32_int15(const bf16 *xg, int8_t *xh, int8_t *xl, float *scale) {
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j < 4; j++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(xg + 8 * j));
        v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        sum = _mm256_add_ps(sum, v[j]);
    }
    const float m = hmax8(amax);
    *scale = m / 16383.0f;
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? 16383.0f / m : 0.0f);
    int32_t q[32];
    for (int64_t j = 0; j < 4; j++)
        _mm256_storeu_si256((__m256i *)(q + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)));
    for (int64_t j = 0; j < 32; j++) {
        xh[j] = (int8_t)(q[j] >> 7); /* arithmetic shift: floor */
        xl[j] = (int8_t)(q[j] & 127);
    }
    return hsum8(sum);
}

/* Fills r (its arrays allocated by the caller for M rows of K) from x [M, K] bf16. */
void int4_avx2_rows(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, int64_t gs, const int4_rows *r) {
#pragma omp parallel for if (M * K > 65536)
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < K / gs; g++) {
            float sum = 0.0f;
            for (int64_t sub = g * (gs / 32); sub < (g + 1) * (gs / 32); sub++)
                sum += quantize32_int15(x + i * x_stride + sub * 32, r->xh + i * K + sub * 32, r->xl + i * K + sub * 32,
                                        r->xs + i * (K / 32) + sub);
            r->xsum[i * (K / gs) + g] = sum;
        }
}

/* x [M, K] bf16 as int4_rows; 0, or -2 when out of memory (everything freed). */
static int64_t int4_rows_make(const bf16 *x, int64_t x_stride, int64_t M, int64_t K, int64_t gs, int4_rows *r) {
    r->xh = malloc((size_t)(M * K));
    r->xl = malloc((size_t)(M * K));
    r->xs = malloc((size_t)(M * K / 32) * sizeof(float));
    r->xsum = malloc((size_t)(M * K / gs) * sizeof(float));
    if (!r->xh || !r->xl || !r->xs || !r->xsum) {
        int4_rows_free(r);
        return -2;
    }
    int4_avx2_rows(x, x_stride, M, K, gs, r);
    return 0;
}

/* Rows [i0, i0 + MB) of r (MB 1 or 2: a step's codes are loaded and split once for both) against one group of
 * 16 columns (codes qp, fp16 d / m rows dp / mp): out[i][0] columns 0-7, out[i][1] 8-15. Each row's arithmetic
 * is the same whatever MB (a row's result does not depend on the batch). */
static inline __attribute__((always_inline)) void int4_rows_avx2(const int4_rows *r, int64_t i0, const int64_t MB,
                                                                 int64_t K, int64_t gs, const uint8_t *qp,
                                                                 const uint16_t *dp, const uint16_t *mp,
                                                                 __m256 out[2][2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < MB; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / gs; g++) {
        __m256 dot[2][2];
        for (int64_t i = 0; i < MB; i++) dot[i][0] = dot[i][1] = _mm256_setzero_ps();
        for (int64_t sub = g * (gs / 32); sub < (g + 1) * (gs / 32); sub++) {
            __m256i h16[2][2], l16[2][2];
            for (int64_t i = 0; i < MB; i++)
                h16[i][0] = h16[i][1] = l16[i][0] = l16[i][1] = _mm256_setzero_si256();
            for (int64_t t = sub * 8; t < sub * 8 + 8; t++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i *)(qp + t * 32));
                const __m256i c[2] = {_mm256_and_si256(codes, low4),
                                      _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4)};
                for (int64_t i = 0; i < MB; i++) {
                    int32_t h4, l4;
                    memcpy(&h4, r->xh + (i0 + i) * K + 4 * t, 4);
                    memcpy(&l4, r->xl + (i0 + i) * K + 4 * t, 4);
                    const __m256i xh4 = _mm256_set1_epi32(h4), xl4 = _mm256_set1_epi32(l4);
                    for (int64_t h = 0; h < 2; h++) {
                        h16[i][h] = _mm256_add_epi16(h16[i][h], _mm256_maddubs_epi16(c[h], xh4));
                        l16[i][h] = _mm256_add_epi16(l16[i][h], _mm256_maddubs_epi16(c[h], xl4));
                    }
                }
            }
            for (int64_t i = 0; i < MB; i++) {
                const __m256 scale = _mm256_set1_ps(r->xs[(i0 + i) * (K / 32) + sub]);
                for (int64_t h = 0; h < 2; h++) {
                    const __m256i whole = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(h16[i][h], ones), 7),
                                                           _mm256_madd_epi16(l16[i][h], ones));
                    dot[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole), scale, dot[i][h]);
                }
            }
        }
        for (int64_t h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + g * 16 + 8 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + g * 16 + 8 * h)));
            for (int64_t i = 0; i < MB; i++)
                out[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(r->xsum[(i0 + i) * (K / gs) + g]),
                                            _mm256_fmadd_ps(d, dot[i][h], out[i][h]));
        }
    }
}

void int4_avx2_chunk(const int4_rows *r, const uint8_t *q_packed, const uint16_t *d, const uint16_t *m,
                     const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t K, int64_t y_f32, int64_t gs,
                     int64_t c0, chunk_commit *commit) {
    const int64_t groups = K / gs;
    const uint8_t *qp = q_packed + c0 * K * 8;
    const uint16_t *dp = d + c0 * groups * 16, *mp = m + c0 * groups * 16;
    const bf16 *b = bias ? bias + c0 * 16 : NULL;
    const int deferred = commit && commit->state;
    __m256 kept[deferred ? M * 2 : 1]; /* the results until the chunk may store them */
    for (int64_t i0 = 0; i0 < M; i0 += 2) {
        __m256 total[2][2];
        const int64_t mb = (M - i0) < 2 ? (M - i0) : 2;
        if (mb == 2) int4_rows_avx2(r, i0, 2, K, gs, qp, dp, mp, total);
        else int4_rows_avx2(r, i0, 1, K, gs, qp, dp, mp, total);
        for (int64_t i = 0; i < mb; i++) {
            if (deferred) memcpy(kept + (i0 + i) * 2, total[i], 2 * sizeof(__m256));
            else store_vectors(y, (i0 + i) * y_stride + c0 * 16, total[i], 2, b, y_f32);
        }
    }
    if (!deferred || !chunk_commit_begin(commit)) return;
    for (int64_t i = 0; i < M; i++) store_vectors(y, i * y_stride + c0 * 16, kept + i * 2, 2, b, y_f32);
    chunk_commit_end(commit);
}

int64_t linear_int4_avx2(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d,
                         const uint16_t *m, const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N,
                         int64_t K, int64_t y_f32, int64_t gs) {
    int4_rows rows;
    if (int4_rows_make(x, x_stride, M, K, gs, &rows)) return -2;
    shared_chunks work;
    shared_chunks_init(&work, N / 16, 1); /* chunks of one group of 16 columns */
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, c0, ng;
        while (shared_chunks_next(&work, &cursor, &c0, &ng))
            int4_avx2_chunk(&rows, q_packed, d, m, bias, y, y_stride, M, K, y_f32, gs, c0, NULL);
    }
    int4_rows_free(&rows);
    return 0;
}
#endif

/* Column groups [g0, g0 + ng) of the AVX2 form's pack_int4 weight (codes [N/16, K/4, 32]: byte 4c + j of step t
 * holds k = 4t + j of columns c (low nibble) and c + 8 (high); fp16 d, m [N/16, K/gs, 16]) dequantized into
 * wt [K, 16 ng] fp32, their transpose, w = q d + m, for a float32 GEMM library's prefill-sized products
 * (cpu_float_gemm.py); 0, or -1 on builds without the AVX2 form (whose codes are in another order). */
int64_t unpack_int4_f32(const uint8_t *q_packed, const uint16_t *d, const uint16_t *m, int64_t K, int64_t gs,
                        int64_t g0, int64_t ng, float *wt) {
#if ASERVE_PACKED_AVX2
    const int64_t steps = K / 4, width = 16 * ng;
    /* per 128-bit lane (4 columns), bytes regrouped k-major: 32-bit element j holds k = 4t + j of its 4 columns */
    const __m256i by_k = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma omp parallel for schedule(static) if (width * K > 65536)
    for (int64_t t = 0; t < steps; t++)
        for (int64_t g = 0; g < ng; g++) {
            const __m256i bytes = _mm256_shuffle_epi8(
                _mm256_loadu_si256((const __m256i *)(q_packed + ((g0 + g) * steps + t) * 32)), by_k);
            const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            const int64_t at = ((g0 + g) * (K / gs) + 4 * t / gs) * 16;
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + at)));
            const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + at + 8)));
            const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + at)));
            const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + at + 8)));
            for (int j = 0; j < 4; j++) { /* row k = 4t + j: columns 0-7 from the low nibbles, 8-15 from the high */
                const __m256i pick = _mm256_setr_epi32(j, j + 4, 0, 0, 0, 0, 0, 0);
                const __m128i q0 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(lo, pick));
                const __m128i q1 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(hi, pick));
                float *row = wt + (4 * t + j) * width + g * 16;
                _mm256_storeu_ps(row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q0)), d0, m0));
                _mm256_storeu_ps(row + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q1)), d1, m1));
            }
        }
    return 0;
#else
    (void)q_packed; (void)d; (void)m; (void)K; (void)gs; (void)g0; (void)ng; (void)wt;
    return -1;
#endif
}
