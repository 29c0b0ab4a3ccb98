/* linear_q8_f32: rows of x times an 8-bit weight with one fp32 scale per 32 codes of a column (GGUF's Q8_0,
 * the form llama.cpp files keep the token embedding in, which a tied LM head multiplies by). Half the
 * bytes of the bf16 weight, for a product whose one-row form streams the weight once per token.
 *
 * Layout (CpuKernels.pack_q8): codes int8 [N/32, K/2, 32, 2] (per 32 columns, per pair of k: column c's
 * codes for k and k + 1 side by side, one 64-byte line; in each half of 16 columns the order the in-lane
 * widening reads back as columns 0-7, 8-15), scales fp32 [N/32, K/32, 32]. x is quantized per group of 32 to int16
 * (scale max|x| / 32767, rounded to nearest even), each group's dot product is exact in int32 (pairs by
 * _mm256_madd_epi16; |code| <= 128, |x| <= 32767, 32 terms), and the groups are summed in fp32 as
 * sum_g float(dot_g) * (scale_w * scale_x). The int16 rounding of x is far finer than bf16's (the
 * activation dtype of the other paths). A column's result does not depend on M or on the threads.
 * Built and loaded by cpu_ops.py with the other kernels; trusts its input (N % 32 == 0, K % 32 == 0).
 */
#include "cpu_common.h"

#define Q8_GROUP 32

int64_t linear_q8_available(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__)
/* Row m of x (bf16 or fp32) as int16 codes xq [K] and per-group scales xs [K / 32]. */
static void quantize_row_int16(const void *x, int64_t x_f32, int64_t K, int16_t *xq, float *xs) {
    for (int64_t g = 0; g < K / Q8_GROUP; g++) {
        float v[Q8_GROUP], amax = 0.0f;
        for (int64_t j = 0; j < Q8_GROUP; j++) {
            const int64_t k = g * Q8_GROUP + j;
            v[j] = x_f32 ? ((const float *)x)[k] : bf16_to_f32(((const bf16 *)x)[k]);
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float s = amax / 32767.0f;
        xs[g] = s;
        for (int64_t j = 0; j < Q8_GROUP; j++)
            xq[g * Q8_GROUP + j] = s > 0.0f ? (int16_t)lrintf(fminf(fmaxf(v[j] / s, -32767.0f), 32767.0f)) : 0;
    }
}

/* One quantized row against the 32 columns of packed block cb: 4 vectors of 8 columns, whose codes for a pair
 * of k are one 64-byte line (one sequential stream per block). With xb (one value per group of 32 of the row)
 * it also stores yb[col] = sum_g scale_w[g][col] * xb[g] (screen_q8_bf16's error bound); NULL skips that. */
static inline __attribute__((always_inline)) void q8_row(const int16_t *xq, const float *xs, int64_t K,
                                                         const int8_t *codes, const float *scales, int64_t cb,
                                                         float *y, const float *xb, float *yb) {
    const int64_t groups = K / Q8_GROUP;
    const int8_t *wp = codes + cb * K * 32;
    const float *sp = scales + cb * groups * 32;
    __m256 total[4], bound[4];
    for (int64_t v = 0; v < 4; v++) total[v] = bound[v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[4];
        for (int64_t v = 0; v < 4; v++) dot[v] = _mm256_setzero_si256();
        for (int64_t p = g * (Q8_GROUP / 2); p < (g + 1) * (Q8_GROUP / 2); p++) {
            int32_t pair;
            memcpy(&pair, xq + 2 * p, sizeof pair);
            const __m256i xp = _mm256_set1_epi32(pair);
            for (int64_t h = 0; h < 2; h++) { /* bytes widened to int16 in-lane: (b * 257) >> 8 */
                const __m256i c = _mm256_loadu_si256((const __m256i *)(wp + p * 64 + h * 32));
                const __m256i lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(c, c), 8);
                const __m256i hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(c, c), 8);
                dot[2 * h] = _mm256_add_epi32(dot[2 * h], _mm256_madd_epi16(lo, xp));
                dot[2 * h + 1] = _mm256_add_epi32(dot[2 * h + 1], _mm256_madd_epi16(hi, xp));
            }
        }
        const __m256 sx = _mm256_set1_ps(xs[g]);
        for (int64_t v = 0; v < 4; v++) {
            const __m256 sw = _mm256_loadu_ps(sp + g * 32 + v * 8);
            total[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[v]), _mm256_mul_ps(sw, sx), total[v]);
            if (xb) bound[v] = _mm256_fmadd_ps(sw, _mm256_set1_ps(xb[g]), bound[v]);
        }
    }
    for (int64_t v = 0; v < 4; v++) _mm256_storeu_ps(y + 8 * v, total[v]);
    if (xb)
        for (int64_t v = 0; v < 4; v++) _mm256_storeu_ps(yb + 8 * v, bound[v]);
}
#endif

