/* aserve's CPU matrix products for bf16 activations: y = x @ W^T for bf16 weights (Hugging Face layout,
 * or packed in K-pairs) and for group-wise 4-bit weights. Built and loaded by cpu_ops.py, which checks
 * shapes; these functions trust their input.
 */
#include "cpu_team.h"

/* sums[i][j] = x[i] . w[j] for i < mb, j < nb (x rows x_stride apart, w rows K apart). MB / NB are
 * compile-time bounds where inlined with constants (the accumulators then live in registers). */
static inline __attribute__((always_inline)) void dot_block(const bf16 *x, int64_t x_stride, const bf16 *w,
                                                            int64_t K, const int64_t mb, const int64_t nb,
                                                            const bf16 *prefetch, float sums[4][4]) {
#if defined(__AVX512BF16__)
    if (K % 32 == 0) {
        __m512 acc[4][4];
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh wv[4];
            for (int64_t j = 0; j < nb; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            if (prefetch) /* the rows after these: 4 lines per step of 32 columns */
                for (int64_t p = 0; p < 128; p += 32) _mm_prefetch((const char *)(prefetch + k * 4 + p), _MM_HINT_T0);
            for (int64_t i = 0; i < mb; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * x_stride + k);
                for (int64_t j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
            }
        }
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        return;
    }
#endif
    (void)prefetch;
    for (int64_t i = 0; i < mb; i++)
        for (int64_t j = 0; j < nb; j++) {
            const bf16 *xr = x + i * x_stride, *wr = w + j * K;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t k = 0; k < K; k++) dot += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
            sums[i][j] = dot;
        }
}

#define LINEAR_PREFETCH_ROWS 8

/* Weight rows [n0, n0 + nb) (nb <= 4) of linear_bf16 for every row of x; stores under `commit` (NULL: at once). */
void linear_bf16_chunk(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, void *y, int64_t y_stride,
                       int64_t M, int64_t N, int64_t K, int64_t y_f32, int64_t n0, int64_t nb, chunk_commit *commit) {
    const bf16 *wb = w + n0 * K;
    const bf16 *prefetch = (n0 + LINEAR_PREFETCH_ROWS + 4 <= N) ? wb + LINEAR_PREFETCH_ROWS * K : NULL;
    const bf16 *b = bias ? bias + n0 : NULL;
    const int deferred = commit && commit->state;
    float kept[deferred ? M * 4 : 1]; /* the results until the chunk may store them */
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mb = (M - m0) < 4 ? (M - m0) : 4;
        float sums[4][4];
        const bf16 *xb = x + m0 * x_stride;
        if (nb == 4 && mb == 4) dot_block(xb, x_stride, wb, K, 4, 4, m0 ? NULL : prefetch, sums);
        else if (nb == 4 && mb == 1) dot_block(xb, x_stride, wb, K, 1, 4, prefetch, sums);
        else if (nb == 4 && mb == 2) dot_block(xb, x_stride, wb, K, 2, 4, m0 ? NULL : prefetch, sums);
        else dot_block(xb, x_stride, wb, K, mb, nb, m0 ? NULL : prefetch, sums);
        for (int64_t i = 0; i < mb; i++) {
            if (deferred) memcpy(kept + (m0 + i) * 4, sums[i], 4 * sizeof(float));
            else store_outputs(y, (m0 + i) * y_stride + n0, sums[i], b, nb, y_f32);
        }
    }
    if (!deferred || !chunk_commit_begin(commit)) return;
    for (int64_t i = 0; i < M; i++) store_outputs(y, i * y_stride + n0, kept + i * 4, b, nb, y_f32);
    chunk_commit_end(commit);
}

/* y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]); bf16 in and out, fp32 accumulation, one rounding.
 * x rows have stride x_stride, y rows y_stride (elements); w is contiguous (Hugging Face layout). y is
 * float32 (no rounding) when y_f32 is non-zero. Output
 * rows are split across threads (shared_chunks: a contiguous part each, then stealing); each streams
 * its part of w once, 4 rows at a time, against every row of x (so w is read from memory once whatever M is). */
