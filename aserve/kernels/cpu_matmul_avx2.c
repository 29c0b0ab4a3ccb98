/* The packed matrix products (linear_vnni_bf16, linear_int4_bf16 in cpu_matmul.c) on CPUs with AVX2 and
 * FMA but no AVX512-BF16 (Zen 2 / Zen 3, Intel before Cooper Lake): the same packed layouts, each weight
 * widened to fp32 exactly (a bf16 is the top half of its fp32; a 4-bit code becomes the bf16 of 128 + q),
 * x converted to fp32 once per call, and fp32 FMAs. Every output column has one accumulation order whatever
 * the block (k in sequence; for 4-bit codes the low and the high nibbles of a step in two accumulators,
 * added per group), so a row's result is bitwise the same alone or in a batch. Built and loaded by
 * cpu_ops.py with the other kernels; these functions trust their input.
 */
#include "cpu_common.h"

#if ASERVE_PACKED_AVX2
#include <immintrin.h>

/* x [M, K] bf16 (rows x_stride apart) as contiguous fp32 [M, K]; NULL when it cannot be allocated. */
static float *rows_to_f32(const bf16 *x, int64_t x_stride, int64_t M, int64_t K) {
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    if (!xf) return NULL;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) xf[i * K + k] = bf16_to_f32(x[i * x_stride + k]);
    return xf;
}

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

/* One row of xf against NV vectors of 8 columns: vnni_block_avx2's sums in its order (so a row's result does
 * not depend on M), accumulated in a local array, which the compiler keeps in registers for the one-row
 * case (the decode step's weight stream); for the batched blocks it schedules acc itself better. */
static inline __attribute__((always_inline)) void vnni_row_avx2(const float *xf, int64_t K, const bf16 *wp,
                                                                const int64_t NV, __m256 acc[4][8]) {
    const int64_t pairs = K / 2, group_stride = pairs * 32;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 sum[8];
    for (int64_t v = 0; v < NV; v++) sum[v] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++)
        for (int64_t v = 0; v < NV; v++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wp + (v / 2) * group_stride + kp * 32 + (v % 2) * 16));
            sum[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)), _mm256_broadcast_ss(xf + 2 * kp + 1),
                                     _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                                                     _mm256_broadcast_ss(xf + 2 * kp), sum[v]));
        }
    for (int64_t v = 0; v < NV; v++) acc[0][v] = sum[v];
}

#define AVX2_ROW_VECTORS 8 /* a one-row chunk: 4 groups of 16 columns */
#define AVX2_BLOCK_ROWS 4  /* a batch's register block: 4 rows x 2 vectors (one group of 16 columns) */

int64_t linear_vnni_avx2(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32) {
    float *xf = rows_to_f32(x, x_stride, M, K);
    if (!xf) return -2;
    const int64_t groups = N / 16, per_chunk = M == 1 ? AVX2_ROW_VECTORS / 2 : 1;
    shared_chunks work;
    shared_chunks_init(&work, groups, per_chunk);
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, g0, ng;
        while (shared_chunks_next(&work, &cursor, &g0, &ng)) {
            const bf16 *wp = w_packed + g0 * (K / 2) * 32;
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
                for (int64_t i = 0; i < mb; i++)
                    store_vectors(y, (m0 + i) * y_stride + g0 * 16, acc[i], 2 * ng, bias ? bias + g0 * 16 : NULL,
                                  y_f32);
            }
        }
    }
    free(xf);
    return 0;
}

/* A group of 16 columns in two vectors of 8 as unpack_epi8 leaves them: columns {0-3, 8-11} and {4-7, 12-15}. */
static inline void split_halves(const uint16_t *h16, __m256 *a, __m256 *b) { /* 16 fp16 values -> both orders */
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h16));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h16 + 8)));
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

/* Rows [0, MB) against one group of 16 columns of pack_int4 codes from qp, group by group of k:
 * total[i][h] = sum over groups of d * (sum of (128 + q) x) + (m - 128 d) * (sum of x), columns 8 h .. 8 h + 7.
 * A step's 32 code bytes (16 columns x 2, see int4_codes_to_bf16) split into low and high nibbles, and each
 * byte interleaved with 0x43 becomes the bf16 of 128 + q: dot-product pairs (k, k + 1) per 32-bit lane,
 * widened as in vnni_block_avx2, for the columns in split_halves' order (put back at the end). One group a
 * block: more spill registers. */
