/* Decode attention's unit of work, one (sequence, KV head), on CPUs with AVX2 + FMA but no AVX512 (Zen 2 /
 * Zen 3, Intel before Skylake-X): the form cpu_attention.c's attend_item calls there instead of the portable
 * loops (which widen each key and reduce each dot product alone).
 *
 * Keys go ATTEND_AVX2_CHUNK at a time: the chunk's keys and values widened to fp32 once into buffers on the
 * stack (a few KB, in L1), scores of 8 keys at a time per query head (one vector accumulator per key, the 8
 * reduced together by a transposing add tree), one online-softmax update per head and chunk, then p . V
 * with up to 4 vectors of a head's accumulators in registers. fp32 throughout, one bf16 rounding per output;
 * the order of sums differs from the portable form's (both are checked against torch's attention). */
#include "cpu_common.h"

#if ASERVE_ATTEND_AVX2

#define ATTEND_AVX2_CHUNK 32 /* keys per softmax update (a multiple of 8) */

/* Lane j = the sum of a[j]'s 8 lanes. */
static inline __m256 sum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* per 128-bit half: keys 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* exp(x) on 8 lanes: fast_exp's polynomial and range (lanes below -87, -inf included, give 0). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 live = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P5);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P0));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/* n rows of D bf16 (at cache + slot[j] * row + offset) widened into dst [ATTEND_AVX2_CHUNK, D] fp32; rows n
 * up to the next multiple of 8 are zeros. */
static inline __attribute__((always_inline)) void widen_rows(float *dst, const bf16 *cache, const int64_t *slot,
                                                             int64_t n, int64_t row, int64_t offset, const int64_t D) {
    for (int64_t j = 0; j < n; j++) {
        const bf16 *src = cache + slot[j] * row + offset;
        for (int64_t i = 0; i < D; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + j * D + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    }
    for (int64_t j = n; j < ((n + 7) & ~(int64_t)7); j++) memset(dst + j * D, 0, (size_t)D * sizeof(float));
}

/* The next chunk's key and value rows (n at slot) pulled towards L1 while this one computes. */
static inline void prefetch_kv(const bf16 *k_cache, const bf16 *v_cache, const int64_t *slot, int64_t n, int64_t row,
                               int64_t offset, int64_t D) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < D; i += 32) { /* 64-byte lines */
            _mm_prefetch((const char *)(k_cache + slot[j] * row + offset + i), _MM_HINT_T0);
            _mm_prefetch((const char *)(v_cache + slot[j] * row + offset + i), _MM_HINT_T0);
        }
}