void linear_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t y_f32) {
    shared_chunks work;
    shared_chunks_init(&work, N, 4); /* chunks of 4 weight rows */
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, n0, nb;
        while (shared_chunks_next(&work, &cursor, &n0, &nb))
            linear_bf16_chunk(x, x_stride, w, bias, y, y_stride, M, N, K, y_f32, n0, nb, NULL);
    }
}

/* 1 when this build multiplies bf16 with the CPU's native bf16 dot product (AVX512-BF16), else 0
 * (then linear_bf16 converts to fp32 and is slower than oneDNN: callers keep oneDNN there). */
int64_t has_native_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Column groups [g0, g0 + ng) of a pack_vnni weight ([N/16, K/2, 16, 2] bf16) widened into wt [K, 16 ng] fp32,
 * their transpose (exact: bf16 widens to fp32 without rounding), for a float32 GEMM library's prefill-sized
 * products on CPUs without a bf16 dot product (cpu_float_gemm.py). Each thread writes whole rows of wt. */
void unpack_vnni_f32(const bf16 *packed, int64_t K, int64_t g0, int64_t ng, float *wt) {
    const int64_t pairs = K / 2, width = 16 * ng;
#pragma omp parallel for schedule(static) if (width * K > 65536)
    for (int64_t kp = 0; kp < pairs; kp++) {
        float *even = wt + 2 * kp * width, *odd = even + width;
        for (int64_t g = 0; g < ng; g++) {
            const bf16 *src = packed + ((g0 + g) * pairs + kp) * 32;
            for (int64_t j = 0; j < 16; j++) {
                even[g * 16 + j] = bf16_to_f32(src[2 * j]);
                odd[g * 16 + j] = bf16_to_f32(src[2 * j + 1]);
            }
        }
    }
}

/* Which form the packed products (linear_vnni_bf16, linear_int4_bf16) run in: 2 = AVX512-BF16 dot
 * products, 1 = AVX2 + FMA in fp32 (cpu_matmul_avx2.c), 0 = none (they return -1). */
