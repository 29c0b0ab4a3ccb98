/* aserve's CPU kernels for bf16 activations: the decode step's small ops, one call each (residual add +
 * RMSNorm, rotary, SiLU-and-mul, paged decode attention). Matrix products are in cpu_matmul.c. Built and
 * loaded by cpu_ops.py, which checks shapes; these functions trust their input.
 */
#include "cpu_common.h"

/* out[r] = bf16(s * rsqrt(mean(s^2) + eps) * w) with s = x[r], or, with a residual, s = x[r] + residual[r]
 * in fp32, stored unrounded in sum_out[r] (the residual stream stays fp32 from layer to layer: closer to
 * an fp32 model than rounding it to bf16 after every add). x is bf16, or fp32 when x_f32 (a projection's
 * unrounded output); residual is bf16, or fp32 when residual_f32;
 * it may be NULL (then sum_out is unused). Row strides in elements; out and sum_out are contiguous
 * [rows, n]. */
static inline void load_row(const void *x, int64_t is_f32, int64_t r, int64_t stride, int64_t n, float *out) {
    if (is_f32) {
        memcpy(out, (const float *)x + r * stride, (size_t)n * sizeof(float));
    } else {
        const bf16 *xr = (const bf16 *)x + r * stride;
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(xr[i]);
    }
}

void add_rms_norm_bf16(const void *x, int64_t x_stride, int64_t x_f32, const void *residual, int64_t res_stride,
                       int64_t residual_f32, const bf16 *weight, bf16 *out, float *sum_out, int64_t rows,
                       int64_t n, float eps, float weight_offset) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float xr[n];
        load_row(x, x_f32, r, x_stride, n, xr);
        bf16 *orow = out + r * n;
        float ss = 0.0f;
        if (residual) {
            float *sr = sum_out + r * n;
            load_row(residual, residual_f32, r, res_stride, n, sr);
            for (int64_t i = 0; i < n; i++) sr[i] += xr[i];
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += sr[i] * sr[i];
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);
            for (int64_t i = 0; i < n; i++) orow[i] = f32_to_bf16(sr[i] * inv * (weight_offset + bf16_to_f32(weight[i])));
            continue;
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) orow[i] = f32_to_bf16(xr[i] * inv * (weight_offset + bf16_to_f32(weight[i])));
    }
}

/* Neox-style rotary embedding of one token's heads: x [heads, head_dim] (row stride head_dim ... given as
 * `head_stride`), rotating the first 2*half dims with cos/sin [half] each, copying the rest. */
static inline void rotate_heads(const bf16 *x, int64_t head_stride, bf16 *out, int64_t heads, int64_t head_dim,
                                const float *cos, const float *sin, int64_t half) {
    for (int64_t h = 0; h < heads; h++) {
        const bf16 *xh = x + h * head_stride;
        bf16 *oh = out + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            float a = bf16_to_f32(xh[i]), b = bf16_to_f32(xh[i + half]);
            oh[i] = f32_to_bf16(a * cos[i] - b * sin[i]);
            oh[i + half] = f32_to_bf16(b * cos[i] + a * sin[i]);
        }
        for (int64_t i = 2 * half; i < head_dim; i++) oh[i] = xh[i];
    }
}

/* q [T, Hq, D] and k [T, Hk, D] (heads contiguous within a token, token stride q_stride / k_stride in
 * elements) rotated neox-style into contiguous q_out [T, Hq, D] / k_out [T, Hk, D]; cos_sin [T, 2*half]
 * (contiguous, bf16: cos then sin). */
void rotary_neox_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, int64_t k_stride, const bf16 *cos_sin,
                      bf16 *q_out, bf16 *k_out, int64_t tokens, int64_t q_heads, int64_t k_heads,
                      int64_t head_dim, int64_t half) {
#pragma omp parallel for schedule(static) if (tokens > 8)
    for (int64_t t = 0; t < tokens; t++) {
        float cos[half], sin[half];
        const bf16 *cs = cos_sin + t * 2 * half;
        for (int64_t i = 0; i < half; i++) {
            cos[i] = bf16_to_f32(cs[i]);
            sin[i] = bf16_to_f32(cs[half + i]);
        }
        rotate_heads(q + t * q_stride, head_dim, q_out + t * q_heads * head_dim, q_heads, head_dim, cos, sin, half);
        rotate_heads(k + t * k_stride, head_dim, k_out + t * k_heads * head_dim, k_heads, head_dim, cos, sin, half);
    }
}

