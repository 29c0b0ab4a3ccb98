/* aserve's CPU attention over a paged bf16 KV cache, reading the blocks in place: decode (one query per
 * sequence) and prefill / extend (a run of queries at the end of each sequence, causal). Scores and the
 * softmax are fp32 with an online (running max) softmax. With AVX512-BF16 and a head size that is a
 * multiple of 32, q.k products use the CPU's bf16 dot product (both are bf16 already, so the products are
 * exact); prefill also multiplies the probabilities, rounded to bf16 as torch's flash attention does,
 * with V that way. Built and loaded by cpu_ops.py, which checks shapes; these functions trust their input.
 */
#include "cpu_team.h"

#define KEY_CHUNK 64

/* One (sequence, KV head) of paged decode attention: the G query heads that share KV head g. D is a
 * compile-time constant where this is inlined for a common head size (the inner loops unroll). */
static inline __attribute__((always_inline)) void attend_kv_head(
    const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t row, int64_t g, int64_t G, const int64_t D, int64_t block_size, float scale,
    float softcap) {
    float qf[MAX_GROUP * D], acc[MAX_GROUP * D], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][KEY_CHUNK], kv[D];
    start_heads(q, G, D, scale, qf, acc, m, l);
    for (int64_t c0 = start; c0 < len; c0 += KEY_CHUNK) {
        const int64_t n = (len - c0) < KEY_CHUNK ? (len - c0) : KEY_CHUNK;
        int64_t slot[KEY_CHUNK];
        key_slots(table, c0, n, block_size, slot);
        for (int64_t j = 0; j < n; j++) {
            const bf16 *kr = k_cache + slot[j] * row + g * D;
#if defined(__AVX512F__)
            if (D % 16 == 0) { /* one 16-lane partial sum per head, reduced once (no per-element chain) */
                for (int64_t h = 0; h < G; h++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t i = 0; i < D; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * D + i), load16_bf16(kr + i), a);
                    s[h][j] = _mm512_reduce_add_ps(a);
                }
                continue;
            }
#endif
            for (int64_t i = 0; i < D; i++) kv[i] = bf16_to_f32(kr[i]);
            for (int64_t h = 0; h < G; h++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < D; i++) dot += qf[h * D + i] * kv[i];
                s[h][j] = dot;
            }
        }
        for (int64_t h = 0; h < G; h++) {
            if (softcap > 0.0f) /* Gemma 2: scores capped as softcap * tanh(s / softcap) */
                for (int64_t j = 0; j < n; j++) s[h][j] = softcap * tanhf(s[h][j] / softcap);
            float mx = m[h];
            for (int64_t j = 0; j < n; j++) mx = s[h][j] > mx ? s[h][j] : mx;
            const float corr = fast_exp(m[h] - mx); /* 0 on the first chunk (m = -inf) */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                s[h][j] = fast_exp(s[h][j] - mx);
                sum += s[h][j];
            }
            l[h] = l[h] * corr + sum;
            m[h] = mx;
            for (int64_t i = 0; i < D; i++) acc[h * D + i] *= corr;
        }
#if defined(__AVX512F__)
        if (D % 64 == 0) { /* values converted once per chunk, then 4 register accumulators per head */
            float vbuf[KEY_CHUNK * D];
            for (int64_t j = 0; j < n; j++) {
                const bf16 *vr = v_cache + slot[j] * row + g * D;
                for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(vbuf + j * D + i, load16_bf16(vr + i));
            }
            for (int64_t h = 0; h < G; h++) {
                for (int64_t i = 0; i < D; i += 64) {
                    float *ah = acc + h * D + i;
                    __m512 a0 = _mm512_loadu_ps(ah), a1 = _mm512_loadu_ps(ah + 16);
                    __m512 a2 = _mm512_loadu_ps(ah + 32), a3 = _mm512_loadu_ps(ah + 48);
                    for (int64_t j = 0; j < n; j++) {
                        const __m512 p = _mm512_set1_ps(s[h][j]);
                        const float *vj = vbuf + j * D + i;
                        a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj), a0);
                        a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16), a1);
                        a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 32), a2);
                        a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 48), a3);
                    }
                    _mm512_storeu_ps(ah, a0);
                    _mm512_storeu_ps(ah + 16, a1);
                    _mm512_storeu_ps(ah + 32, a2);
                    _mm512_storeu_ps(ah + 48, a3);
                }
            }
            continue;
        }
#endif
        for (int64_t j = 0; j < n; j++) {
            const bf16 *vr = v_cache + slot[j] * row + g * D;
            for (int64_t i = 0; i < D; i++) kv[i] = bf16_to_f32(vr[i]);
            for (int64_t h = 0; h < G; h++) {
                const float p = s[h][j];
#pragma omp simd
                for (int64_t i = 0; i < D; i++) acc[h * D + i] += p * kv[i];
            }
        }
    }
    finish_heads(acc, m, l, G, D, out, NULL);
}