int64_t packed_matmul_isa(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif ASERVE_PACKED_AVX2
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* Rows [m0, m0 + mb) x columns [col0, col0 + 16 ng) of y from register blocks acc[i][j] (16 columns each). */
static inline void store_blocks(void *y, int64_t y_stride, int64_t m0, int64_t col0, __m512 acc[][4], int64_t mb,
                                int64_t ng, const bf16 *bias, int64_t y_f32) {
    for (int64_t i = 0; i < mb; i++)
        for (int64_t j = 0; j < ng; j++) {
            float v[16];
            _mm512_storeu_ps(v, acc[i][j]);
            const int64_t col = col0 + j * 16;
            store_outputs(y, (m0 + i) * y_stride + col, v, bias ? bias + col : NULL, 16, y_f32);
        }
}

/* One register block of linear_vnni_bf16: rows [0, MB) of x against NG groups of 16 output columns. */
static inline __attribute__((always_inline)) void vnni_block(const bf16 *x, int64_t x_stride, const bf16 *wp,
                                                             int64_t K, const int64_t MB, const int64_t NG,
                                                             __m512 acc[6][4]) {
    const int64_t pairs = K / 2, group_stride = pairs * 32;
    for (int64_t i = 0; i < MB; i++)
        for (int64_t j = 0; j < NG; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < pairs; kp++) {
        __m512bh b[4];
        for (int64_t j = 0; j < NG; j++) b[j] = (__m512bh)_mm512_loadu_si512(wp + j * group_stride + kp * 32);
        for (int64_t i = 0; i < MB; i++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * kp, sizeof(pair));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int64_t j = 0; j < NG; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
}
#endif

#if defined(__AVX512BF16__)
#define ROW_GROUPS 8 /* column groups of 16 a one-row chunk streams at once */

/* One row of x against NG <= ROW_GROUPS groups of 16 columns: vnni_block's sums in vnni_block's order (one
 * accumulator per group, k-pairs in sequence, so a row's result does not depend on M), with twice the
 * groups and two k-pairs per iteration: more weight loads in flight, which is what one row waits on. */
static inline __attribute__((always_inline)) void vnni_row(const bf16 *x, const bf16 *wp, int64_t K, const int64_t NG,
                                                           __m512 acc[ROW_GROUPS]) {
    const int64_t pairs = K / 2, group_stride = pairs * 32;
    for (int64_t j = 0; j < NG; j++) acc[j] = _mm512_setzero_ps();
    int64_t kp = 0;
    for (; kp + 2 <= pairs; kp += 2) {
        int32_t p0, p1;
        memcpy(&p0, x + 2 * kp, sizeof(p0));
        memcpy(&p1, x + 2 * kp + 2, sizeof(p1));
        const __m512bh a0 = (__m512bh)_mm512_set1_epi32(p0), a1 = (__m512bh)_mm512_set1_epi32(p1);
        __m512bh b0[ROW_GROUPS], b1[ROW_GROUPS];
        for (int64_t j = 0; j < NG; j++) {
            b0[j] = (__m512bh)_mm512_loadu_si512(wp + j * group_stride + kp * 32);
            b1[j] = (__m512bh)_mm512_loadu_si512(wp + j * group_stride + kp * 32 + 32);
        }
        for (int64_t j = 0; j < NG; j++) acc[j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[j], a0, b0[j]), a1, b1[j]);
    }
    if (kp < pairs) {
        int32_t p0;
        memcpy(&p0, x + 2 * kp, sizeof(p0));
        const __m512bh a0 = (__m512bh)_mm512_set1_epi32(p0);
        for (int64_t j = 0; j < NG; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], a0, (__m512bh)_mm512_loadu_si512(wp + j * group_stride + kp * 32));
    }
}

/* linear_vnni_bf16 for one row: chunks of ROW_GROUPS column groups shared among the threads. */
static void vnni_one_row(const bf16 *x, const bf16 *w_packed, const bf16 *bias, void *y, int64_t N, int64_t K,
                         int64_t y_f32) {
    const int64_t groups = N / 16;
    shared_chunks work;
    shared_chunks_init(&work, groups, ROW_GROUPS);
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, g0, ng;
        while (shared_chunks_next(&work, &cursor, &g0, &ng)) {
            const bf16 *wp = w_packed + g0 * (K / 2) * 32;
            __m512 acc[ROW_GROUPS];
            if (ng == ROW_GROUPS) vnni_row(x, wp, K, ROW_GROUPS, acc);
            else vnni_row(x, wp, K, ng, acc);
            for (int64_t j = 0; j < ng; j++) {
                float v[16];
                _mm512_storeu_ps(v, acc[j]);
                store_outputs(y, (g0 + j) * 16, v, bias ? bias + (g0 + j) * 16 : NULL, 16, y_f32);
            }
        }
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias) with W pre-packed in pairs along K ("VNNI" layout): w_packed is
 * [N / 16][K / 2][16][2] bf16 (pack with cpu_ops.pack_vnni), N % 16 == 0, K even. Register blocks of
 * 6 rows x 64 columns accumulate with one broadcast x pair per 16-column dot product (no horizontal
 * sums); each thread starts on a contiguous range of columns (shared_chunks, then steals chunks of 64
 * columns), so every weight byte is read once per 6 rows from cache and once from memory. y is bf16, or fp32 when y_f32. AVX512-BF16 only (returns -1 otherwise). */
