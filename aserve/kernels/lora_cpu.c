/* Multi-LoRA delta for CPU steps with bf16 activations and bf16 LoRA weights, one call per layer:
 * y[t] += B[s] @ (A[s] @ x[t]) (+ bias[s]) for each token t of slot s = slots[t] (BGMV-style: each token
 * multiplies only its own slot's weights). Built and loaded by lora_cpu.py, which checks shapes and
 * dtypes; this file trusts them, but bounds every slot and rank it reads (a slot outside [0, S) adds
 * nothing, a rank above R is taken as R).
 *
 * Arithmetic is fp32: the shrink A[s] @ x[t] accumulates in fp32 and stays fp32 (not rounded), the
 * expand accumulates in fp32 and y is rounded once (bf16 y) or not at all (fp32 y).
 */
#include "cpu_common.h"

#define TOK_BLOCK 4   /* tokens per shrink register block */
#define ROW_BLOCK 4   /* A rows per shrink register block */
#define EXP_TOKENS 8  /* tokens per expand register block */

/* sums[i][j] = xs[i] . w[j] over K for i < mb, j < nb (w rows K apart). Constant mb / nb where inlined
 * keep the accumulators in registers. */
static inline __attribute__((always_inline)) void dot_rows(const bf16 *const *xs, const bf16 *w, int64_t K,
                                                           const int64_t mb, const int64_t nb,
                                                           float sums[TOK_BLOCK][ROW_BLOCK]) {
#if defined(__AVX512BF16__)
    if (K % 32 == 0) {
        __m512 acc[TOK_BLOCK][ROW_BLOCK];
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            __m512bh wv[ROW_BLOCK];
            for (int64_t j = 0; j < nb; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
            for (int64_t i = 0; i < mb; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[i] + k);
                for (int64_t j = 0; j < nb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
            }
        }
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        return;
    }
#endif
    for (int64_t i = 0; i < mb; i++)
        for (int64_t j = 0; j < nb; j++) {
            const bf16 *xr = xs[i], *wr = w + j * K;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t k = 0; k < K; k++) dot += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
            sums[i][j] = dot;
        }
}

/* shrunk[t][w] = A[s] row w . x[t] for the rows w < rows of tokens toks[0..count) (all of slot s). */
static void shrink_rows(const bf16 *x, int64_t x_stride, const bf16 *a_rows, int64_t row0, int64_t nb,
                        const int64_t *toks, int64_t count, int64_t K, float *shrunk, int64_t W) {
    const bf16 *w = a_rows + row0 * K;
    for (int64_t c0 = 0; c0 < count; c0 += TOK_BLOCK) {
        const int64_t mb = (count - c0) < TOK_BLOCK ? (count - c0) : TOK_BLOCK;
        const bf16 *xs[TOK_BLOCK];
        for (int64_t i = 0; i < mb; i++) xs[i] = x + toks[c0 + i] * x_stride;
        float sums[TOK_BLOCK][ROW_BLOCK];
        if (mb == TOK_BLOCK && nb == ROW_BLOCK) dot_rows(xs, w, K, TOK_BLOCK, ROW_BLOCK, sums);
        else if (mb == 1 && nb == ROW_BLOCK) dot_rows(xs, w, K, 1, ROW_BLOCK, sums);
        else dot_rows(xs, w, K, mb, nb, sums);
        for (int64_t i = 0; i < mb; i++)
            for (int64_t j = 0; j < nb; j++) shrunk[toks[c0 + i] * W + row0 + j] = sums[i][j];
    }
}

/* coef[j * EXP_TOKENS + i] = shrunk[toks[i]][j * n + shard] for j < rank, i < tb; 0 for tb <= i < EXP_TOKENS
 * (so a block can run on a constant number of tokens). */
static void gather_coefs(const float *shrunk, int64_t W, int64_t n, int64_t shard, int64_t rank,
                         const int64_t *toks, int64_t tb, float *coef) {
    for (int64_t j = 0; j < rank; j++)
        for (int64_t i = 0; i < EXP_TOKENS; i++)
            coef[j * EXP_TOKENS + i] = i < tb ? shrunk[toks[i] * W + j * n + shard] : 0.0f;
}