#if defined(__AVX512BF16__)
#define KEY_TILE 16

/* Lane j = the sum of v[j]'s 16 lanes (a transposing add tree: 30 shuffles, 15 adds). */
static inline __m512 sum16x16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per lane: keys 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* lanes: keys 8i..8i+3 twice, then 8i+4..8i+7 twice */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* Scores of one query head against KEY_TILE keys: lane j = q . k_j (bf16 products, fp32 sums); keys
 * at or past n give 0. */
static inline __attribute__((always_inline)) __m512 tile_scores(const bf16 *q, const bf16 *const *keys, int64_t n,
                                                               const int64_t D) {
    __m512 part[KEY_TILE];
    for (int64_t j = 0; j < KEY_TILE; j++) {
        __m512 a = _mm512_setzero_ps();
        if (j < n)
            for (int64_t i = 0; i < D; i += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(keys[j] + i));
        part[j] = a;
    }
    return sum16x16(part);
}

/* Head g's D elements at each of n cache slots pulled towards L1. */
static inline void prefetch_rows(const bf16 *cache, const int64_t *slot, int64_t n, int64_t row, int64_t g, int64_t D) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < D; i += 32) _mm_prefetch((const char *)(cache + slot[j] * row + g * D + i), _MM_HINT_T0);
}

#define DOT_CHUNK 64 /* keys per softmax update */
#define HEAD_BLOCK 4 /* query heads whose outputs accumulate in registers together */

/* attend_kv_head on the bf16 dot product: D % 32 == 0, D <= 256. Keys go DOT_CHUNK at a time: scores of
 * every head (tiles of 16 keys), one softmax update per head, then p . V with the values converted to
 * fp32 once and HEAD_BLOCK heads' accumulators in registers. */
static inline __attribute__((always_inline)) void attend_kv_head_dot(
    const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t row, int64_t g, int64_t G, const int64_t D, int64_t block_size, float scale,
    float softcap, float *partial) {
    float acc[MAX_GROUP * D], m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][DOT_CHUNK], vbuf[DOT_CHUNK * D];
    for (int64_t h = 0; h < G; h++) {
        for (int64_t i = 0; i < D; i++) acc[h * D + i] = 0.0f;
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const __m512 scale_v = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t c0 = start; c0 < len; c0 += DOT_CHUNK) {
        const int64_t n = (len - c0) < DOT_CHUNK ? (len - c0) : DOT_CHUNK;
        const int64_t tiles = (n + KEY_TILE - 1) / KEY_TILE;
        int64_t slot[DOT_CHUNK];
        const bf16 *keys[DOT_CHUNK];
        key_slots(table, c0, n, block_size, slot);
        for (int64_t j = 0; j < n; j++) keys[j] = k_cache + slot[j] * row + g * D;
        prefetch_rows(v_cache, slot, n, row, g, D); /* this chunk's values, read after the scores */
        if (c0 + DOT_CHUNK < len) { /* the next chunk's keys */
            const int64_t nn = (len - c0 - DOT_CHUNK) < DOT_CHUNK ? (len - c0 - DOT_CHUNK) : DOT_CHUNK;
            int64_t next[DOT_CHUNK];
            key_slots(table, c0 + DOT_CHUNK, nn, block_size, next);
            prefetch_rows(k_cache, next, nn, row, g, D);
        }
        for (int64_t h = 0; h < G; h++) {
            __m512 s[DOT_CHUNK / KEY_TILE];
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t nt = (n - t * KEY_TILE) < KEY_TILE ? (n - t * KEY_TILE) : KEY_TILE;
                s[t] = _mm512_mul_ps(tile_scores(q + h * D, keys + t * KEY_TILE, nt, D), scale_v);
                if (softcap > 0.0f) s[t] = cap_scores(s[t], softcap);
                s[t] = _mm512_mask_mov_ps(minus_inf, (__mmask16)((1u << nt) - 1u), s[t]);
            }
            const float corr = softmax_chunk(s, tiles, &m[h], &l[h]);
            for (int64_t t = 0; t < tiles; t++) _mm512_storeu_ps(p[h] + t * KEY_TILE, s[t]);
            if (corr != 1.0f)
                for (int64_t i = 0; i < D; i += 16)
                    _mm512_storeu_ps(acc + h * D + i, _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + i), _mm512_set1_ps(corr)));
        }
        for (int64_t j = 0; j < n; j++) { /* values converted once per chunk */
            const bf16 *vr = v_cache + slot[j] * row + g * D;
            for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(vbuf + j * D + i, load16_bf16(vr + i));
        }
        for (int64_t h0 = 0; h0 < G; h0 += HEAD_BLOCK) {
            const int64_t hb = (G - h0) < HEAD_BLOCK ? (G - h0) : HEAD_BLOCK;
            for (int64_t i = 0; i < D; i += 32) {
                __m512 a[HEAD_BLOCK][2];
                for (int64_t h = 0; h < hb; h++) {
                    a[h][0] = _mm512_loadu_ps(acc + (h0 + h) * D + i);
                    a[h][1] = _mm512_loadu_ps(acc + (h0 + h) * D + i + 16);
                }
                for (int64_t j = 0; j < n; j++) {
                    const __m512 v0 = _mm512_loadu_ps(vbuf + j * D + i), v1 = _mm512_loadu_ps(vbuf + j * D + i + 16);
                    for (int64_t h = 0; h < hb; h++) {
                        const __m512 pj = _mm512_set1_ps(p[h0 + h][j]);
                        a[h][0] = _mm512_fmadd_ps(pj, v0, a[h][0]);
                        a[h][1] = _mm512_fmadd_ps(pj, v1, a[h][1]);
                    }
                }
                for (int64_t h = 0; h < hb; h++) {
                    _mm512_storeu_ps(acc + (h0 + h) * D + i, a[h][0]);
                    _mm512_storeu_ps(acc + (h0 + h) * D + i + 16, a[h][1]);
                }
            }
        }
    }
    finish_heads(acc, m, l, G, D, out, partial);
}