int64_t linear_vnni_bf16(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32) {
#if defined(__AVX512BF16__)
    if (M == 1) { /* a decode step's row: a weight stream with more loads in flight, the same sums */
        vnni_one_row(x, w_packed, bias, y, N, K, y_f32);
        return 0;
    }
    const int64_t groups = N / 16;
    shared_chunks work;
    shared_chunks_init(&work, groups, 4); /* chunks of 4 column groups: one register block wide */
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, g0, ng;
        while (shared_chunks_next(&work, &cursor, &g0, &ng)) {
            const bf16 *wp = w_packed + g0 * (K / 2) * 32;
            for (int64_t m0 = 0; m0 < M; m0 += 6) {
                const int64_t mb = (M - m0) < 6 ? (M - m0) : 6;
                const bf16 *xb = x + m0 * x_stride;
                __m512 acc[6][4];
                if (ng == 4 && mb == 6) vnni_block(xb, x_stride, wp, K, 6, 4, acc);
                else if (ng == 4 && mb == 1) vnni_block(xb, x_stride, wp, K, 1, 4, acc);
                else if (ng == 4 && mb == 2) vnni_block(xb, x_stride, wp, K, 2, 4, acc);
                else if (ng == 4 && mb == 4) vnni_block(xb, x_stride, wp, K, 4, 4, acc);
                else vnni_block(xb, x_stride, wp, K, mb, ng, acc);
                store_blocks(y, y_stride, m0, g0 * 16, acc, mb, ng, bias, y_f32);
            }
        }
    }
    return 0;
#elif ASERVE_PACKED_AVX2
    return linear_vnni_avx2(x, x_stride, w_packed, bias, y, y_stride, M, N, K, y_f32);
#else
    (void)x; (void)x_stride; (void)w_packed; (void)bias; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    (void)y_f32;
    return -1;
#endif
}

#if defined(__AVX512BF16__)
/* 32 bytes of packed 4-bit codes -> two vectors of 32 bf16 in dot-product pairs (16 columns x 2 k). Byte j
 * holds column j / 2's code for k = 4t + j % 2 (low nibble, first vector) and k = 4t + 2 + j % 2 (high
 * nibble, second). A code v becomes the bf16 bits 0x4300 | v, which is exactly 128 + v: no conversion
 * instruction; callers subtract 128 * sum(x) (folded into the packed offsets). */
static inline void int4_codes_to_bf16(const uint8_t *p, __m512bh *lo, __m512bh *hi) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i bias = _mm512_set1_epi16(0x4300);
    *lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0xF)), bias);
    *hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
}

/* One register block of linear_int4_bf16: rows [0, MB) against NG groups of 16 columns (MB * NG <= 8).
 * Two accumulators per output vector (low / high nibble codes) halve the dot products' dependency chains. */