static inline __attribute__((always_inline)) void attend_kv_head_avx2(
    const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t row, int64_t g, int64_t G, const int64_t D, int64_t block_size, float scale,
    float softcap, float *partial) {
    float qf[MAX_GROUP * D], acc[MAX_GROUP * D], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][ATTEND_AVX2_CHUNK];
    float kbuf[ATTEND_AVX2_CHUNK * D], vbuf[ATTEND_AVX2_CHUNK * D];
    start_heads(q, G, D, scale, qf, acc, m, l);
    int64_t slot[ATTEND_AVX2_CHUNK], next[ATTEND_AVX2_CHUNK];
    key_slots(table, start, (len - start) < ATTEND_AVX2_CHUNK ? (len - start) : ATTEND_AVX2_CHUNK, block_size, next);
    for (int64_t c0 = start; c0 < len; c0 += ATTEND_AVX2_CHUNK) {
        const int64_t n = (len - c0) < ATTEND_AVX2_CHUNK ? (len - c0) : ATTEND_AVX2_CHUNK;
        memcpy(slot, next, (size_t)n * sizeof(int64_t));
        if (c0 + ATTEND_AVX2_CHUNK < len) {
            const int64_t c1 = c0 + ATTEND_AVX2_CHUNK, nn = (len - c1) < ATTEND_AVX2_CHUNK ? (len - c1) : ATTEND_AVX2_CHUNK;
            key_slots(table, c1, nn, block_size, next);
            prefetch_kv(k_cache, v_cache, next, nn, row, g * D, D);
        }
        widen_rows(kbuf, k_cache, slot, n, row, g * D, D);
        widen_rows(vbuf, v_cache, slot, n, row, g * D, D);
        const int64_t tiles = (n + 7) / 8;
        for (int64_t h = 0; h < G; h++) {
            const float *qh = qf + h * D;
            __m256 sv[ATTEND_AVX2_CHUNK / 8];
            for (int64_t t = 0; t < tiles; t++) {
                __m256 a[8];
                for (int64_t j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + i);
                    for (int64_t j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kbuf + (8 * t + j) * D + i), a[j]);
                }
                sv[t] = sum8x8(a);
                if (softcap > 0.0f) { /* Gemma 2: scores capped as softcap * tanh(s / softcap) */
                    float v[8];
                    _mm256_storeu_ps(v, sv[t]);
                    for (int j = 0; j < 8; j++) v[j] = softcap * tanhf(v[j] / softcap);
                    sv[t] = _mm256_loadu_ps(v);
                }
            }
            if (n % 8) { /* keys past the chunk's end: -inf */
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                const __m256 past = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)(n % 8) - 1)));
                sv[tiles - 1] = _mm256_blendv_ps(sv[tiles - 1], _mm256_set1_ps(-INFINITY), past);
            }
            __m256 mx_v = sv[0];
            for (int64_t t = 1; t < tiles; t++) mx_v = _mm256_max_ps(mx_v, sv[t]);
            const float chunk_max = hmax8(mx_v), mx = chunk_max > m[h] ? chunk_max : m[h];
            const float corr = fast_exp(m[h] - mx); /* 0 on the first chunk (m = -inf) */
            __m256 sum = _mm256_setzero_ps();
            for (int64_t t = 0; t < tiles; t++) {
                sv[t] = exp8(_mm256_sub_ps(sv[t], _mm256_set1_ps(mx)));
                sum = _mm256_add_ps(sum, sv[t]);
                _mm256_storeu_ps(s[h] + 8 * t, sv[t]);
            }
            l[h] = l[h] * corr + hsum8(sum);
            m[h] = mx;
            float *ah = acc + h * D;
            for (int64_t i0 = 0; i0 < D; i0 += 32) { /* up to 4 vectors of this head's sums in registers */
                const int64_t nv = (D - i0) < 32 ? (D - i0) / 8 : 4;
                const __m256 c = _mm256_set1_ps(corr);
                __m256 r[4];
                for (int64_t v = 0; v < nv; v++) r[v] = _mm256_mul_ps(_mm256_loadu_ps(ah + i0 + 8 * v), c);
                for (int64_t j = 0; j < n; j++) {
                    const __m256 p = _mm256_set1_ps(s[h][j]);
                    for (int64_t v = 0; v < nv; v++) r[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vbuf + j * D + i0 + 8 * v), r[v]);
                }
                for (int64_t v = 0; v < nv; v++) _mm256_storeu_ps(ah + i0 + 8 * v, r[v]);
            }
        }
    }
    finish_heads(acc, m, l, G, D, out, partial);
}

void attend_avx2(const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
                 int64_t start, int64_t len, int64_t row, int64_t g, int64_t G, int64_t D, int64_t block_size,
                 float scale, float softcap, float *partial) {
    WITH_HEAD_SIZE(D, attend_kv_head_avx2(q, out, k_cache, v_cache, table, start, len, row, g, G, HEAD_D, block_size,
                                          scale, softcap, partial));
}

int64_t attend_avx2_splits(const int32_t *seq_lens, int64_t B, int64_t KVH, int64_t window) {
    if (B * KVH >= ATTEND_SPLIT_ITEMS) return 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = (window > 0 && seq_lens[b] > window) ? window : seq_lens[b];
        longest = n > longest ? n : longest;
    }
    int64_t S = (ATTEND_SPLIT_ITEMS + B * KVH - 1) / (B * KVH);
    if (S > longest / ATTEND_SPLIT_MIN_KEYS) S = longest / ATTEND_SPLIT_MIN_KEYS;
    return S > 1 ? S : 1;
}

void attend_avx2_split(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, int64_t b, int64_t sp, int64_t S, int64_t g,
                       int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                       float softcap, float *part) {
    const int64_t len = seq_lens[b], G = H / KVH;
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t per = ((len - start + S - 1) / S + ATTEND_AVX2_CHUNK - 1) / ATTEND_AVX2_CHUNK * ATTEND_AVX2_CHUNK;
    const int64_t lo = start + sp * per < len ? start + sp * per : len, hi = lo + per < len ? lo + per : len;
    attend_avx2(q + (b * H + g * G) * D, NULL, k_cache, v_cache, block_tables + b * bt_stride, lo, hi, KVH * D, g, G,
                D, block_size, scale, softcap, part);
}

#endif

/* Which form decode attention's items run in: 2 = the bf16 dot product (AVX512-BF16; runs of keys split over
 * the threads), 1 = AVX2 + FMA (runs split as attend_avx2_splits says), 0 = the portable loops (no split). */
int64_t decode_attention_form(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif ASERVE_ATTEND_AVX2
    return 1;
#else
    return 0;
#endif
}