/* attend_kv_head_dot with a compile-time head size where it is a common one (the inner loops unroll). */
static inline void attend_dot(const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache,
                              const int32_t *table, int64_t start, int64_t len, int64_t row, int64_t g, int64_t G,
                              int64_t D, int64_t block_size, float scale, float softcap, float *partial) {
    WITH_HEAD_SIZE(D, attend_kv_head_dot(q, out, k_cache, v_cache, table, start, len, row, g, G, HEAD_D, block_size,
                                         scale, softcap, partial));
}

#define SPLIT_MIN_KEYS 128           /* keys per split at least (a multiple of DOT_CHUNK) */
#define SPLIT_MAX_FLOATS (64 * 1024) /* the splits' states live on the caller's stack */

/* How many runs of keys each sequence of a decode batch is split into (each run attended over every KV
 * head in turn, reading whole cache rows) when there are fewer (sequence, KV head) pairs than twice the
 * threads: 1 (no split) unless the batch is small and its keys many. */
static int64_t decode_splits(const int32_t *seq_lens, int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t window) {
#if defined(_OPENMP)
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    if (threads < 2 || B * KVH >= 2 * threads) return 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = (window > 0 && seq_lens[b] > window) ? window : seq_lens[b];
        longest = n > longest ? n : longest;
    }
    int64_t S = (2 * threads + B - 1) / B; /* runs of keys per sequence, each over every KV head */
    if (S > longest / SPLIT_MIN_KEYS) S = longest / SPLIT_MIN_KEYS;
    while (S > 1 && B * KVH * S * (G * D + 2 * G) > SPLIT_MAX_FLOATS) S--;
    return S > 1 ? S : 1;
}
#endif

/* Sequence b's G query heads of KV head g (q [B, H, D]) attended into og [G, D]: paged decode attention's
 * unit of work, on the bf16 dot product where the build and D allow, else attend_kv_head. */
static void attend_item(const bf16 *q, bf16 *og, const bf16 *k_cache, const bf16 *v_cache, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *seq_lens, int64_t b, int64_t g, int64_t H, int64_t G,
                        int64_t D, int64_t row, int64_t block_size, int64_t window, float scale, float softcap) {
    const int64_t len = seq_lens[b];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int32_t *table = block_tables + b * bt_stride;
    const bf16 *qg = q + (b * H + g * G) * D;
#if defined(__AVX512BF16__)
    if (D % 32 == 0 && D <= 256) {
        attend_dot(qg, og, k_cache, v_cache, table, start, len, row, g, G, D, block_size, scale, softcap, NULL);
        return;
    }
#elif ASERVE_ATTEND_AVX2
    if (D % 8 == 0) {
        attend_avx2(qg, og, k_cache, v_cache, table, start, len, row, g, G, D, block_size, scale, softcap, NULL);
        return;
    }
#endif
    WITH_HEAD_SIZE(D, attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, HEAD_D, block_size, scale,
                                     softcap));
}