static inline __attribute__((always_inline)) void int4_block(
    const bf16 *x, int64_t x_stride, const float *xsum, int64_t groups, const uint8_t *qp, const uint16_t *dp,
    const uint16_t *mp, int64_t K, int64_t gs, const int64_t MB, const int64_t NG, __m512 total[4][4]) {
    const int64_t q_stride = K * 8, s_stride = groups * 16; /* bytes of codes per 16 columns: K * 16 / 2 */
    const int64_t g_bytes = gs * 8, g_steps = gs / 4; /* a group's code bytes per 16 columns; its k-steps */
    for (int64_t i = 0; i < MB; i++)
        for (int64_t j = 0; j < NG; j++) total[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc0[4][4], acc1[4][4];
        for (int64_t i = 0; i < MB; i++)
            for (int64_t j = 0; j < NG; j++) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
        for (int64_t j = 0; j < NG; j++) /* codes 2 KiB ahead, one group's worth (g_bytes per 16 columns) */
            for (int64_t p = 2048; p < 2048 + g_bytes; p += 64)
                _mm_prefetch((const char *)(qp + j * q_stride + g * g_bytes + p), _MM_HINT_T0);
        for (int64_t t = g * g_steps; t < (g + 1) * g_steps; t++) { /* 4 values of k per step */
            __m512bh lo[4], hi[4];
            for (int64_t j = 0; j < NG; j++) int4_codes_to_bf16(qp + j * q_stride + t * 32, &lo[j], &hi[j]);
            for (int64_t i = 0; i < MB; i++) {
                int32_t pair0, pair1;
                memcpy(&pair0, x + i * x_stride + 4 * t, sizeof(pair0));
                memcpy(&pair1, x + i * x_stride + 4 * t + 2, sizeof(pair1));
                const __m512bh a0 = (__m512bh)_mm512_set1_epi32(pair0), a1 = (__m512bh)_mm512_set1_epi32(pair1);
                for (int64_t j = 0; j < NG; j++) {
                    acc0[i][j] = _mm512_dpbf16_ps(acc0[i][j], a0, lo[j]);
                    acc1[i][j] = _mm512_dpbf16_ps(acc1[i][j], a1, hi[j]);
                }
            }
        }
        for (int64_t j = 0; j < NG; j++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + j * s_stride + g * 16)));
            const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, /* m - 128 d: the codes entered as 128 + q */
                                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + j * s_stride + g * 16))));
            for (int64_t i = 0; i < MB; i++)
                total[i][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * groups + g]),
                                              _mm512_fmadd_ps(d, _mm512_add_ps(acc0[i][j], acc1[i][j]), total[i][j]));
        }
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias) for group-wise 4-bit weights W[n, k] = q[n, k] * d[n, g] + m[n, g]
 * (g = k / gs, gs a multiple of 32 dividing K; GGUF Q4_1 is this form with gs 32, Q4_0 has m = -8 d). Packed
 * per 16 output columns (cpu_ops.pack_int4):
 * q_packed [N/16][K/4][32] bytes (see int4_codes_to_bf16), d and m as [N/16][K/gs][16] fp16 (GGUF's own
 * precision; half the bytes of fp32, which matters when streaming). The codes enter the dot products as
 * 128 + q (exact in bf16; products exact in fp32) and m - 128 d is applied in fp32, so only x is rounded,
 * as in the bf16 path. N % 16 == 0, K % 32 == 0. y is bf16, or fp32 when y_f32.
 * AVX512-BF16 only (returns -1 otherwise; -2 when the row sums cannot be allocated; -3 for a bad gs). */
int64_t linear_int4_bf16(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d, const uint16_t *m,
                         const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                         int64_t y_f32, int64_t gs) {
    if (gs < 32 || gs % 32 || K % gs) return -3;
#if defined(__AVX512BF16__)
    const int64_t groups = K / gs, col_groups = N / 16;
    float *xsum = row_group_sums(x, x_stride, M, K, gs);
    if (!xsum) return -2;
    const int64_t step = M <= 2 ? 4 : 2; /* column groups per register block */
    shared_chunks work;
    shared_chunks_init(&work, col_groups, step);
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, c0, ng;
        while (shared_chunks_next(&work, &cursor, &c0, &ng)) {
            const uint8_t *qp = q_packed + c0 * K * 8;
            const uint16_t *dp = d + c0 * groups * 16, *mp = m + c0 * groups * 16;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t mb = (M - m0) < 4 ? (M - m0) : 4;
                const bf16 *xb = x + m0 * x_stride;
                const float *xs = xsum + m0 * groups;
                __m512 total[4][4];
                if (ng == 2 && mb == 4) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, gs, 4, 2, total);
                else if (ng == 4 && mb == 1) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, gs, 1, 4, total);
                else if (ng == 4 && mb == 2) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, gs, 2, 4, total);
                else int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, gs, mb, ng, total); /* mb * ng <= 8 */
                store_blocks(y, y_stride, m0, c0 * 16, total, mb, ng, bias, y_f32);
            }
        }
    }
    free(xsum);
    return 0;
#elif ASERVE_PACKED_AVX2
    return linear_int4_avx2(x, x_stride, q_packed, d, m, bias, y, y_stride, M, N, K, y_f32, gs);
#else
    (void)x; (void)x_stride; (void)q_packed; (void)d; (void)m; (void)bias; (void)y; (void)y_stride; (void)M; (void)N;
    (void)K; (void)y_f32;
    return -1;
#endif
}
