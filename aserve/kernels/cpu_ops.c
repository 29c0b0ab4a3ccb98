
/* aserve's CPU kernels for 16-bit (bfloat16) activations: the decode step's small ops in one call each.
 *
 * Built at first use by aserve/kernels/cpu_ops.py (`cc -O3 -march=native -fopenmp -shared`), loaded with
 * ctypes; the Python side checks shapes, dtypes and contiguity, so these functions trust their input.
 * Arithmetic is fp32 inside with one rounding to bf16 per output (round to nearest even, as torch).
 * OpenMP here shares torch's runtime (the .so is loaded after torch's libgomp), so it uses torch's
 * thread count and pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

static inline float bf16_to_f32(bf16 h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline bf16 f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* exp(x): Cody-Waite range reduction and a degree-6 polynomial, within ~2 ulp of expf for
 * x in [-87, 88] (0 below, inf above); plain arithmetic, so the loops that call it vectorize. */
static inline float fast_exp(float x) {
    if (x < -87.0f) return 0.0f;
    if (x > 88.0f) return INFINITY;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

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
                       int64_t n, float eps) {
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
            for (int64_t i = 0; i < n; i++) orow[i] = f32_to_bf16(sr[i] * inv * bf16_to_f32(weight[i]));
            continue;
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) orow[i] = f32_to_bf16(xr[i] * inv * bf16_to_f32(weight[i]));
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

/* out [rows, n] = bf16(silu(x[r, :n]) * x[r, n:2n]), x (bf16, or fp32 when x_f32) with row stride x_stride. */
void silu_and_mul_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float row[2 * n];
        load_row(x, x_f32, r, x_stride, 2 * n, row);
        bf16 *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = row[i];
            o[i] = f32_to_bf16(a / (1.0f + fast_exp(-a)) * row[n + i]);
        }
    }
}

#define KEY_CHUNK 64
#define MAX_GROUP 16

/* One (sequence, KV head) of paged decode attention: the G query heads that share KV head g. D is a
 * compile-time constant where this is inlined for a common head size (the inner loops unroll). */
static inline __attribute__((always_inline)) void attend_kv_head(
    const bf16 *q, bf16 *out, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, int64_t start,
    int64_t len, int64_t row, int64_t g, int64_t G, const int64_t D, int64_t block_size, float scale) {
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
 * Online softmax in fp32.
 */
void paged_decode_attention_bf16(const bf16 *q, bf16 *out, bf16 *k_cache, bf16 *v_cache,
                                 const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                 const int64_t *slots, const bf16 *k_new, int64_t k_stride, const bf16 *v_new,
                                 int64_t v_stride, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                 int64_t block_size, int64_t window, float scale) {
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
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, 64, block_size, scale);
                break;
            case 128:
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, 128, block_size, scale);
                break;
            default:
                attend_kv_head(qg, og, k_cache, v_cache, table, start, len, row, g, G, D, block_size, scale);
            }
        }
    }
}

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

/* y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]); bf16 in and out, fp32 accumulation, one rounding.
 * x rows have stride x_stride, y rows y_stride (elements); w is contiguous (Hugging Face layout). y is
 * float32 (no rounding) when y_f32 is non-zero. Output
 * rows are split across threads; each thread streams its own contiguous part of w once, 4 rows at a
 * time, against every row of x (so w is read from memory once whatever M is). */
void linear_bf16(const bf16 *x, int64_t x_stride, const bf16 *w, const bf16 *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t y_f32) {
#pragma omp parallel if (N * K > 65536)
    {
#if defined(_OPENMP)
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t per = ((N + nt - 1) / nt + 3) / 4 * 4;
        const int64_t n_begin = t * per, n_end = (n_begin + per) < N ? (n_begin + per) : N;
        for (int64_t n0 = n_begin; n0 < n_end; n0 += 4) {
            const int64_t nb = (n_end - n0) < 4 ? (n_end - n0) : 4;
            const bf16 *wb = w + n0 * K;
            const bf16 *prefetch = (n0 + LINEAR_PREFETCH_ROWS + 4 <= n_end) ? wb + LINEAR_PREFETCH_ROWS * K : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t mb = (M - m0) < 4 ? (M - m0) : 4;
                float sums[4][4];
                const bf16 *xb = x + m0 * x_stride;
                if (nb == 4 && mb == 4) dot_block(xb, x_stride, wb, K, 4, 4, m0 ? NULL : prefetch, sums);
                else if (nb == 4 && mb == 1) dot_block(xb, x_stride, wb, K, 1, 4, prefetch, sums);
                else if (nb == 4 && mb == 2) dot_block(xb, x_stride, wb, K, 2, 4, m0 ? NULL : prefetch, sums);
                else dot_block(xb, x_stride, wb, K, mb, nb, m0 ? NULL : prefetch, sums);
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < nb; j++) {
                        const float v = sums[i][j] + (bias ? bf16_to_f32(bias[n0 + j]) : 0.0f);
                        const int64_t at = (m0 + i) * y_stride + n0 + j;
                        if (y_f32) ((float *)y)[at] = v;
                        else ((bf16 *)y)[at] = f32_to_bf16(v);
                    }
            }
        }
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

#if defined(__AVX512BF16__)
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

/* y [M, N] = x [M, K] @ W^T (+ bias) with W pre-packed in pairs along K ("VNNI" layout): w_packed is
 * [N / 16][K / 2][16][2] bf16 (pack with cpu_ops.pack_vnni), N % 16 == 0, K even. Register blocks of
 * 6 rows x 64 columns accumulate with one broadcast x pair per 16-column dot product (no horizontal
 * sums); each thread owns a contiguous range of columns, so every weight byte is read once per 6 rows
 * from cache and once from memory. y is bf16, or fp32 when y_f32. AVX512-BF16 only (returns -1 otherwise). */