#if defined(__AVX512F__)
static inline __m512 load_bf16_masked(__mmask16 mask, const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

/* y[toks[i], o0 + c] += sum_j coef[j * EXP_TOKENS + i] * b[j * 16 + c] (+ bias[c]) for i < tb and the
 * columns c of NT tiles (b: the first tile of B from column o0, tiles tile_stride apart; bias pointing at
 * column o0): c < m <= 16 when NT is 1, else NT whole tiles. TB >= tb and NT are constants where inlined
 * (the accumulators then live in registers); coefficients of tokens tb..TB are zero. */
static inline __attribute__((always_inline)) void expand_block(const float *coef, int64_t rank, const bf16 *b,
                                                               int64_t tile_stride, const bf16 *bias, int64_t o0,
                                                               const int64_t NT, int64_t m, const int64_t *toks,
                                                               const int64_t TB, int64_t tb, void *y,
                                                               int64_t y_stride, int64_t y_f32) {
#if defined(__AVX512F__)
    const __mmask16 mask = NT > 1 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1u);
    __m512 acc[EXP_TOKENS][4];
    for (int64_t t = 0; t < NT; t++) {
        const __m512 b0 = bias ? load_bf16_masked(mask, bias + 16 * t) : _mm512_setzero_ps();
        for (int64_t i = 0; i < TB; i++) acc[i][t] = b0;
    }
    for (int64_t j = 0; j < rank; j++) {
        __m512 bv[4];
        for (int64_t t = 0; t < NT; t++) bv[t] = load_bf16_masked(mask, b + t * tile_stride + j * 16);
        for (int64_t i = 0; i < TB; i++) {
            const __m512 cv = _mm512_set1_ps(coef[j * EXP_TOKENS + i]);
            for (int64_t t = 0; t < NT; t++) acc[i][t] = _mm512_fmadd_ps(cv, bv[t], acc[i][t]);
        }
    }
    for (int64_t i = 0; i < tb; i++)
        for (int64_t t = 0; t < NT; t++) {
            const int64_t at = toks[i] * y_stride + o0 + 16 * t;
            if (y_f32) {
                float *yr = (float *)y + at;
                _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), acc[i][t]));
            } else {
                bf16 *yr = (bf16 *)y + at;
#if defined(__AVX512BF16__)  /* round to nearest even, as f32_to_bf16 */
                const __m512 sum = _mm512_add_ps(load_bf16_masked(mask, yr), acc[i][t]);
                _mm256_mask_storeu_epi16(yr, mask, (__m256i)_mm512_cvtneps_pbh(sum));
#else
                float v[16];
                _mm512_storeu_ps(v, acc[i][t]);
                for (int64_t c = 0; c < (NT > 1 ? 16 : m); c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + v[c]);
#endif
            }
        }
#else
    (void)TB;
    const int64_t cols = NT > 1 ? 16 : m;
    for (int64_t t = 0; t < NT; t++) {  /* one tile at a time */
        const bf16 *bt = b + t * tile_stride, *bias_t = bias ? bias + 16 * t : NULL;
        float acc[EXP_TOKENS][16];
        for (int64_t i = 0; i < tb; i++)
            for (int64_t c = 0; c < cols; c++) acc[i][c] = bias_t ? bf16_to_f32(bias_t[c]) : 0.0f;
        for (int64_t j = 0; j < rank; j++) {
            const bf16 *br = bt + j * 16;
            for (int64_t i = 0; i < tb; i++) {
                const float sv = coef[j * EXP_TOKENS + i];
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) acc[i][c] += sv * bf16_to_f32(br[c]);
            }
        }
        for (int64_t i = 0; i < tb; i++) {
            const int64_t at = toks[i] * y_stride + o0 + 16 * t;
            if (y_f32)
                for (int64_t c = 0; c < cols; c++) ((float *)y)[at + c] += acc[i][c];
            else
                for (int64_t c = 0; c < cols; c++) {
                    bf16 *yr = (bf16 *)y + at;
                    yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + acc[i][c]);
                }
        }
    }
#endif
}

/* y[toks[i], lo .. hi) += the expand of tb tokens (coefficients from gather_coefs), the columns [lo, hi)
 * of one shard: whole groups of tiles at once, partial tiles (a shard edge off a multiple of 16) alone.
 * b_slot: the slot's tiles; bias_slot: the slot's bias row or NULL. TB is the smallest of 1, 2, 4,
 * EXP_TOKENS that holds tb. */
static void expand_range(const float *coef, int64_t rank, const bf16 *b_slot, int64_t tile_stride,
                         const bf16 *bias_slot, int64_t lo, int64_t hi, const int64_t *toks, int64_t tb, void *y,
                         int64_t y_stride, int64_t y_f32) {
#define EXPAND(NT, M, TB) expand_block(coef, rank, b, tile_stride, bias, o0, NT, M, toks, TB, tb, y, y_stride, y_f32)
    for (int64_t o0 = lo, m; o0 < hi; o0 += m) {
        const bf16 *b = b_slot + (o0 / 16) * tile_stride + o0 % 16, *bias = bias_slot ? bias_slot + o0 : NULL;
        if (o0 % 16 == 0 && hi - o0 >= 64 && tb <= 4) {
            m = 64;
            if (tb == 1) EXPAND(4, 16, 1);
            else if (tb == 2) EXPAND(4, 16, 2);
            else EXPAND(4, 16, 4);
        } else if (o0 % 16 == 0 && hi - o0 >= 32) {
            m = 32;
            if (tb <= 2) EXPAND(2, 16, 2);
            else if (tb <= 4) EXPAND(2, 16, 4);
            else EXPAND(2, 16, EXP_TOKENS);
        } else {  /* the part of one tile in this shard */
            m = (hi - o0) < 16 - o0 % 16 ? (hi - o0) : 16 - o0 % 16;
            if (tb <= 2) EXPAND(1, m, 2);
            else if (tb <= 4) EXPAND(1, m, 4);
            else EXPAND(1, m, EXP_TOKENS);
        }
    }
#undef EXPAND
}