/* y [M, N] fp32 (rows y_stride apart) = x [M, K] (bf16, or fp32 when x_f32; rows x_stride apart) times the
 * packed weight. Returns 0, -1 when this build has no AVX2, -2 when out of memory. */
int64_t linear_q8_f32(const void *x, int64_t x_stride, int64_t x_f32, const int8_t *codes, const float *scales,
                      float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
    const int64_t groups = K / Q8_GROUP, blocks = N / 32;
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t));
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    const size_t elem = x_f32 ? sizeof(float) : sizeof(bf16);
    for (int64_t m = 0; m < M; m++)
        quantize_row_int16((const char *)x + (size_t)(m * x_stride) * elem, x_f32, K, xq + m * K, xs + m * groups);
    shared_chunks work;
    shared_chunks_init(&work, blocks, 4); /* chunks of 4 blocks of 32 columns */
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, first, count;
        while (shared_chunks_next(&work, &cursor, &first, &count))
            for (int64_t cb = first; cb < first + count; cb++)
                for (int64_t m = 0; m < M; m++)
                    q8_row(xq + m * K, xs + m * groups, K, codes, scales, cb, y + m * y_stride + cb * 32, NULL, NULL);
    }
    free(xq);
    free(xs);
    return 0;
#else
    (void)x; (void)x_stride; (void)x_f32; (void)codes; (void)scales; (void)y; (void)y_stride; (void)M; (void)N;
    (void)K;
    return -1;
#endif
}

/* Greedy screening of a tied or untied LM head: for each row m of x (bf16 [M, K], rows x_stride apart) the
 * columns that can hold the row's largest logit, found on the 8-bit copy of the weight (codes, scales: the
 * pack_q8 form of w quantized per 32 with scale max|w| / 127, so |w - scale * code| <= scale / 2).
 *
 * approx[c] is linear_q8's value; bound[c] >= |exact[c] - approx[c]| for the exact logit as any fp32 sum of the
 * bf16 products computes it (the packed bf16 kernels included): per group of 32, the weight's rounding
 * (scale / 2 * sum |x|), x's int16 rounding (|code| <= 127: 127 * 32 * scale * xscale / 2) and fp32 rounding
 * of both sums (at most K - 1 and K / 32 + 3 roundings of terms up to 127.5 * scale * |x| each: (K + K / 32 + 8)
 * * 2^-24 * 127.5 * scale * sum |x|), plus 2^-100 a group for flushed subnormals, the total raised by 2^-10 for the rounding of the bound
 * itself. Every column with approx + bound >= max(approx - bound) is a candidate: the argmax of the
 * exact logits is among them. cand [M, max_cand] gets each row's candidates in column order, counts [M] their
 * number, or -1 where there are more than max_cand or none (a NaN); the caller computes those rows in full.
 * work: [M, 2, N] fp32 scratch. Returns 0, -1 when this build has no AVX2, -2 when out of memory. */
int64_t screen_q8_bf16(const bf16 *x, int64_t x_stride, const int8_t *codes, const float *scales, int64_t M,
                       int64_t N, int64_t K, float *work, int32_t *cand, int64_t max_cand, int64_t *counts) {
#if defined(__AVX2__)
    const int64_t groups = K / Q8_GROUP, blocks = N / 32;
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t));
    float *xs = malloc((size_t)(2 * M * groups) * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -2;
    }
    float *xb = xs + M * groups;
    const float sum_rounding = 0.5f + 127.5f * (float)(K + groups + 8) * 0x1p-24f;
    for (int64_t m = 0; m < M; m++) {
        const bf16 *row = x + m * x_stride;
        quantize_row_int16(row, 0, K, xq + m * K, xs + m * groups);
        for (int64_t g = 0; g < groups; g++) {
            float l1 = 0.0f;
            for (int64_t j = 0; j < Q8_GROUP; j++) l1 += fabsf(bf16_to_f32(row[g * Q8_GROUP + j]));
            xb[m * groups + g] = (l1 * sum_rounding + 2032.0f * xs[m * groups + g] + 0x1p-100f) * (1.0f + 0x1p-10f);
        }
    }
    shared_chunks work_chunks;
    shared_chunks_init(&work_chunks, blocks, 4);
