/* aserve's CPU kernels for bf16 activations: the decode step's small ops, one call each (residual add +
 * RMSNorm or LayerNorm, rotary, SiLU / GELU-and-mul, non-gated GELU / ReLU). Matrix products are in cpu_matmul.c, attention in
 * cpu_attention.c and cpu_prefill_attention.c. Built and loaded by cpu_ops.py, which checks shapes;
 * these functions trust their input.
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

/* add_rms_norm_bf16's contract for LayerNorm: out[r] = bf16((s - mean(s)) * rsqrt(var(s) + eps) * w + b), the
 * biased variance, fp32 inside; weight and bias may be NULL (no elementwise affine). */
void add_layer_norm_bf16(const void *x, int64_t x_stride, int64_t x_f32, const void *residual, int64_t res_stride,
                         int64_t residual_f32, const bf16 *weight, const bf16 *bias, bf16 *out, float *sum_out,
                         int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float xr[n];
        load_row(x, x_f32, r, x_stride, n, xr);
        const float *s = xr;
        if (residual) {
            float *sr = sum_out + r * n;
            load_row(residual, residual_f32, r, res_stride, n, sr);
            for (int64_t i = 0; i < n; i++) sr[i] += xr[i];
            s = sr;
        }
        float sum = 0.0f, sq = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += s[i];
        const float mean = sum / (float)n;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < n; i++) sq += (s[i] - mean) * (s[i] - mean);
        const float inv = 1.0f / sqrtf(sq / (float)n + eps);
        bf16 *orow = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            float v = (s[i] - mean) * inv;
            if (weight) v *= bf16_to_f32(weight[i]);
            if (bias) v += bf16_to_f32(bias[i]);
            orow[i] = f32_to_bf16(v);
        }
    }
}

/* out [rows, n] = bf16(act(x[r, i])), fp32 inside: kind ACT_GELU_TANH (torch's tanh approximation, as
 * sigmoid_gated computes it), ACT_RELU, ACT_GELU (exact, erf). x bf16, or fp32 when x_f32, row stride x_stride. */
void act_bf16(const void *x, int64_t x_stride, int64_t x_f32, bf16 *out, int64_t rows, int64_t n, int64_t kind) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float row[n];
        load_row(x, x_f32, r, x_stride, n, row);
        bf16 *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float a = row[i];
            float v;
            if (kind == ACT_GELU_TANH) v = a / (1.0f + fast_exp(-1.5957691216057308f * (a + 0.044715f * a * a * a)));
            else if (kind == ACT_RELU) v = a > 0.0f ? a : 0.0f;
            else v = 0.5f * a * (1.0f + erff(a * 0.70710678118654752f));
            o[i] = f32_to_bf16(v);
        }
    }
}
