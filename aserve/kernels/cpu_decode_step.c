/* The decoder layers of a bf16 decode step in one call: for every layer, residual add + RMSNorm, the
 * fused q|k|v projection, rotary, the new K/V written into the paged cache and decode attention, o_proj,
 * residual add + RMSNorm, gate|up, SiLU-and-mul, down, with no Python between the ops. It calls the
 * same kernels the layers call one by one (cpu_ops.c, cpu_matmul.c) in the same order with the same
 * roundings, so its result is bitwise the layer-by-layer one. Built with them by cpu_ops.py; the
 * caller (aserve/runner/cpu_decode_step.py) checks every shape and layout, this code trusts them. */
#include "cpu_common.h"

/* One weight: kind 0 = pack_vnni bf16 ([N/16, K/2, 16, 2]); kind 1 = pack_int4 codes with fp16 scale and
 * offset ([N/16, K/gs, 16]). bias [N] bf16 or NULL; the output is fp32 (unrounded) when y_f32, else bf16. */
typedef struct {
    int64_t kind;
    const void *weight;
    const void *scale;
    const void *offset;
    const bf16 *bias;
    int64_t n;
    int64_t group_size;
    int64_t y_f32;
} decode_matmul;

/* One decoder layer. Llama form (gemma == 0): x -> norm(x + res) -> attention -> o -> norm(o + res) -> MLP.
 * Gemma form (gemma == 1): the attention output is normalized alone (post_norm), added to the residual
 * in pre_ff_norm, and the MLP output is normalized alone (post_ff_norm) before the next layer adds it.
 * Norm weights [H] (norms scale by norm_offset + w), per-head q / k norms [D] (NULL: none), four
 * projections, the cache halves [num_blocks, block_size, KVH, D], the window (0: none), score scale and
 * softcap (0: none), the activation (0: SiLU, 1: GELU tanh) and which rotary table (1: the local one). */
typedef struct {
    const bf16 *input_norm;
    const bf16 *post_norm;
    const bf16 *pre_ff_norm;
    const bf16 *post_ff_norm;
    const bf16 *q_norm;
    const bf16 *k_norm;
    decode_matmul qkv, o, gate_up, down;
    bf16 *k_cache;
    bf16 *v_cache;
    int64_t window;
    float scale;
    float softcap;
    float norm_offset;
    int64_t gemma;
    int64_t act;
    int64_t local_rotary;
} decode_layer;

static int64_t matmul(const decode_matmul *m, const bf16 *x, int64_t k, void *y, int64_t rows) {
    if (m->kind == 0)
        return linear_vnni_bf16(x, k, (const bf16 *)m->weight, m->bias, y, m->n, rows, m->n, k, m->y_f32);
    return linear_int4_bf16(x, k, (const uint8_t *)m->weight, (const uint16_t *)m->scale, (const uint16_t *)m->offset,
                            m->bias, y, m->n, rows, m->n, k, m->y_f32, m->group_size);
}

/* B decode rows through `num_layers` layers. embedded [B, H] bf16 (the embedding's output, scaled where the
 * model scales it) -> the last layer's output in hidden (fp32 [B, H] for the Llama form, bf16 for the Gemma
 * form) and the residual stream [B, H] fp32 in residual[0] or residual[1] (the returned index; negative: a
 * matmul's error code). cos_sin / local_cos_sin [B, 2 * rot_half] bf16 rows; block_tables [B, bt_stride]
 * int32, seq_lens [B] int32 (after this token), slots [B] int64.
 * Scratch: normed [B, H], qkv [B, (NH + 2 KVH) D], q_rot and q_normed [B, NH, D], k_rot and k_normed
 * [B, KVH, D], attn [B, NH, D] (bf16); o_out [B, H], gate_up [B, 2 I] (fp32 or bf16); act [B, I] (bf16). */