static inline __attribute__((always_inline)) void int4_block_avx2(const float *xf, int64_t K, const float *xsum,
                                                                  int64_t groups, const uint8_t *qp,
                                                                  const uint16_t *dp, const uint16_t *mp, int64_t gs,
                                                                  const int64_t MB, __m256 total[2][2]) {
    const int64_t g_steps = gs / 4;
    const __m256i low4 = _mm256_set1_epi8(0x0F), exponent = _mm256_set1_epi8(0x43);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t i = 0; i < MB; i++) total[i][0] = total[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 lo[2][2], hi[2][2]; /* k = 4t, 4t + 1 | 4t + 2, 4t + 3 */
        for (int64_t i = 0; i < MB; i++)
            for (int64_t h = 0; h < 2; h++) lo[i][h] = hi[i][h] = _mm256_setzero_ps();
        for (int64_t t = g * g_steps; t < (g + 1) * g_steps; t++) {
            const __m256i r = _mm256_loadu_si256((const __m256i *)(qp + t * 32));
            const __m256i nib_lo = _mm256_and_si256(r, low4);
            const __m256i nib_hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), low4);
            const __m256i pairs[4] = {_mm256_unpacklo_epi8(nib_lo, exponent), _mm256_unpackhi_epi8(nib_lo, exponent),
                                      _mm256_unpacklo_epi8(nib_hi, exponent), _mm256_unpackhi_epi8(nib_hi, exponent)};
            for (int64_t p = 0; p < 4; p++) { /* p / 2: low or high nibbles; p % 2 = h: which half of the columns */
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs[p], 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pairs[p], high));
                const int64_t h = p % 2;
                for (int64_t i = 0; i < MB; i++) {
                    const float *xr = xf + i * K + 4 * t + 2 * (p / 2);
                    const __m256 sum = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(xr + 1),
                                                       _mm256_fmadd_ps(even, _mm256_broadcast_ss(xr),
                                                                       p < 2 ? lo[i][h] : hi[i][h]));
                    if (p < 2) lo[i][h] = sum;
                    else hi[i][h] = sum;
                }
            }
        }
        __m256 d[2], m[2];
        split_halves(dp + g * 16, &d[0], &d[1]);
        split_halves(mp + g * 16, &m[0], &m[1]);
        for (int64_t h = 0; h < 2; h++) {
            const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(128.0f), d[h], m[h]); /* codes entered as 128 + q */
            for (int64_t i = 0; i < MB; i++)
                total[i][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[i * groups + g]),
                                              _mm256_fmadd_ps(d[h], _mm256_add_ps(lo[i][h], hi[i][h]), total[i][h]));
        }
    }
    for (int64_t i = 0; i < MB; i++) { /* back to column order */
        const __m256 a = total[i][0], b = total[i][1];
        total[i][0] = _mm256_permute2f128_ps(a, b, 0x20);
        total[i][1] = _mm256_permute2f128_ps(a, b, 0x31);
    }
}

int64_t linear_int4_avx2(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d,
                         const uint16_t *m, const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N,
                         int64_t K, int64_t y_f32, int64_t gs) {
    const int64_t groups = K / gs, col_groups = N / 16;
    float *xf = rows_to_f32(x, x_stride, M, K);
    float *xsum = row_group_sums(x, x_stride, M, K, gs);
    if (!xf || !xsum) {
        free(xf);
        free(xsum);
        return -2;
    }
    shared_chunks work;
    shared_chunks_init(&work, col_groups, 1); /* chunks of one group of 16 columns */
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, c0, ng;
        while (shared_chunks_next(&work, &cursor, &c0, &ng)) {
            const uint8_t *qp = q_packed + c0 * K * 8;
            const uint16_t *dp = d + c0 * groups * 16, *mp = m + c0 * groups * 16;
            for (int64_t m0 = 0; m0 < M; m0 += 2) {
                const int64_t mb = (M - m0) < 2 ? (M - m0) : 2;
                const float *xb = xf + m0 * K, *xs = xsum + m0 * groups;
                __m256 total[2][2];
                if (mb == 2) int4_block_avx2(xb, K, xs, groups, qp, dp, mp, gs, 2, total);
                else int4_block_avx2(xb, K, xs, groups, qp, dp, mp, gs, 1, total);
                for (int64_t i = 0; i < mb; i++)
                    store_vectors(y, (m0 + i) * y_stride + c0 * 16, total[i], 2, bias ? bias + c0 * 16 : NULL, y_f32);
            }
        }
    }
    free(xf);
    free(xsum);
    return 0;
}
#endif