/* Adds the LoRA delta into y in place. x [T, K] bf16 (rows x_stride apart); slots [T] int32; a [S, W, K]
 * bf16 contiguous with W = R * n, rank-major (row j * n + i: rank j of shard i); ranks [S] int64 (slot s
 * uses the rows [0, ranks[s] * n); 0: the slot adds nothing, not even its bias); bt [S, ceil(OUT / 16), R, 16]
 * bf16 contiguous, B in tiles of 16 output rows: bt[s, o / 16, j, o % 16] = B[s][o, j] (rows o of shard i
 * take shard i's rank j; zero past OUT); slices [n] int64, the shards' output rows in
 * order, summing to OUT (n >= 1); bias [S, OUT] bf16 or NULL; y [T, OUT] fp32 (y_f32) or bf16, rows
 * y_stride apart, not overlapping any input.
 * Returns 0, or -1 when out of memory (y untouched). */
int64_t lora_delta_bf16(const bf16 *x, int64_t x_stride, const int32_t *slots, int64_t T, const bf16 *a,
                        const int64_t *ranks, const bf16 *bt, const int64_t *slices, const bf16 *bias, void *y,
                        int64_t y_stride, int64_t y_f32, int64_t S, int64_t R, int64_t n, int64_t K, int64_t OUT) {
    const int64_t W = R * n, tiles = (OUT + 15) / 16;
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(2 * S + 1 + T + 2 * S * ((W + ROW_BLOCK - 1) / ROW_BLOCK) + 1));
    float *shrunk = malloc(sizeof(float) * (size_t)(T * W + 1));
    if (!start || !shrunk) {
        free(start);
        free(shrunk);
        return -1;
    }
    int64_t *rank = start + S + 1, *order = rank + S, *items = order + T;
    /* tokens grouped by slot (counting sort, token order kept): order[start[s] .. start[s + 1]) */
    for (int64_t s = 0; s <= S; s++) start[s] = 0;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0 && slots[t] < S) start[slots[t] + 1]++;
    for (int64_t s = 0; s < S; s++) {
        start[s + 1] += start[s];
        rank[s] = ranks[s] < 0 ? 0 : (ranks[s] > R ? R : ranks[s]);
    }
    {
        int64_t fill[S > 0 ? S : 1];
        for (int64_t s = 0; s < S; s++) fill[s] = start[s];
        for (int64_t t = 0; t < T; t++)
            if (slots[t] >= 0 && slots[t] < S) order[fill[slots[t]]++] = t;
    }
    /* shrink work items: (slot, first row) of ROW_BLOCK rows, for slots with tokens and a rank */
    int64_t num_items = 0, work = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t count = start[s + 1] - start[s], rows = rank[s] * n;
        if (!count || !rows) continue;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            items[2 * num_items] = s;
            items[2 * num_items + 1] = r0;
            num_items++;
        }
        work += count * rows * (K + OUT / n);
    }
#pragma omp parallel if (work > 65536)
    {
#pragma omp for schedule(static, 1)
        for (int64_t it = 0; it < num_items; it++) {
            const int64_t s = items[2 * it], r0 = items[2 * it + 1], rows = rank[s] * n;
            const int64_t nb = (rows - r0) < ROW_BLOCK ? (rows - r0) : ROW_BLOCK;
            shrink_rows(x, x_stride, a + s * W * K, r0, nb, order + start[s], start[s + 1] - start[s], K, shrunk, W);
        }  /* implicit barrier: every shrunk value is written before any expand reads it */
        int64_t o_begin, o_end;
        thread_share(OUT, 16, &o_begin, &o_end);
        float coef[EXP_TOKENS * (R > 0 ? R : 1)];
        for (int64_t s = 0; s < S; s++) {
            const int64_t count = start[s + 1] - start[s];
            if (!count || !rank[s]) continue;
            const bf16 *b_slot = bt + s * tiles * R * 16, *bias_slot = bias ? bias + s * OUT : NULL;
            int64_t off = 0;
            for (int64_t i = 0; i < n; off += slices[i], i++) {
                const int64_t lo = off > o_begin ? off : o_begin;
                const int64_t hi = (off + slices[i]) < o_end ? (off + slices[i]) : o_end;
                if (lo >= hi) continue;
                for (int64_t c0 = 0; c0 < count; c0 += EXP_TOKENS) {
                    const int64_t tb = (count - c0) < EXP_TOKENS ? (count - c0) : EXP_TOKENS;
                    const int64_t *toks = order + start[s] + c0;
                    gather_coefs(shrunk, W, n, i, rank[s], toks, tb, coef);
                    expand_range(coef, rank[s], b_slot, R * 16, bias_slot, lo, hi, toks, tb, y, y_stride, y_f32);
                }
            }
        }
    }
    free(start);
    free(shrunk);
    return 0;
}