#pragma omp parallel if (N * K > 65536)
    {
        int64_t cursor = 0, first, count;
        while (shared_chunks_next(&work_chunks, &cursor, &first, &count))
            for (int64_t cb = first; cb < first + count; cb++)
                for (int64_t m = 0; m < M; m++) {
                    float *approx = work + 2 * m * N;
                    q8_row(xq + m * K, xs + m * groups, K, codes, scales, cb, approx + cb * 32, xb + m * groups,
                           approx + N + cb * 32);
                }
    }
    for (int64_t m = 0; m < M; m++) {
        const float *approx = work + 2 * m * N, *bound = approx + N;
        __m256 low = _mm256_set1_ps(-INFINITY); /* (a NaN lane is skipped: _mm256_max_ps keeps the second) */
        for (int64_t c = 0; c < N; c += 8)
            low = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(approx + c), _mm256_loadu_ps(bound + c)), low);
        float lows[8], floor_ = -INFINITY;
        _mm256_storeu_ps(lows, low);
        for (int64_t l = 0; l < 8; l++) floor_ = fmaxf(floor_, lows[l]);
        const __m256 floor_v = _mm256_set1_ps(floor_);
        int64_t found = 0;
        for (int64_t c = 0; c < N && found <= max_cand; c += 8) {
            const __m256 high = _mm256_add_ps(_mm256_loadu_ps(approx + c), _mm256_loadu_ps(bound + c));
            int mask = _mm256_movemask_ps(_mm256_cmp_ps(high, floor_v, _CMP_GE_OQ));
            for (; mask; mask &= mask - 1) {
                if (found < max_cand) cand[m * max_cand + found] = (int32_t)(c + __builtin_ctz((unsigned)mask));
                found++;
            }
        }
        counts[m] = (found == 0 || found > max_cand) ? -1 : found;
    }
    free(xq);
    free(xs);
    return 0;
#else
    (void)x; (void)x_stride; (void)codes; (void)scales; (void)M; (void)N; (void)K; (void)work; (void)cand;
    (void)max_cand; (void)counts;
    return -1;
#endif
}

/* Each row's argmax of x @ W^T as linear_vnni_bf16 computes it, where vnni is W's pack_vnni form and codes /
 * scales its 8-bit copy: screen_q8_bf16's candidates, then only their groups of 16 columns multiplied exactly
 * (each column's sums are the same in any group count), the first of equal values winning. tokens [M]: the
 * column, or -1 where the row must be computed in full (more than max_cand candidates, or a non-finite value
 * among them). work [M, 2, N] fp32 and cand [M, max_cand] int32: scratch. Returns 0, -1 when this build has no
 * AVX2, -2 when out of memory. */
int64_t greedy_q8_bf16(const bf16 *x, int64_t x_stride, const int8_t *codes, const float *scales, const bf16 *vnni,
                       int64_t M, int64_t N, int64_t K, float *work, int32_t *cand, int64_t max_cand,
                       int64_t *tokens) {
    const int64_t status = screen_q8_bf16(x, x_stride, codes, scales, M, N, K, work, cand, max_cand, tokens);
    if (status) return status;
    for (int64_t m = 0; m < M; m++) {
        const int64_t found = tokens[m];
        int64_t best = -1, group = -1;
        float best_value = -INFINITY, exact[16];
        for (int64_t i = 0; i < found; i++) {
            const int64_t c = cand[m * max_cand + i];
            if (c / 16 != group) { /* candidates come in column order: each group once */
                group = c / 16;
                const int64_t run = linear_vnni_bf16(x + m * x_stride, x_stride, vnni + group * (K / 2) * 32, NULL,
                                                     exact, 16, 1, 16, K, 1);
                if (run) return run;
            }
            const float v = exact[c % 16];
            if (!isfinite(v)) {
                best = -1;
                break;
            }
            if (best < 0 || v > best_value) {
                best = c;
                best_value = v;
            }
        }
        tokens[m] = found > 0 ? best : -1;
    }
    return 0;
}