int64_t linear_vnni_bf16(const bf16 *x, int64_t x_stride, const bf16 *w_packed, const bf16 *bias, void *y,
                         int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t y_f32) {
#if defined(__AVX512BF16__)
    const int64_t groups = N / 16;
#pragma omp parallel if (N * K > 65536)
    {
#if defined(_OPENMP)
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t per = (groups + nt - 1) / nt;
        const int64_t g_begin = t * per, g_end = (g_begin + per) < groups ? (g_begin + per) : groups;
        for (int64_t g0 = g_begin; g0 < g_end; g0 += 4) {
            const int64_t ng = (g_end - g0) < 4 ? (g_end - g0) : 4;
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
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < ng; j++) {
                        float v[16];
                        _mm512_storeu_ps(v, acc[i][j]);
                        const int64_t col = (g0 + j) * 16;
                        const int64_t at = (m0 + i) * y_stride + col;
                        for (int64_t c = 0; c < 16; c++) {
                            const float o = v[c] + (bias ? bf16_to_f32(bias[col + c]) : 0.0f);
                            if (y_f32) ((float *)y)[at + c] = o;
                            else ((bf16 *)y)[at + c] = f32_to_bf16(o);
                        }
                    }
            }
        }
    }
    return 0;
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
    const uint16_t *mp, int64_t K, const int64_t MB, const int64_t NG, __m512 total[4][4]) {
    const int64_t q_stride = K * 8, s_stride = groups * 16; /* bytes of codes per 16 columns: K * 16 / 2 */
    for (int64_t i = 0; i < MB; i++)
        for (int64_t j = 0; j < NG; j++) total[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc0[4][4], acc1[4][4];
        for (int64_t i = 0; i < MB; i++)
            for (int64_t j = 0; j < NG; j++) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
        for (int64_t j = 0; j < NG; j++) /* the next group's codes: 256 bytes per 16 columns */
            for (int64_t p = 2048; p < 2048 + 256; p += 64) _mm_prefetch((const char *)(qp + j * q_stride + g * 256 + p), _MM_HINT_T0);
        for (int64_t t = g * 8; t < g * 8 + 8; t++) { /* 4 values of k per step */
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
 * (g = k / 32; GGUF Q4_1 is this form, Q4_0 has m = -8 d). Packed per 16 output columns (cpu_ops.pack_int4):
 * q_packed [N/16][K/4][32] bytes (see int4_codes_to_bf16), d and m as [N/16][K/32][16] fp16 (GGUF's own
 * precision; half the bytes of fp32, which matters when streaming). The codes enter the dot products as
 * 128 + q (exact in bf16; products exact in fp32) and m - 128 d is applied in fp32, so only x is rounded,
 * as in the bf16 path. N % 16 == 0, K % 32 == 0. y is bf16, or fp32 when y_f32.
 * AVX512-BF16 only (returns -1 otherwise; -2 when the row sums cannot be allocated). */
int64_t linear_int4_bf16(const bf16 *x, int64_t x_stride, const uint8_t *q_packed, const uint16_t *d, const uint16_t *m,
                         const bf16 *bias, void *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                         int64_t y_f32) {
#if defined(__AVX512BF16__)
    const int64_t groups = K / 32, col_groups = N / 16;
    float *xsum = malloc((size_t)(M * groups) * sizeof(float)); /* sum of each row's x over each group */
    if (!xsum) return -2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t k = g * 32; k < g * 32 + 32; k++) s += bf16_to_f32(x[i * x_stride + k]);
            xsum[i * groups + g] = s;
        }
#pragma omp parallel if (N * K > 65536)
    {
#if defined(_OPENMP)
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t step = M <= 2 ? 4 : 2; /* column groups per register block */
        const int64_t per = ((col_groups + nt - 1) / nt + step - 1) / step * step;
        const int64_t c_begin = t * per, c_end = (c_begin + per) < col_groups ? (c_begin + per) : col_groups;
        for (int64_t c0 = c_begin; c0 < c_end; c0 += step) {
            const int64_t ng = (c_end - c0) < step ? (c_end - c0) : step;
            const uint8_t *qp = q_packed + c0 * K * 8;
            const uint16_t *dp = d + c0 * groups * 16, *mp = m + c0 * groups * 16;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int64_t mb = (M - m0) < 4 ? (M - m0) : 4;
                const bf16 *xb = x + m0 * x_stride;
                const float *xs = xsum + m0 * groups;
                __m512 total[4][4];
                if (ng == 2 && mb == 4) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, 4, 2, total);
                else if (ng == 4 && mb == 1) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, 1, 4, total);
                else if (ng == 4 && mb == 2) int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, 2, 4, total);
                else int4_block(xb, x_stride, xs, groups, qp, dp, mp, K, mb, ng, total); /* mb * ng <= 8 */
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < ng; j++) {
                        float v[16];
                        _mm512_storeu_ps(v, total[i][j]);
                        const int64_t col = (c0 + j) * 16, at = (m0 + i) * y_stride + col;
                        for (int64_t c = 0; c < 16; c++) {
                            const float o = v[c] + (bias ? bf16_to_f32(bias[col + c]) : 0.0f);
                            if (y_f32) ((float *)y)[at + c] = o;
                            else ((bf16 *)y)[at + c] = f32_to_bf16(o);
                        }
                    }
            }
        }
    }
    free(xsum);
    return 0;
#else
    (void)x; (void)x_stride; (void)q_packed; (void)d; (void)m; (void)bias; (void)y; (void)y_stride; (void)M; (void)N;
    (void)K; (void)y_f32;
    return -1;
#endif
}