/* out [rows, n] = bf16(a * sigmoid(z) * x[r, n + i]) for a = x[r, i] (fp32 inside, one rounding): z = a is
 * SiLU; z = 2y, y = sqrt(2 / pi) (a + 0.044715 a^3), is GELU with torch's tanh approximation, since
 * (1 + tanh(y)) / 2 = sigmoid(2y) (a form that keeps its precision where GELU nears 0, unlike 1 + tanh).
 * x bf16, or fp32 when x_f32, row stride x_stride. */
static inline void sigmoid_gated(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n,
                                 const int gelu) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float row[2 * n];
        load_row(x, x_f32, r, x_stride, 2 * n, row);
        bf16 *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = row[i];
            const float z = gelu ? 1.5957691216057308f * (a + 0.044715f * a * a * a) : a;
            o[i] = f32_to_bf16(a / (1.0f + fast_exp(-z)) * row[n + i]);
        }
    }
}

void silu_and_mul_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n) {
    sigmoid_gated(x, x_stride, x_f32, out, rows, n, 0);
}

void gelu_tanh_and_mul_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n) {
    sigmoid_gated(x, x_stride, x_f32, out, rows, n, 1);
}

#define KEY_CHUNK 64
#define MAX_GROUP 16

/* One (sequence, KV head) of paged decode attention: the G query heads that share KV head g. D is a
 * compile-time constant where this is inlined for a common head size (the inner loops unroll). */
static inline __attribute__((always_inline)) void attend_kv_head(
    const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t row, int64_t g, int64_t G, const int64_t D, int64_t block_size, float scale,
    float softcap) {
    float qf[MAX_GROUP * D], acc[MAX_GROUP * D], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][KEY_CHUNK], kv[D];
    for (int64_t h = 0; h < G; h++) {
        for (int64_t i = 0; i < D; i++) {
            qf[h * D + i] = bf16_to_f32(q[h * D + i]) * scale;
            acc[h * D + i] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t c0 = start; c0 < len; c0 += KEY_CHUNK) {
        const int64_t n = (len - c0) < KEY_CHUNK ? (len - c0) : KEY_CHUNK;
        int64_t slot[KEY_CHUNK]; /* cache slot of each key in the chunk (no division per key) */
        for (int64_t j = 0, block = c0 / block_size, offset = c0 % block_size; j < n; j++) {
            slot[j] = (int64_t)table[block] * block_size + offset;
            if (++offset == block_size) {
                offset = 0;
                block++;
            }
        }
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
    for (int64_t h = 0; h < G; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t i = 0; i < D; i++) out[h * D + i] = f32_to_bf16(acc[h * D + i] * inv);
    }
}

/* Decode attention over a paged bf16 KV cache, reading the blocks in place.
 *
 * q [B, H, D] contiguous; k_cache / v_cache [num_blocks, block_size, KVH, D] (one layer's halves);
 * block_tables [B, bt_stride] int32; seq_lens [B] int32 (keys of sequence b: positions [start, len),
 * start = len - window when window > 0 and len > window, else 0). If slots is not NULL, first writes
 * the new keys / values k_new, v_new [B, KVH, D] (token strides k_stride, v_stride) at slots [B] (int64,
 * -1 = skip). out [B, H, D] contiguous. Query head h uses KV head h / (H / KVH), H / KVH <= 16.
 * Online softmax in fp32; softcap > 0 caps the scaled scores as softcap * tanh(s / softcap).
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
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work * H > 16384)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t g = 0; g < KVH; g++) {
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int32_t *table = block_tables + b * bt_stride;
            const bf16 *qg = q + (b * H + g * G) * D;
            bf16 *og = out + (b * H + g * G) * D;
            switch (D) {
            case 64:
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, 64, block_size, scale, softcap);
                break;
            case 128:
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, 128, block_size, scale, softcap);
                break;
            default:
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, D, block_size, scale, softcap);
            }
        }
    }
}

