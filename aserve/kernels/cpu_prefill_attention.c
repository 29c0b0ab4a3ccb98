/* Prefill / extend attention over a paged bf16 KV cache on the CPU's bf16 dot product (AVX512-BF16),
 * reading the blocks in place: each sequence's queries are the last q_len positions of its context and
 * see the keys at or before their own position (within the window, if any). Flash-attention style:
 * a work item is one KV head's query heads over a tile of query tokens (PREFILL_ROWS rows of scores at
 * most), keys go PREFILL_KEYS at a time with an online (running max) softmax in fp32; q.k products are
 * exact bf16 products summed in fp32, the probabilities are rounded to bf16 for p.V as torch's flash
 * attention does. Built and loaded by cpu_ops.py, which checks shapes; this code trusts its input.
 */
#include "cpu_common.h"

#if defined(__AVX512BF16__)
#define PREFILL_ROWS 64 /* rows (query token x query head of the group) of one work item */
#define PREFILL_KEYS 32 /* keys per softmax update: two 16-lane vectors of scores a row */
#define SCORE_ROWS 8    /* rows whose scores accumulate in registers together */
#define MAX_HEAD_DIM 256

/* The keys of a tile in pairs along D: kp[p][j] = (k_j[2p], k_j[2p + 1]), and the values in pairs of
 * keys: vp[i][d] = (v_2i[d], v_2i+1[d]); keys at or past n are zeros. */
static void pack_tile(const bf16 *k_cache, const bf16 *v_cache, const int64_t *slot, int64_t n, int64_t row,
                      int64_t g, int64_t D, uint32_t *kp, uint32_t *vp) {
    for (int64_t j = 0; j < PREFILL_KEYS; j++) {
        const bf16 *kr = k_cache + slot[j < n ? j : 0] * row + g * D;
        for (int64_t p = 0; p < D / 2; p++) {
            uint32_t pair = 0u;
            if (j < n) memcpy(&pair, kr + 2 * p, sizeof(pair));
            kp[p * PREFILL_KEYS + j] = pair;
        }
    }
    for (int64_t i = 0; i < PREFILL_KEYS / 2; i++) {
        const int64_t a = 2 * i, b = 2 * i + 1;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i lo = a < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_cache + slot[a] * row + g * D + d)))
                                     : _mm512_setzero_si512();
            const __m512i hi = b < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_cache + slot[b] * row + g * D + d)))
                                     : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + i * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* Raw scores of rows [r0, r0 + rb) (rb <= SCORE_ROWS) against a packed key tile: acc[r][0 | 1] lanes are
 * keys 0..15 | 16..31. qrow[r] points at row r's D query elements. */
static inline void tile_scores_rows(const bf16 *const *qrow, int64_t rb, const uint32_t *kp, int64_t D,
                                    __m512 acc[SCORE_ROWS][2]) {
    for (int64_t r = 0; r < SCORE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * PREFILL_KEYS);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * PREFILL_KEYS + 16);
        for (int64_t r = 0; r < rb; r++) {
            uint32_t pair;
            memcpy(&pair, qrow[r] + 2 * p, sizeof(pair));
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int32_t)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, k1);
        }
    }
}

/* One work item: query tokens [t0, t0 + nt) of a sequence (its queries are rows q0.. of q, the last ql of
 * its L positions) for the G query heads of KV head g. */