int64_t decode_layers_bf16(const decode_layer *layers, int64_t num_layers, const bf16 *embedded, void *hidden,
                           float *residual0, float *residual1, const bf16 *cos_sin, const bf16 *local_cos_sin,
                           int64_t rot_half, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int64_t *slots, int64_t B, int64_t H, int64_t NH, int64_t KVH, int64_t D,
                           int64_t I, int64_t block_size, float eps, bf16 *normed, bf16 *qkv, bf16 *q_rot,
                           bf16 *k_rot, bf16 *attn, void *o_out, void *gate_up, bf16 *act, bf16 *q_normed,
                           bf16 *k_normed, bf16 *attn_normed) {
    float *residual[2] = {residual0, residual1};
    int64_t cur = 0;          /* residual[cur] holds the stream once the first layer's second norm ran */
    int64_t hidden_f32 = 0;   /* the dtype the previous layer left its output in */
    const int64_t qkv_width = (NH + 2 * KVH) * D;
    int64_t status;
    for (int64_t l = 0; l < num_layers; l++) {
        const decode_layer *L = layers + l;
        const float off = L->norm_offset;
        if (l == 0) { /* the stream starts as the embedding (bf16); the norm takes it as x */
            add_rms_norm_bf16(embedded, H, 0, NULL, 0, 0, L->input_norm, normed, NULL, B, H, eps, off);
        } else {
            add_rms_norm_bf16(hidden, H, hidden_f32, residual[cur], H, 1, L->input_norm, normed, residual[1 - cur], B,
                              H, eps, off);
            cur = 1 - cur;
        }
        if ((status = matmul(&L->qkv, normed, H, qkv, B))) return status;
        const bf16 *rot = L->local_rotary ? local_cos_sin : cos_sin;
        if (L->q_norm) { /* each head of q and k normalized over D, token by token (rows of D, stride D) */
            for (int64_t b = 0; b < B; b++) {
                add_rms_norm_bf16(qkv + b * qkv_width, D, 0, NULL, 0, 0, L->q_norm, q_normed + b * NH * D, NULL, NH,
                                  D, eps, off);
                add_rms_norm_bf16(qkv + b * qkv_width + NH * D, D, 0, NULL, 0, 0, L->k_norm, k_normed + b * KVH * D,
                                  NULL, KVH, D, eps, off);
            }
            rotary_neox_bf16(q_normed, NH * D, k_normed, KVH * D, rot, q_rot, k_rot, B, NH, KVH, D, rot_half);
        } else {
            rotary_neox_bf16(qkv, qkv_width, qkv + NH * D, qkv_width, rot, q_rot, k_rot, B, NH, KVH, D, rot_half);
        }
        paged_decode_attention_bf16(q_rot, attn, L->k_cache, L->v_cache, block_tables, bt_stride, seq_lens, slots,
                                    k_rot, KVH * D, qkv + (NH + KVH) * D, qkv_width, B, NH, KVH, D, block_size,
                                    L->window, L->scale, L->softcap);
        if ((status = matmul(&L->o, attn, NH * D, o_out, B))) return status;
        const void *stream_x = o_out; /* what the second norm adds to the residual */
        int64_t stream_f32 = L->o.y_f32;
        const bf16 *second_norm = L->post_norm;
        if (L->gemma) { /* the attention output normalized alone, then added in pre_ff_norm */
            add_rms_norm_bf16(o_out, H, L->o.y_f32, NULL, 0, 0, L->post_norm, attn_normed, NULL, B, H, eps, off);
            stream_x = attn_normed;
            stream_f32 = 0;
            second_norm = L->pre_ff_norm;
        }
        if (l == 0) {
            add_rms_norm_bf16(stream_x, H, stream_f32, embedded, H, 0, second_norm, normed, residual[cur], B, H, eps,
                              off);
        } else {
            add_rms_norm_bf16(stream_x, H, stream_f32, residual[cur], H, 1, second_norm, normed, residual[1 - cur], B,
                              H, eps, off);
            cur = 1 - cur;
        }
        if ((status = matmul(&L->gate_up, normed, H, gate_up, B))) return status;
        if (L->act == 0)
            silu_and_mul_bf16(gate_up, 2 * I, L->gate_up.y_f32, act, B, I);
        else
            gelu_tanh_and_mul_bf16(gate_up, 2 * I, L->gate_up.y_f32, act, B, I);
        if (L->gemma) { /* the MLP output normalized alone: the layer's output (bf16) */
            if ((status = matmul(&L->down, act, I, o_out, B))) return status;
            add_rms_norm_bf16(o_out, H, L->down.y_f32, NULL, 0, 0, L->post_ff_norm, (bf16 *)hidden, NULL, B, H, eps,
                              off);
            hidden_f32 = 0;
        } else {
            if ((status = matmul(&L->down, act, I, hidden, B))) return status;
            hidden_f32 = L->down.y_f32;
        }
    }
    return cur;
}