/* Decode attention over a paged bf16 KV cache, reading the blocks in place.
 *
 * q [B, H, D] contiguous; k_cache / v_cache [num_blocks, block_size, KVH, D] (one layer's halves);
 * block_tables [B, bt_stride] int32; seq_lens [B] int32 (keys of sequence b: positions [start, len),
 * start = len - window when window > 0 and len > window, else 0). If slots is not NULL, first writes
 * the new keys / values k_new, v_new [B, KVH, D] (token strides k_stride, v_stride) at slots [B] (int64,
 * -1 = skip). out [B, H, D] contiguous. Query head h uses KV head h / (H / KVH), H / KVH <= 16.
 * softcap > 0 caps the scaled scores as softcap * tanh(s / softcap).
 */
void paged_decode_attention_bf16(const bf16 *q, bf16 *out, bf16 *k_cache, bf16 *v_cache,
                                 const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                 const int64_t *slots, const bf16 *k_new, int64_t k_stride, const bf16 *v_new,
                                 int64_t v_stride, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                 int64_t block_size, int64_t window, float scale, float softcap) {
    const int64_t row = KVH * D; /* elements per cache slot */
    if (slots) {
        for (int64_t b = 0; b < B; b++) {
            if (slots[b] < 0) continue;
            memcpy(k_cache + slots[b] * row, k_new + b * k_stride, (size_t)row * sizeof(bf16));
            memcpy(v_cache + slots[b] * row, v_new + b * v_stride, (size_t)row * sizeof(bf16));
        }
    }
    const int64_t G = H / KVH;
#if defined(__AVX512BF16__)
    const int64_t S = D % 32 == 0 && D <= 256 ? decode_splits(seq_lens, B, KVH, G, D, window) : 1;
    if (S > 1) { /* split-KV: each (sequence, KV head)'s keys in S runs on the threads, then merged */
        const int64_t width = G * D + 2 * G;
        float parts[B * KVH * S * width];
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++)
            for (int64_t sp = 0; sp < S; sp++)
                for (int64_t g = 0; g < KVH; g++) { /* a run of whole cache rows: every KV head in turn */
                    const int64_t len = seq_lens[b];
                    const int64_t start = (window > 0 && len > window) ? len - window : 0;
                    const int64_t per = ((len - start + S - 1) / S + DOT_CHUNK - 1) / DOT_CHUNK * DOT_CHUNK;
                    const int64_t lo = start + sp * per, hi = lo + per < len ? lo + per : len;
                    float *part = parts + ((b * KVH + g) * S + sp) * width;
                    if (lo >= hi) { /* nothing left for this split */
                        for (int64_t h = 0; h < G; h++) part[G * D + G + h] = 0.0f, part[G * D + h] = -INFINITY;
                        continue;
                    }
                    attend_dot(q + (b * H + g * G) * D, NULL, k_cache, v_cache, block_tables + b * bt_stride, lo,
                               hi, row, g, G, D, block_size, scale, softcap, part);
                }
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < KVH; g++)
                merge_splits(parts + (b * KVH + g) * S * width, S, G, D, out + (b * H + g * G) * D);
        return;
    }
#elif ASERVE_ATTEND_AVX2
    const int64_t S = D % 8 == 0 ? attend_avx2_splits(seq_lens, B, KVH, window) : 1;
    if (S > 1) { /* split-KV: (sequence, run of keys, KV head) items, then merged (as the team's step does) */
        const int64_t width = G * D + 2 * G;
        float parts[B * KVH * S * width];
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t c = 0; c < B * S * KVH; c++) {
            const int64_t b = c / (S * KVH), sp = c / KVH % S, g = c % KVH;
            attend_avx2_split(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, b, sp, S, g, H, KVH, D,
                              block_size, window, scale, softcap, parts + ((b * KVH + g) * S + sp) * width);
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < KVH; g++)
                merge_splits(parts + (b * KVH + g) * S * width, S, G, D, out + (b * H + g * G) * D);
        return;
    }
#endif
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work * H > 16384)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t g = 0; g < KVH; g++) {
            attend_item(q, out + (b * H + g * G) * D, k_cache, v_cache, block_tables, bt_stride, seq_lens, b, g, H, G,
                        D, row, block_size, window, scale, softcap);
        }
    }
}

/* One (sequence b, KV head g) item of paged_decode_attention_bf16's unsplit form (the cache already
 * written): the G query heads' outputs, stored under `commit` (cpu_team.h). */
void decode_attention_item(const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t b, int64_t g,
                           int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                           float softcap, chunk_commit *commit) {
    const int64_t G = H / KVH;
    bf16 kept[G * D];
    attend_item(q, kept, k_cache, v_cache, block_tables, bt_stride, seq_lens, b, g, H, G, D, KVH * D, block_size, window,
                scale, softcap);
    if (!chunk_commit_begin(commit)) return;
    memcpy(out + (b * H + g * G) * D, kept, (size_t)(G * D) * sizeof(bf16));
    chunk_commit_end(commit);
}