static void prefill_item(const bf16 *q, int64_t q_stride, bf16 *out, const bf16 *k_cache, const bf16 *v_cache,
                         const int32_t *table, int64_t q0, int64_t ql, int64_t L, int64_t t0, int64_t nt, int64_t g,
                         int64_t G, int64_t H, int64_t D, int64_t row, int64_t block_size, int64_t window, float scale,
                         float softcap) {
    float o[PREFILL_ROWS * MAX_HEAD_DIM], m[PREFILL_ROWS], l[PREFILL_ROWS];
    uint32_t kp[MAX_HEAD_DIM / 2 * PREFILL_KEYS], vp[PREFILL_KEYS / 2 * MAX_HEAD_DIM], pb[PREFILL_ROWS][PREFILL_KEYS / 2];
    const bf16 *qrow[PREFILL_ROWS];
    int64_t pos[PREFILL_ROWS];
    const int64_t R = nt * G, first = L - ql + t0, last = first + nt - 1;
    for (int64_t r = 0; r < R; r++) { /* row r = token r / G, head r % G of the group */
        qrow[r] = q + (q0 + t0 + r / G) * q_stride + (g * G + r % G) * D;
        pos[r] = first + r / G;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, (size_t)(R * D) * sizeof(float));
    const int64_t lo = (window > 0 && first - window + 1 > 0) ? first - window + 1 : 0;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale_v = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t kt = lo; kt <= last; kt += PREFILL_KEYS) {
        const int64_t n = (last + 1 - kt) < PREFILL_KEYS ? (last + 1 - kt) : PREFILL_KEYS;
        int64_t slot[PREFILL_KEYS];
        key_slots(table, kt, n, block_size, slot);
        pack_tile(k_cache, v_cache, slot, n, row, g, D, kp, vp);
        const __m512i key0 = _mm512_add_epi32(_mm512_set1_epi32((int32_t)kt), lane);
        const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
        for (int64_t r0 = 0; r0 < R; r0 += SCORE_ROWS) {
            const int64_t rb = (R - r0) < SCORE_ROWS ? (R - r0) : SCORE_ROWS;
            __m512 acc[SCORE_ROWS][2];
            tile_scores_rows(qrow + r0, rb, kp, D, acc);
            for (int64_t i = 0; i < rb; i++) {
                const int64_t r = r0 + i;
                __m512 s[2] = {_mm512_mul_ps(acc[i][0], scale_v), _mm512_mul_ps(acc[i][1], scale_v)};
                const __m512i at = _mm512_set1_epi32((int32_t)pos[r]); /* visible: key <= pos (and in window) */
                __mmask16 v0 = _mm512_cmple_epi32_mask(key0, at), v1 = _mm512_cmple_epi32_mask(key1, at);
                if (window > 0) {
                    const __m512i from = _mm512_set1_epi32((int32_t)(pos[r] - window));
                    v0 &= _mm512_cmpgt_epi32_mask(key0, from);
                    v1 &= _mm512_cmpgt_epi32_mask(key1, from);
                }
                for (int64_t t = 0; t < 2; t++) {
                    if (softcap > 0.0f) s[t] = cap_scores(s[t], softcap);
                    s[t] = _mm512_mask_mov_ps(minus_inf, t ? v1 : v0, s[t]);
                }
                const float corr = softmax_chunk(s, 2, &m[r], &l[r]);
                if (corr != 1.0f)
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(corr)));
                const __m512i probs = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(s[0])),
                                                         (__m256i)_mm512_cvtneps_pbh(s[1]), 1);
                _mm512_storeu_si512(pb[r], probs); /* 32 bf16 = 16 pairs of keys */
            }
        }
        for (int64_t r = 0; r < R; r++) /* o[r] += p[r] . V, 64 output lanes at a time */
            for (int64_t d = 0; d < D; d += 64) {
                const int64_t nv = (D - d) < 64 ? (D - d) / 16 : 4;
                __m512 a[4];
                for (int64_t c = 0; c < nv; c++) a[c] = _mm512_loadu_ps(o + r * D + d + 16 * c);
                for (int64_t i = 0; i < PREFILL_KEYS / 2; i++) {
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int32_t)pb[r][i]);
                    for (int64_t c = 0; c < nv; c++)
                        a[c] = _mm512_dpbf16_ps(a[c], pv, (__m512bh)_mm512_loadu_si512(vp + i * D + d + 16 * c));
                }
                for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + r * D + d + 16 * c, a[c]);
            }
    }
    for (int64_t r = 0; r < R; r++) {
        bf16 *dst = out + (q0 + t0 + r / G) * H * D + (g * G + r % G) * D;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(o[r * D + d] * inv);
    }
}
#endif

/* Attention of the queries of sequences [first_seq, num_seqs): sequence s's queries are rows
 * [query_start[s], query_start[s + 1]) of q [T, H, D] (token stride q_stride, heads D apart), its
 * context the seq_lens[s] positions reached through block_tables[s] (int32, bt_stride apart) in
 * k_cache / v_cache [num_blocks, block_size, KVH, D], its own keys already written there. A query at
 * position p sees keys k <= p, and k > p - window when window > 0. out [T, H, D] contiguous: those
 * rows written, no other. softcap > 0 caps the scaled scores as softcap * tanh(s / softcap).
 * Returns 0, or -1 (nothing done) without AVX512-BF16 or when D % 32 != 0 or D > 256 or H / KVH > 64. */
int64_t paged_prefill_attention_bf16(const bf16 *q, int64_t q_stride, bf16 *out, const bf16 *k_cache,
                                     const bf16 *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                     const int32_t *query_start, const int32_t *seq_lens, int64_t first_seq,
                                     int64_t num_seqs, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                     int64_t window, float scale, float softcap) {
#if defined(__AVX512BF16__)
    const int64_t G = H / KVH;
    if (D % 32 != 0 || D > MAX_HEAD_DIM || G > PREFILL_ROWS) return -1;
    const int64_t tokens_per_item = PREFILL_ROWS / G, row = KVH * D;
    int64_t items = 0;
    for (int64_t s = first_seq; s < num_seqs; s++)
        items += (query_start[s + 1] - query_start[s] + tokens_per_item - 1) / tokens_per_item * KVH;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t rest = items - 1 - it; /* the last tiles (the most keys) first */
        for (int64_t s = first_seq; s < num_seqs; s++) {
            const int64_t ql = query_start[s + 1] - query_start[s];
            const int64_t here = (ql + tokens_per_item - 1) / tokens_per_item * KVH;
            if (rest >= here) {
                rest -= here;
                continue;
            }
            const int64_t t0 = rest / KVH * tokens_per_item, g = rest % KVH;
            const int64_t nt = (ql - t0) < tokens_per_item ? (ql - t0) : tokens_per_item;
            prefill_item(q, q_stride, out, k_cache, v_cache, block_tables + s * bt_stride, query_start[s], ql,
                         seq_lens[s], t0, nt, g, G, H, D, row, block_size, window, scale, softcap);
            break;
        }
    }
    return 0;
#else
    (void)q, (void)q_stride, (void)out, (void)k_cache, (void)v_cache, (void)block_tables, (void)bt_stride;
    (void)query_start, (void)seq_lens, (void)first_seq, (void)num_seqs, (void)H, (void)KVH, (void)D;
    (void)block_size, (void)window, (void)scale, (void)softcap;
    return -1;
#endif
}
